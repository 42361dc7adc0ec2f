"""The trainer's own test: its accumulation is exact and all-reduces once per window.

    python -m pytest examples/testing_your_trainer

It fails on ``trainer.py`` as written, with "4 all-reduces per window at steps=4,
expected 1"; moving the loss into the ``with`` block makes it pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

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
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)


def rank_batches(rank: int) -> list[trainer.Batch]:
    """13 microbatches of 2 rows, different on every rank: 3 windows and a dropped one."""
    generator = torch.Generator().manual_seed(rank)
    return [
        (
            torch.randn(2, 4, generator=generator, dtype=torch.float64),
            torch.randn(2, 1, generator=generator, dtype=torch.float64),
        )
        for _ in range(13)
    ]


def check(train_epoch: Callable[..., None]) -> None:
    """``train_epoch`` under DDP on 2 gloo ranks: parameters equal to one big float64
    batch per window, 3 optimizer and scheduler steps, 1 all-reduce per window."""
    report = check_accumulation(
        make_model,
        make_optimizer,
        functools.partial(train_epoch, steps=STEPS),
        [rank_batches(0), rank_batches(1)],
        trainer.loss_fn,
        steps=STEPS,
        make_scheduler=make_scheduler,
        wrap=DistributedDataParallel,
        expect_collectives={"all_reduce": 1},
    )
    assert report.ok, report


def test_accumulation_is_exact_and_all_reduces_once_per_window() -> None:
    check(trainer.train_epoch)
