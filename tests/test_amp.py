"""The GradScaler path on CPU: scale every microstep, unscale/clip/step/update at the boundary."""

from __future__ import annotations

import math

import pytest
import torch

import gradaccum
from tests.helpers import make_batches, make_model, mean_loss


def run(
    scaler: torch.amp.GradScaler | None, poison: set[int] = frozenset(), fused: bool = False
) -> tuple:
    """steps=4 over 12 microbatches, clipped, a StepLR; SGD, or with ``fused`` an AdamW
    with ``fused=True``, which takes the scaler into its step (and skips on the device)."""
    batches = make_batches([3] * 12, dtype=torch.float32)
    model = make_model(dtype=torch.float32)
    optimizer = (
        torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        if fused
        else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    acc = gradaccum.Accumulator(
        model, optimizer, scheduler, steps=4, max_grad_norm=1.0, scaler=scaler
    )
    steps = []
    snapshots = []
    for index, batch in enumerate(acc.epoch(batches)):
        loss = mean_loss(model, batch)
        if index in poison:
            loss = loss * math.inf
        with acc.microstep(loss) as step:
            pass
        if step.boundary:
            steps.append(step)
            snapshots.append([p.detach().clone() for p in model.parameters()])
    return model, scheduler, acc, steps, snapshots


def test_power_of_two_scale_matches_no_scaler_exactly() -> None:
    """Scaling by 2**k and unscaling is exact: the run equals the unscaled one bit for bit."""
    plain, *_ = run(None)
    scaled, *_ = run(torch.amp.GradScaler("cpu", init_scale=2.0**10))
    for p, q in zip(plain.parameters(), scaled.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("fused", [False, True], ids=["skipped_by_the_scaler", "fused"])
def test_overflow_skips_the_window_and_its_scheduler_step(fused: bool) -> None:
    """An inf in window 2: no update, no scheduler step, step.skipped, scale backed off;
    whether GradScaler skips the optimizer's step (seen by its pre-hook) or calls a
    fused one, which skips on the device (seen as the scale shrinking)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    _, scheduler, acc, steps, snapshots = run(scaler, poison={5}, fused=fused)
    assert [s.skipped for s in steps] == [False, True, False]
    assert acc.global_step == 3  # windows completed, the skipped one included
    assert scheduler.last_epoch == 2
    for before, after in zip(snapshots[0], snapshots[1], strict=True):
        assert torch.equal(before, after)  # the poisoned window changed nothing
    assert scaler.get_scale() == 2.0**9
    assert all(s.grad_norm is not None for s in steps)
    assert steps[2].lr == 0.1 * 0.5  # only one decay so far when window 3 was applied


def test_disabled_scaler_is_no_scaler() -> None:
    """GradScaler(enabled=False) behaves exactly as scaler=None."""
    plain, *_ = run(None)
    disabled, *_ = run(torch.amp.GradScaler("cpu", enabled=False))
    for p, q in zip(plain.parameters(), disabled.parameters(), strict=True):
        assert torch.equal(p, q)


def test_exception_after_unscale_leaves_the_scaler_usable() -> None:
    """A failing boundary body (after unscale_) is discarded; the next window steps normally."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    batches = make_batches([2] * 8, dtype=torch.float32)
    model = make_model(dtype=torch.float32)
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), steps=4, scaler=scaler
    )

    def epoch_with_failing_logger() -> None:
        for batch in acc.epoch(batches):
            with acc.microstep(mean_loss(model, batch)) as step:
                if step.boundary:
                    raise KeyError("logging failed")

    with pytest.raises(KeyError):
        epoch_with_failing_logger()
    assert acc.global_step == 0
    for batch in acc.epoch(batches):
        with acc.microstep(mean_loss(model, batch)):
            pass
    assert acc.global_step == 2
    assert scaler.get_scale() == 2.0**10


def test_the_recipes_own_unscale_in_the_boundary_block_is_explained() -> None:
    """The AMP recipe's ``scaler.unscale_(optimizer)`` before a clip of one's own, kept in
    the boundary's block: torch refuses a second unscale, and the error says why (the
    accumulator unscaled already) and what to remove; nothing is applied."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model = make_model(dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, optimizer, steps=2, scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]

    def the_recipe() -> None:
        for batch in acc.epoch(make_batches([2] * 4, dtype=torch.float32)):
            with acc.microstep(mean_loss(model, batch)) as step:
                if step.boundary:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    with pytest.raises(RuntimeError, match="already been called") as raised:
        the_recipe()
    notes = getattr(raised.value, "__notes__", [])
    assert len(notes) == 1
    assert "remove the scaler.unscale_(optimizer) call" in notes[0]
    assert acc.global_step == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
