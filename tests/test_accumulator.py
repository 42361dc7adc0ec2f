"""The accumulator (the facade) where its parts meet, on one process: resuming after a
change of steps or from the top of the loop body, parameter groups added between windows,
the steps setter at a window start, windows across epochs, item totals in float16, misuse
that would lose data, a failure after the update was applied, and no loss's autograd graph
held past its microstep."""

from __future__ import annotations

import copy
import math
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from torch import nn

import gradaccum
from tests.helpers import (
    Batch,
    concat,
    load_checkpoint,
    make_batches,
    make_model,
    mean_loss,
    save_checkpoint,
    split_optimizers,
    sum_loss,
)

Parts = tuple[nn.Module, torch.optim.Optimizer, Any, gradaccum.Accumulator]

TOL = 1e-10
LR = 0.1
BATCHES = make_batches([2] * 12)


def build(steps: int, **options: Any) -> Parts:
    """Float64 model, AdamW and a decaying LR, the same from the same seed every time."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=steps, **options)
    return model, optimizer, scheduler, acc


def count_steps(optimizer: torch.optim.Optimizer) -> list[None]:
    """A list that grows by one on every ``optimizer.step()``."""
    taken: list[None] = []
    optimizer.register_step_post_hook(lambda *_: taken.append(None))
    return taken


def feed(data: list[Batch], sized: bool) -> Iterable[Batch]:
    """The epoch's microbatches as a list, or as an iterator without len."""
    return data if sized else iter(data)


def train(parts: Parts, data: Iterable[Batch]) -> None:
    """One plain epoch: one microstep per microbatch."""
    model, _, _, acc = parts
    for batch in acc.epoch(data):
        with acc.microstep(mean_loss(model, batch)):
            pass


def step_once(acc: gradaccum.Accumulator, loss: torch.Tensor, num_items: int | None = None) -> None:
    with acc.microstep(loss, num_items):
        pass


def assert_same_run(run: Parts, reference: Parts) -> None:
    """Steps, LR, every parameter and the AdamW state equal the reference's, exactly."""
    (model, optimizer, scheduler, acc), (model_r, optimizer_r, scheduler_r, acc_r) = run, reference
    assert acc.global_step == acc_r.global_step
    assert scheduler.last_epoch == scheduler_r.last_epoch
    assert optimizer.param_groups[0]["lr"] == optimizer_r.param_groups[0]["lr"]
    for p, q in zip(model.parameters(), model_r.parameters(), strict=True):
        assert torch.equal(p, q)
        for key, value in optimizer_r.state[q].items():
            assert torch.equal(optimizer.state[p][key], value)


def assert_params_equal(model: nn.Module, reference: nn.Module) -> None:
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


# 1. Resume after a mid-epoch change of steps ------------------------------------------


class TestResumeAfterStepsChange:
    @pytest.mark.parametrize("drop_last", [True, False])
    @pytest.mark.parametrize("sized", [True, False])
    def test_resume_after_a_mid_epoch_steps_change_is_exact(
        self, sized: bool, drop_last: bool
    ) -> None:
        """14 microbatches: 2 windows of 2, then ``acc.steps = 3``; checkpointed after the
        third window and resumed into a fresh Accumulator(steps=3) over the same data: the
        same optimizer steps, LR, parameters and AdamW state as the uninterrupted run."""
        batches = make_batches([2] * 14)

        def run(parts: Parts, stop_after: int | None = None) -> None:
            model, _, _, acc = parts
            for batch in acc.epoch(feed(batches, sized)):
                with acc.microstep(mean_loss(model, batch)):
                    pass
                if acc.global_step == 2 and acc.steps == 2:
                    acc.steps = 3
                if acc.global_step == stop_after:
                    return

        whole = build(2, drop_last=drop_last)
        whole_steps = count_steps(whole[1])
        run(whole)
        first = build(2, drop_last=drop_last)
        first_steps = count_steps(first[1])
        run(first, stop_after=3)
        resumed = load_checkpoint(build(3, drop_last=drop_last), save_checkpoint(first))
        resumed_steps = count_steps(resumed[1])
        run(resumed)
        assert len(whole_steps) == (5 if drop_last else 6)  # 2, 2, 3, 3, 3 (, 1)
        assert len(first_steps) + len(resumed_steps) == len(whole_steps)
        assert_same_run(resumed, whole)


