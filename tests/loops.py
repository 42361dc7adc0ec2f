"""Training loops, right and wrong, that gradaccum.testing's own tests check, and what
the gloo ranks of its distributed test run (a module the ranks can import)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradaccum
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
    **options: Any,
) -> None:
    """The design-card loop (``options`` go to the `Accumulator`)."""
    with gradaccum.Accumulator(model, optimizer, scheduler, steps=steps, **options) as acc:
        for batch in acc.epoch(batches):
            loss = sum_loss(model, batch) if by_items else mean_loss(model, batch)
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
) -> None:
    """A loop of its own: ``loss / steps`` per microbatch, ``no_sync()`` off the boundary
    (around the forward too, unless ``forward_inside`` is False: the bug equal gradients
    hide), the optimizer and the scheduler stepped at the boundary (the scheduler on every
    microbatch with ``scheduler_every_microbatch``: the bug the step count shows)."""
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    for index, batch in enumerate(batches[: len(batches) // steps * steps]):
        boundary = (index + 1) % steps == 0
        context = contextlib.nullcontext() if boundary else no_sync()
        if forward_inside:
            with context:
                (mean_loss(model, batch) / steps).backward()
        else:
            loss = mean_loss(model, batch) / steps
            with context:
                loss.backward()
        if boundary:
            optimizer.step()
            optimizer.zero_grad()
        if scheduler is not None and (boundary or scheduler_every_microbatch):
            scheduler.step()


def adamw(params: Any) -> torch.optim.Optimizer:
    """nanoGPT's optimizer (its betas and weight decay, a learning rate set by hand)."""
    return torch.optim.AdamW(params, lr=6e-3, betas=(0.9, 0.95), weight_decay=0.1)


def split_optimizers(params: Any) -> list[torch.optim.Optimizer]:
    """SGD with momentum on the weights, Adam on the biases."""
    params = list(params)
    return [
        torch.optim.SGD([p for p in params if p.ndim > 1], lr=0.1, momentum=0.9),
        torch.optim.Adam([p for p in params if p.ndim == 1], lr=1e-2),
    ]


def check(loop: Any, *, by_items: bool = False, **options: Any) -> AccumulationReport:
    """``loop`` checked on this process's ranks (one, or those of the group) in the mean
    mode, or by items with ``by_items``; ``options`` go to `check_accumulation`."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return check_accumulation(
        make_model,
        sgd,
        loop,
        [rank_batches(rank) for rank in range(world)],
        sum_loss if by_items else mean_loss,
        steps=STEPS,
        make_scheduler=decay,
        num_items=items if by_items else None,
        **options,
    )


def checks(rank: int, world: int) -> dict[str, Any]:
    """gradaccum.testing on real ranks, in one launch: `check_accumulation` on the
    Accumulator (DDP by mean and by items, fully_shard, FSDP1) and on hand-written loops,
    a `DDPBucketCounter`, and plain ``torch.distributed`` calls counted by kind."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    ddp = {"wrap": DistributedDataParallel}
    items_loop = functools.partial(accumulator_loop, by_items=True)
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
        "scheduler_every_microbatch": check(
            functools.partial(hand_loop, scheduler_every_microbatch=True), **ddp
        ),
        "mean_of_means": check(hand_loop, by_items=True, **ddp),
    }
    found["buckets"] = {}
    for name, forward_inside in (("forward_outside", False), ("forward_inside", True)):
        model = DistributedDataParallel(make_model())
        optimizer = sgd(model.parameters())
        buckets = DDPBucketCounter(model)
        hand_loop(model, optimizer, None, rank_batches(rank), forward_inside=forward_inside)
        found["buckets"][name] = buckets.buckets
    found["plain"] = plain_collectives()
    return found


def plain_collectives() -> list[dict[str, int]]:
    """Plain ``torch.distributed`` calls, each counted on its own: the kinds they count as."""
    world = dist.get_world_size()
    tensor = torch.ones(4)
    calls = [
        lambda: dist.all_reduce(tensor),
        lambda: dist.broadcast(tensor, src=0),
        lambda: dist.all_gather_into_tensor(torch.empty(4 * world), tensor),
        lambda: dist.all_gather([torch.empty(4) for _ in range(world)], tensor),
        lambda: dist.reduce_scatter_tensor(torch.empty(4 // world), tensor),
        lambda: dist.barrier(),
    ]
    counted = []
    for call in calls:
        counter = CollectiveCounter()
        with counter:
            call()
        counted.append(dict(counter.counts.collectives))
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
