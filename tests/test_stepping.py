"""Several optimizers and schedulers in one window: each stepped once, skipped together,
and every watch (foreign steps, zero_grad, scheduler steps) covers each of them."""

from __future__ import annotations

import copy
import gc
import math
import warnings
import weakref
from typing import Any

import pytest
import torch

import gradaccum
from tests.helpers import (
    make_batches,
    make_model,
    max_param_diff,
    mean_loss,
    reference_sgd,
    split_optimizers,
)


def parts(dtype: torch.dtype = torch.float64) -> tuple[torch.nn.Module, list[Any], list[Any]]:
    model = make_model(dtype=dtype)
    optimizers, schedulers = split_optimizers(model)
    return model, optimizers, schedulers


def poisoned_in_biases(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """A loss whose value is finite but whose gradient is NaN in the biases only (the
    second optimizer's parameters)."""
    bias = model[2].bias
    return mean_loss(model, batch) + (bias - bias.detach()).sum() * math.nan


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [param.detach().clone() for param in model.parameters()]


@pytest.mark.parametrize("how", ["scaler", "skip"])
def test_a_nan_in_one_optimizers_gradient_skips_every_optimizer_and_scheduler(how: str) -> None:
    """A NaN only in the AdamW half's gradient: neither optimizer nor either scheduler
    steps (with a GradScaler the scale backs off once), ``step.skipped`` is known in the
    block, and the next window applies both."""
    model, optimizers, schedulers = parts()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if how == "scaler" else None
    acc = gradaccum.Accumulator(
        model,
        optimizers,
        schedulers,
        steps=2,
        scaler=scaler,
        on_nonfinite="skip" if how == "skip" else None,
    )
    batches = make_batches([3] * 4)
    before = snapshot(model)
    seen = []
    for index, batch in enumerate(acc.epoch(batches)):
        loss = poisoned_in_biases(model, batch) if index == 0 else mean_loss(model, batch)
        with acc.microstep(loss) as step:
            if step.boundary:
                seen.append(step.skipped)
        if index == 1:
            assert all(torch.equal(p, q) for p, q in zip(snapshot(model), before, strict=True))
            assert [s.last_epoch for s in schedulers] == [0, 0]
    assert seen == [True, False]
    assert acc.skipped_steps == 1
    assert [s.last_epoch for s in schedulers] == [1, 1]
    assert all(not torch.equal(p, q) for p, q in zip(snapshot(model), before, strict=True))
    if scaler is not None:
        assert scaler.get_scale() == 2.0**7


def test_a_nan_in_one_optimizers_gradient_raises_under_raise() -> None:
    """``on_nonfinite="raise"`` sees a NaN in the second optimizer's share, and nothing steps."""
    model, optimizers, schedulers = parts()
    acc = gradaccum.Accumulator(model, optimizers, schedulers, steps=1, on_nonfinite="raise")
    before = snapshot(model)
    with pytest.raises(gradaccum.NonFiniteError, match="window 1"):  # noqa: SIM117
        with acc.microstep(poisoned_in_biases(model, make_batches([2])[0])):
            pass
    assert all(torch.equal(p, q) for p, q in zip(snapshot(model), before, strict=True))


def test_the_scaler_unscales_each_optimizer_once_and_updates_once() -> None:
    """With a GradScaler a window unscales and steps every optimizer, and updates the scale
    once: a power-of-two scale leaves the run bit for bit the unscaled one."""
    runs = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)):
        model, optimizers, schedulers = parts(torch.float32)
        acc = gradaccum.Accumulator(
            model, optimizers, schedulers, steps=3, scaler=scaler, max_grad_norm=0.5
        )
        for batch in acc.epoch(make_batches([2] * 9, dtype=torch.float32)):
            with acc.microstep(mean_loss(model, batch)):
                pass
        runs.append(snapshot(model))
        if scaler is not None:
            assert scaler.get_scale() == 2.0**13  # grew once per window: one update each
    assert all(torch.equal(p, q) for p, q in zip(*runs, strict=True))