# 2. A checkpoint at the top of the loop body -----------------------------------------


class TestCheckpointAtTheTopOfTheLoopBody:
    @pytest.mark.parametrize("sized", [True, False])
    def test_the_handed_out_microbatch_is_trained_after_the_resume(self, sized: bool) -> None:
        """steps=3, 12 microbatches: checkpointed between windows right after microbatch 6
        was handed out (before its microstep), resumed in fresh objects: microbatch 6 is
        trained, and the run equals the uninterrupted one."""

        def run(parts: Parts, stop_at: int | None = None) -> bytes | None:
            model, _, _, acc = parts
            for index, batch in enumerate(acc.epoch(feed(BATCHES, sized))):
                if index == stop_at:
                    return save_checkpoint(parts)
                with acc.microstep(mean_loss(model, batch)):
                    pass
            return None

        whole = build(3)
        whole_steps = count_steps(whole[1])
        run(whole)
        first = build(3)
        first_steps = count_steps(first[1])
        blob = run(first, stop_at=6)
        assert blob is not None
        assert len(first_steps) == 2
        resumed = load_checkpoint(build(3), blob)
        resumed_steps = count_steps(resumed[1])
        run(resumed)
        assert len(whole_steps) == 4
        assert len(first_steps) + len(resumed_steps) == 4
        assert_same_run(resumed, whole)


# 3. A parameter group added between windows ----------------------------------------


def unfreezing(**options: Any) -> tuple[nn.Module, gradaccum.Accumulator]:
    """The first layer frozen and outside the optimizer; one window trained on the rest
    (SGD), then the first layer unfrozen and added as a new parameter group."""
    model = make_model()
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model[2].parameters(), lr=LR)
    acc = gradaccum.Accumulator(model, optimizer, steps=2, **options)
    for batch in make_batches([2, 2], seed=5):
        step_once(acc, mean_loss(model, batch))
    assert acc.global_step == 1
    model[0].requires_grad_(True)
    optimizer.add_param_group({"params": list(model[0].parameters())})
    return model, acc


def reference_grads(model: nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, list(model.parameters())))


class TestParamGroupAddedBetweenWindows:
    def test_new_group_is_normalized_by_the_window_items(self) -> None:
        """Summed losses with num_items (3 + 5 items): in the boundary block every
        gradient, the new group's too, is the float64 big-batch item-mean gradient."""
        model, acc = unfreezing()
        window = make_batches([3, 5], seed=6)
        reference = copy.deepcopy(model)
        expected = reference_grads(reference, mean_loss(reference, concat(window)))
        step_once(acc, sum_loss(model, window[0]), len(window[0][0]))
        with acc.microstep(sum_loss(model, window[1]), num_items=len(window[1][0])) as step:
            assert step.boundary
            got = [p.grad for p in model.parameters()]
        assert all(grad is not None for grad in got)
        for grad, want in zip(got, expected, strict=True):
            assert (grad - want).abs().max().item() < TOL

    def test_new_group_counts_in_the_clipped_norm_and_is_clipped(self) -> None:
        """max_grad_norm: the norm covers the new group's gradient, and every gradient,
        the new group's too, is scaled by max_norm / (norm + 1e-6), computed by hand."""
        max_norm = 0.05
        model, acc = unfreezing(max_grad_norm=max_norm)
        window = make_batches([2, 2], seed=6)
        reference = copy.deepcopy(model)
        expected = reference_grads(reference, mean_loss(reference, concat(window)))
        norm = torch.stack([grad.square().sum() for grad in expected]).sum().sqrt()
        coefficient = max_norm / (norm.item() + 1e-6)
        assert coefficient < 1.0  # the window is clipped
        step_once(acc, mean_loss(model, window[0]))
        with acc.microstep(mean_loss(model, window[1])) as step:
            assert step.grad_norm is not None
            assert abs(step.grad_norm.item() - norm.item()) < TOL
            got = [p.grad for p in model.parameters()]
        assert all(grad is not None for grad in got)
        for grad, want in zip(got, expected, strict=True):
            assert (grad - want * coefficient).abs().max().item() < TOL

    @pytest.mark.parametrize("policy", ["raise", "skip"])
    def test_nan_only_in_the_new_group_is_caught(self, policy: str) -> None:
        """A NaN only in the new parameters' gradient: on_nonfinite="raise" raises
        NonFiniteError, "skip" skips; either way no parameter moves."""
        model, acc = unfreezing(on_nonfinite=policy)
        window = make_batches([2, 2], seed=6)
        before = copy.deepcopy(model)
        model[0].weight.register_hook(lambda grad: torch.full_like(grad, math.nan))
        step_once(acc, mean_loss(model, window[0]))
        loss = mean_loss(model, window[1])
        if policy == "raise":
            with pytest.raises(gradaccum.NonFiniteError):
                step_once(acc, loss)
        else:
            with acc.microstep(loss) as step:
                assert step.skipped
            assert acc.skipped_steps == 1
        assert_params_equal(model, before)


