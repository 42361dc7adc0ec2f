"""The trainer's own test: its accumulation is exact and all-reduces once per window.

    python -m pytest examples/testing_your_trainer

It fails on ``trainer.py`` as written, with "4 all-reduces per window at steps=4,
expected 1"; moving the loss into the ``with`` block makes it pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import trainer
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradaccum.testing import check_accumulation

STEPS = 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def make_optimizer(params: object) -> torch.optim.Optimizer:
    """The trainer's AdamW; the learning rate is the trainer's to set, step by step."""
    return torch.optim.AdamW(params, lr=trainer.MAX_LR, betas=(0.9, 0.95), weight_decay=0.1)  # type: ignore[arg-type]


def rank_batches(rank: int) -> list[trainer.Batch]:
    """13 microbatches of 2 rows, different on every rank: 3 windows and a dropped one."""
    generator = torch.Generator().manual_seed(rank)
    return [
        (
            torch.randn(2, 4, generator=generator, dtype=torch.float64),
            0.1 * torch.randn(2, 1, generator=generator, dtype=torch.float64),
        )
        for _ in range(13)
    ]


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batches: Sequence[trainer.Batch],
    *,
    train_epoch: Callable[..., None] = trainer.train_epoch,
) -> None:
    """One epoch of ``train_epoch``, as ``check_accumulation`` calls its ``train``; the
    trainer has no scheduler (it sets the learning rate by hand), so ``scheduler`` is
    None."""
    train_epoch(model, optimizer, batches, STEPS)


def check(train_epoch: Callable[..., None] = trainer.train_epoch) -> None:
    """``train_epoch`` under DDP on 2 gloo ranks: each window's gradient and the
    parameters after it equal to one big float64 batch's at the trainer's learning
    rates, 3 optimizer steps, DDP's all-reduce in one backward per window."""
    report = check_accumulation(
        make_model,
        make_optimizer,
        functools.partial(train, train_epoch=train_epoch),
        [rank_batches(0), rank_batches(1)],
        trainer.loss_fn,
        steps=STEPS,
        wrap=DistributedDataParallel,
        max_grad_norm=trainer.GRAD_CLIP,
    )
    assert report.ok, str(report)  # a string: pytest shows it whole


def test_accumulation_is_exact_and_all_reduces_once_per_window() -> None:
    check()
