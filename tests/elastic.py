"""Runs resumed on another number of gloo ranks, for tests/test_elastic_distributed.py (a
module the ranks can import).

Every case trains two epochs with a global batch of 16 samples: microbatches of 2 samples
on each rank, ``steps = gradaccum.steps_for(16, 2, world)``. Its data is a
DistributedSampler (``set_epoch`` at every epoch; shuffled but in one case) over a
dataset whose size makes the sampler pad or cut (``CONFIGS``). The uninterrupted run
records the float64 parameters and learning rate after every window, and saves a
checkpoint after its second window (mid-epoch): the model and optimizer through
``torch.distributed.checkpoint`` (which reshards them), the scheduler and the accumulator
as a file. A resumed run loads it on another number of ranks and records the same after
each of its windows.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gradaccum

GLOBAL_BATCH = 16
BATCH = 2  # samples per rank and microbatch
EPOCHS = 2
CHECKPOINT_AT = 2  # the global step after which the uninterrupted run saves (mid-epoch)

# name: (samples, shuffle, the sampler's drop_last, the loader's drop_last, the accumulator's)
CONFIGS = {
    # 50 samples: on 4 ranks the sampler pads to 52 (or cuts to 48) and the loader's last
    # microbatch is shorter; the 3 windows of 16 an epoch trains are the same samples.
    "padded": (50, True, False, False, True),
    "cut": (50, True, True, True, True),
    # The same with the trailing partial window trained: on 4 ranks it holds samples 48 to
    # 51 (two of them padding), on 1 or 2 ranks 48 and 49 (refused between 4 and 2).
    "padded, partial": (50, True, False, False, False),
    # 52 samples with the trailing partial window trained: samples 48 to 51 on any number.
    "partial": (52, True, False, False, False),
    # The same in the dataset's order, every epoch alike (no set_epoch needed).
    "unshuffled": (52, False, False, False, False),
    # 44 samples, partial window trained: on 4 ranks the last window holds the last,
    # shorter microbatches, on 1 or 2 ranks it is 3 whole ones: the same samples, weighed
    # otherwise in mean mode (refused between 4 and 2 ranks), alike with num_items.
    "short": (44, True, False, False, False),
}
WRAPPERS = ("ddp", "fully_shard")
MODES = ("mean", "items")
# What each wrapper adds is how its model and optimizer reshard through DCP, the same for
# every config: DDP runs every config, fully_shard the padded one and the short one (its
# refusal between 4 and 2 ranks in mean mode, and its exact resume with num_items).
CONFIGS_OF = {"ddp": tuple(CONFIGS), "fully_shard": ("padded", "short")}


@dataclass(frozen=True)
class Case:
    wrapper: str
    mode: str
    config: str

    def __str__(self) -> str:
        return f"{self.wrapper}-{self.mode}-{self.config}"


CASES = [Case(w, m, c) for w in WRAPPERS for m in MODES for c in CONFIGS_OF[w]]


def dataset(n: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(n, 5, generator=generator, dtype=torch.float64)
    y = torch.randn(n, 1, generator=generator, dtype=torch.float64)
    tokens = torch.randint(1, 4, (n,), generator=generator)  # items per sample
    return TensorDataset(x, y, tokens)


class Run:
    """One case's parts on ``world`` ranks (this is ``rank``)."""

    def __init__(self, case: Case, rank: int, world: int, *, loader: str = "dataloader") -> None:
        from tests.distributed import wrap

        self.case = case
        n, shuffle, sampler_drop_last, loader_drop_last, drop_last = CONFIGS[case.config]
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)).double()
        self.model = wrap(case.wrapper, model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LinearLR(self.optimizer, 1.0, 0.1, total_iters=8)
        self.acc = gradaccum.Accumulator(
            self.model,
            self.optimizer,
            self.scheduler,
            steps=gradaccum.steps_for(GLOBAL_BATCH, BATCH, world),
            drop_last=drop_last,
        )
        data = dataset(n)
        self.sampler = DistributedSampler(
            data, world, rank, shuffle=shuffle, seed=3, drop_last=sampler_drop_last
        )
        self.loader = DataLoader(
            data, batch_size=BATCH, sampler=self.sampler, drop_last=loader_drop_last
        )
        self.kind = loader

    def iterable(self, epoch: int) -> Any:
        self.sampler.set_epoch(epoch)
        if self.kind == "generator":  # no global order known
            return (batch for batch in self.loader)
        return self.loader

    def loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, y, tokens = batch
        errors = (self.model(x) - y).square().squeeze(1)
        if self.case.mode == "mean":
            return errors.mean(), None
        return (errors * tokens).sum(), tokens.sum()

    def params(self) -> list[torch.Tensor]:
        from tests.distributed import full_params

        return full_params(self.model, self.case.wrapper)

    def train(self, stop_at: int | None = None, *, include_grads: bool = False) -> Iterator[Any]:
        """Train to the end (or to global step ``stop_at``: then yield the state); yield
        (global step, parameters, learning rate) after every window."""
        acc = self.acc
        for epoch in range(acc.epochs_completed, EPOCHS):
            for batch in acc.epoch(self.iterable(epoch)):
                loss, items = self.loss(batch)
                with acc.microstep(loss, num_items=items) as step:
                    pass
                if step.boundary:
                    yield acc.global_step, self.params(), step.lr
                    if acc.global_step == stop_at and not include_grads:
                        return
                elif include_grads and acc.global_step == stop_at:
                    return

    def save(self, path: str, *, include_grads: bool = False) -> None:
        """The recipe: model and optimizer through DCP, the rest as files (rank 0)."""
        model, optimizer = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model, "optimizer": optimizer}, checkpoint_id=path)
        acc = self.acc.state_dict(include_grads=include_grads)
        if dist.get_rank() == 0:
            torch.save(
                {"acc": acc, "scheduler": self.scheduler.state_dict()},
                os.path.join(path, "rest.pt"),
            )
        dist.barrier()

    def load(self, path: str, **allow: bool) -> None:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        state = {"model": model, "optimizer": optimizer}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        rest = torch.load(os.path.join(path, "rest.pt"))
        self.scheduler.load_state_dict(rest["scheduler"])
        self.acc.load_state_dict(rest["acc"], **allow)


