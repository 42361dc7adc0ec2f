"""Non-finite windows, changing steps, mid-window checkpoints, misuse warnings and the
set-ups that must stay accepted, on one process."""

from __future__ import annotations

import copy
import io
import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradaccum
from gradaccum.testing import CollectiveCounter
from tests.helpers import (
    Batch,
    concat,
    make_batches,
    make_model,
    max_param_diff,
    mean_loss,
    reference_sgd,
    sgd,
    sum_loss,
    windows_of,
)

TOL = 1e-10
BATCHES = make_batches([2] * 12)


def setup(steps: int = 4, **options: Any) -> tuple[torch.nn.Module, Any, gradaccum.Accumulator]:
    model = make_model()
    optimizer = sgd(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=1.0)
    return (
        model,
        scheduler,
        gradaccum.Accumulator(model, optimizer, scheduler, steps=steps, **options),
    )


def train(model: torch.nn.Module, acc: gradaccum.Accumulator, poison: int | None) -> list[Any]:
    """One epoch of BATCHES; microbatch ``poison`` has a NaN loss. What each boundary said."""
    seen: list[Any] = []
    for index, batch in enumerate(acc.epoch(BATCHES)):
        loss = mean_loss(model, batch) * (math.nan if index == poison else 1.0)
        try:
            with acc.microstep(loss) as step:
                if step.boundary:
                    seen.append(step.skipped)
        except gradaccum.NonFiniteError as error:
            seen.append(str(error))
    return seen


# Non-finite windows -----------------------------------------------------------------


def test_skip_drops_the_whole_window_and_its_scheduler_step() -> None:
    """A NaN in window 2: no optimizer or scheduler step, the block knew, it is counted."""
    model, scheduler, acc = setup(on_nonfinite="skip")
    start = copy.deepcopy(model)
    assert train(model, acc, poison=5) == [False, True, False]
    assert (acc.global_step, acc.skipped_steps, scheduler.last_epoch) == (3, 1, 2)
    assert all(p.grad is None for p in model.parameters())
    windows = windows_of(BATCHES, 4)
    assert max_param_diff(model, reference_sgd(start, [windows[0], windows[2]], lr=0.1)) < TOL


def test_raise_names_the_window_and_applies_nothing_of_it() -> None:
    """NonFiniteError says which window; it is discarded, not counted; the next is clean."""
    model, scheduler, acc = setup(on_nonfinite="raise")
    start = copy.deepcopy(model)
    seen = train(model, acc, poison=6)
    assert seen[0] is False
    assert seen[2] is False
    assert "the gradient of window 2 (the optimizer step after 1) holds inf or NaN" in seen[1]
    assert "on_nonfinite='skip'" in seen[1]
    assert (acc.global_step, acc.skipped_steps, scheduler.last_epoch) == (2, 0, 2)
    windows = windows_of(BATCHES, 4)
    assert max_param_diff(model, reference_sgd(start, [windows[0], windows[2]], lr=0.1)) < TOL


def test_default_lets_nan_through_like_plain_pytorch() -> None:
    """on_nonfinite=None checks nothing: the NaN reaches the parameters."""
    model, _, acc = setup()
    assert train(model, acc, poison=0) == [False, False, False]
    assert all(p.isnan().any() for p in model.parameters())


def test_check_costs_one_host_sync_per_window_and_none_off_it() -> None:
    """The check reads one flag at the boundary; non-boundary microsteps stay sync-free."""
    model, _, acc = setup(steps=2, on_nonfinite="skip", max_grad_norm=1.0)
    counter = CollectiveCounter()
    with counter, acc.microstep(mean_loss(model, BATCHES[0])):
        pass
    assert counter.host_syncs == 0
    with counter, acc.microstep(mean_loss(model, BATCHES[1])):
        pass
    assert counter.host_syncs == 1


