"""The accumulator where its parts meet, on real gloo ranks: the steps setter keeps an
unsized epoch's trailing window, num_items normalizes exactly over 3 ranks, a mid-window
checkpoint of an iterable without len resumes bit for bit, and a scheduler failing after
the optimizer step counts the window as applied on every rank."""

from __future__ import annotations

import pytest
import torch

from tests import accumulator_distributed
from tests.distributed import run
from tests.helpers import make_model, reference_sgd
from tests.test_distributed import global_windows

TOL = 1e-10


def test_steps_setter_at_window_start_keeps_the_unsized_trailing_window_under_ddp() -> None:
    """A generator of 5 microbatches per rank, steps=2, drop_last=False: ``acc.steps =
    acc.steps`` at the top of every window's first loop body still gives windows of 2, 2
    and 1 on both ranks, i.e. 3 optimizer steps, the same all-reduces (3 length
    agreements, 3 gradient all-reduces), no warning, and parameters equal to the run
    without the setter."""
    for runs in run(accumulator_distributed.same_steps_at_window_starts, 2):
        plain, setter = (
            [r["optimizer_steps"], r["global_step"], r["warnings"]] for r in runs.values()
        )
        assert plain == [3, 3, []]
        assert setter == plain
        for name in runs:
            assert runs[name]["collectives"]["c10d::allreduce_"] == 6, name
        for got, want in zip(runs["setter"]["params"], runs["plain"]["params"], strict=True):
            assert torch.equal(got, want)


def test_num_items_over_three_ranks_matches_the_float64_reference() -> None:
    """3 DDP ranks in float64, summed losses with num_items (ints, int64 and float64 0-dim
    tensors) that differ on every rank and microbatch: within 1e-10 of the float64
    big-batch reference, at one gradient and one item-count all-reduce per window besides
    the length agreement, and step.loss still this rank's own item-mean. No window's item
    total (46, 44, 49) is divisible by 3, so a total divided by the world size in float32
    is off by 2e-8 of itself (2.4e-9 in the parameters)."""
    world = 3
    sizes = [[1 + (2 * i + r) % 7 for i in range(13)] for r in range(world)]
    windows = global_windows(sizes, world)
    expected = list(reference_sgd(make_model(), windows, lr=0.1).parameters())
    for runs in run(accumulator_distributed.items_over_ranks, world, sizes):
        for kind, training in runs.items():
            assert training["global_step"] == len(windows) == 3
            assert training["collectives"]["c10d::allreduce_"] == 1 + 2 * len(windows)
            worst = max(
                (got - want).abs().max().item()
                for got, want in zip(training["params"], expected, strict=True)
            )
            assert worst < TOL, f"num_items as {kind}: {worst:.3g} off the reference"
            # step.loss stays this rank's own: the item total is summed over ranks in a copy.
            assert training["loss_error"] < TOL, kind
        assert set(runs) == {"int", "tensor", "float64"}


def test_ddp_mid_window_resume_of_an_unsized_iterable_is_bit_for_bit() -> None:
    """steps=3, 9 microbatches per rank as a generator: checkpointed with include_grads=True
    after the block of window 2's first microstep (global_step 1, position 4), every rank
    loads its own state into fresh objects and re-iterates the same data. In all exactly 3
    optimizer steps (1 before, 2 after), global_step 3, and parameters, AdamW state and
    LR equal to the uninterrupted run's on both ranks."""
    for outcome in run(accumulator_distributed.resume_unsized_mid_window, 2):
        assert outcome == {
            "saved_at": (1, 4),
            "optimizer_steps": (3, 1, 2),  # uninterrupted; before and after the checkpoint
            "global_step": (3, 3),
            "params": True,
            "optimizer": True,
            "lr": True,
        }


def test_ddp_scheduler_failing_after_the_step_counts_the_window_on_every_rank() -> None:
    """OneCycleLR(total_steps=2) raises in its 3rd step(), after the optimizer stepped for
    window 3; rank 0 fails first, rank 1 later. Each rank must see the scheduler's own
    ValueError (rank 1 no RankFailedError telling it that no rank applied window 3),
    global_step 3, 3 optimizer steps, every gradient cleared to None, and a state_dict()
    it accepts, with global_step 3 and position 6 (window 3's microbatches count as
    trained); the parameters equal, on both ranks, a run whose scheduler stops instead of
    raising."""
    outcomes = run(accumulator_distributed.scheduler_fails_after_the_step, 2)
    for rank, seen in enumerate(outcomes):
        assert seen["caught"] is not None, f"rank {rank} raised nothing"
        error, _, _ = seen["caught"].partition(".")  # up to the end of the first sentence
        assert {
            "caught": error,
            "global_step": seen["global_step"],
            "optimizer_steps": seen["optimizer_steps"],
            "grads cleared": all(seen["grads"]),
            "state (global_step, position)": seen["state"],
            "uninterrupted": seen["uninterrupted"],
        } == {
            "caught": "ValueError: Tried to step 3 times",
            "global_step": 3,
            "optimizer_steps": 3,
            "grads cleared": True,
            "state (global_step, position)": (3, 6),
            "uninterrupted": True,
        }, f"rank {rank}"
    for got, want in zip(outcomes[0]["params"], outcomes[1]["params"], strict=True):
        assert torch.equal(got, want)


def test_zero_grad_in_a_window_is_each_ranks_own_refusal_under_ddp() -> None:
    """DDP with bucket views: two epochs raise no false alarm (6 windows); a zero_grad()
    inside a window is refused on every rank as its own UsageError naming zero_grad, not
    as a RankFailedError blaming the rank that raised first."""
    for outcome in run(accumulator_distributed.zero_grad_in_a_window, 2):
        assert outcome["trained"] == 6
        assert outcome["refused"].startswith("UsageError: the gradient of this window"), outcome
        assert "zero_grad" in outcome["refused"]


@pytest.mark.parametrize("kind", ["ddp", "fully_shard"])
def test_a_second_accumulator_over_the_same_ddp_model_takes_it_over(kind: str) -> None:
    """Two accumulators over one DDP (or ``fully_shard``) model with an optimizer each: one
    sets the wrapper's sync at a time. The second is refused while the first's window is
    open, and between windows closes the first (which then refuses its microsteps) with a
    warning; its window then reduces as the hand loop's does, and the ranks agree (they
    drifted apart when both armed the same DDP for their own windows)."""
    outcomes = run(accumulator_distributed.two_accumulators_over_one_ddp, 2, kind)
    for found in outcomes:
        assert "owned by another open Accumulator, whose window is open" in found["mid-window"]
        assert "pass another model" in found["mid-window"]
        assert any("closed the previous Accumulator" in w for w in found["warnings"])
        assert "closed Accumulator (a newer Accumulator took over" in found["first after"]
        if kind == "ddp":
            assert found["backwards"] == [1]
    for got, want in zip(outcomes[0]["params"], outcomes[1]["params"], strict=True):
        assert torch.equal(got, want)
