"""Edges on 2 gloo ranks: a failing rank named by the others under every wrapping, also
when the failure reaches them in a forward's collective or after a boundary block, and
DDP with two forwards in one microstep."""

from __future__ import annotations

import sys

import pytest
import torch

from tests import edges_distributed
from tests.distributed import rank_batches, run
from tests.helpers import concat, make_model, mean_loss, reference_sgd, windows_of

TOL = 1e-12

# A forward's collective failing because another rank did raises RankFailedError from the
# backend's error where CPython lets the model's hook replace the error (3.11 and later),
# the backend's error with the same message as a note on 3.10.
REPLACED_IN_FORWARD = sys.version_info >= (3, 11) and sys.implementation.name == "cpython"

# (kind, the microbatch whose block raises on rank 1, steps=4): in the second block of
# window 1 the others next meet in a forward (fully_shard's all-gather) or at the
# boundary (DDP); in the boundary block's body rank 0 has reduced and applies window 1.
CASES = [
    ("ddp", 1, "window 1 because rank 1 failed there first", 1, False),
    ("ddp", 3, "window 2 because rank 1 failed first, in window 1", 2, False),
    ("fully_shard", 1, "window 1 because rank 1 failed there first", 1, False),
    ("fully_shard", 3, "window 2 because rank 1 failed first, in window 1", 2, False),
    ("fsdp1", 7, "window 3 because rank 1 failed first, in window 2", 3, False),
]