def test_skip_with_a_scaler_backs_the_scale_off_once() -> None:
    """With a GradScaler, "skip" decides in the block; the scale still backs off."""
    model = make_model(dtype=torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc = gradaccum.Accumulator(model, sgd(model), steps=2, scaler=scaler, on_nonfinite="skip")
    batches = make_batches([2] * 2, dtype=torch.float32)
    with acc.microstep(mean_loss(model, batches[0]) * math.inf):
        pass
    with acc.microstep(mean_loss(model, batches[1])) as step:
        assert step.skipped
    assert scaler.get_scale() == 2.0**9
    assert (acc.global_step, acc.skipped_steps) == (1, 1)
    assert all(p.grad is None for p in model.parameters())


# Changing steps ---------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("at_top", [False, True])  # after the block, or after the hand-out
def test_steps_change_mid_epoch_replans_the_rest(drop_last: bool, at_top: bool) -> None:
    """13 microbatches: one window of 4, then steps=3 cuts the other 9 into 3 windows."""
    batches = make_batches([2] * 13)
    model, _, acc = setup(drop_last=drop_last)
    start = copy.deepcopy(model)
    for batch in acc.epoch(batches):
        if at_top and acc.global_step == 1 and acc.steps == 4:
            acc.steps = 3
        with acc.microstep(mean_loss(model, batch)):
            pass
        if not at_top and acc.global_step == 1 and acc.steps == 4:
            acc.steps = 3
    expected = [batches[:4], batches[4:7], batches[7:10], batches[10:13]]
    assert acc.global_step == 4
    assert max_param_diff(model, reference_sgd(start, expected, lr=0.1)) < TOL


def test_steps_change_keeps_a_short_last_window_without_drop_last() -> None:
    """drop_last=False: 10 microbatches, 4 then steps=4→3: windows 4, 3, 3."""
    batches = make_batches([2] * 10)
    model, _, acc = setup(steps=4, drop_last=False)
    start = copy.deepcopy(model)
    for batch in acc.epoch(batches):
        with acc.microstep(mean_loss(model, batch)):
            pass
        if acc.global_step == 1 and acc.steps == 4:
            acc.steps = 3
    assert acc.global_step == 3
    expected = [batches[:4], batches[4:7], batches[7:10]]
    assert max_param_diff(model, reference_sgd(start, expected, lr=0.1)) < TOL


@settings(max_examples=60, deadline=None)
@given(
    n_batches=st.integers(0, 9),
    schedule=st.dictionaries(st.integers(1, 3), st.integers(1, 4), max_size=2).map(
        lambda later: {0: 1} | later
    ),
    epochs=st.integers(0, 4),
    drop_last=st.booleans(),
)
def test_total_steps_of_a_schedule_is_what_training_takes(
    n_batches: int, schedule: dict[int, int], epochs: int, drop_last: bool
) -> None:
    """total_steps(n, {epoch: steps}, ...) equals the optimizer steps of the real loop that
    sets acc.steps = steps_at_epoch(schedule, epoch) (epochs too short are skipped)."""
    model = torch.nn.Linear(2, 1)
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.0), drop_last=drop_last
    )
    data = [torch.ones(1, 2)] * n_batches
    for epoch in range(epochs):
        acc.steps = gradaccum.steps_at_epoch(schedule, epoch)
        if gradaccum.total_steps(n_batches, acc.steps, 1, drop_last) == 0:
            continue  # the guard would refuse it
        for x in acc.epoch(data):
            with acc.microstep(model(x).sum()):
                pass
    assert acc.global_step == gradaccum.total_steps(n_batches, schedule, epochs, drop_last)


def test_steps_cannot_change_mid_window() -> None:
    """Mid-window the new value is refused and the window completes with the old one."""
    model, _, acc = setup(steps=2)
    with acc.microstep(mean_loss(model, BATCHES[0])):
        pass
    with pytest.raises(gradaccum.UsageError, match="steps was set to 3 mid-window"):
        acc.steps = 3
    acc.steps = 2  # the value it has: nothing changes (a loop setting it every microbatch)
    with acc.microstep(mean_loss(model, BATCHES[1])):
        pass
    assert (acc.steps, acc.global_step) == (2, 1)


def test_steps_set_to_its_value_at_every_microbatch_changes_nothing() -> None:
    """``acc.steps = steps_at_epoch(schedule, epoch)`` written at the top of the loop body
    (every microbatch, not every epoch): the same value mid-window is no change, and the
    run is the one without the line, bit for bit."""
    schedule = {0: 2, 1: 4}
    runs = []
    for every_microbatch in (False, True):
        model, _, acc = setup(steps=2)
        for epoch in range(2):
            acc.steps = gradaccum.steps_at_epoch(schedule, epoch)
            for batch in acc.epoch(BATCHES):
                if every_microbatch:
                    acc.steps = gradaccum.steps_at_epoch(schedule, epoch)
                with acc.microstep(mean_loss(model, batch)):
                    pass
        runs.append((acc.global_step, [p.detach().clone() for p in model.parameters()]))
    (steps, before), (again, after) = runs
    assert steps == again == len(BATCHES) // 2 + len(BATCHES) // 4
    assert all(torch.equal(p, q) for p, q in zip(before, after, strict=True))


def test_state_with_other_steps_loads_at_an_epoch_boundary_when_asked() -> None:
    """allow_steps_change keeps the new steps and the saved global_step."""
    model, _, acc = setup(steps=4)
    for batch in acc.epoch(BATCHES):
        with acc.microstep(mean_loss(model, batch)):
            pass
    state = acc.state_dict()
    _, _, other = setup(steps=2)
    other.load_state_dict(state, allow_steps_change=True)
    assert (other.steps, other.global_step, other.position) == (2, 3, 0)


# Mid-window checkpoints --------------------------------------------------------------


def run_items(
    model: torch.nn.Module, acc: gradaccum.Accumulator, batches: list[Batch]
) -> list[Any]:
    out = []
    for batch in acc.epoch(batches):
        with acc.microstep(sum_loss(model, batch), num_items=torch.tensor(len(batch[0]))) as step:
            if step.boundary:
                out.append(step.loss)
    return out