def test_a_step_by_hand_of_any_optimizer_is_refused_in_a_window_and_warned_between() -> None:
    """The step pre-hook is on every optimizer: the second one's ``step()`` inside a window
    is a `UsageError`, between windows a warning."""
    model, optimizers, schedulers = parts()
    acc = gradaccum.Accumulator(model, optimizers, schedulers, steps=2)
    batch = make_batches([2])[0]
    with acc.microstep(mean_loss(model, batch)):
        pass
    with pytest.raises(gradaccum.UsageError, match="inside an accumulation window"):
        optimizers[1].step()
    with acc.microstep(mean_loss(model, batch)):
        pass
    with pytest.warns(gradaccum.GradaccumWarning, match="between windows"):
        optimizers[1].step()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_zero_grad_of_any_optimizer_inside_a_window_is_refused(set_to_none: bool) -> None:
    """The watch follows one gradient of every optimizer: the second optimizer's
    ``zero_grad()`` wipes only its own share, and is still caught (zeroed in place too,
    while the first optimizer's gradients are not zero)."""
    model, optimizers, schedulers = parts()
    acc = gradaccum.Accumulator(model, optimizers, schedulers, steps=3)
    batch = make_batches([2])[0]
    with acc.microstep(mean_loss(model, batch)):
        pass
    optimizers[1].zero_grad(set_to_none=set_to_none)
    with pytest.raises(gradaccum.UsageError, match="zero_grad"):  # noqa: SIM117
        with acc.microstep(mean_loss(model, batch)):
            pass


def test_each_scheduler_is_watched_for_steps_by_hand() -> None:
    """The second scheduler stepped by hand between windows is reported at its next step."""
    model, optimizers, schedulers = parts()
    acc = gradaccum.Accumulator(model, optimizers, schedulers, steps=1)
    batches = make_batches([2] * 2)
    with acc.microstep(mean_loss(model, batches[0])):
        pass
    schedulers[1].step()
    with (
        pytest.warns(gradaccum.GradaccumWarning, match="stepped outside the accumulator"),
        acc.microstep(mean_loss(model, batches[1])),
    ):
        pass


