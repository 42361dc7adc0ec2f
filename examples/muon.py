"""Muon on the matrices and AdamW on the rest, under one accumulator.

    python examples/muon.py  # 4 microbatches per optimizer step by default

The split of nanochat and most 2025-2026 LLM recipes: ``torch.optim.Muon`` takes the 2-D
weights, AdamW the biases and norms, each with its own scheduler sized by
``gradaccum.total_steps``. One window steps both optimizers and both schedulers once,
after one clip of the total gradient norm over all the parameters. The script then trains
the same model with the hand-written loop a user would write without gradaccum, over the
same windows, and prints how far apart the two ended (0: bit for bit the same).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

import gradaccum

Batch = tuple[torch.Tensor, torch.Tensor]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))


def make_optimizers(
    model: nn.Module, horizon: int
) -> tuple[list[torch.optim.Optimizer], list[torch.optim.lr_scheduler.LRScheduler]]:
    """Muon on the 2-D weights, AdamW on the rest; a cosine schedule for each, over
    ``horizon`` optimizer steps."""
    matrices = [param for param in model.parameters() if param.ndim == 2]
    rest = [param for param in model.parameters() if param.ndim != 2]
    optimizers = [
        torch.optim.Muon(matrices, lr=0.02, momentum=0.95),
        torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.0),
    ]
    schedulers = [
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=horizon)
        for optimizer in optimizers
    ]
    return optimizers, schedulers


def data(count: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(1)
    target = torch.randn(16, 1, generator=generator)
    xs = [torch.randn(8, 16, generator=generator) for _ in range(count)]
    return [(x, torch.tanh(x @ target)) for x in xs]


def loss_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).square().mean()


def with_gradaccum(batches: list[Batch], steps: int, epochs: int) -> nn.Module:
    model = make_model()
    horizon = gradaccum.total_steps(len(batches), steps, epochs)
    optimizers, schedulers = make_optimizers(model, horizon)
    with gradaccum.Accumulator(
        model, optimizers, schedulers, steps=steps, max_grad_norm=1.0
    ) as acc:
        for epoch in range(epochs):
            for batch in acc.epoch(batches):
                loss = loss_of(model, batch)
                with acc.microstep(loss) as step:
                    if step.boundary and step.global_step % 4 == 0:
                        muon_lr, adamw_lr = step.lrs  # one per optimizer, as used by this step
                        print(
                            f"epoch {epoch} step {step.global_step}/{horizon} "
                            f"loss {step.loss.item():.5f} grad norm {step.grad_norm.item():.4f} "
                            f"lr muon {muon_lr:.5f} adamw {adamw_lr:.6f}"
                        )
    return model


def by_hand(batches: list[Batch], steps: int, epochs: int) -> nn.Module:
    """The same training without gradaccum: loss / steps, one clip over the model's
    parameters, both optimizers and both schedulers stepped once per window."""
    model = make_model()
    horizon = gradaccum.total_steps(len(batches), steps, epochs)
    optimizers, schedulers = make_optimizers(model, horizon)
    usable = len(batches) // steps * steps  # the trailing partial window is dropped
    for _ in range(epochs):
        for index, batch in enumerate(batches[:usable]):
            (loss_of(model, batch) / steps).backward()
            if (index + 1) % steps == 0:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                for optimizer in optimizers:
                    optimizer.step()
                for scheduler in schedulers:
                    scheduler.step()
                for optimizer in optimizers:
                    optimizer.zero_grad(set_to_none=True)
    return model


def main(argv: list[str] | None = None) -> float:
    """Train both ways; return the largest difference between their parameters."""
    parser = gradaccum.add_arguments(argparse.ArgumentParser(description=__doc__), default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=34)
    args = parser.parse_args(argv)
    batches = data(args.microbatches)
    runs: list[Callable[[list[Batch], int, int], nn.Module]] = [with_gradaccum, by_hand]
    accumulated, hand = (
        run(batches, args.gradient_accumulation_steps, args.epochs) for run in runs
    )
    gap = max(
        (p - q).abs().max().item()
        for p, q in zip(accumulated.parameters(), hand.parameters(), strict=True)
    )
    print(f"max |param - hand-written loop| {gap:.1e}")
    return gap


if __name__ == "__main__":
    main()
