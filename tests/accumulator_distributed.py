"""What the gloo ranks of the seam tests run (a module the ranks can import): the steps
setter at a window start, item normalization over 3 ranks, a mid-window resume of an
iterable without len, and a scheduler failing after the optimizer stepped."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

import gradaccum
from gradaccum.testing import CollectiveCounter
from tests.distributed import full_params, rank_batches, wrap
from tests.helpers import (
    Batch,
    load_checkpoint,
    make_model,
    mean_loss,
    save_checkpoint,
    sum_loss,
)


def count_steps(optimizer: torch.optim.Optimizer) -> list[int]:
    """A one-element counter of ``optimizer.step()`` calls, kept by a post hook."""
    stepped = [0]

    def count(*_: object) -> None:
        stepped[0] += 1

    optimizer.register_step_post_hook(count)
    return stepped


def generator(batches: list[Batch]) -> Iterator[Batch]:
    """``batches`` as an iterable without len."""
    yield from batches


# The steps setter at a window start keeps an unsized epoch's trailing window ----


def same_steps_at_window_starts(rank: int, world: int) -> dict[str, Any]:
    """5 microbatches per rank as a generator, steps=2, drop_last=False, under DDP: once
    with ``acc.steps = acc.steps`` at the top of the loop body at every window start,
    once without. Per run: parameters, optimizer steps, global_step, collectives of the
    epoch and the GradaccumWarnings."""
    batches = rank_batches(rank, [2] * 5)
    runs = {}
    for name, setter in (("plain", False), ("setter", True)):
        model = wrap("ddp", make_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        stepped = count_steps(optimizer)
        acc = gradaccum.Accumulator(model, optimizer, steps=2, drop_last=False)
        counter = CollectiveCounter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", gradaccum.GradaccumWarning)
            with counter:
                for index, batch in enumerate(acc.epoch(generator(batches))):
                    if setter and index % 2 == 0:  # windows of 2, 2, 1: each one's start
                        acc.steps = acc.steps
                    with acc.microstep(mean_loss(model, batch)):
                        pass
        acc.close()
        runs[name] = {
            "params": full_params(model, "ddp"),
            "optimizer_steps": stepped[0],
            "global_step": acc.global_step,
            "collectives": dict(counter.ops),
            "warnings": [str(w.message) for w in caught],
        }
    return runs


# num_items over 3 ranks in float64 -------------------------------------------


def items_over_ranks(rank: int, world: int, sizes: list[list[int]]) -> dict[str, Any]:
    """One DDP epoch of summed losses with num_items (steps=4) on ``sizes[rank]``, with int
    counts, 0-dim int64 tensor counts and 0-dim float64 tensor counts; parameters,
    global_step, the epoch's collectives, and how far ``step.loss`` was from this rank's
    own item-mean loss of the window."""
    batches = rank_batches(rank, sizes[rank])
    counts: dict[str, Any] = {
        "int": int,
        "tensor": torch.tensor,
        "float64": lambda n: torch.tensor(float(n), dtype=torch.float64),
    }
    runs = {}
    for kind, count in counts.items():
        model = wrap("ddp", make_model())
        acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=4)
        counter = CollectiveCounter()
        window: list[tuple[torch.Tensor, int]] = []
        loss_error = 0.0
        with counter:
            for batch in acc.epoch(batches):
                loss = sum_loss(model, batch)
                window.append((loss.detach(), len(batch[0])))
                with acc.microstep(loss, num_items=count(len(batch[0]))) as step:
                    if step.boundary:
                        mine = sum(part for part, _ in window) / sum(n for _, n in window)
                        loss_error = max(loss_error, abs(float(step.loss - mine)))
                        window = []
        acc.close()
        runs[kind] = {
            "params": full_params(model, "ddp"),
            "global_step": acc.global_step,
            "collectives": dict(counter.ops),
            "loss_error": loss_error,
        }
    return runs


# Mid-window resume of an iterable without len ---------------------------------


def resume_unsized_mid_window(rank: int, world: int) -> dict[str, Any]:
    """steps=3 over 9 microbatches per rank given as a generator, under DDP: uninterrupted,
    against a run checkpointed with include_grads=True one microstep into window 2 (every
    rank its own state), rebuilt from scratch and resumed on the same data. What the two
    runs ended with, and the optimizer steps the interrupted one took before and after."""
    batches = rank_batches(rank, [2] * 9)

    def build() -> tuple[Any, Any, Any, gradaccum.Accumulator]:
        model = wrap("ddp", make_model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=3)
        acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=3)
        return model, optimizer, scheduler, acc

    whole = build()
    whole_steps = count_steps(whole[1])
    for batch in whole[3].epoch(generator(batches)):
        with whole[3].microstep(mean_loss(whole[0], batch)):
            pass
    whole[3].close()

    first = build()
    before = count_steps(first[1])
    for index, batch in enumerate(first[3].epoch(generator(batches))):
        with first[3].microstep(mean_loss(first[0], batch)):
            pass
        if index == 3:  # the block of window 2's first microstep has exited
            break
    saved_at = (first[3].global_step, first[3].position)
    blob = save_checkpoint(first, include_grads=True)
    first[3].close()
    del first

    model, optimizer, _, acc = load_checkpoint(build(), blob)
    after = count_steps(optimizer)
    for batch in acc.epoch(generator(batches)):
        with acc.microstep(mean_loss(model, batch)):
            pass
    acc.close()
    return {
        "saved_at": saved_at,
        "optimizer_steps": (whole_steps[0], before[0], after[0]),
        "global_step": (whole[3].global_step, acc.global_step),
        "params": all(
            torch.equal(p, q)
            for p, q in zip(whole[0].parameters(), model.parameters(), strict=True)
        ),
        "optimizer": all(
            torch.equal(value, optimizer.state[q][key])
            for p, q in zip(whole[0].parameters(), model.parameters(), strict=True)
            for key, value in whole[1].state[p].items()
        ),
        "lr": whole[1].param_groups[0]["lr"] == optimizer.param_groups[0]["lr"],
    }


# A scheduler failing after the optimizer stepped -----------------------------


class StopsAfterTwo(torch.optim.lr_scheduler.OneCycleLR):
    """OneCycleLR(total_steps=2) whose later steps do nothing instead of raising: the
    uninterrupted run of the same LRs."""

    def step(self, epoch: int | None = None) -> None:
        if self.last_epoch < 2:
            super().step(epoch)


def scheduler_fails_after_the_step(rank: int, world: int) -> dict[str, Any]:
    """steps=2 over 8 microbatches per rank (a list), under DDP, with OneCycleLR(total_steps=2):
    its 3rd step() raises, in the 3rd boundary's exit, after the optimizer stepped. Rank 1
    lingers in that boundary's block, so rank 0 fails first. What each rank caught and saw
    after, and whether its parameters equal a run whose scheduler stops instead of raising."""
    batches = rank_batches(rank, [2] * 8)

    def three_windows(scheduler_type: type[Any]) -> tuple[Any, Any, list[int], str | None]:
        model = wrap("ddp", make_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        stepped = count_steps(optimizer)
        scheduler = scheduler_type(optimizer, max_lr=0.1, total_steps=2, cycle_momentum=False)
        acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=2)
        try:
            for index, batch in enumerate(acc.epoch(batches)):
                if index == 6:  # window 4: not reached when window 3 raises
                    break
                with acc.microstep(mean_loss(model, batch)) as step:
                    if step.boundary and step.global_step == 3 and rank == 1:
                        time.sleep(0.5)
        except Exception as error:
            return model, acc, stepped, f"{type(error).__name__}: {error}"
        return model, acc, stepped, None

    model, acc, stepped, caught = three_windows(torch.optim.lr_scheduler.OneCycleLR)
    state = acc.state_dict()
    seen = {
        "caught": caught,
        "global_step": acc.global_step,
        "optimizer_steps": stepped[0],
        "grads": [p.grad is None for p in model.parameters()],
        "state": (state["global_step"], state["position"]),
    }
    acc.close()
    uninterrupted, other, _, _ = three_windows(StopsAfterTwo)
    other.close()
    seen["uninterrupted"] = all(
        torch.equal(p, q)
        for p, q in zip(model.parameters(), uninterrupted.parameters(), strict=True)
    )
    seen["params"] = full_params(model, "ddp")
    return seen


# zero_grad() inside a window under DDP --------------------------------------------


def zero_grad_in_a_window(rank: int, world: int) -> dict[str, Any]:
    """DDP with gradient_as_bucket_view=True (DDP swaps param.grad for bucket views): two
    epochs of steps=4 train without a false alarm; then every rank zeroes the gradient in
    place after a window's second microstep, and its third microstep is refused."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make_model(), gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, optimizer, steps=4)
    batches = rank_batches(rank, [2] * 13)
    for _ in range(2):
        for batch in acc.epoch(generator(batches)):
            with acc.microstep(mean_loss(model, batch)):
                pass
    trained = acc.global_step
    refused = ""
    for index, batch in enumerate(batches[:3]):
        if index == 2:
            optimizer.zero_grad(set_to_none=False)
        try:
            with acc.microstep(mean_loss(model, batch)):
                pass
        except gradaccum.GradaccumError as error:
            refused = f"{type(error).__name__}: {error}"
    acc.close()
    return {"trained": trained, "refused": refused}


