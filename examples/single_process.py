"""Train a small regressor with gradient accumulation on one process.

    python examples/single_process.py --epochs 3  # 4 microbatches per step by default

Shows the parts together: the CLI flag, the scheduler horizon from ``total_steps``, a
log cadence from ``interval``, item-weighted losses for variable-length microbatches,
and a checkpoint taken between windows.
"""

from __future__ import annotations

import argparse
import io

import torch
from torch import nn

import gradaccum


def microbatches(count: int, generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Variable-length microbatches of a noisy linear target (rows are the "items")."""
    weight = torch.randn(8, 1, generator=generator)
    batches = []
    for _ in range(count):
        rows = int(torch.randint(1, 9, (), generator=generator))
        x = torch.randn(rows, 8, generator=generator)
        batches.append((x, x @ weight + 0.01 * torch.randn(rows, 1, generator=generator)))
    return batches


def main(argv: list[str] | None = None) -> float:
    """Train, checkpoint once, and return the last window's loss."""
    parser = gradaccum.add_arguments(argparse.ArgumentParser(description=__doc__), default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=26)
    parser.add_argument("--log-every", type=float, default=0.5, help="steps, or epoch fraction")
    args = parser.parse_args(argv)
    steps = args.gradient_accumulation_steps

    data = microbatches(args.microbatches, torch.Generator().manual_seed(0))
    model = nn.Linear(8, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    horizon = gradaccum.total_steps(len(data), steps, args.epochs)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=horizon)
    log_every = gradaccum.interval(args.log_every, gradaccum.steps_per_epoch(len(data), steps))

    acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=steps, max_grad_norm=1.0)
    checkpoint = b""
    loss = float("nan")
    for epoch in range(args.epochs):
        for x, y in acc.epoch(data):
            loss_sum = (model(x) - y).square().sum()
            with acc.microstep(loss_sum, num_items=len(x)) as step:
                if step.boundary and step.global_step % log_every == 0:
                    loss = step.loss.item()  # reading a value: the one host sync
                    print(
                        f"epoch {epoch} step {step.global_step}/{horizon} "
                        f"loss {loss:.4f} grad norm {step.grad_norm.item():.3f} lr {step.lr:.4f}"
                    )
            # After a boundary block has exited the window is applied: checkpoint here.
            if step.boundary and acc.global_step == horizon // 2:
                buffer = io.BytesIO()
                torch.save({"model": model.state_dict(), "acc": acc.state_dict()}, buffer)
                checkpoint = buffer.getvalue()
    print(f"{acc.global_step} optimizer steps; checkpoint of {len(checkpoint)} bytes")
    return loss


if __name__ == "__main__":
    main()