# 4. The steps setter at a window start ----------------------------------------------


class TestStepsSetterAtAWindowStart:
    @pytest.mark.parametrize(
        ("starts", "value"),
        [((0, 2, 4), 2), ((4,), 3)],  # the same value at every start; another at the last
    )
    def test_unsized_trailing_window_is_kept(self, starts: tuple[int, ...], value: int) -> None:
        """A generator of 5 microbatches, steps=2, drop_last=False: ``acc.steps = value``
        at the top of the loop body of a window's first microbatch keeps the windows
        2, 2, 1: 3 optimizer steps, equal to the run without the setter."""
        batches = make_batches([2] * 5)

        def run(parts: Parts, setter: bool) -> None:
            model, _, _, acc = parts
            for index, batch in enumerate(acc.epoch(iter(batches))):
                if setter and index in starts:
                    acc.steps = value
                with acc.microstep(mean_loss(model, batch)):
                    pass

        plain = build(2, drop_last=False)
        plain_steps = count_steps(plain[1])
        run(plain, setter=False)
        setting = build(2, drop_last=False)
        setting_steps = count_steps(setting[1])
        run(setting, setter=True)
        assert len(plain_steps) == 3
        assert len(setting_steps) == 3
        assert_same_run(setting, plain)


# 5. Windows do not carry across epochs ----------------------------------------------


class TestWindowsAcrossEpochs:
    def test_a_skipped_trailing_window_does_not_size_the_next_epoch(self) -> None:
        """Unsized, drop_last=False, steps=2: epoch 1's 5th microbatch forms its own window
        and the loop skips it; epoch 2 (4 microbatches) still has 2 windows of 2, the same
        run as with epoch 1 ending at microbatch 4."""
        batches = make_batches([2] * 5)
        second = make_batches([2] * 4, seed=7)

        def run(parts: Parts, first: list[Batch]) -> None:
            model, _, _, acc = parts
            for index, batch in enumerate(acc.epoch(iter(first))):
                if index == 4:
                    continue  # the trailing window of one microbatch, skipped
                with acc.microstep(mean_loss(model, batch)):
                    pass
            train(parts, iter(second))

        skipping = build(2, drop_last=False)
        skipping_steps = count_steps(skipping[1])
        run(skipping, batches)
        plain = build(2, drop_last=False)
        plain_steps = count_steps(plain[1])
        run(plain, batches[:4])
        assert len(plain_steps) == 4
        assert len(skipping_steps) == 4
        assert_same_run(skipping, plain)


# 6. Item totals above float16's range ------------------------------------------------

ITEMS = 40_000  # two microsteps: 80000 items in the window, above float16's 65504