def where(root: str, case: Case, world: int) -> str:
    return os.path.join(root, f"{case}-on-{world}")


def reference(case: Case, rank: int, world: int, root: str) -> dict[int, Any]:
    """The uninterrupted run: the parameters and learning rate after every window; saves
    its checkpoint after window `CHECKPOINT_AT`."""
    run = Run(case, rank, world)
    seen = {}
    for global_step, params, lr in run.train():
        seen[global_step] = (params, lr)
        if global_step == CHECKPOINT_AT:
            run.save(where(root, case, world))
    run.acc.close()
    return seen


def resumed(case: Case, rank: int, world: int, root: str, saved_on: int) -> Any:
    """The run resumed on ``world`` ranks from the checkpoint saved on ``saved_on``: what
    it recorded after every window and its counters, or the refusal's message."""
    run = Run(case, rank, world)
    try:
        run.load(where(root, case, saved_on), allow_world_size_change=True)
        seen = {step: (params, lr) for step, params, lr in run.train()}
    except gradaccum.ConfigError as error:
        return str(error)
    finally:
        run.acc.close()
    return seen, run.acc.global_step, run.acc.epochs_completed


def launch(rank: int, world: int, root: str, resumes: list[int], extra: str = "") -> Any:
    """Every case's uninterrupted run on ``world`` ranks (its checkpoint saved), and every
    case resumed here from the checkpoints saved on each of ``resumes``; with ``extra``,
    that scenario's refusals too. Rank 0's results."""
    references = {str(case): reference(case, rank, world, root) for case in CASES}
    resumes_here = {
        (str(case), saved_on): resumed(case, rank, world, root, saved_on)
        for saved_on in resumes
        for case in CASES
    }
    refusals = REFUSALS[extra](rank, world, root) if extra else {}
    return (references, resumes_here, refusals) if rank == 0 else None


def resume_only(rank: int, world: int, root: str, resumes: list[int]) -> Any:
    """Every case resumed on ``world`` ranks from the checkpoints saved on ``resumes``, and
    the refusals at an epoch's start; rank 0's results."""
    resumes_here = {
        (str(case), saved_on): resumed(case, rank, world, root, saved_on)
        for saved_on in resumes
        for case in CASES
    }
    refusals = refused_when_the_epoch_begins(rank, world, root)
    return (resumes_here, refusals) if rank == 0 else None


# Refusals ---------------------------------------------------------------------------


def _refusal(call: Any) -> str:
    try:
        call()
    except gradaccum.ConfigError as error:
        return str(error)
    return ""


