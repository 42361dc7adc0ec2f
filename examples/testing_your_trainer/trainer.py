"""A small trainer with its own accumulation loop, no gradaccum in it.

It is written the way the trainer gradaccum grew out of wrote it: ``no_sync()`` around
the backward of each microstep but the last of a window, the forward outside. Its
gradients are right, so a test that compares them passes. But DDP decides in the
*forward* whether the backward all-reduces, so every microstep all-reduces anyway.
``test_trainer.py`` catches it with ``gradaccum.testing``; the fix is one line: compute
the loss inside the ``with`` block (or train with ``gradaccum.Accumulator``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The mean squared error of the model on the batch."""
    inputs, targets = batch
    return nn.functional.mse_loss(model(inputs), targets)


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batches: Sequence[Batch],
    steps: int,
) -> None:
    """One epoch, ``steps`` microbatches per optimizer step; the trailing partial window
    is dropped. ``model`` is a ``DistributedDataParallel`` (or a plain module)."""
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    trained = len(batches) // steps * steps
    for index, batch in enumerate(batches[:trained]):
        boundary = (index + 1) % steps == 0
        loss = loss_fn(model, batch) / steps
        with contextlib.nullcontext() if boundary else no_sync():
            loss.backward()
        if boundary:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
