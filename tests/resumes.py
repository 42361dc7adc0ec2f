"""Two-epoch runs resumed at every window boundary, for three kinds of loader: what
tests/test_resuming.py runs on one process and tests/test_resuming_distributed.py on gloo
ranks (a module the ranks can import).

The model has dropout and the loader shuffles, so a resume is bit for bit only when the
random state, the loader's order and the epoch are all restored: the guide's recipe,
followed here to the letter. The uninterrupted run saves a checkpoint (serialized, as a
file would hold it) after every window's block and after every epoch; each is loaded into
fresh objects that finish the run, and the final parameters must be equal.
"""

from __future__ import annotations

import io
import multiprocessing
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    TensorDataset,
)

import gradaccum

SEED = 1234
STEPS = 4
BATCH = 4
MICROBATCHES = 13  # per rank and epoch: 3 windows of 4, and a 13th that is dropped
EPOCHS = 2
KINDS = ("dataloader", "stateful", "generator")


def dataset(world: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    n = BATCH * MICROBATCHES * world
    return TensorDataset(
        torch.randn(n, 5, generator=generator), torch.randn(n, 1, generator=generator)
    )


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``data`` with noise added to every sample as it is loaded, drawn from torch's global
    random state (random augmentation in the main process: ``num_workers=0``)."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[index]
        return x + 0.1 * torch.randn(x.shape), y


def batches_of(loader: Iterable[Any]) -> Iterator[Any]:
    """The loader's batches through a plain generator: no len, no state, no sampler."""
    yield from loader


class Run:
    """The parts of one training run, built afresh for every resume.

    ``kind``: ``"dataloader"`` (a shuffled DataLoader: index-level skip), ``"stateful"``
    (torchdata's StatefulDataLoader, shuffled, two workers: restores itself) or
    ``"generator"`` (a generator over the DataLoader's batches: drawn and dropped). On
    several ranks the order comes from a DistributedSampler instead of ``shuffle``. Two
    more, on one process, have two persistent workers: ``"persistent"`` draws its order
    from a RandomSampler's own generator and its workers' seed from another (the fix the
    guide gives), ``"persistent, shared"`` both from one (refused on resuming). And two
    whose DataLoader has no generator, its order drawn from its sampler's own (a
    RandomSampler's, or on several ranks a DistributedSampler's): ``"no loader
    generator"`` (index-level skip) and ``"no loader generator, drawn"`` (through a plain
    generator: drawn and dropped). Such a loader draws its workers' seed from torch's
    global random state at every iterator, which a mid-epoch resume must not move. And
    ``"augmented"``: a DataLoader whose samples draw noise from torch's global random state
    as they are loaded (`Augmented`).
    """

    def __init__(
        self,
        kind: str,
        rank: int = 0,
        world: int = 1,
        wrap: Callable[[nn.Module], nn.Module] | None = None,
    ) -> None:
        self.kind = kind
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.25), nn.Tanh(), nn.Linear(16, 1))
        self.model = model if wrap is None else wrap(model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LinearLR(self.optimizer, 1.0, 0.1, total_iters=6)
        self.acc = gradaccum.Accumulator(
            self.model, self.optimizer, self.scheduler, steps=STEPS, max_grad_norm=1.0
        )
        data = dataset(world)
        self.generator = torch.Generator()  # seeded at every epoch's start
        self.sampler = (
            DistributedSampler(data, world, rank, shuffle=True, seed=SEED) if world > 1 else None
        )
        options: dict[str, Any] = {
            "batch_size": BATCH,
            "shuffle": self.sampler is None,
            "sampler": self.sampler,
            "generator": self.generator,
        }
        if kind == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader

            # The workers start from a forkserver that has imported torch and this module
            # once: forking the rank itself, as a torchrun script's DataLoader does on
            # Linux, forks a process that runs gloo's threads (it hung this test 2 times in
            # 20), and a bare forkserver imports torch in every worker (8 times slower).
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(["torch", "torchdata.stateful_dataloader", __name__])
            self.loader: Any = StatefulDataLoader(
                data, num_workers=2, multiprocessing_context=context, **options
            )
        elif kind.startswith("no loader generator"):
            options.update(
                shuffle=False,
                sampler=self.sampler or RandomSampler(data, generator=self.generator),
                generator=None,
            )
            self.loader = DataLoader(data, **options)
        elif kind == "augmented":
            self.loader = DataLoader(Augmented(data), **options)
        elif kind.startswith("persistent"):
            if kind == "persistent":
                options.update(
                    shuffle=False,
                    sampler=RandomSampler(data, generator=self.generator),
                    generator=torch.Generator(),
                )
            self.loader = DataLoader(data, num_workers=2, persistent_workers=True, **options)
        else:
            self.loader = DataLoader(data, **options)

    def iterable(self, epoch: int) -> Iterable[Any]:
        """The loader, set up for ``epoch``: its order depends on the epoch only."""
        self.generator.manual_seed(SEED + epoch)
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
        drawn = self.kind in ("generator", "no loader generator, drawn")
        return batches_of(self.loader) if drawn else self.loader

    def save(self) -> bytes:
        """Everything a resume needs, as the guide's checkpoint saves it."""
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "acc": self.acc.state_dict(),
            "random": gradaccum.random_state(),
        }
        if self.kind == "stateful":
            state["loader"] = self.loader.state_dict()
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    def load(self, blob: bytes) -> Run:
        """Load ``blob`` from `save`; the random state last, right before the loop."""
        state = torch.load(io.BytesIO(blob))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.acc.load_state_dict(state["acc"])
        if self.kind == "stateful" and self.acc.position:  # mid-epoch only
            self.loader.load_state_dict(state["loader"])
        gradaccum.set_random_state(state["random"])
        return self


