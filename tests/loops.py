"""Training loops, right and wrong, that gradaccum.testing's own tests check, and what
the gloo ranks of its distributed test run (a module the ranks can import)."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradaccum
from examples.testing_your_trainer import test_dist_adamw as nanochat
from gradaccum.testing import (
    AccumulationReport,
    CollectiveCounter,
    DDPBucketCounter,
    check_accumulation,
)
from gradaccum.verify import wrapper
from tests.helpers import Batch, make_batches, make_model, mean_loss, sum_loss

STEPS = 4
SIZES = [1, 3, 2, 4, 2, 1, 3, 3, 2, 1, 4, 2, 2]  # 13 microbatches of varying rows: 3 windows


def items(batch: Batch) -> int:
    """A microbatch's items: its rows."""
    return len(batch[0])


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def decay(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)


def rank_batches(rank: int, sizes: Sequence[int] = SIZES) -> list[Batch]:
    return make_batches(list(sizes), seed=300 + rank)


def accumulator_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batches: Sequence[Batch],
    *,
    steps: int = STEPS,
    by_items: bool = False,
    around_ddp: bool = False,
    **options: Any,
) -> None:
    """The design-card loop (``options`` go to the `Accumulator`); with ``around_ddp``,
    each forward calls the module inside DDP, ``model.module`` (a bug)."""
    net = model.module if around_ddp else model
    with gradaccum.Accumulator(model, optimizer, scheduler, steps=steps, **options) as acc:
        for batch in acc.epoch(batches):
            loss = sum_loss(net, batch) if by_items else mean_loss(net, batch)
            with acc.microstep(loss, num_items=items(batch) if by_items else None):
                pass


