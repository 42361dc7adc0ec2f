"""`Accumulator.step` on one process: the window it runs is the ``with acc.microstep``
form's over the same microbatches (options, several optimizers, checkpoints), the batch's
mean-loss gradient whatever the cut, and with ``microbatch="auto"`` an out-of-memory error
at any point of a window is recovered into exactly the run that used the smaller microbatch
from the start."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gradaccum
from gradaccum.cutting import cut
from tests.helpers import POINTS, items_fn, make_batches, make_model, mean_fn, oom_at

Batch = tuple[torch.Tensor, torch.Tensor]


def big_batch(rows: int, seed: int = 1) -> Batch:
    return make_batches([rows], seed=seed)[0]


def parts(lr: float = 0.1, **options: Any) -> tuple[nn.Module, gradaccum.Accumulator]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, gradaccum.Accumulator(model, optimizer, scheduler, **options)


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def worst(a: nn.Module, b: nn.Module) -> float:
    return max(
        (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


class TestTheWindow:
    @pytest.mark.parametrize("fn", [mean_fn, items_fn], ids=["mean", "items"])
    def test_it_is_the_with_form_over_the_same_microbatches(self, fn: Callable[..., Any]) -> None:
        """Two optimizers, their schedulers, clipping and the non-finite check: three calls
        of acc.step on 12-row batches with microbatch=4 are bit for bit the ``with
        acc.microstep`` loop with steps=3 over the same 4-row pieces (losses, norms, LRs
        and parameters)."""
        runs = []
        for form in ("step", "with"):
            model = make_model()
            first, second = list(model.parameters())[:2], list(model.parameters())[2:]
            optimizers = [torch.optim.SGD(first, lr=0.1), torch.optim.AdamW(second, lr=0.01)]
            schedulers = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in optimizers]
            options: dict[str, Any] = {"max_grad_norm": 0.5, "on_nonfinite": "raise"}
            if form == "step":
                acc = gradaccum.Accumulator(model, optimizers, schedulers, microbatch=4, **options)
            else:
                acc = gradaccum.Accumulator(model, optimizers, schedulers, steps=3, **options)
            seen = []
            for seed in range(3):
                batch = big_batch(12, seed)
                if form == "step":
                    step = acc.step(batch, fn)
                else:
                    for piece, _ in cut(batch, 12, 4):
                        returned = fn(model, piece)
                        loss, items = returned if isinstance(returned, tuple) else (returned, None)
                        with acc.microstep(loss, items) as step:
                            pass
                seen.append((step.loss, step.grad_norm, step.lrs, step.global_step))
            runs.append((model, seen))
        (model, seen), (twin, expected) = runs
        assert same(model, twin)
        assert seen == expected

    def test_unequal_microbatches_weigh_by_their_rows(self) -> None:
        """Mean mode, 10 rows cut 4, 4, 2 (and 3, 3, 3, 1): the update and step.loss are the
        batch's mean-loss gradient and loss, within 1e-12 of one float64 big batch."""
        batch = big_batch(10)
        reference = make_model()
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        loss = mean_fn(reference, batch)
        loss.backward()
        optimizer.step()
        for microbatch in (4, 3, 10, 64):
            model = make_model()
            acc = gradaccum.Accumulator(
                model, torch.optim.SGD(model.parameters(), lr=0.1), microbatch=microbatch
            )
            step = acc.step(batch, mean_fn)
            assert worst(model, reference) < 1e-12, microbatch
            assert abs(step.loss.item() - loss.item()) < 1e-12
            assert (step.microbatch, acc.microbatch, acc.global_step) == (
                min(microbatch, 10),
                microbatch,
                1,
            )

    def test_without_microbatch_the_batch_is_one_microstep(self) -> None:
        """microbatch=None: the whole batch in one microstep, as the hand loop's step."""
        model, acc = parts()
        twin = copy.deepcopy(model)
        batch = big_batch(6)
        step = acc.step(batch, mean_fn)
        optimizer = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
        mean_fn(twin, batch).backward()
        optimizer.step()
        assert same(model, twin)
        assert (step.microbatch, acc.microbatch) == (6, None)

    def test_inside_an_epoch_each_batch_is_a_window(self) -> None:
        """In ``for batch in acc.epoch(loader)`` with steps=1, each call is a window: the
        position counts batches and global_step is total_steps(len(loader), 1), whatever
        the microbatch; a checkpoint between calls resumes bit for bit in a new process's
        objects."""
        batches = [big_batch(8, seed) for seed in range(5)]
        model, acc = parts(microbatch=3)
        for index, batch in enumerate(acc.epoch(batches)):
            acc.step(batch, mean_fn)
            if index == 1:
                state = acc.state_dict()
                saved = copy.deepcopy((model.state_dict(), acc.optimizer.state_dict()))
        assert acc.global_step == gradaccum.total_steps(len(batches), 1) == 5
        assert (state["position"], state["microbatch"], state["steps"]) == (2, 3, 1)
        resumed, again = parts(microbatch=3)
        resumed.load_state_dict(saved[0])
        again.optimizer.load_state_dict(saved[1])
        again.scheduler.load_state_dict(acc.scheduler.state_dict() | {"last_epoch": 2})
        again.load_state_dict(state)
        for batch in again.epoch(batches):
            again.step(batch, mean_fn)
        assert same(resumed, model)
        assert again.global_step == 5

    def test_a_window_of_the_with_form_or_steps_other_than_1_are_refused(self) -> None:
        """acc.step is a whole window: refused inside an open window of acc.microstep, and
        with steps=2; nothing changes."""
        model, acc = parts(steps=2)
        with acc.microstep(mean_fn(model, big_batch(2))):
            pass
        with pytest.raises(gradaccum.UsageError, match=r"inside a window of acc\.microstep"):
            acc.step(big_batch(4), mean_fn)
        assert repr(acc) == "Accumulator(steps=2, global_step=0, window=1/2)"
        _, plain = parts(steps=2)
        with pytest.raises(gradaccum.UsageError, match="has steps=2"):
            plain.step(big_batch(4), mean_fn)