def two_accumulators_over_one_ddp(rank: int, world: int, kind: str) -> dict[str, Any]:
    """A DDP (or ``fully_shard``) model whose two halves have an optimizer each, and an
    accumulator per optimizer built one after the other, as a GAN's loop would: the second
    takes the model over mid-window (refused) and between windows (the first is closed,
    with a warning); the second then trains as the hand loop does, every window reduced."""
    model = wrap(kind, make_model())
    first, second = (torch.optim.SGD(list(model.parameters())[half::2], lr=0.1) for half in (0, 1))
    batches = rank_batches(rank, [2] * 4)
    found: dict[str, Any] = {}
    acc = gradaccum.Accumulator(model, first, steps=2)
    with acc.microstep(mean_loss(model, batches[0])):
        pass
    try:
        gradaccum.Accumulator(model, second, steps=2)
    except gradaccum.UsageError as error:
        found["mid-window"] = str(error)
    with acc.microstep(mean_loss(model, batches[1])):
        pass
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        taker = gradaccum.Accumulator(model, second, steps=2)
    found["warnings"] = [str(w.message) for w in caught]
    try:
        acc.microstep(mean_loss(model, batches[2]))
    except gradaccum.UsageError as error:
        found["first after"] = str(error)
    counter = CollectiveCounter(second)
    with counter:
        for batch in batches[2:]:
            with taker.microstep(mean_loss(model, batch)):
                pass
    taker.close()
    found["backwards"] = [window.backwards.get("all_reduce", 0) for window in counter.windows]
    found["params"] = full_params(model, kind)
    return found
