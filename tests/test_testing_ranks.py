"""gradaccum.testing.run_ranks: every rank's result in order, every rank's traceback when
one fails, a hang killed with nothing left running, and launches it refuses up front."""

from __future__ import annotations

import functools
import math
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import gradaccum
from gradaccum.testing import LaunchError, run_ranks
from tests import loops


def test_every_rank_returns_in_rank_order() -> None:
    assert run_ranks(pow, 3, timeout=30) == [0, 1, 8]  # pow(rank, world_size)


def test_any_number_of_tensors_reaches_the_ranks() -> None:
    """Arguments holding 300 tensors: sent as one buffer, not as a file descriptor per
    tensor (the forkserver sends at most 256)."""
    tensors = [torch.full((2,), float(i)) for i in range(300)]
    assert run_ranks(loops.total_of, 2, (tensors,), timeout=30) == [299 * 300.0] * 2


def test_each_rank_has_the_variables_torchrun_sets() -> None:
    """``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``: Accelerate reads
    them to know that it runs distributed."""
    assert run_ranks(loops.launch_variables, 2, timeout=30) == [
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        for rank in range(2)
    ]


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
    # Killed, not waited for (rank 1 sleeps an hour): 10 times the 6 s it takes on 2 idle
    # cores, so that a loaded machine's slow start-up alone cannot fail it.
    assert time.monotonic() - started < 60
    failures = caught.value.failures
    assert sorted(failures) == [0, 1]
    assert "Traceback" in failures[0]
    assert failures[1] == (
        "rank 1 gave no answer within 6 s of every rank's start (was killed, with every "
        "process it started); where it was only slow (a busy machine, a large model), pass "
        "a larger timeout="
    )
    assert str(caught.value).startswith(
        "2 of 2 ranks failed; every rank and every process a rank started have been ended\n"
    )
    for name in ("0", "1", "child of 0", "child of 1"):
        assert ended(int((tmp_path / name).read_text())), name


def test_a_rank_that_ends_without_raising_is_told_from_one_that_could_not_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank whose fn ends its process (``os._exit``) is said to have ended in fn, with
    its exit code, not to have hung; one whose process cannot start (here: fn's module
    is not importable there, as a script's top level that launches again is not) says
    so and names the usual cause, the missing ``if __name__ == "__main__":``."""
    started = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        run_ranks(loops.exit_on_rank_1, 2, timeout=30)
    assert time.monotonic() - started < 30  # reported at once, not after the timeout
    assert caught.value.results == {0: 0}
    assert caught.value.failures == {
        1: "rank 1 ended (exit code 3) in fn or while joining the process group, without "
        "raising (os._exit, or a signal); what it printed is above"
    }
    absent = types.ModuleType("gradaccum_tests_absent")  # importable here only
    exec("def job(rank, world):\n    return rank", absent.__dict__)
    monkeypatch.setitem(sys.modules, absent.__name__, absent)
    with pytest.raises(LaunchError) as caught:
        run_ranks(absent.job, 1, timeout=30)
    assert caught.value.failures == {
        0: "rank 0 could not start (exit code 1); what it printed is above. Most often its "
        "start ran the launching script's top level again, which launched again: call "
        'run_ranks (or check_accumulation) under `if __name__ == "__main__":`; or fn or its '
        "arguments could not be imported there"
    }


@pytest.mark.parametrize(
    ("main_file", "error", "message"),
    [
        (
            None,
            gradaccum.ConfigTypeError,
            "args holds job, defined in an interactive session's __main__ (a notebook, "
            "python -c), which the ranks cannot import (each is a new process, which "
            "imports what it is sent by module and name); define it in a module file and "
            "import it from there",
        ),
        (
            "<stdin>",
            gradaccum.ConfigError,
            "the ranks cannot be started from a program read from <stdin>: each rank's "
            "process runs the launching program's file again first (multiprocessing's "
            "forkserver), and there is none; save the program to a file and run that",
        ),
    ],
)
def test_a_launch_from_a_session_the_ranks_cannot_import_is_refused(
    monkeypatch: pytest.MonkeyPatch, main_file: str | None, error: type[Exception], message: str
) -> None:
    """A notebook's or ``python -c``'s function (a ``functools.partial`` of one here),
    and any launch from a program read from stdin, which a rank's process could not run
    again: refused before any rank starts."""
    main = types.ModuleType("__main__")
    if main_file is not None:
        main.__file__ = main_file
    exec("def job(rank, world):\n    return rank", main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    started = time.monotonic()
    with pytest.raises(error) as caught:
        run_ranks(functools.partial(pow), 1, (main.job,))
    assert str(caught.value) == message
    assert time.monotonic() - started < 1  # no rank was started


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
