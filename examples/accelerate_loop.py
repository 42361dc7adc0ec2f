"""An Accelerate training loop moved to gradaccum, ``accelerator.prepare`` kept, as the
Migration page's Accelerate section says line by line.

    accelerate launch --num_processes 2 examples/accelerate_loop.py  # or, the same:
    torchrun --nproc_per_node 2 examples/accelerate_loop.py

The prepared model (DDP on several processes), optimizer, scheduler and loader go to the
Accumulator as they are: it unwraps the prepared optimizer and scheduler and steps the
torch ones once per window, on any number of processes. At the end every process checks
its run against one float64 big batch per window, built from the microbatches every
process trained on, and rank 0 prints the scheduler's step count and the largest gap.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradaccum


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def make_optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, object]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.9**k)


def main(argv: list[str] | None = None) -> None:
    parser = gradaccum.add_arguments(argparse.ArgumentParser(description=__doc__), default=4)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(160, 4, generator=generator, dtype=torch.float64),
        torch.randn(160, 1, generator=generator, dtype=torch.float64),
    )
    model = make_model()
    optimizer, scheduler = make_optimizer(model)
    loader = DataLoader(data, batch_size=4)

    # The Accelerate section, literally: prepare kept, no gradient_accumulation_steps.
    accelerator = Accelerator(cpu=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    acc = gradaccum.Accumulator(
        model,
        optimizer,
        scheduler,
        steps=args.gradient_accumulation_steps,
        max_grad_norm=1.0,
        global_loss=True,  # step.global_loss in mean mode: one scalar all-reduce a window
    )
    trained: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]  # this process's windows
    for epoch in range(args.epochs):
        for x, y in acc.epoch(loader):
            loss = nn.functional.mse_loss(model(x), y)  # the forward before the block
            with acc.microstep(loss) as step:
                trained[-1].append((x, y))
                if step.boundary:  # was: if accelerator.sync_gradients
                    trained.append([])
                    accelerator.print(
                        f"epoch {epoch} step {step.global_step} loss "
                        f"{step.global_loss.item():.6f} lr {step.lr:.6f}"
                    )
    acc.close()
    check(accelerator, model, acc, trained[:-1])
    accelerator.end_training()  # destroys the process group: no thread left at exit


def check(
    accelerator: Accelerator,
    model: nn.Module,
    acc: gradaccum.Accumulator,
    trained: list[list[tuple[torch.Tensor, torch.Tensor]]],
) -> None:
    """Compare with one float64 big batch per window of every process's microbatches (the
    mean of their mean losses), clipped to 1.0, AdamW and the LambdaLR stepped once each."""
    everyone: list[object] = [None] * accelerator.num_processes
    if accelerator.num_processes > 1:
        dist.all_gather_object(everyone, trained)
    else:
        everyone = [trained]
    reference = make_model()
    optimizer, scheduler = make_optimizer(reference)
    for window in zip(*everyone, strict=True):
        batches = [batch for mine in window for batch in mine]
        loss = torch.stack([nn.functional.mse_loss(reference(x), y) for x, y in batches]).mean()
        loss.backward()
        nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        scheduler.step()  # type: ignore[attr-defined]
        optimizer.zero_grad()
    gap = max(
        (p - q).abs().max().item()
        for p, q in zip(
            accelerator.unwrap_model(model).parameters(), reference.parameters(), strict=True
        )
    )
    schedule = acc.schedulers[0]
    accelerator.print(
        f"scheduler steps {schedule.last_epoch} for {acc.global_step} windows on "
        f"{accelerator.num_processes} processes; max |param - float64 big batch| {gap:.1e}"
    )


if __name__ == "__main__":
    main()
