"""A trainer that keeps its own loop and takes only the parts from gradaccum.

    python examples/own_trainer.py --gradient-accumulation-steps 4
    torchrun --nproc_per_node 2 examples/own_trainer.py --gradient-accumulation-steps 4

This is how another framework would use gradaccum: it scales each microbatch's loss by
1/N itself, steps the optimizer and the scheduler itself on a window's last microbatch,
and runs the forward *and* the backward of every other microstep inside
``gradaccum.no_sync(model)`` (DDP decides during the forward whether the backward
all-reduces, so a ``no_sync`` around the backward alone would all-reduce every
microstep). From gradaccum it takes the flag (``add_arguments``), the counts
(``steps_per_epoch`` and ``total_steps``: each epoch's trailing ``n % N`` microbatches
are dropped, never loaded) and the log cadence (``interval(0.25, steps_per_epoch)``: a
quarter epoch, rounded to whole optimizer steps). Under ``torchrun`` it trains a DDP
model on gloo (CPU); alone, a plain model.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gradaccum

Batch = Sequence[torch.Tensor]


class Batches(Protocol):
    """A DataLoader, a list: anything with a length that yields microbatches."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Batch]: ...


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The mean squared error of the model on one microbatch."""
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batches: Batches,
    steps: int,
    *,
    global_step: int = 0,
    log_every: int = 0,
) -> int:
    """One epoch of ``steps`` microbatches per optimizer step; returns the optimizer steps
    taken so far. ``batches`` needs a ``len``; logs every ``log_every`` steps (0: never)."""
    trained = gradaccum.steps_per_epoch(len(batches), steps) * steps
    losses = []
    for index, batch in enumerate(itertools.islice(batches, trained)):
        boundary = (index + 1) % steps == 0
        # Forward and backward inside no_sync: DDP arms its all-reduce in the forward.
        with contextlib.nullcontext() if boundary else gradaccum.no_sync(model):
            loss = loss_fn(model, batch)
            (loss / steps).backward()
        losses.append(loss.detach())  # device tensors: no host sync mid-window
        if boundary:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            if log_every and global_step % log_every == 0 and rank() == 0:
                print(f"step {global_step} loss {torch.stack(losses).mean().item():.4f}")
            losses.clear()
    return global_step


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def dataset() -> TensorDataset:
    """A noisy nonlinear regression target: 50 batches of 8."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(400, 16, generator=generator)
    y = torch.tanh(x @ torch.randn(16, 1, generator=generator))
    return TensorDataset(x, y + 0.01 * torch.randn(400, 1, generator=generator))


def main(argv: list[str] | None = None) -> None:
    parser = gradaccum.add_arguments(argparse.ArgumentParser(description=__doc__), default=4)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    steps = args.gradient_accumulation_steps

    torch.manual_seed(0)  # the same initial weights on every rank
    model: nn.Module = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    data = dataset()
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] | None = None
    if "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        model = DistributedDataParallel(model)
        sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler, shuffle=sampler is None)

    per_epoch = gradaccum.steps_per_epoch(len(loader), steps)
    horizon = gradaccum.total_steps(len(loader), steps, args.epochs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=horizon)
    log_every = gradaccum.interval(0.25, per_epoch)  # a quarter epoch, in optimizer steps

    global_step = 0
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        global_step = train_epoch(
            model, optimizer, scheduler, loader, steps, global_step=global_step, log_every=log_every
        )
    if rank() == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        print(f"{global_step} of {horizon} optimizer steps on {world} process(es)")
    if dist.is_initialized():
        del model, optimizer, scheduler
        gc.collect()  # DDP holds the group in reference cycles: free it before destroying
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