class TestItemNormalizationInFloat16:
    @pytest.mark.parametrize("as_tensor", [False, True])
    def test_a_window_of_80000_items_in_float16(self, as_tensor: bool) -> None:
        """A float16 model on CPU, 2 microsteps of 40000 summed items each (num_items as
        ints, or as 0-dim tensors): the boundary block's gradient is the float64
        item-mean gradient of the window, to float16 precision."""
        model = make_model(dtype=torch.float16)
        reference = copy.deepcopy(model).double()
        generator = torch.Generator().manual_seed(3)
        window: list[Batch] = []
        for _ in range(2):
            inputs = torch.randn(ITEMS, 5, generator=generator, dtype=torch.float64)
            noise = torch.randn(ITEMS, 1, generator=generator, dtype=torch.float64)
            with torch.no_grad():
                targets = 0.8 * reference(inputs) + 0.1 * noise
            window.append((inputs.half(), targets.half()))
        wide = concat([(inputs.double(), targets.double()) for inputs, targets in window])
        expected = reference_grads(reference, mean_loss(reference, wide))
        acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR), steps=2)
        items: int | torch.Tensor = torch.tensor(ITEMS) if as_tensor else ITEMS
        with acc.microstep(sum_loss(model, window[0]), num_items=items):
            pass
        with acc.microstep(sum_loss(model, window[1]), num_items=items) as step:
            assert step.boundary
            got = [p.grad for p in model.parameters()]
        for grad, want in zip(got, expected, strict=True):
            assert grad is not None
            assert grad.dtype == torch.float16
            scale = want.abs().max().item()
            assert (grad.double() - want).abs().max().item() < 1e-2 * scale


# 7. Misuse that would lose data -----------------------------------------------------


