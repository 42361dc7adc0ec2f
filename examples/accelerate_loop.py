"""An Accelerate training loop moved to gradaccum, ``accelerator.prepare`` kept, as the
Migration page's Accelerate section says line by line.

    python examples/accelerate_loop.py                          # one process
    torchrun --nproc_per_node 2 examples/accelerate_loop.py     # two
    accelerate launch --num_processes 2 examples/accelerate_loop.py  # two, with a GPU each

Without GPUs, ``accelerate launch --num_processes 2`` runs one process (accelerate 1.16):
add ``--multi_gpu`` (this script passes ``Accelerator(cpu=True)``), or use torchrun.

The prepared model (DDP on several processes), optimizer, scheduler and loader go to the
Accumulator as they are: it unwraps the prepared optimizer and scheduler and steps the
torch ones once per window, on any number of processes. At the end every process checks
its run against one float64 big batch per window, built from the microbatches every
process trained on, and rank 0 prints the scheduler's step count and the largest gap.

Then it runs the Checkpoint page's recipe on the same prepared objects, over a plain
DataLoader and over a stateful one (``use_stateful_dataloader=True``): each run stops
mid-epoch as if killed, a run of fresh objects resumes from the files every process
saved, and rank 0 prints whether it ended bit for bit where the uninterrupted run ends.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
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
    with TemporaryDirectory() as directory:
        shared = [directory]
        if accelerator.num_processes > 1:  # one directory for every process
            dist.broadcast_object_list(shared)
        exact = [resumes_exactly(Path(shared[0]), stateful) for stateful in (False, True)]
    accelerator.print(f"resumed bit for bit: plain DataLoader {exact[0]}, stateful {exact[1]}")
    accelerator.end_training()  # destroys the process group: no thread left at exit


SEED, EPOCHS, EVERY = 0, 2, 3  # a checkpoint every 3 optimizer steps


def train(path: Path, stateful: bool, crash_at: int | None = None) -> nn.Module:
    """The Checkpoint page's recipe on a migrated script: the loader prepared first, the
    scheduler sized from its length, then the rest prepared; the loader's state saved
    through `gradaccum.loader_state` (None over a plain DataLoader)."""
    config = DataLoaderConfiguration(use_stateful_dataloader=stateful)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    path = path / f"rank{accelerator.process_index}.pt"  # one file per process
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.1), nn.GELU(), nn.Linear(16, 1))
    data = TensorDataset(torch.randn(128, 4), torch.randn(128, 1))
    generator = torch.Generator()
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=generator)
    loader = accelerator.prepare(loader)  # first: the horizon counts this process's share
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    horizon = gradaccum.total_steps(len(loader), 4, EPOCHS)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=horizon)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=4, max_grad_norm=1.0)
    if path.exists():
        state = torch.load(path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        acc.load_state_dict(state["acc"])
        if state["loader"] is not None and acc.position:
            loader.load_state_dict(state["loader"])
        gradaccum.set_random_state(state["random"])
    for epoch in range(acc.epochs_completed, EPOCHS):
        generator.manual_seed(SEED + epoch)
        for x, y in acc.epoch(loader):
            loss = nn.functional.mse_loss(model(x), y)
            with acc.microstep(loss) as step:
                pass
            if step.boundary and acc.global_step % EVERY == 0:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "acc": acc.state_dict(),
                    "loader": gradaccum.loader_state(loader),
                    "random": gradaccum.random_state(),
                }
                torch.save(state, path)
            if step.boundary and acc.global_step == crash_at:
                return model  # as if the process died here
    acc.close()
    return model


def resumes_exactly(directory: Path, stateful: bool) -> bool:
    """Stopped 2 windows past a mid-epoch checkpoint of the second epoch, resumed with
    fresh objects from the files: whether every process ends with the uninterrupted
    run's parameters, bit for bit."""
    kind = "stateful" if stateful else "plain"
    crashed, whole = directory / kind, directory / f"{kind}-whole"
    for made in (crashed, whole):
        made.mkdir(exist_ok=True)
    world = dist.get_world_size() if dist.is_initialized() else 1
    windows = gradaccum.steps_per_epoch(128 // 4 // world, 4)  # per epoch
    saved_at = EVERY * (windows // EVERY + 1)  # the first checkpoint of the second epoch
    assert windows < saved_at < 2 * windows, "the checkpoint falls mid second epoch"
    crash_at = saved_at + 1
    train(crashed, stateful, crash_at=crash_at)
    resumed = train(crashed, stateful)
    uninterrupted = train(whole, stateful)
    pairs = zip(resumed.parameters(), uninterrupted.parameters(), strict=True)
    same = torch.tensor(int(all(torch.equal(p, q) for p, q in pairs)))
    if dist.is_initialized():  # every process's parameters, not rank 0's alone
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same)


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