def hand_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batches: Sequence[Batch],
    *,
    steps: int = STEPS,
    forward_inside: bool = True,
    scheduler_every_microbatch: bool = False,
    divisor: float | None = None,
    synced: int = 1,
    synced_first: bool = False,
    zero_every_microstep: bool = False,
    clip_every_microstep: float | None = None,
    around_ddp: bool = False,
    peek_around_ddp: bool = False,
) -> None:
    """A loop of its own: ``loss / steps`` per microbatch (by ``divisor`` if given: a
    bug), ``no_sync()`` off the boundary (around the forward too, unless
    ``forward_inside`` is False: the bug equal gradients hide; off a window's last
    ``synced`` microbatches, more than one: exact, and wasteful; off all but its first
    with ``synced_first``: the ranks step apart), the optimizer and the
    scheduler stepped at the boundary (the scheduler on every microbatch with
    ``scheduler_every_microbatch``: the bug the step count shows). Two more bugs: with
    ``zero_every_microstep``, a plain loop's ``zero_grad()`` left at the top of the body
    (each backward clears the window's gradient so far); with ``clip_every_microstep``,
    ``clip_grad_norm_`` to it right after every backward (the partial sums clipped); with
    ``around_ddp``, each forward calls the module inside DDP, ``model.module``, which DDP
    never sees (its backward all-reduces nothing); with ``peek_around_ddp``, each
    microbatch also runs ``model.module`` under grad mode for a value never
    back-propagated (right: the check must not blame it)."""
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    net = model.module if around_ddp else model
    for index, batch in enumerate(batches[: len(batches) // steps * steps]):
        if zero_every_microstep:
            optimizer.zero_grad()
        boundary = (index + 1) % steps == 0
        sync = index % steps == 0 if synced_first else index % steps >= steps - synced
        context = contextlib.nullcontext() if sync else no_sync()
        divisor = steps if divisor is None else divisor
        if forward_inside:
            with context:
                (mean_loss(net, batch) / divisor).backward()
        else:
            loss = mean_loss(net, batch) / divisor
            with context:
                loss.backward()
        if peek_around_ddp:
            model.module(batch[0]).sum().detach()
        if clip_every_microstep is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip_every_microstep)
        if boundary:
            optimizer.step()
            optimizer.zero_grad()
        if scheduler is not None and (boundary or scheduler_every_microbatch):
            scheduler.step()


def get_lr(it: int, warmup: int = 1, decay: int = 3, top: float = 6e-3) -> float:
    """nanoGPT's learning rate at iteration ``it``: a linear warmup, then a cosine down
    to a tenth of ``top`` at ``decay``, then flat."""
    if it < warmup:
        return top * (it + 1) / (warmup + 1)
    if it > decay:
        return top / 10
    ratio = (it - warmup) / (decay - warmup)
    return top / 10 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (top - top / 10)


def nanogpt_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batches: Sequence[Batch],
    *,
    steps: int = STEPS,
    divide: bool = True,
    grad_clip: float = 1.0,
    autocast: torch.dtype | None = None,
) -> None:
    """nanoGPT's training loop, as its train.py writes it: the learning rate set by hand
    each iteration (no scheduler), DDP's sync flag set before each forward, the forward
    and the loss under ``torch.autocast`` to ``autocast`` if given (its ``with ctx:``),
    the loss divided by the accumulation steps (unless not ``divide``: the bug),
    clipping, the step, ``zero_grad(set_to_none=True)``; it logs nothing."""
    ddp = hasattr(model, "require_backward_grad_sync")
    for it in range(len(batches) // steps):
        lr = get_lr(it)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        for micro_step in range(steps):
            if ddp:
                model.require_backward_grad_sync = micro_step == steps - 1
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = mean_loss(model, batches[it * steps + micro_step])
            if divide:
                loss = loss / steps
            loss.backward()
        if grad_clip != 0.0:
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def adamw(params: Any) -> torch.optim.Optimizer:
    """nanoGPT's optimizer (its betas and weight decay, a learning rate set by hand)."""
    return torch.optim.AdamW(params, lr=6e-3, betas=(0.9, 0.95), weight_decay=0.1)


def small_batches(rank: int) -> list[Batch]:
    """`rank_batches` in float32, scaled so that a gradient 4x too large stays under
    nanoGPT's clipping norm of 1 (clipping would hide the factor)."""
    return [(0.2 * x.float(), 0.2 * y.float()) for x, y in rank_batches(rank)]


class AutocastInside(nn.Module):
    """`make_model`'s layers in float32, its forward under ``torch.autocast`` to ``dtype``
    entered inside ``forward``, a lower precision's output returned in float32: what
    Accelerate's ``mixed_precision`` makes of a prepared model's forward."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner, self.dtype = make_model(dtype=torch.float32), dtype

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=self.dtype):
            out = self.inner(inputs)
        return out.float() if out.dtype in (torch.bfloat16, torch.float16) else out


def nanogpt_check(
    make_optimizer: Any = adamw,
    world: int = 1,
    tolerance: float | None = None,
    inner_autocast: torch.dtype | None = None,
    **options: Any,
) -> AccumulationReport:
    """`nanogpt_loop` (``options`` go to it) on a float32 model under DDP on ``world``
    ranks (the plain model on one), no scheduler given, clipped at 1, at ``tolerance``
    (the check's default for None); with ``inner_autocast``, on `AutocastInside`."""
    from torch.nn.parallel import DistributedDataParallel

    return check_accumulation(
        functools.partial(make_model, dtype=torch.float32)
        if inner_autocast is None
        else functools.partial(AutocastInside, inner_autocast),
        make_optimizer,
        functools.partial(nanogpt_loop, **options),
        [small_batches(rank) for rank in range(world)],
        mean_loss,
        steps=STEPS,
        wrap=DistributedDataParallel if world > 1 else None,
        max_grad_norm=1.0,
        expect_collectives={"all_reduce": 1} if world > 1 else None,
        tolerance=tolerance,
    )


def replicated(model: nn.Module) -> nn.Module:
    """``model`` under torchtitan's DDP, the composable ``replicate()``, over every rank."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.device_mesh import init_device_mesh

    return replicate(model, device_mesh=init_device_mesh("cpu", (dist.get_world_size(),)))


def replicate_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batches: Sequence[Batch],
    *,
    synced_first: bool = False,
) -> None:
    """A hand loop over a `replicated` model, as torchtitan's would defer: its sync set with
    ``set_requires_gradient_sync()`` before each forward, on for a window's last microbatch
    (its first with ``synced_first``: the ranks step apart)."""
    for index, batch in enumerate(batches[: len(batches) // STEPS * STEPS]):
        position = index % STEPS
        model.set_requires_gradient_sync(position == (0 if synced_first else STEPS - 1))  # type: ignore[operator]
        (mean_loss(model, batch) / STEPS).backward()
        if position == STEPS - 1:
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    model.set_requires_gradient_sync(True)  # type: ignore[operator]


def split_optimizers(params: Any) -> list[torch.optim.Optimizer]:
    """SGD with momentum on the weights, Adam on the biases."""
    params = list(params)
    return [
        torch.optim.SGD([p for p in params if p.ndim > 1], lr=0.1, momentum=0.9),
        torch.optim.Adam([p for p in params if p.ndim == 1], lr=1e-2),
    ]


def split_schedulers(optimizers: Sequence[torch.optim.Optimizer]) -> list[Any]:
    """A StepLR for the SGD; the Adam keeps its learning rate."""
    return [torch.optim.lr_scheduler.StepLR(optimizers[0], step_size=1, gamma=0.8), None]


def two_optimizer_loop(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[Any],
    batches: Sequence[Batch],
    *,
    steps: int = STEPS,
    divide: bool = True,
    scheduler_every_microbatch: bool = False,
    skip_last_adam_step: bool = False,
    zero_first_only: bool = False,
) -> None:
    """A hand loop with two optimizers, as a Muon + AdamW trainer writes it: each
    microbatch's ``loss / steps`` (not divided, unless ``divide``) inside ``no_sync()`` off
    the boundary; at the boundary each optimizer steps and zeroes its gradients, then
    each scheduler steps (every microbatch with ``scheduler_every_microbatch``; the
    Adam's last step left out with ``skip_last_adam_step``; only the first optimizer's
    gradients zeroed with ``zero_first_only``)."""
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    trained = len(batches) // steps * steps
    for index, batch in enumerate(batches[:trained]):
        boundary = (index + 1) % steps == 0
        with contextlib.nullcontext() if boundary else no_sync():
            loss = mean_loss(model, batch)
            (loss / steps if divide else loss).backward()
        if boundary:
            for number, optimizer in enumerate(optimizers):
                if not (skip_last_adam_step and number == 1 and index + 1 == trained):
                    optimizer.step()
                if not (zero_first_only and number > 0):
                    optimizer.zero_grad()
        if boundary or scheduler_every_microbatch:
            for scheduler in schedulers:
                if scheduler is not None:
                    scheduler.step()


def two_optimizer_check(
    world: int = 1, loop: Any = two_optimizer_loop, **options: Any
) -> AccumulationReport:
    """``loop`` (``options`` go to it; the hand-written `two_optimizer_loop` by default)
    checked with `split_optimizers`, under DDP on several ranks."""
    from torch.nn.parallel import DistributedDataParallel

    return check_accumulation(
        make_model,
        split_optimizers,
        functools.partial(loop, **options),
        [rank_batches(rank) for rank in range(world)],
        mean_loss,
        steps=STEPS,
        make_scheduler=split_schedulers,
        wrap=DistributedDataParallel if world > 1 else None,
        expect_collectives={"all_reduce": 1} if world > 1 else None,
    )


def epoch_scheduler_loop(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, batches: Sequence[Batch]
) -> None:
    """`hand_loop`'s windows with the scheduler stepped once, at the epoch's end: a
    schedule in epochs, as torchvision's reference scripts step theirs."""
    hand_loop(model, optimizer, None, batches)
    scheduler.step()


def epoch_spanning_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batches: Sequence[Batch],
    *,
    count_on: bool = True,
) -> None:
    """A loop of its own that back-propagates every microbatch of the epoch and steps on
    every ``steps``-th: counted by a microbatch count that runs on across epochs (kept on
    the optimizer, as a trainer's ``global_step``), so that windows span epochs; or, not
    ``count_on``, counted by the epoch's ``enumerate``, with the epoch's trailing
    microbatches' gradient never cleared (both bugs: the next epoch's first window adds
    it)."""
    counted = optimizer.__dict__.setdefault("microbatches_seen", [0])
    for index, batch in enumerate(batches):
        (mean_loss(model, batch) / STEPS).backward()
        counted[0] += 1
        if (counted[0] if count_on else index + 1) % STEPS == 0:
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()


def metrics_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batches: Sequence[Batch],
    *,
    all_reduced: bool = False,
    forward_inside: bool = True,
) -> None:
    """`hand_loop`, and at each window's end the window's loss and rows reduced to rank 0
    with ``dist.reduce`` and read there, as a trainer logs them: two reduces per window,
    and on rank 0 two host syncs. With ``all_reduced``, the loss, the rows and the largest
    loss are all-reduced instead (3 all-reduces a window, outside the backward); without
    ``forward_inside``, the forward runs outside ``no_sync()`` (DDP then all-reduces
    every microbatch)."""
    window: list[torch.Tensor] = []
    rows = 0
    for index, batch in enumerate(batches[: len(batches) // STEPS * STEPS]):
        no_sync = model.no_sync() if (index + 1) % STEPS else contextlib.nullcontext()
        loss = mean_loss(model, batch) if not forward_inside else None
        with no_sync:
            loss = mean_loss(model, batch) if loss is None else loss
            (loss / STEPS).backward()
        window.append(loss.detach())
        rows += len(batch[0])
        if (index + 1) % STEPS == 0:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            total, count = torch.stack(window).sum(), torch.tensor(float(rows))
            if all_reduced:
                largest = torch.stack(window).max()
                dist.all_reduce(total)
                dist.all_reduce(count)
                dist.all_reduce(largest, op=dist.ReduceOp.MAX)
            else:
                dist.reduce(total, dst=0)
                dist.reduce(count, dst=0)
            if dist.get_rank() == 0:  # what a trainer would log: two host syncs
                _ = total.item() / count.item()
            window, rows = [], 0


def own_items_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batches: Sequence[Batch],
    *,
    every_rank: bool = False,
    times_world: bool = True,
    by_steps: bool = False,
) -> None:
    """Item mode by hand, forward inside ``no_sync()`` off the boundary: each rank divides
    its summed losses by its own window's items, and DDP averages those means (a bug);
    with ``every_rank``, by every rank's items, all-reduced before the window, times the
    world size, as Hugging Face's Trainer does with ``num_items_in_batch`` (right; a bug
    without ``times_world``, or ``by_steps``: divided by steps as well)."""
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    world = dist.get_world_size() if dist.is_initialized() else 1
    for start in range(0, len(batches) // STEPS * STEPS, STEPS):
        window = batches[start : start + STEPS]
        divisor = torch.tensor(float(sum(items(batch) for batch in window)), dtype=torch.float64)
        if every_rank:
            if world > 1:
                dist.all_reduce(divisor)
            divisor /= world if times_world else 1
        if by_steps:
            divisor *= STEPS
        for index, batch in enumerate(window):
            with contextlib.nullcontext() if index == STEPS - 1 else no_sync():
                (sum_loss(model, batch) / divisor).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def with_dropout() -> nn.Module:
    """`make_model`'s layers with a dropout of 0.1 after the first: not per item."""
    first, tanh, last = make_model()
    return nn.Sequential(first, nn.Dropout(0.1), tanh, last)


def with_batch_norm() -> nn.Module:
    """`make_model`'s layers with a batch norm after the first: per microbatch, as the
    reference computes each microbatch."""
    first, tanh, last = make_model()
    return nn.Sequential(first, nn.BatchNorm1d(7, dtype=torch.float64), tanh, last)


def sync_batch_norm_seen(training: bool) -> dict[str, str]:
    """What `Observed` records of one forward of `with_batch_norm`'s model converted to
    a SyncBatchNorm, on this process's ranks (in training mode, or eval): its forward
    pre-hook runs before the SyncBatchNorm, which refuses a CPU input under a group."""
    from gradaccum.testing.counting import CollectiveCounter
    from gradaccum.testing.observed import Observed

    model = nn.SyncBatchNorm.convert_sync_batchnorm(with_batch_norm()).train(training)
    observed = Observed(model, [sgd(model.parameters())], CollectiveCounter())
    with observed, contextlib.suppress(ValueError):  # (SyncBatchNorm wants a GPU here)
        model(torch.randn(2, 5, dtype=torch.float64))
    return observed.not_per_item


class FunctionalDropout(nn.Module):
    """`make_model`'s layers with ``F.dropout(p)`` after the first in its own ``forward``
    (training mode): random, and no module shows it."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.first, self.tanh, self.last = make_model()
        self.p = p

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = nn.functional.dropout(self.first(inputs), self.p, training=self.training)
        return self.last(self.tanh(hidden))


def check(
    loop: Any,
    *,
    by_items: bool = False,
    uneven: bool = False,
    make_model: Any = make_model,
    **options: Any,
) -> AccumulationReport:
    """``loop`` checked on this process's ranks (one, or those of the group) in the mean
    mode, or by items with ``by_items``, with a StepLR; with ``uneven``, the last rank's
    microbatches have their rows in reverse order (so the ranks' windows hold different
    items); ``make_model`` and ``options`` go to `check_accumulation`."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    reverse = uneven and world > 1
    return check_accumulation(
        make_model,
        sgd,
        loop,
        [
            rank_batches(rank, SIZES[::-1] if reverse and rank == world - 1 else SIZES)
            for rank in range(world)
        ],
        sum_loss if by_items else mean_loss,
        steps=STEPS,
        num_items=items if by_items else None,
        **({"make_scheduler": decay} | options),
    )


def checks(rank: int, world: int) -> dict[str, Any]:
    """gradaccum.testing on real ranks, in one launch: `check_accumulation` on the
    Accumulator (DDP by mean and by items, fully_shard, FSDP1) and on hand-written loops
    (nanoGPT's, two optimizers, metrics reduced, wrong ones), a `DDPBucketCounter`, and
    plain ``torch.distributed`` calls counted by kind."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    ddp = {"wrap": DistributedDataParallel}
    items_loop = functools.partial(accumulator_loop, by_items=True)
    every_rank = functools.partial(own_items_loop, every_rank=True)
    found: dict[str, Any] = {
        "ddp": check(accumulator_loop, expect_collectives={"all_reduce": 1}, **ddp),
        "ddp_items": check(items_loop, by_items=True, **ddp),
        "fully_shard": check(accumulator_loop, wrap=wrapper("fully_shard", torch.device("cpu"))),
        "fsdp1": check(
            accumulator_loop,
            wrap=functools.partial(FullyShardedDataParallel, device_id=torch.device("cpu")),
        ),
        "forward_outside": check(
            functools.partial(hand_loop, forward_inside=False),
            expect_collectives={"all_reduce": 1},
            **ddp,
        ),
        "forward_inside": check(hand_loop, expect_collectives={"all_reduce": 1}, **ddp),
        # Without an expected count of all-reduces, DDP's sync is checked all the same.
        "forward_outside_unexpected": check(
            functools.partial(hand_loop, forward_inside=False), **ddp
        ),
        "synced_twice": check(functools.partial(hand_loop, synced=2), **ddp),
        "no_no_sync": check(functools.partial(hand_loop, synced=STEPS), **ddp),
        # A DDP the trainer makes itself (accelerator.prepare inside train, say).
        "ddp_made_inside": check(ddp_inside_loop),
        "ddp_made_inside_outside": check(functools.partial(ddp_inside_loop, forward_inside=False)),
        "never_synced": check(functools.partial(hand_loop, synced=0), **ddp),
        "around_ddp": check(functools.partial(hand_loop, around_ddp=True), **ddp),
        "peek_around_ddp": check(functools.partial(hand_loop, peek_around_ddp=True), **ddp),
        "synced_first": check(
            functools.partial(hand_loop, synced_first=True),
            expect_collectives={"all_reduce": 1},
            **ddp,
        ),
        "two_optimizers_one_zeroed": two_optimizer_check(world, zero_first_only=True),
        "replicate": check(replicate_loop, wrap=replicated),
        "replicate_accumulator": check(accumulator_loop, wrap=replicated),
        "replicate_synced_first": check(
            functools.partial(replicate_loop, synced_first=True), wrap=replicated
        ),
        "forward_inside_unexpected": check(hand_loop, **ddp),
        "scheduler_every_microbatch": check(
            functools.partial(hand_loop, scheduler_every_microbatch=True), **ddp
        ),
        "mean_of_means": check(hand_loop, by_items=True, **ddp),
        "own_rank_items": check(own_items_loop, by_items=True, uneven=True, **ddp),
        "own_rank_items_even": check(own_items_loop, by_items=True, **ddp),
        "ddp_items_uneven": check(items_loop, by_items=True, uneven=True, **ddp),
        "every_rank_items": check(every_rank, by_items=True, uneven=True, **ddp),
        "every_rank_items_not_times_world": check(
            functools.partial(every_rank, times_world=False), by_items=True, uneven=True, **ddp
        ),
        "every_rank_items_by_steps": check(
            functools.partial(every_rank, by_steps=True), by_items=True, uneven=True, **ddp
        ),
        "fsdp1_unscaled": check(
            functools.partial(hand_loop, divisor=1),
            wrap=functools.partial(FullyShardedDataParallel, device_id=torch.device("cpu")),
        ),
        "divided_by_world": check(functools.partial(hand_loop, divisor=STEPS * world), **ddp),
        "summed_over_ranks": check(
            functools.partial(hand_loop, divisor=STEPS / world),
            expect_collectives={"all_reduce": 1},
            **ddp,
        ),
        "metrics": check(metrics_loop, expect_collectives={"all_reduce": 1, "reduce": 2}, **ddp),
        "metrics_all_reduced": check(
            functools.partial(metrics_loop, all_reduced=True),
            expect_collectives={"all_reduce": 1},
            **ddp,
        ),
        "metrics_all_reduced_unexpected": check(
            functools.partial(metrics_loop, all_reduced=True), **ddp
        ),
        "metrics_all_reduced_forward_outside": check(
            functools.partial(metrics_loop, all_reduced=True, forward_inside=False),
            expect_collectives={"all_reduce": 4},
            **ddp,
        ),
        "nanogpt": nanogpt_check(world=world),
        "nanogpt_unscaled": nanogpt_check(world=world, divide=False),
        "nanogpt_autocast": nanogpt_check(world=world, autocast=torch.bfloat16),
        "dropout": check(hand_loop, make_model=with_dropout, **ddp),
        "functional_dropout": check(hand_loop, make_model=FunctionalDropout, **ddp),
        "batch_norm": check_accumulation(
            with_batch_norm,
            sgd,
            hand_loop,
            [rank_batches(each, [2] * 13) for each in range(world)],  # (no 1-row batch)
            mean_loss,
            steps=STEPS,
            **ddp,
        ),
        "sync_batch_norm": sync_batch_norm_seen(training=True),
        "sync_batch_norm_eval": sync_batch_norm_seen(training=False),
        "zero_every_microstep": check(
            functools.partial(hand_loop, zero_every_microstep=True), **ddp
        ),
        "nanogpt_unscaled_sgd": nanogpt_check(sgd, world, divide=False),
        "two_optimizers": two_optimizer_check(world),
        "two_optimizers_unscaled": two_optimizer_check(world, divide=False),
        "two_optimizers_accumulator": two_optimizer_check(world, accumulator_loop),
        "dist_adamw": nanochat.check(),
        "dist_adamw_summed": nanochat.check(divide=False),
    }
    found["buckets"] = {}
    for name, forward_inside in (("forward_outside", False), ("forward_inside", True)):
        model = DistributedDataParallel(make_model())
        optimizer = sgd(model.parameters())
        buckets = DDPBucketCounter(model)
        hand_loop(model, optimizer, None, rank_batches(rank), forward_inside=forward_inside)
        found["buckets"][name] = buckets.buckets
    found["plain"] = plain_collectives()
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        found["around_ddp_accumulator"] = check(
            functools.partial(accumulator_loop, around_ddp=True), **ddp
        )
    found["around_ddp_warnings"] = {
        str(warning.message) for warning in told if "accumulator armed" in str(warning.message)
    }
    return found


def plain_collectives() -> dict[str, dict[str, int]]:
    """Plain ``torch.distributed`` calls, each counted on its own: the kinds they count
    as, by the call's name."""
    from torch.distributed import _functional_collectives as functional
    from torch.distributed.distributed_c10d import _coalescing_manager

    world, rank = dist.get_world_size(), dist.get_rank()
    tensor = torch.ones(4)
    group = dist.group.WORLD

    def coalesced() -> None:
        with _coalescing_manager(async_ops=True) as manager:
            dist.all_reduce(tensor)
            dist.all_reduce(torch.ones(3))
        manager.wait()

    def batch_p2p() -> None:
        ops = [
            dist.P2POp(dist.isend, tensor, 1 - rank),
            dist.P2POp(dist.irecv, torch.empty(4), 1 - rank),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    calls = {
        "all_reduce": lambda: dist.all_reduce(tensor),
        "broadcast": lambda: dist.broadcast(tensor, src=0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.empty(4 * world), tensor
        ),
        "all_gather": lambda: dist.all_gather([torch.empty(4) for _ in range(world)], tensor),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.empty(4 // world), tensor
        ),
        "barrier": lambda: dist.barrier(),
        "monitored_barrier": lambda: dist.monitored_barrier(),
        "reduce": lambda: dist.reduce(tensor, dst=0),
        "all_to_all": lambda: dist.all_to_all(
            [torch.empty(2) for _ in range(world)], [torch.ones(2) for _ in range(world)]
        ),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(4), tensor),
        "gather": lambda: dist.gather(
            tensor, [torch.empty(4) for _ in range(world)] if rank == 0 else None, dst=0
        ),
        "scatter": lambda: dist.scatter(
            torch.empty(4), [torch.ones(4) for _ in range(world)] if rank == 0 else None, src=0
        ),
        "send_or_recv": lambda: dist.send(tensor, 1) if rank == 0 else dist.recv(tensor, 0),
        "batch_isend_irecv": batch_p2p,
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([tensor, torch.ones(3)]),
        "coalescing_manager": coalesced,
        "functional_all_reduce": lambda: functional.all_reduce(tensor, "sum", group) + 0,
        "functional_all_to_all_single": lambda: (
            functional.all_to_all_single(tensor, None, None, group) + 0
        ),
    }
    counted = {}
    for name, call in calls.items():
        counter = CollectiveCounter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # all_reduce_coalesced's
            with counter:
                call()
        counted[name] = dict(counter.counts.collectives)
    return counted


def start_a_child(folder: str, name: str) -> None:
    """Start a process that sleeps for an hour, and write its pid to ``folder/name``."""
    import subprocess
    import sys
    from pathlib import Path

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    Path(folder, name).write_text(str(child.pid))


def leave_a_child(rank: int, world: int, folder: str) -> None:
    """Start a child process and return, leaving it running."""
    start_a_child(folder, f"child of {rank}")


def barrier_while_rank_1_hangs(rank: int, world: int, pids: str) -> None:
    """Each rank starts a child process and writes its own pid and the child's; then
    rank 0 waits in a barrier that rank 1 never reaches."""
    import os
    import time
    from pathlib import Path

    Path(pids, str(rank)).write_text(str(os.getpid()))
    start_a_child(pids, f"child of {rank}")
    if rank == 1:
        time.sleep(3600)
    dist.barrier()


def exit_on_rank_1(rank: int, world: int) -> int:
    """Rank 1 ends its process from inside fn, raising nothing; rank 0 returns its rank."""
    import os

    if rank == 1:
        os._exit(3)
    return rank


def total_of(rank: int, world: int, tensors: list[torch.Tensor]) -> float:
    """The sum of every value of ``tensors``."""
    return float(sum(tensor.sum() for tensor in tensors))


def launch_variables(rank: int, world: int) -> dict[str, str | None]:
    """The launch variables torchrun sets, as this rank sees them."""
    import os

    return {
        name: os.environ.get(name)
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    }


def ddp_inside_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batches: Sequence[Batch],
    *,
    forward_inside: bool = True,
) -> None:
    """`hand_loop` on a DDP the trainer wraps the model in itself, as
    ``accelerator.prepare`` inside ``train`` does."""
    from torch.nn.parallel import DistributedDataParallel

    hand_loop(
        DistributedDataParallel(model), optimizer, scheduler, batches, forward_inside=forward_inside
    )
