"""gradaccum.testing.run_ranks: every rank's result in order, every rank's traceback when
one fails, a hang killed with nothing left running, and launches it refuses up front."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

import gradaccum
from gradaccum.testing import LaunchError, run_ranks
from tests import loops


def test_every_rank_returns_in_rank_order() -> None:
    assert run_ranks(pow, 3, timeout=30) == [0, 1, 8]  # pow(rank, world_size)


def test_a_failing_rank_brings_its_traceback_and_the_others_their_results() -> None:
    """math.log(0, 2) raises on rank 0; rank 1 returns log(1, 2)."""
    with pytest.raises(LaunchError) as caught:
        run_ranks(math.log, 2, timeout=30)
    error = caught.value
    assert list(error.failures) == [0]
    assert "ValueError: math domain error" in error.failures[0]
    assert "Traceback" in error.failures[0]
    assert error.results == {1: 0.0}
    assert str(error).startswith(
        "1 of 2 ranks failed; every rank and every process a rank started have been ended\n"
        "--- rank 0 ---\nTraceback"
    )
    assert isinstance(error, RuntimeError)


def running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped by whoever
    adopted it, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended, or does within 30 s: a killed process dies
    once the kernel delivers the signal, which a loaded machine may take a moment for."""
    deadline = time.monotonic() + 30
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running(pid)


def test_a_hang_is_killed_and_reported_with_the_waiting_rank_s_timeout(tmp_path: Path) -> None:
    """Rank 1 never reaches the barrier: rank 0's collective times out after 3 s and
    raises; rank 1 is killed at 6 s. Both are reported; neither process is left, nor
    the process each started (a rank that raises leaves at once, one killed gets no say:
    only killing each rank's process group ends its children)."""
    started = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        run_ranks(loops.barrier_while_rank_1_hangs, 2, (str(tmp_path),), timeout=3)
    assert time.monotonic() - started < 30
    failures = caught.value.failures
    assert sorted(failures) == [0, 1]
    assert "Traceback" in failures[0]
    assert (
        failures[1]
        == "rank 1 gave no answer within 6 s (was killed, with every process it started)"
    )
    assert str(caught.value).startswith(
        "2 of 2 ranks failed; every rank and every process a rank started have been ended\n"
    )
    for name in ("0", "1", "child of 0", "child of 1"):
        assert ended(int((tmp_path / name).read_text())), name


def test_what_a_rank_that_returned_left_running_is_ended(tmp_path: Path) -> None:
    """A rank that returns with a child of its own still running: the child is ended."""
    assert run_ranks(loops.leave_a_child, 1, (str(tmp_path),), timeout=30) == [None]
    assert ended(int((tmp_path / "child of 0").read_text()))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: run_ranks(pow, 0),
            gradaccum.ConfigError,
            "world_size must be a positive int, got 0",
        ),
        (lambda: run_ranks(pow, True), gradaccum.ConfigTypeError, "got True (bool)"),
        (lambda: run_ranks(None, 2), gradaccum.ConfigTypeError, "fn must be callable"),  # type: ignore[arg-type]
        (lambda: run_ranks(lambda r, w: r, 2), gradaccum.ConfigTypeError, "fn cannot be sent"),
        (lambda: run_ranks(pow, 2, (lambda: 0,)), gradaccum.ConfigTypeError, "args cannot be sent"),
        (lambda: run_ranks(pow, 2, "ab"), gradaccum.ConfigTypeError, "args must be a sequence"),
        (lambda: run_ranks(pow, 2, backend="mpi"), gradaccum.ConfigError, "backend must be one of"),
        (lambda: run_ranks(pow, 2, timeout=0), gradaccum.ConfigError, "timeout must be a positive"),
        (
            lambda: run_ranks(pow, torch.cuda.device_count() + 1, backend="nccl"),
            gradaccum.ConfigError,
            "backend='nccl' needs a GPU per rank",
        ),
    ],
)
def test_launches_that_cannot_work_are_refused_before_any_rank_starts(
    call: object, error: type[Exception], message: str
) -> None:
    started = time.monotonic()
    with pytest.raises(error) as caught:
        call()  # type: ignore[operator]
    assert message in str(caught.value)
    assert time.monotonic() - started < 1  # no rank was started