def test_a_scheduler_stepped_by_hand_every_window_is_reported_once() -> None:
    """A loop that also steps the scheduler does it every window: one warning says so,
    not one a window in the log of a long run."""
    model, optimizers, schedulers = parts()
    acc = gradaccum.Accumulator(model, optimizers, schedulers, steps=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for batch in make_batches([2] * 4):
            with acc.microstep(mean_loss(model, batch)):
                pass
            schedulers[0].step()
    told = [str(w.message) for w in seen if "stepped outside the accumulator" in str(w.message)]
    assert len(told) == 1, told
    assert "said once per accumulator" in told[0]


def test_a_chained_scheduler_stepped_by_hand_is_reported() -> None:
    """A ``ChainedScheduler`` has no ``last_epoch`` of its own, so a step by hand of it
    (a schedule running twice as fast) went unseen; it is read by its first scheduler's."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    chained = torch.optim.lr_scheduler.ChainedScheduler(
        [
            torch.optim.lr_scheduler.StepLR(optimizer, step_size=1),
            torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9),
        ]
    )
    acc = gradaccum.Accumulator(model, optimizer, chained, steps=1)
    batches = make_batches([2] * 2)
    with acc.microstep(mean_loss(model, batches[0])):
        pass
    chained.step()
    with (
        pytest.warns(gradaccum.GradaccumWarning, match="last_epoch moved from 1 to 2"),
        acc.microstep(mean_loss(model, batches[1])),
    ):
        pass


def test_a_scheduler_entry_may_be_none() -> None:
    """``scheduler=[StepLR, None]``: the first optimizer's schedule runs, the second keeps
    its learning rate; `Step.lrs` reports both."""
    model, optimizers, schedulers = parts()
    acc = gradaccum.Accumulator(model, optimizers, [schedulers[0], None], steps=2)
    lrs = []
    for batch in acc.epoch(make_batches([2] * 6)):
        with acc.microstep(mean_loss(model, batch)) as step:
            if step.boundary:
                lrs.append(step.lrs)
    assert lrs == [(0.1, 0.01), (0.1 * 0.8, 0.01), (0.1 * 0.8 * 0.8, 0.01)]
    assert schedulers[1].last_epoch == 0


def test_a_new_accumulator_takes_over_every_optimizer_and_close_removes_every_hook() -> None:
    """An accumulator over the same two optimizers closes the previous one (with the
    warning); closing it leaves neither optimizer hooked."""
    model, optimizers, schedulers = parts()
    first = gradaccum.Accumulator(model, optimizers, schedulers, steps=2)
    with pytest.warns(gradaccum.GradaccumWarning, match="closed the previous Accumulator"):
        second = gradaccum.Accumulator(model, optimizers[::-1], schedulers[::-1], steps=2)
    with pytest.raises(gradaccum.UsageError, match="closed Accumulator"):
        first.microstep(mean_loss(model, make_batches([2])[0]))
    second.close()
    assert all(not optimizer._optimizer_step_pre_hooks for optimizer in optimizers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for optimizer in optimizers:
            optimizer.step()  # no longer owned: no warning


@pytest.mark.parametrize("mid_window", [False, True], ids=["between_windows", "mid_window"])
def test_an_accumulator_dropped_unclosed_leaves_no_hook(mid_window: bool) -> None:
    """A trainer function that returns (or breaks out of its loop) without close(): its
    accumulator is freed at once, with no garbage collection, and takes its hooks with
    it. Its step hook once stayed on the optimizer, so that a new accumulator's own
    steps were refused ("optimizer.step() was called inside an accumulation window") or
    warned about as steps by hand; the new accumulator trains as the hand loop."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = make_batches([2] * 6)

    def train_a_little() -> None:
        acc = gradaccum.Accumulator(model, optimizer, steps=2)
        for index, batch in enumerate(acc.epoch(batches)):
            if index == 2 + mid_window:
                return  # an early stop
            with acc.microstep(mean_loss(model, batch)):
                pass

    was_collecting = gc.isenabled()
    gc.disable()
    try:
        train_a_little()
        assert_unhooked_and_a_new_accumulator_trains_as_the_hand_loop(model, optimizer, batches)
    finally:
        if was_collecting:
            gc.enable()


def assert_unhooked_and_a_new_accumulator_trains_as_the_hand_loop(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any]
) -> None:
    """No hook of a dead accumulator is left on ``optimizer``, and a new accumulator over
    it trains the 6 microbatches of ``batches`` in 3 windows as plain SGD does, without a
    refusal or a warning."""
    assert not optimizer._optimizer_step_pre_hooks
    assert not optimizer._optimizer_load_state_dict_post_hooks
    start = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc = gradaccum.Accumulator(model, optimizer, steps=2)
        for batch in acc.epoch(batches):
            with acc.microstep(mean_loss(model, batch)):
                pass
    assert acc.global_step == 3
    expected = reference_sgd(start, [batches[i : i + 2] for i in range(0, 6, 2)], lr=0.1)
    assert max_param_diff(model, expected) < 1e-12