@pytest.mark.parametrize("stop", [2, 5, 9])  # mid-window, epoch 1; its short last window
def test_include_grads_resumes_mid_window_bit_for_bit(stop: int) -> None:
    """num_items windows, drop_last=False over 10 microbatches of varying size: saved after
    ``stop`` microsteps with include_grads, resumed in fresh objects: the same run,
    parameters, AdamW state, step.loss and all."""
    batches = make_batches([1, 3, 2, 2, 4, 1, 2, 3, 1, 2], dtype=torch.float32)

    def build() -> tuple[Any, Any, gradaccum.Accumulator]:
        model = make_model(dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, optimizer, gradaccum.Accumulator(model, optimizer, steps=4, drop_last=False)

    model, _, acc = build()
    whole = run_items(model, acc, batches)
    first, optimizer, acc = build()
    for index, batch in enumerate(acc.epoch(batches)):
        with acc.microstep(sum_loss(first, batch), num_items=torch.tensor(len(batch[0]))):
            pass
        if index + 1 == stop:
            break
    assert acc.position == stop
    buffer = io.BytesIO()
    torch.save(
        [first.state_dict(), optimizer.state_dict(), acc.state_dict(include_grads=True)], buffer
    )
    resumed, optimizer, acc = build()
    model_state, optimizer_state, acc_state = torch.load(io.BytesIO(buffer.getvalue()))
    resumed.load_state_dict(model_state)
    optimizer.load_state_dict(optimizer_state)
    acc.load_state_dict(acc_state)
    assert acc.position == stop
    losses = run_items(resumed, acc, batches)
    assert all(torch.equal(a, b) for a, b in zip(losses, whole[-len(losses) :], strict=True))
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
    assert acc.global_step == 3


# Misuse warnings --------------------------------------------------------------------


def test_optimizer_step_between_windows_warns() -> None:
    """optimizer.step() by hand after a boundary: a warning saying to remove it."""
    model, _, acc = setup(steps=1)
    with acc.microstep(mean_loss(model, BATCHES[0])):
        pass
    with pytest.warns(gradaccum.GradaccumWarning, match="optimizer.step\\(\\) was called between"):
        acc.optimizer.step()


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")
def test_scheduler_step_by_hand_warns_at_the_next_boundary() -> None:
    """The accumulator notices scheduler.step() calls it did not make."""
    model, scheduler, acc = setup(steps=2)
    with acc.microstep(mean_loss(model, BATCHES[0])):
        pass
    scheduler.step()  # the misuse: stepping it per microbatch
    loss = mean_loss(model, BATCHES[1])
    with (
        pytest.warns(gradaccum.GradaccumWarning, match="last_epoch moved from 0 to 1"),
        acc.microstep(loss),
    ):
        pass
    assert scheduler.last_epoch == 2


def test_clipping_a_partial_window_warns_and_clipping_the_boundary_does_not() -> None:
    """clip_grad_norm_ between microsteps clips a partial sum: warned at the next
    microstep, with the fix; clipping in the boundary's block is fine."""
    model, _, acc = setup(steps=3)
    with acc.microstep(mean_loss(model, BATCHES[0])):
        pass
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with (
        pytest.warns(gradaccum.GradaccumWarning, match="changed in place after microstep 1 of 3"),
        acc.microstep(mean_loss(model, BATCHES[1])),
    ):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradaccum.GradaccumWarning)
        with acc.microstep(mean_loss(model, BATCHES[2])) as step:
            assert step.boundary
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the full window: fine
        for batch in BATCHES[3:6]:  # the next window starts clean
            with acc.microstep(mean_loss(model, batch)):
                pass


def test_clipping_costs_code_outside_the_accumulator_nothing() -> None:
    """No torch function is wrapped: a clip_grad_norm_ call anywhere is torch's own, while
    an accumulator's window is open."""
    original = torch.nn.utils.clip_grad_norm_
    model, _, acc = setup(steps=2)
    with acc.microstep(mean_loss(model, BATCHES[0])):
        pass
    assert torch.nn.utils.clip_grad_norm_ is original
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is original
    assert original.__module__ == "torch.nn.utils.clip_grad"  # torch's, not a wrapper


# Set-ups that stay accepted ---------------------------------------------------------


def test_partly_frozen_model_trains_its_trainable_part() -> None:
    """A frozen first layer keeps no gradient and does not move; the rest equals the
    reference on the same frozen model."""
    model = make_model()
    model[0].requires_grad_(False)
    start = copy.deepcopy(model)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=4)
    for batch in acc.epoch(BATCHES):
        with acc.microstep(mean_loss(model, batch)):
            pass
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model[0].weight, start[0].weight)
    reference = copy.deepcopy(start)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    for window in windows_of(BATCHES, 4):
        grads = torch.autograd.grad(mean_loss(reference, concat(window)), trainable)
        with torch.no_grad():
            for param, grad in zip(trainable, grads, strict=True):
                param -= 0.1 * grad
    assert max_param_diff(model, reference) < TOL
