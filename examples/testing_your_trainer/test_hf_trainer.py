"""A Hugging Face ``Trainer``, which owns its loop, tested unmodified: its own shuffling
sampler, its own accumulation (each microbatch's summed loss over the window's items,
``num_items_in_batch``), its own scheduler and clipping. ``train`` builds the Trainer on
the batches and the optimizer the check hands it and calls ``trainer.train()``; the check
follows the order the Trainer's forwards consumed the microbatches in.

    python -m pytest examples/testing_your_trainer/test_hf_trainer.py
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

from gradaccum.testing import AccumulationReport, check_accumulation

transformers = pytest.importorskip("transformers", reason="needs transformers (the trainers extra)")

STEPS, CLIP = 4, 0.5
Batch = dict[str, torch.Tensor]


class Regression(nn.Module):
    """A model as the Trainer runs a Hugging Face one: ``model(**batch)`` returns the loss;
    given ``num_items_in_batch`` (the Trainer passes it to a forward that takes
    ``**loss_kwargs``, by that name), the summed loss over the window's items, else the
    mean."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)).double()

    def forward(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        num_items_in_batch: Any = None,
        **loss_kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        items = labels.numel() if num_items_in_batch is None else num_items_in_batch
        return {"loss": summed_loss(self, {"inputs": inputs, "labels": labels}) / items}


def summed_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The check's loss: the microbatch's summed squared error (item mode)."""
    return (model.net(batch["inputs"]) - batch["labels"]).square().sum()


def items(batch: Batch) -> int:
    return batch["labels"].numel()


def batches() -> list[Batch]:
    """13 microbatches of 1 to 4 rows: 3 windows, and one the Trainer drops."""
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "inputs": torch.randn(rows, 5, generator=generator, dtype=torch.float64),
            "labels": torch.randn(rows, 1, generator=generator, dtype=torch.float64),
        }
        for rows in (1, 3, 2, 4, 2, 1, 3, 3, 2, 1, 4, 2, 2)
    ]


def the_microbatch(features: list[Batch]) -> Batch:
    """The collator: each dataset item is a whole microbatch (per_device_train_batch_size=1)."""
    return features[0]


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def train(model: nn.Module, optimizer: Any, scheduler: Any, batches: Sequence[Batch]) -> None:
    """One epoch of the Trainer, as it runs for its users (its linear schedule, a
    RandomSampler), on the check's microbatches and optimizer."""
    with tempfile.TemporaryDirectory() as folder:
        args = transformers.TrainingArguments(
            folder,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=STEPS,
            num_train_epochs=1,
            max_grad_norm=CLIP,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        trainer = transformers.Trainer(
            model=model,
            args=args,
            train_dataset=batches,
            data_collator=the_microbatch,
            optimizers=(optimizer, scheduler),
        )
        trainer.train()


def check() -> AccumulationReport:
    return check_accumulation(
        Regression,
        adamw,
        train,
        [batches()],
        summed_loss,
        steps=STEPS,
        num_items=items,
        max_grad_norm=CLIP,
    )


def test_the_trainer_s_windows_are_the_big_batch_s() -> None:
    report = check()
    assert report.ok, str(report)