@pytest.mark.parametrize(("kind", "index", "stopped", "window", "applied"), CASES)
def test_a_failing_rank_is_named_under_every_wrapping(
    kind: str, index: int, stopped: str, window: int, applied: bool
) -> None:
    survivor, failed = run(edges_distributed.fail_in_a_block, 2, kind, index)
    assert (
        f"rank 0 stopped in {stopped}: KeyError: 'rank 1 fails on purpose'" in survivor["message"]
    )
    if REPLACED_IN_FORWARD:  # a RankFailedError, also from a forward's collective
        assert (survivor["rank"], survivor["window"], survivor["applied"]) == (1, window, applied)
    peer_window = (index // 4) + 1
    assert f"rank 1 did not apply window {peer_window}" in survivor["message"]
    if window > peer_window:  # rank 0 applied the window rank 1 failed in
        assert f"so rank 0 applied window {peer_window} that rank 1 did not" in survivor["message"]
        assert survivor["global_step"] == peer_window
    else:
        assert "so rank 0 applied" not in survivor["message"]
        assert survivor["global_step"] == peer_window - 1
    assert survivor["message"].endswith("Restart every rank from the last checkpoint")
    assert "after this rank failed in window" in failed["refused"]
    # The model keeps its own class while the accumulator is open, and after.
    for outcome in (survivor, failed):
        assert outcome["same_type_open"]
        assert outcome["same_type_closed"]


def test_two_forwards_in_one_microstep_under_ddp() -> None:
    """A regularizer's second forward: no warning, one all-reduce per window, and the
    float64 big-batch reference."""
    outcomes = run(edges_distributed.two_forwards, 2)
    twin = make_model()
    params = list(twin.parameters())
    per_rank = [windows_of(rank_batches(rank, [2] * 8), 2) for rank in range(2)]
    for windows in zip(*per_rank, strict=True):
        inputs, targets = concat([batch for window in windows for batch in window])
        loss = mean_loss(twin, (inputs, targets)) + 0.1 * twin(inputs).square().mean()
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for param, grad in zip(params, grads, strict=True):
                param -= 0.1 * grad
    for outcome in outcomes:
        assert outcome["warnings"] == []
        assert outcome["allreduces"] == 4
        assert outcome["global_step"] == 4
        for got, want in zip(outcome["params"], params, strict=True):
            assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("kind", ["fully_shard", "fsdp1"])
def test_a_failure_met_in_a_forward_collective_raises_rank_failed_error(kind: str) -> None:
    """Rank 1 fails and leaves; rank 0's next forward runs FSDP's all-gather, outside any
    gradaccum call, which fails with gloo's own error. The model keeps its class, yet
    rank 0's ``model(x)`` raises `RankFailedError` naming rank 1, its window and what it
    raised, from gloo's error (as under DDP, where the failure is met in a block); on
    Python 3.10 (no C API to replace the error) gloo's error with that message as a
    note. The accumulator then refuses to go on."""
    survivor, _ = run(edges_distributed.fail_then_leave, 2, kind)
    want = "rank 0 stopped in window 1 because rank 1 failed there first: "
    if REPLACED_IN_FORWARD:
        assert survivor["rank_failed"], survivor
        assert survivor["message"].startswith(want + "KeyError: 'rank 1 fails on purpose'")
        assert survivor["message"].endswith("Restart every rank from the last checkpoint")
        assert (survivor["rank"], survivor["window"], survivor["applied"]) == (1, 1, False)
        assert survivor["cause"].startswith("RuntimeError("), survivor["cause"]  # gloo's
    else:
        assert not survivor["rank_failed"]
        (note,) = survivor["notes"]
        assert note.startswith("gradaccum.RankFailedError: " + want)
        assert "KeyError: 'rank 1 fails on purpose'" in note
        assert note.endswith("Restart every rank from the last checkpoint")
    assert "after rank 1 failed" in survivor["refused"]


def test_a_compiled_training_step_under_ddp() -> None:
    """The forward and the microstep block compiled as one function under DDP: bit for bit
    the hand loop's step compiled the same way, 3 windows, each all-reducing in one
    backward only, no warning."""
    for found in run(edges_distributed.compiled_steps, 2):
        ours, hand = found["accumulator"], found["hand"]
        assert all(torch.equal(a, b) for a, b in zip(ours["params"], hand["params"], strict=True))
        assert ours["stepped"] == hand["stepped"] == 3
        assert ours["buckets"] == hand["buckets"] == 3  # one bucket, once a window
        assert ours["graphs"] > 0
        assert hand["graphs"] > 0
        assert ours["warnings"] == []


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "reentrant_checkpoint"])
def test_ddp_with_static_graph_defers_after_its_first_window(checkpointed: bool) -> None:
    """static_graph=True, whose first iteration must all-reduce (torch's reducer asserts
    otherwise), also under reentrant activation checkpointing: the first window
    all-reduces in its first backward (the run's first iteration) and its last, where it
    once all-reduced in all 4, the next in its last only, and the parameters are the
    float64 big-batch reference's."""
    outcomes = run(edges_distributed.static_graph, 2, checkpointed)
    per_rank = [windows_of(rank_batches(rank, [2] * 8), 4) for rank in range(2)]
    windows = [[batch for part in both for batch in part] for both in zip(*per_rank, strict=True)]
    want = list(reference_sgd(make_model(), windows, 0.1).parameters())
    for outcome in outcomes:
        assert outcome["backwards"] == [2, 1]
        for got, expected in zip(outcome["params"], want, strict=True):
            assert (got - expected).abs().max().item() < TOL


def test_a_loop_inside_ddps_join_defers_and_is_exact() -> None:
    """``with model.join():`` around the loop, as torch's answer to uneven inputs: the
    window's gradient still all-reduces in its last backward only and the parameters
    are the float64 big-batch reference's; Join adds its own all-reduces in every forward
    (2 a microbatch), which the docs say to drop it for."""
    outcomes = run(edges_distributed.joined, 2)
    per_rank = [windows_of(rank_batches(rank, [2] * 8), 4) for rank in range(2)]
    windows = [[batch for part in both for batch in part] for both in zip(*per_rank, strict=True)]
    want = list(reference_sgd(make_model(), windows, 0.1).parameters())
    for outcome in outcomes:
        assert outcome["backwards"] == [1, 1]
        # The second window: its gradient's all-reduce and Join's 2 in each of 4 forwards
        # (the first also holds the epoch's length agreement).
        assert outcome["all_reduces"][1] == 1 + 2 * 4
        for got, expected in zip(outcome["params"], want, strict=True):
            assert (got - expected).abs().max().item() < TOL