class _Trainer:
    """A trainer object as real ones are written: it holds the model, the optimizer and
    the accumulator, and counts the steps with a hook of its own on the optimizer."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.optimizer.register_step_post_hook(self.on_step)
        self.acc = gradaccum.Accumulator(model, self.optimizer, steps=2)
        self.stepped = 0

    def on_step(self, *_: object) -> None:
        self.stepped += 1


@pytest.mark.parametrize(
    ("holder", "ddp"),
    [("trainer", False), ("model", False), ("trainer", True), ("model", True)],
    ids=["a-trainer-s-hook", "kept-on-the-model", "a-trainer-s-hook-ddp", "kept-on-the-model-ddp"],
)
def test_user_objects_that_hold_the_accumulator_are_freed_with_it(
    holder: str, ddp: bool, request: pytest.FixtureRequest
) -> None:
    """A trial of a sweep that trains and returns without close(), where the user's own
    objects hold the accumulator: a trainer whose hook on the optimizer is a bound method,
    or the accumulator kept as an attribute of the model (under DDP on a one-rank group
    too). Once the trial's objects are garbage, the garbage collector frees the model and
    the optimizer (a GPU sweep's memory). The registry of owned optimizers once held its
    accumulators strongly, so they lived, with everything they reach, to the end of the
    process."""
    if ddp:
        request.getfixturevalue("process_group")

    def trial() -> tuple[weakref.ref[Any], weakref.ref[Any]]:
        model: torch.nn.Module = make_model()
        if ddp:
            model = torch.nn.parallel.DistributedDataParallel(model)
        if holder == "trainer":
            trainer = _Trainer(model)
            optimizer, acc = trainer.optimizer, trainer.acc
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            acc = gradaccum.Accumulator(model, optimizer, steps=2)
            model.acc = acc
        for batch in acc.epoch(make_batches([2] * 3)):  # a window and a half, left open
            with acc.microstep(mean_loss(model, batch)):
                pass
        return weakref.ref(model), weakref.ref(optimizer)

    model, optimizer = trial()
    gc.collect()
    assert model() is None
    assert optimizer() is None


def test_an_accumulator_freed_in_a_cycle_leaves_the_kept_optimizer_unhooked() -> None:
    """The accumulator kept on a wrapper of the model, and the wrapper dropped mid-window
    while the model and its optimizer are kept: the garbage collector frees the wrapper
    and the accumulator together, and the optimizer's hooks go with them, so that a new
    accumulator over the same optimizer trains as the hand loop, with no refusal ("inside
    an accumulation window") and no warning."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = make_batches([2] * 6)

    def a_wrapper_for_a_while() -> None:
        wrapper = torch.nn.Sequential(model)
        wrapper.acc = gradaccum.Accumulator(wrapper, optimizer, steps=2)
        with wrapper.acc.microstep(mean_loss(wrapper, batches[0])):
            pass  # a window left open

    a_wrapper_for_a_while()
    gc.collect()
    for param in model.parameters():
        param.grad = None  # (the dropped window's gradient, as a new run starts)
    assert_unhooked_and_a_new_accumulator_trains_as_the_hand_loop(model, optimizer, batches)


def test_a_window_open_on_one_optimizer_refuses_a_new_owner() -> None:
    """A second accumulator over an optimizer whose owner has an open window is refused,
    and leaves the other optimizer unowned."""
    model, optimizers, schedulers = parts()
    first = gradaccum.Accumulator(model, optimizers[1], steps=2)
    with first.microstep(mean_loss(model, make_batches([2])[0])):
        pass
    with pytest.raises(gradaccum.UsageError, match="whose window is open"):
        gradaccum.Accumulator(model, optimizers, schedulers, steps=2)
    assert not optimizers[0]._optimizer_step_pre_hooks


@pytest.mark.parametrize(
    ("build", "error"),
    [
        (lambda o, s: ([o[0], o[0]], None), gradaccum.ConfigError),
        (lambda o, s: ([o[0], o[1]], [s[1], s[0]]), gradaccum.ConfigError),
        (lambda o, s: ([o[0], o[1]], s[0]), gradaccum.ConfigError),
        (lambda o, s: ([o[0], "adamw"], None), gradaccum.ConfigTypeError),
        (lambda o, s: ([o[0], o[1]], [s[0], "cosine"]), gradaccum.ConfigTypeError),
    ],
)
def test_a_refused_set_up_changes_nothing(build: Any, error: type[Exception]) -> None:
    """Refused before any work: no hook on any optimizer, the gradients kept, no owner."""
    model, optimizers, schedulers = parts()
    mean_loss(model, make_batches([2])[0]).backward()
    grads = [param.grad.clone() for param in model.parameters()]
    optimizer, scheduler = build(optimizers, schedulers)
    with pytest.raises(error):
        gradaccum.Accumulator(model, optimizer, scheduler, steps=2)
    assert all(not o._optimizer_step_pre_hooks for o in optimizers)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    gradaccum.Accumulator(model, optimizers, schedulers, steps=2).close()  # nobody owns them


@pytest.mark.parametrize("optimizer_first", [True, False])
def test_a_resume_that_loads_the_optimizer_and_the_scheduler_is_no_step_by_hand(
    optimizer_first: bool,
) -> None:
    """A resume that keeps its own count: the accumulator is built, then the optimizer's
    and the scheduler's states are loaded, in either order (``last_epoch`` 0 -> 5). No
    warning: loading an optimizer's state tells the accumulator that the schedules were
    loaded too, and it takes them as they are; a step by hand after that is still
    reported. (It warned "remove the scheduler.step() call", a call never made.)"""
    model, optimizers, schedulers = parts()
    for _ in range(5):
        optimizers[0].step()
        schedulers[0].step()
    saved = optimizers[0].state_dict(), schedulers[0].state_dict()
    model, optimizers, schedulers = parts()
    acc = gradaccum.Accumulator(model, optimizers, schedulers, steps=1)
    loaders = [optimizers[0].load_state_dict, schedulers[0].load_state_dict]
    loads = list(zip(loaders, saved, strict=True))
    for load, state in loads if optimizer_first else loads[::-1]:
        load(state)
    batches = make_batches([2] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradaccum.GradaccumWarning)
        with acc.microstep(mean_loss(model, batches[0])):
            pass
    assert schedulers[0].last_epoch == 6
    schedulers[0].step()
    with (
        pytest.warns(gradaccum.GradaccumWarning, match="moved from 6 to 7"),
        acc.microstep(mean_loss(model, batches[1])),
    ):
        pass


def _unfreezing(scaled: bool) -> tuple[torch.nn.Module, list[Any], Any]:
    """A model whose first layer (the "backbone") is frozen for now, with an optimizer of
    its own beside the head's, and a GradScaler when ``scaled``."""
    model = make_model(dtype=torch.float32)
    model[0].requires_grad_(False)
    optimizers = [
        torch.optim.SGD(model[2].parameters(), lr=0.1),
        torch.optim.AdamW(model[0].parameters(), lr=1e-2),
    ]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if scaled else None
    return model, optimizers, scaler


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaler"])
def test_an_optimizer_over_layers_frozen_for_now_steps_once_they_are_unfrozen(
    scaled: bool,
) -> None:
    """Progressive unfreezing with the backbone's own optimizer: it was refused as
    holding none of the model's trainable parameters, and with a GradScaler a window in
    which it has no gradient crashed inside torch ("No inf checks were recorded for this
    optimizer") after the head's optimizer had stepped. Now both epochs train bit for bit
    as the hand loop that steps what has a gradient."""
    batches = make_batches([4] * 8, dtype=torch.float32)
    model, optimizers, scaler = _unfreezing(scaled)
    acc = gradaccum.Accumulator(model, optimizers, steps=2, scaler=scaler)
    for epoch in range(2):
        model[0].requires_grad_(epoch == 1)
        for batch in acc.epoch(batches):
            with acc.microstep(mean_loss(model, batch)):
                pass
    assert acc.global_step == 8

    hand, hand_optimizers, hand_scaler = _unfreezing(scaled)
    for epoch in range(2):
        hand[0].requires_grad_(epoch == 1)
        for index, batch in enumerate(batches):
            loss = mean_loss(hand, batch) / 2
            (loss if hand_scaler is None else hand_scaler.scale(loss)).backward()
            if index % 2 == 0:
                continue
            for optimizer in hand_optimizers:
                has_grad = any(p.grad is not None for p in optimizer.param_groups[0]["params"])
                if hand_scaler is None:
                    optimizer.step()
                elif has_grad:
                    hand_scaler.step(optimizer)
            if hand_scaler is not None:
                hand_scaler.update()
            for optimizer in hand_optimizers:
                optimizer.zero_grad()
    for got, want in zip(model.parameters(), hand.parameters(), strict=True):
        assert torch.equal(got, want)