class TestOutOfMemory:
    @pytest.mark.parametrize("fn", [mean_fn, items_fn], ids=["mean", "items"])
    @pytest.mark.parametrize("point", POINTS)
    def test_a_window_re_runs_smaller_into_the_small_microbatch_run(
        self, point: str, fn: Callable[..., Any]
    ) -> None:
        """An accumulator that found microbatch=8 (loaded) meets a 32-row batch whose
        microbatches of 8 run out of memory at ``point``: the window is discarded (gradients
        put back as they were, including one set before the call), re-run with 4 rows, and
        is bit for bit the run with microbatch=4 from the start: one optimizer and
        scheduler step, acc.microbatch 4, saved as such."""
        models = []
        for microbatch in ("auto", 4):
            model, acc = parts(microbatch=microbatch)
            if microbatch == "auto":
                acc.load_state_dict(dict(acc.state_dict(), microbatch=8))
            stepped: list[int] = []
            acc.optimizer.register_step_post_hook(lambda *_, seen=stepped: seen.append(1))
            model[0].bias.grad = torch.full_like(model[0].bias, 0.25)  # a backward of one's own
            loss_fn = oom_at(point, 4, fn)
            for seed in range(2):
                step = acc.step(big_batch(32, seed), loss_fn)
            assert (step.microbatch, acc.microbatch, acc.state_dict()["microbatch"]) == (4, 4, 4)
            assert (len(stepped), acc.global_step, acc.scheduler.last_epoch) == (2, 2, 2)
            models.append(model)
        assert same(*models)

    def test_the_first_window_probes_down_from_the_batch_s_rows(self) -> None:
        """Nothing over 5 rows fits: the first window tries 40, 20, 10 and 5 rows, and is
        then bit for bit the microbatch=5 run; the probe is kept for later windows."""
        tried: list[int] = []

        def fits_5(model: nn.Module, batch: Batch) -> torch.Tensor:
            tried.append(len(batch[0]))
            if len(batch[0]) > 5:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ...")
            return mean_fn(model, batch)

        model, acc = parts(microbatch="auto")
        twin, fixed = parts(microbatch=5)
        for seed in range(2):
            acc.step(big_batch(40, seed), fits_5)
            fixed.step(big_batch(40, seed), mean_fn)
        assert tried[:4] == [40, 20, 10, 5]
        assert set(tried[4:]) == {5}
        assert acc.microbatch == 5
        assert same(model, twin)

    def test_no_row_fits(self) -> None:
        """Microbatches of one row still run out: OutOfMemoryError naming rank 0,
        microbatch 1 and what to do; nothing applied, no gradient left, and the
        accumulator takes the next window."""

        def never(model: nn.Module, batch: Batch) -> torch.Tensor:
            raise torch.OutOfMemoryError("injected")

        model, acc = parts(microbatch="auto")
        before = copy.deepcopy(model)
        with pytest.raises(gradaccum.OutOfMemoryError, match="no microbatch fits") as caught:
            acc.step(big_batch(4), never)
        assert (caught.value.rank, caught.value.microbatch, caught.value.window) == (0, 1, 1)
        assert "activation checkpointing" in str(caught.value)
        assert same(model, before)
        assert all(p.grad is None for p in model.parameters())
        assert acc.global_step == 0
        acc.step(big_batch(4), mean_fn)
        assert acc.global_step == 1

    def test_other_errors_and_fixed_microbatches_are_not_retried(self) -> None:
        """An out-of-memory error with a fixed microbatch, or another error under "auto",
        propagates as it is and drops the window, as in the ``with`` form."""
        for microbatch, error in ((4, torch.OutOfMemoryError), ("auto", KeyError)):

            def failing(model: nn.Module, batch: Batch, error: type = error) -> torch.Tensor:
                raise error("x")

            model, acc = parts(microbatch=microbatch)
            with pytest.raises(error):
                acc.step(big_batch(8), failing)
            assert acc.global_step == 0
            assert all(p.grad is None for p in model.parameters())
            acc.step(big_batch(8), mean_fn)
            assert acc.global_step == 1

    def test_a_loaded_microbatch_is_kept_by_a_fixed_one(self) -> None:
        """A state saved under "auto" restores its found microbatch into "auto", and a fixed
        microbatch keeps its own."""
        _, found = parts(microbatch="auto")
        found.step(big_batch(6), mean_fn)
        state = found.state_dict()
        assert state["microbatch"] == 6
        _, fixed = parts(microbatch=2)
        fixed.load_state_dict(state)
        _, auto = parts(microbatch="auto")
        auto.load_state_dict(state)
        assert (fixed.microbatch, auto.microbatch) == (2, 6)