class TestMisuseThatLosesData:
    @pytest.mark.parametrize("set_to_none", [True, False])
    @pytest.mark.parametrize("caller", ["optimizer", "model"])
    def test_zero_grad_inside_an_open_window_is_refused(
        self, caller: str, set_to_none: bool
    ) -> None:
        """7a: zero_grad() between two microsteps of a window wipes its gradient: the next
        microstep raises UsageError naming zero_grad, before back-propagating."""
        model, optimizer, _, acc = build(3)
        step_once(acc, mean_loss(model, BATCHES[0]))
        if caller == "optimizer":
            optimizer.zero_grad(set_to_none=set_to_none)
        else:
            model.zero_grad(set_to_none=set_to_none)
        loss = mean_loss(model, BATCHES[1])
        with pytest.raises(gradaccum.UsageError, match="zero_grad"):
            step_once(acc, loss)
        # The window's gradient is gone: it is discarded, and the next microstep opens a
        # new window (the loss above was not back-propagated).
        assert all(p.grad is None for p in model.parameters())
        assert repr(acc) == "Accumulator(steps=3, global_step=0, window=0/3)"

    @pytest.mark.parametrize("steps", [1, 3])
    @pytest.mark.parametrize("caller", ["optimizer", "model"])
    def test_zero_grad_in_the_boundary_block_is_refused(self, caller: str, steps: int) -> None:
        """7a: the habit of a plain loop, ``zero_grad()`` beside the ``optimizer.step()``
        that was deleted, left in the boundary's block: it clears the window's gradient
        before the accumulator steps, so the update would silently be lost. Leaving the
        block raises UsageError naming it; nothing is applied (no optimizer or scheduler
        step), the window is discarded, and the run goes on as if it had not been."""
        reference = build(steps)
        train(reference, BATCHES[steps : 3 * steps])
        model, optimizer, scheduler, acc = parts = build(steps)
        taken = count_steps(optimizer)
        epoch = acc.epoch(BATCHES[: 3 * steps])
        for _ in range(steps - 1):
            step_once(acc, mean_loss(model, next(epoch)))

        def boundary_with_zero_grad() -> None:
            with acc.microstep(mean_loss(model, next(epoch))) as step:
                assert step.boundary
                (optimizer if caller == "optimizer" else model).zero_grad()

        with pytest.raises(gradaccum.UsageError, match="inside its boundary block"):
            boundary_with_zero_grad()
        assert (taken, acc.global_step, scheduler.last_epoch) == ([], 0, 0)
        assert all(p.grad is None for p in model.parameters())
        assert repr(acc) == f"Accumulator(steps={steps}, global_step=0, window=0/{steps})"
        for batch in epoch:
            step_once(acc, mean_loss(model, batch))
        assert_same_run(parts, reference)

    def test_zero_grad_of_the_second_optimizer_in_the_boundary_block_is_refused(self) -> None:
        """7a: with two optimizers, the second's ``zero_grad()`` in the boundary's block
        clears only its own share of the gradient; that is refused too, and neither
        optimizer steps."""
        model = make_model()
        (first, second), _ = split_optimizers(model, schedulers=False)
        taken = count_steps(first) + count_steps(second)
        acc = gradaccum.Accumulator(model, [first, second], steps=2)
        before = [p.detach().clone() for p in model.parameters()]
        step_once(acc, mean_loss(model, BATCHES[0]))

        def boundary_with_zero_grad() -> None:
            with acc.microstep(mean_loss(model, BATCHES[1])):
                second.zero_grad()

        with pytest.raises(gradaccum.UsageError, match="inside its boundary block"):
            boundary_with_zero_grad()
        assert taken == []
        assert acc.global_step == 0
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
        acc.close()

    def test_a_gradient_dropped_by_hand_in_the_boundary_block_is_no_zero_grad(self) -> None:
        """A gradient set to None in the boundary's block, leaving its parameter out of
        this update, is not taken for a ``zero_grad()``: the window steps the others, as
        the hand loop does, with no warning."""
        hand = make_model()
        hand_optimizer = torch.optim.SGD(hand.parameters(), lr=LR)
        for batch in BATCHES[:2]:
            (mean_loss(hand, batch) / 2).backward()
        first = next(hand.parameters())
        first.grad = None
        hand_optimizer.step()
        model = make_model()
        acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR), steps=2)
        step_once(acc, mean_loss(model, BATCHES[0]))
        with acc.microstep(mean_loss(model, BATCHES[1])):
            next(model.parameters()).grad = None
        assert acc.global_step == 1
        assert_params_equal(model, hand)
        acc.close()

    def test_a_clip_over_an_adapter_whose_gradient_is_zero_is_no_zero_grad(self) -> None:
        """A LoRA adapter starts with its second matrix at zero, so the first one's
        gradient (the optimizer's first, the one watched) is all zero; a clip left in the
        loop body scales it in place. That is warned about as a change of the partial
        gradient, not refused as a ``zero_grad()`` (another gradient of the optimizer is
        not zero), and the window steps as the hand loop does."""

        def adapter() -> torch.nn.Module:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(5, 2), torch.nn.Linear(2, 1))
            with torch.no_grad():
                model[1].weight.zero_()  # (lora_B's initialization)
            return model.double()

        hand, model = adapter(), adapter()
        hand_optimizer = torch.optim.SGD(hand.parameters(), lr=LR)
        for batch in BATCHES[:2]:
            (mean_loss(hand, batch) / 2).backward()
            torch.nn.utils.clip_grad_norm_(hand.parameters(), 1e-3)
        hand_optimizer.step()
        acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=LR), steps=2)
        step_once(acc, mean_loss(model, BATCHES[0]))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with acc.microstep(mean_loss(model, BATCHES[1])) as step:
                assert step.boundary
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        assert [w.category for w in caught] == [gradaccum.GradaccumWarning]
        assert "changed in place" in str(caught[0].message)
        assert acc.global_step == 1
        assert_params_equal(model, hand)
        acc.close()

    def test_second_accumulator_on_an_open_window_is_refused(self) -> None:
        """7b: a second Accumulator on an optimizer whose owner has an open window raises
        UsageError ("owned by"); the open window is kept and completes as if untouched."""
        whole = build(2)
        train(whole, BATCHES[:4])
        model, optimizer, scheduler, acc = parts = build(2)
        step_once(acc, mean_loss(model, BATCHES[0]))
        with pytest.raises(gradaccum.UsageError, match="owned by"):
            gradaccum.Accumulator(model, optimizer, scheduler, steps=2)
        for batch in BATCHES[1:4]:
            step_once(acc, mean_loss(model, batch))
        assert_same_run(parts, whole)

    def test_second_accumulator_between_windows_takes_over(self) -> None:
        """7b: between the old one's windows a second Accumulator warns at the user's line
        that it closed the previous one; the old one is closed, the new one steps the
        optimizer once per window without warnings, as one accumulator would."""
        whole = build(2)
        train(whole, BATCHES[:6])
        model, optimizer, scheduler, old = build(2)
        taken = count_steps(optimizer)
        train((model, optimizer, scheduler, old), BATCHES[:2])
        with pytest.warns(
            gradaccum.GradaccumWarning, match="closed the previous Accumulator"
        ) as record:
            new = gradaccum.Accumulator(model, optimizer, scheduler, steps=2)
        takeover = [w for w in record if "closed the previous Accumulator" in str(w.message)]
        assert [w.filename for w in takeover] == [__file__]
        with pytest.raises(gradaccum.UsageError, match="closed"):
            old.microstep(mean_loss(model, BATCHES[2]))
        train((model, optimizer, scheduler, new), BATCHES[2:6])
        assert len(taken) == 3
        assert (old.global_step, new.global_step) == (1, 2)
        assert scheduler.last_epoch == whole[2].last_epoch == 3
        assert_params_equal(model, whole[0])

    def test_nested_epoch_is_refused_at_its_first_next(self) -> None:
        """7c: iterating a second acc.epoch() while the first is being iterated raises
        UsageError naming the epoch at the inner's first next(); the outer one goes on."""
        whole = build(4)
        train(whole, BATCHES)
        model, _, _, acc = parts = build(4)
        outer = acc.epoch(BATCHES)
        batch = next(outer)
        inner = acc.epoch(BATCHES)
        with pytest.raises(gradaccum.UsageError, match="epoch"):
            next(inner)
        step_once(acc, mean_loss(model, batch))
        for batch in outer:
            step_once(acc, mean_loss(model, batch))
        assert_same_run(parts, whole)

    def test_load_state_dict_on_a_closed_accumulator_is_refused(self) -> None:
        """7d: load_state_dict() on a closed Accumulator raises UsageError ("closed")."""
        _, _, _, acc = build(2)
        state = acc.state_dict()
        acc.close()
        with pytest.raises(gradaccum.UsageError, match="closed"):
            acc.load_state_dict(state)

    def test_steps_set_before_the_first_next_plans_the_epoch(self) -> None:
        """7e: ``it = acc.epoch(12)`` with steps=8, then ``acc.steps = 4``, then iterate:
        3 windows of 4, the same run as steps=4 from the start."""
        whole = build(4)
        whole_steps = count_steps(whole[1])
        train(whole, BATCHES)
        model, optimizer, _, acc = parts = build(8)
        taken = count_steps(optimizer)
        epoch = acc.epoch(BATCHES)
        acc.steps = 4
        for batch in epoch:
            step_once(acc, mean_loss(model, batch))
        assert len(whole_steps) == 3
        assert len(taken) == 3
        assert_same_run(parts, whole)

    def test_too_short_epoch_is_refused_when_iterated(self) -> None:
        """7e: steps=8 and 6 microbatches: acc.epoch() returns, the first next() raises
        ConfigError, and nothing is trained."""
        model, _, _, acc = build(8)
        start = copy.deepcopy(model)
        epoch = acc.epoch(BATCHES[:6])
        with pytest.raises(gradaccum.ConfigError):
            next(epoch)
        assert acc.global_step == 0
        assert_params_equal(model, start)

    def test_steps_lowered_before_iterating_a_short_epoch(self) -> None:
        """7e: steps=8 and 6 microbatches, then ``acc.steps = 2`` before iterating: 3
        windows of 2, the same run as steps=2 from the start."""
        whole = build(2)
        train(whole, BATCHES[:6])
        model, optimizer, _, acc = parts = build(8)
        taken = count_steps(optimizer)
        epoch = acc.epoch(BATCHES[:6])
        acc.steps = 2
        for batch in epoch:
            step_once(acc, mean_loss(model, batch))
        assert len(taken) == 3
        assert_same_run(parts, whole)