def saved_for_refusals(rank: int, world: int, root: str) -> dict[str, str]:
    """On 2 ranks: a state saved mid-window (include_grads, under DDP) and one saved
    mid-epoch from a generator (no global order)."""
    case = Case("ddp", "mean", "padded")
    run = Run(case, rank, world)
    for _ in run.train(CHECKPOINT_AT + 1, include_grads=True):
        pass
    run.save(os.path.join(root, "mid-window"), include_grads=True)
    run.acc.close()
    run = Run(case, rank, world, loader="generator")
    for _ in run.train(CHECKPOINT_AT):
        pass
    run.save(os.path.join(root, "generator"))
    run.acc.close()
    return {}


def refused_when_loading(rank: int, world: int, root: str) -> dict[str, Any]:
    """On 1 process, states saved on 2 ranks that cannot resume here: what each load says,
    and the accumulator's counters after it (nothing loaded)."""
    case = Case("ddp", "mean", "padded")
    saved = where(root, case, 2)
    out: dict[str, Any] = {}

    def attempt(name: str, path: str, steps: int | None = None, **allow: bool) -> None:
        run = Run(case, rank, world)
        if steps is not None:
            run.acc.steps = steps
        out[name] = _refusal(lambda: run.load(path, **allow))
        out[name + " counters"] = (run.acc.global_step, run.acc.position)
        run.acc.close()

    attempt("not allowed", saved)
    attempt("steps", saved, steps=4, allow_world_size_change=True)
    attempt("mid-window", os.path.join(root, "mid-window"), allow_world_size_change=True)
    attempt("no order saved", os.path.join(root, "generator"), allow_world_size_change=True)
    return out


def refused_when_the_epoch_begins(rank: int, world: int, root: str) -> dict[str, Any]:
    """On 2 ranks, states saved on 1 or 4 that load but whose next epoch is not the one
    that continues them: each refusal raised by the epoch's first next(), and where the
    accumulator stands after it (the resume still ahead)."""
    out: dict[str, Any] = {}

    def attempt(name: str, case: Case, saved_on: int, epoch: int, loader: str) -> None:
        run = Run(case, rank, world, loader=loader)
        run.load(where(root, case, saved_on), allow_world_size_change=True)
        run.sampler.set_epoch(epoch)
        iterable = run.loader if loader == "dataloader" else run.iterable(epoch)
        out[name] = _refusal(lambda: next(iter(run.acc.epoch(iterable))))
        out[name + " counters"] = (run.acc.global_step, run.acc.position)
        run.acc.close()

    attempt("no order here", Case("ddp", "mean", "padded"), 1, 0, "generator")
    attempt("another epoch", Case("ddp", "mean", "padded"), 1, 1, "dataloader")
    return out


REFUSALS = {"save": saved_for_refusals, "load": refused_when_loading}


def saved_at_an_epochs_end(rank: int, world: int, root: str, save: bool) -> Any:
    """DDP over a DistributedSampler of 32 samples (one window of 16 a step, 2 an epoch),
    two epochs: with ``save``, checkpointed after the first epoch's last window (step 2,
    the epoch's end: a cadence that divides the epoch lands there), else resumed from it.
    The parameters at the end, and the global step, or the refusal."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(5, 1).double())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, optimizer, steps=gradaccum.steps_for(16, 2, world))
    data = dataset(32)
    sampler = DistributedSampler(data, world, rank, seed=3)
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    path = os.path.join(root, "epoch_end")
    if not save:
        model.module.load_state_dict(torch.load(f"{path}.model"))  # (the same on every rank)
        optimizer.load_state_dict(torch.load(f"{path}.optimizer"))
        acc.load_state_dict(torch.load(f"{path}.acc"), allow_world_size_change=True)
    try:
        for epoch in range(acc.epochs_completed, EPOCHS):
            sampler.set_epoch(epoch)
            for x, y, _ in acc.epoch(loader):
                with acc.microstep((model(x) - y).square().mean()) as step:
                    pass
                if save and step.boundary and acc.global_step == 2:
                    if rank == 0:
                        torch.save(model.module.state_dict(), f"{path}.model")
                        torch.save(optimizer.state_dict(), f"{path}.optimizer")
                        torch.save(acc.state_dict(), f"{path}.acc")
                    dist.barrier()
    except gradaccum.GradaccumError as refused:
        return str(refused)
    finally:
        acc.close()
    return acc.global_step, [param.detach().clone() for param in model.module.parameters()]
