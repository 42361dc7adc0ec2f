"""Reliability on real gloo ranks: resume bit for bit, non-finite windows decided alike on
every rank, a failing rank named by the others, misuse warned about, steps warmed up."""

from __future__ import annotations

import time

import pytest

from gradaccum.testing import LaunchError, run_ranks
from tests import distributed
from tests.distributed import run
from tests.helpers import make_model, reference_sgd
from tests.test_distributed import global_windows

TOL = 1e-10


@pytest.mark.parametrize(
    ("stop", "include_grads"),
    [(4, False), (8, False), (20, False), (6, True), (15, True)],
    ids=["end-of-window-1", "mid-epoch", "epoch-2", "mid-window", "mid-window-epoch-2"],
)
def test_ddp_resume_is_bit_for_bit(stop: int, include_grads: bool) -> None:
    """Stopped after ``stop`` microsteps, saved per rank, rebuilt and resumed: parameters,
    AdamW state, LR and global_step equal the uninterrupted run's exactly, on both ranks."""
    for outcome in run(distributed.resume, 2, stop, include_grads):
        assert outcome == {"params": True, "optimizer": True, "lr": True, "global_step": True}


@pytest.mark.parametrize("kind", ["fully_shard", "fsdp1"])
def test_sharded_mid_window_checkpoint_is_refused(kind: str) -> None:
    """Where the partial gradient lives inside the wrapper, include_grads says so, and a
    saved window is not loaded there either (FSDP1's flat shards do not even fit)."""
    for saving, loading in run(distributed.checkpoint_mid_window, 2, kind):
        assert "state_dict(include_grads=True) cannot save this window" in saving
        assert "held by the wrapper" in saving
        if kind == "fully_shard":
            assert loading.startswith("UsageError: load_state_dict() cannot restore this")
            assert "held by the wrapper" in loading
        else:
            assert loading.startswith("ConfigError: state['window'] does not fit")


@pytest.mark.parametrize("kind", ["ddp", "fsdp1"])
@pytest.mark.parametrize("on_nonfinite", ["skip", "raise"])
def test_nonfinite_window_is_decided_alike_on_every_rank(kind: str, on_nonfinite: str) -> None:
    """Rank 1 alone poisons window 2 (under FSDP1 only its own shard): every rank skips
    it, or raises for it, and the others are applied exactly as the reference; the
    agreement costs one scalar all-reduce per window, counted."""
    trainings = run(distributed.nonfinite, 2, kind, on_nonfinite)
    windows = global_windows([[2] * 12] * 2, 2)
    expected = list(reference_sgd(make_model(), [windows[0], windows[2]], lr=0.1).parameters())
    # All-reduces: the epoch-length agreement, then per window the flag (one scalar),
    # besides DDP's one gradient all-reduce per window.
    all_reduces = 1 + 3 * (2 if kind == "ddp" else 1)
    for training in trainings:
        assert training.collectives["c10d::allreduce_"] == all_reduces
        decisions, skipped = training.warnings
        if on_nonfinite == "skip":
            assert decisions == "[False, True, False]"
            assert (training.global_step, skipped) == (3, "1")
        else:
            assert "window 2 (the optimizer step after 1) holds inf or NaN" in decisions
            assert (training.global_step, skipped) == (2, "0")
        for got, want in zip(training.params, expected, strict=True):
            assert (got - want).abs().max().item() < TOL


def test_a_rank_failing_in_a_block_is_named_by_the_others() -> None:
    """Rank 1 raises inside its second block; rank 0, in its boundary all-reduce, raises
    RankFailedError naming rank 1 and its error, having applied nothing; rank 1 refuses
    to go on. Well within the process-group timeout."""
    started = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        run_ranks(distributed.fail_inside_a_block, 2, timeout=distributed.PROCESS_GROUP_TIMEOUT)
    assert time.monotonic() - started < distributed.PROCESS_GROUP_TIMEOUT
    assert list(caught.value.failures) == [1]
    failed = caught.value.failures[1]
    assert "refused: microstep() was called after this rank failed in window 1" in failed
    assert "restart every rank from the last checkpoint" in failed
    message, unchanged, global_step = caught.value.results[0]
    assert "rank 0 stopped in window 1 because rank 1 failed there first" in message
    assert "KeyError: 'rank 1 fails on purpose'" in message
    assert unchanged
    assert global_step == 0


def test_forward_run_for_another_microstep_warns() -> None:
    """Forwards run ahead of their blocks under DDP: the boundary's forward saw the
    deferring flag, which is warned about once; the right loop warns nothing."""
    for messages in run(distributed.forwards_ahead, 2):
        assert len(messages) == 1
        assert "the forward of microstep 2 of 2 ran while DDP was set to defer" in messages[0]
        assert "run each microbatch's forward through the DDP model itself" in messages[0]


def test_warm_up_schedule_under_ddp() -> None:
    """steps 1 then 4 by epoch: one all-reduce per window (9, then 2) besides the epoch's
    length agreement, and the reference."""
    windows = [window for steps in (1, 4) for window in global_windows([[2] * 9] * 2, 2, steps)]
    expected = list(reference_sgd(make_model(), windows, lr=0.1).parameters())
    for counts, params, global_step in run(distributed.warm_up, 2):
        assert [c.get("c10d::allreduce_", 0) for c in counts] == [9 + 1, 2 + 1]
        assert global_step == 9 + 2 == len(windows)
        for got, want in zip(params, expected, strict=True):
            assert (got - want).abs().max().item() < TOL