# 9. A failure after the update was applied -----------------------------------------


class TestFailureAfterTheUpdate:
    def test_scheduler_failing_after_the_step_counts_the_window_as_applied(self) -> None:
        """OneCycleLR(total_steps=2) raises on its 3rd step(): the 3rd boundary's exit
        raises that error, yet the window counts as applied: global_step 3, 3 optimizer
        steps, gradients cleared, and state_dict() saves position 3 * steps."""
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=LR, total_steps=2, cycle_momentum=False
        )
        acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=2)
        taken = count_steps(optimizer)
        with pytest.raises(ValueError, match="Tried to step 3 times"):
            train((model, optimizer, scheduler, acc), BATCHES[:8])
        assert acc.global_step == 3
        assert len(taken) == 3
        assert all(p.grad is None for p in model.parameters())
        state = acc.state_dict()
        assert state["position"] == 3 * 2

    def test_window_discarded_in_its_boundary_block_is_retrained_after_resume(self) -> None:
        """An exception in the boundary block of window 2 discards it: state_dict() then
        saves position 2 (the window's start), and the resumed run retrains microbatches
        2 and 3: equal to the uninterrupted run."""
        whole = build(2)
        train(whole, BATCHES[:8])
        model, _, _, acc = first = build(2)

        def fail_in_window_2() -> None:
            for batch in acc.epoch(BATCHES[:8]):
                with acc.microstep(mean_loss(model, batch)) as step:
                    if step.global_step == 2 and step.boundary:
                        raise KeyError("user code failed")

        with pytest.raises(KeyError):
            fail_in_window_2()
        assert acc.global_step == 1
        assert acc.state_dict()["position"] == 2
        resumed = load_checkpoint(build(2), save_checkpoint(first))
        train(resumed, BATCHES[:8])
        assert_same_run(resumed, whole)


