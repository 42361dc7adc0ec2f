"""Stop a run mid-epoch in one process, resume it in another, and get the same model.

    python examples/resume.py                      # a shuffled DataLoader
    python examples/resume.py --loader stateful    # torchdata's StatefulDataLoader

The model has dropout and the loader shuffles, so the resumed run is bit for bit the
uninterrupted one only if the checkpoint holds everything a training loop depends on:
the model, optimizer, scheduler and accumulator states, the random state, the loader's
position, and the epoch. This script trains the uninterrupted run itself, then runs the
interrupted one as two processes: ``--part first`` trains up to ``--stop-at`` optimizer
steps (mid-epoch) and saves a checkpoint, ``--part rest`` loads it and trains to the
end. It compares the final parameters with ``torch.equal`` and exits with status 1 if
they differ.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradaccum

SEED = 0
EPOCHS = 3


def dataset() -> TensorDataset:
    """A noisy nonlinear regression target: 64 batches of 8."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=generator)
    y = torch.tanh(x @ torch.randn(16, 1, generator=generator))
    return TensorDataset(x, y + 0.01 * torch.randn(512, 1, generator=generator))


@dataclass
class Training:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    acc: gradaccum.Accumulator
    loader: Any
    generator: torch.Generator


def build(loader_kind: str) -> Training:
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))
    # The loader draws its order (and its workers' seeds) from its own generator, seeded
    # at every epoch's start: the order depends on the epoch only, also after a resume.
    generator = torch.Generator()
    if loader_kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader: Any = StatefulDataLoader(
            dataset(), batch_size=8, shuffle=True, generator=generator, num_workers=2
        )
    else:
        loader = DataLoader(dataset(), batch_size=8, shuffle=True, generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    horizon = gradaccum.total_steps(len(loader), 4, EPOCHS)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=horizon)
    acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=4, max_grad_norm=1.0)
    return Training(model, optimizer, scheduler, acc, loader, generator)


def save(run: Training, path: Path) -> None:
    """Everything the loop depends on; call it after a window's ``with`` block."""
    state = {
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "acc": run.acc.state_dict(),  # position, global_step, epochs_completed, ...
        "random": gradaccum.random_state(),  # dropout; each rank saves its own
        "loader": gradaccum.loader_state(run.loader),  # None: the accumulator skips
    }
    torch.save(state, path)


def load(run: Training, path: Path) -> None:
    """Restore `save`'s checkpoint into freshly built parts; the random state last."""
    state = torch.load(path)
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.acc.load_state_dict(state["acc"])
    if state["loader"] is not None and run.acc.position:  # mid-epoch: it resumes where it stood
        run.loader.load_state_dict(state["loader"])
    gradaccum.set_random_state(state["random"])


def train(run: Training, stop_at: int | None = None, path: Path | None = None) -> None:
    """Train to the end, or save a checkpoint after ``stop_at`` optimizer steps and stop."""
    for epoch in range(run.acc.epochs_completed, EPOCHS):
        run.generator.manual_seed(SEED + epoch)
        for x, y in run.acc.epoch(run.loader):
            loss = nn.functional.mse_loss(run.model(x), y)
            with run.acc.microstep(loss):
                pass
            if run.acc.global_step == stop_at and run.acc.position:  # after the block
                assert path is not None
                save(run, path)
                return


def params_of(run: Training) -> list[torch.Tensor]:
    return [param.detach().clone() for param in run.model.parameters()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loader", choices=["dataloader", "stateful"], default="dataloader")
    parser.add_argument("--stop-at", type=int, default=21, help="optimizer steps (mid-epoch)")
    parser.add_argument("--part", choices=["first", "rest"], help="run one part of the run")
    parser.add_argument("--dir", type=Path, help="where the parts keep their files")
    args = parser.parse_args(argv)
    if args.part == "first":
        train(build(args.loader), args.stop_at, args.dir / "checkpoint.pt")
        return 0
    if args.part == "rest":
        run = build(args.loader)
        load(run, args.dir / "checkpoint.pt")
        train(run)
        torch.save(params_of(run), args.dir / "params.pt")
        return 0

    uninterrupted = build(args.loader)
    train(uninterrupted)
    with tempfile.TemporaryDirectory() as directory:
        for part in ("first", "rest"):  # two processes: nothing carries over but the file
            command = [sys.executable, __file__, "--part", part, "--dir", directory]
            command += ["--loader", args.loader, "--stop-at", str(args.stop_at)]
            subprocess.run(command, check=True)
        resumed = torch.load(Path(directory) / "params.pt")
    same = all(torch.equal(a, b) for a, b in zip(params_of(uninterrupted), resumed, strict=True))
    steps = uninterrupted.acc.global_step
    print(f"stopped after {args.stop_at} of {steps} optimizer steps; resumed bit for bit: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