def train(
    run: Run,
    checkpoint: Callable[[Run], None] | None = None,
    top: Callable[[Run], None] | None = None,
) -> Run:
    """The guide's loop, from the epoch the accumulator says; ``checkpoint`` after every
    window's block and every epoch, ``top`` at the top of the loop body of every window's
    first microbatch (handed out, not back-propagated yet)."""
    for epoch in range(run.acc.epochs_completed, EPOCHS):
        for index, (x, y) in enumerate(run.acc.epoch(run.iterable(epoch))):
            if top is not None and index % STEPS == 0 and index < 3 * STEPS:
                top(run)
            loss = (run.model(x) - y).square().mean()
            with run.acc.microstep(loss) as step:
                pass
            if step.boundary and checkpoint is not None:
                checkpoint(run)
        if checkpoint is not None:
            checkpoint(run)
    return run


CHECKPOINTS = ["step 1", "step 2", "step 3", "epoch 1", "step 4", "step 5", "step 6", "epoch 2"]
"""Where `train` checkpoints two epochs of three windows: after every window and epoch."""


TOPS = [f"top of window {n}" for n in range(1, 3 * EPOCHS + 1)]
"""Where `train` checkpoints with ``top``: the top of the loop body of every window's first
microbatch, the epochs' first microbatches (windows 1 and 4) included."""


def resumed_everywhere(
    kind: str,
    rank: int = 0,
    world: int = 1,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    params: Callable[[nn.Module], list[torch.Tensor]] | None = None,
    top: bool = False,
) -> dict[str, bool]:
    """For every checkpoint of an uninterrupted run (``"step 3"``, ``"epoch 1"``; with
    ``top``, ``"top of window 4"``): does the run resumed from it end bit for bit where the
    uninterrupted one did?"""
    saves: list[tuple[str, bytes]] = []

    def checkpoint(run: Run) -> None:
        acc = run.acc
        where = f"step {acc.global_step}" if acc.position else f"epoch {acc.epochs_completed}"
        saves.append((where, run.save()))

    def at_the_top(run: Run) -> None:
        saves.append((f"top of window {run.acc.global_step + 1}", run.save()))

    if top:
        whole = train(Run(kind, rank, world, wrap), top=at_the_top)
    else:
        whole = train(Run(kind, rank, world, wrap), checkpoint)
    read = params or (lambda model: [p.detach() for p in model.parameters()])
    expected = read(whole.model)
    whole.acc.close()
    outcome = {}
    for where, blob in saves:
        resumed = train(Run(kind, rank, world, wrap).load(blob))
        got = read(resumed.model)
        outcome[where] = (
            all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
            and resumed.acc.global_step == whole.acc.global_step == 3 * EPOCHS
            and resumed.acc.epochs_completed == EPOCHS
        )
        resumed.acc.close()
    return outcome


def resumed_everywhere_on_ranks(rank: int, world: int) -> dict[str, dict[str, bool]]:
    """`resumed_everywhere` for every kind under DDP, and for the StatefulDataLoader
    under ``fully_shard``, in one launch."""
    from tests.distributed import full_params, wrap

    outcome = {
        kind: resumed_everywhere(kind, rank, world, lambda model: wrap("ddp", model))
        for kind in KINDS
    }
    outcome["stateful under fully_shard"] = resumed_everywhere(
        "stateful",
        rank,
        world,
        lambda model: wrap("fully_shard", model),
        lambda model: full_params(model, "fully_shard"),
    )
    return outcome


def state_at(run: Run, global_step: int) -> dict[str, Any]:
    """``run``'s accumulator state after the window that brings it to ``global_step``, in
    the first epoch (mid-epoch)."""
    for x, y in run.acc.epoch(run.iterable(0)):
        with run.acc.microstep((run.model(x) - y).square().mean()) as step:
            pass
        if step.boundary and run.acc.global_step == global_step:
            return run.acc.state_dict()
    raise AssertionError(f"the first epoch has fewer than {global_step} windows")


def world_size_refusals_on_ranks(
    rank: int, world: int, saved_alone: dict[str, Any]
) -> tuple[dict[str, Any], str, tuple[int, int]]:
    """Under DDP: this rank's state 2 windows into the first epoch, the refusal by a fresh
    accumulator of ``saved_alone`` (a state saved on one process), and that accumulator's
    global step and position after it (nothing loaded)."""
    from tests.distributed import wrap

    def ddp(model: nn.Module) -> nn.Module:
        return wrap("ddp", model)

    saved = state_at(Run("dataloader", rank, world, ddp), 2)
    fresh = Run("dataloader", rank, world, ddp).acc
    try:
        fresh.load_state_dict(saved_alone)
    except gradaccum.ConfigError as error:
        refusal = str(error)
    else:
        refusal = ""
    return saved, refusal, (fresh.global_step, fresh.position)


def on_two_ranks(rank: int, world: int, saved_alone: dict[str, Any]) -> dict[str, Any]:
    """What tests/test_resuming_distributed.py checks, in one launch: `resumed_everywhere_on_ranks`
    and `world_size_refusals_on_ranks`."""
    return {
        "resumed": resumed_everywhere_on_ranks(rank, world),
        "world size": world_size_refusals_on_ranks(rank, world, saved_alone),
    }