# 9. No autograd graph held across microsteps ------------------------------------------


class _Keep(torch.autograd.Function):
    """Identity whose graph node holds ``keep`` (a ctx attribute, not a saved tensor, so
    backward does not free it): alive exactly as long as the loss's graph is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        ctx.keep = keep
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class TestNoGraphAcrossMicrosteps:
    @pytest.mark.parametrize("by_items", [False, True])
    def test_each_loss_graph_is_freed_when_its_block_exits(self, by_items: bool) -> None:
        """Once a microstep's block has exited, nothing of its loss's autograd graph is
        alive (only the loss's value is kept, for step.loss), also after the boundary
        while its Step is held; step.loss and a mid-window checkpoint's losses are the
        values, unchanged."""
        import weakref

        model, _, _, acc = build(steps=3)
        alive: list[weakref.ref[torch.Tensor]] = []
        values = []
        for batch in BATCHES[:3]:
            keep = torch.zeros(1000)  # what an activation the graph holds would be
            alive.append(weakref.ref(keep))
            inner = sum_loss(model, batch) if by_items else mean_loss(model, batch)
            loss = _Keep.apply(inner, keep)
            values.append(loss.detach().clone())
            with acc.microstep(loss, num_items=2 if by_items else None) as step:
                pass
            del keep, inner, loss
            assert alive[-1]() is None, "the loss's graph outlived its block"
            if not step.boundary:
                saved = acc.state_dict(include_grads=True)["window"]["losses"]
                assert all(not loss.requires_grad for loss in saved)
                assert torch.equal(torch.stack(saved), torch.stack(values))
        assert step.boundary
        assert step.loss is not None
        want = torch.stack(values).sum() / (6 if by_items else 3)
        assert torch.equal(step.loss, want)
