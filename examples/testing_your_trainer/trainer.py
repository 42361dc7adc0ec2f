"""A small trainer with its own accumulation loop, no gradaccum in it.

It is written the way real trainers write theirs (nanoGPT's train.py, for one): AdamW,
the learning rate set by hand at each step (a warmup, then a cosine), each microbatch's
loss divided by the accumulation steps, clipping, ``zero_grad(set_to_none=True)``. And,
the way the trainer gradaccum grew out of wrote it, ``no_sync()`` around the backward of
each microstep but the last of a window, the forward outside. Its gradients are right,
so a test that compares them passes. But DDP decides in the *forward* whether the
backward all-reduces, so every microstep all-reduces anyway. ``test_trainer.py`` catches
it with ``gradaccum.testing``; the fix is one line: compute the loss inside the ``with``
block (or set ``model.require_backward_grad_sync`` before the forward, as nanoGPT does,
or train with ``gradaccum.Accumulator``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]
MAX_LR, MIN_LR, WARMUP, DECAY = 1e-2, 1e-3, 1, 3  # in optimizer steps
GRAD_CLIP = 2.0


def get_lr(step: int) -> float:
    """The learning rate of optimizer step ``step``: linear warmup, then cosine decay."""
    if step < WARMUP:
        return MAX_LR * (step + 1) / (WARMUP + 1)
    if step > DECAY:
        return MIN_LR
    ratio = (step - WARMUP) / (DECAY - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (MAX_LR - MIN_LR)


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The mean squared error of the model on the batch."""
    inputs, targets = batch
    return nn.functional.mse_loss(model(inputs), targets)


def train_epoch(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[Batch], steps: int
) -> None:
    """One epoch, ``steps`` microbatches per optimizer step; the trailing partial window
    is dropped. ``model`` is a ``DistributedDataParallel`` (or a plain module)."""
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    for step in range(len(batches) // steps):
        for param_group in optimizer.param_groups:
            param_group["lr"] = get_lr(step)
        for micro in range(steps):
            boundary = micro == steps - 1
            loss = loss_fn(model, batches[step * steps + micro]) / steps
            with contextlib.nullcontext() if boundary else no_sync():
                loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
