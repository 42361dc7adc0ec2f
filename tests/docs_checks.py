"""Checks that docs pages run after their visible code, in the page's own namespace.

A page calls one of these from a short hidden block, passing ``globals()``: Sybil runs the
page's blocks in one namespace (tests/test_docs.py), so each check runs the functions the
reader copies, as written on the page, and asserts what the page says of them. They live
here rather than in the page so that the page's source stays short.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _one_rank_group(store: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)


def _end_group() -> None:
    gc.collect()  # the models hold the group in reference cycles
    dist.destroy_process_group()


def sharded_resume(page: dict[str, Any]) -> None:
    """checkpoint.md, "Sharded models": `save_sharded` and `load_sharded`, under
    `fully_shard` with a `DistributedSampler` on a one-rank gloo group: stopped at step 12
    and resumed from step 10, the run ends bit for bit as the uninterrupted one."""
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    gradaccum, seed = page["gradaccum"], page["SEED"]
    save_sharded, load_sharded = page["save_sharded"], page["load_sharded"]

    def sharded_run(directory: str, crash_at: int | None = None) -> list[torch.Tensor] | None:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.1), nn.GELU(), nn.Linear(64, 1))
        fully_shard(model[0])
        fully_shard(model)
        data = TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
        sampler = DistributedSampler(data, seed=seed)
        loader = DataLoader(data, batch_size=8, sampler=sampler, generator=torch.Generator())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=16)
        acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=4, max_grad_norm=1.0)
        if Path(directory).exists():
            load_sharded(directory, model, optimizer, scheduler, acc)
            assert (acc.global_step, acc.position) == (10, 8)
        for epoch in range(acc.epochs_completed, 2):
            sampler.set_epoch(epoch)
            loader.generator.manual_seed(seed + epoch)
            for x, y in acc.epoch(loader):
                loss = nn.functional.mse_loss(model(x), y)
                with acc.microstep(loss) as step:
                    pass
                if step.boundary and acc.global_step == 10:
                    save_sharded(directory, model, optimizer, scheduler, acc)
                if step.boundary and acc.global_step == crash_at:
                    return None
        return [p.full_tensor() for p in model.parameters()]

    _one_rank_group("store")
    try:
        sharded_run("dcp", crash_at=12)
        resumed = sharded_run("dcp")
        whole = sharded_run("dcp-whole")
        assert resumed is not None
        assert whole is not None
        assert all(torch.equal(p, q) for p, q in zip(resumed, whole, strict=True))
    finally:
        _end_group()


def elastic_resume(page: dict[str, Any]) -> None:
    """checkpoint.md, "Resume on another number of GPUs": `elastic_run` stopped at step 5
    saves the world size, position and global position; resumed, it ends bit for bit as
    the uninterrupted run (one rank here; tests/test_elastic_distributed.py changes it)."""
    elastic_run = page["elastic_run"]

    def plain_model() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))

    _one_rank_group("store-elastic")
    try:
        elastic_run("elastic", plain_model, stop_at=5)
        saved = torch.load("elastic/rest.pt")["acc"]
        assert (saved["world_size"], saved["position"], saved["global_position"]) == (1, 40, 320)
        assert saved["global_order"]["samples"] == 512
        resumed = elastic_run("elastic", plain_model)
        whole = elastic_run("elastic-whole", plain_model)
        pairs = zip(resumed.parameters(), whole.parameters(), strict=True)
        assert all(torch.equal(p, q) for p, q in pairs)
    finally:
        _end_group()


def distributed_setup(page: dict[str, Any]) -> None:
    """distributed.md, "Only the wrapping line differs": the names its wrapping block
    uses, on a one-rank gloo group (the page's last hidden block destroys it)."""
    import tempfile
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.nn.parallel import DistributedDataParallel

    import gradaccum

    warnings.filterwarnings("ignore", "FSDP is switching to use `NO_SHARD`")  # one rank here
    store = dist.FileStore(tempfile.mkstemp()[1], 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    def make_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))

    def build(model: nn.Module) -> gradaccum.Accumulator:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return gradaccum.Accumulator(model, optimizer, steps=4)

    page.update(
        torch=torch,
        dist=dist,
        nn=nn,
        gradaccum=gradaccum,
        init_device_mesh=init_device_mesh,
        FullyShardedDataParallel=FullyShardedDataParallel,
        fully_shard=fully_shard,
        ColwiseParallel=ColwiseParallel,
        RowwiseParallel=RowwiseParallel,
        parallelize_module=parallelize_module,
        DistributedDataParallel=DistributedDataParallel,
        make_model=make_model,
        build=build,
        device=torch.device("cpu"),
        world=1,
        nodes=1,
        per_node=1,
        dp=1,
        tp=1,
    )


def semantics_setup(page: dict[str, Any]) -> None:
    """semantics.md, "The loop": a model, SGD, a StepLR, a loader of 10 microbatches, and
    `log`, which records what the loop logs in `logged`."""
    import gradaccum

    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logged: list[tuple[Any, ...]] = []
    page.update(
        torch=torch,
        nn=nn,
        gradaccum=gradaccum,
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=2),
        loader=torch.utils.data.DataLoader(torch.randn(40, 8), batch_size=4),
        epochs=2,
        logged=logged,
        log=lambda *values: logged.append(values),
    )


class MyWrapper(nn.Module):
    """semantics.md, "Other wrappers": a wrapper gradaccum does not know, whose forward
    records the sync flag the strategy armed."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module, self.syncing, self.seen = module, True, []

    def set_syncing(self, sync: bool) -> None:
        self.syncing = sync

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.syncing)
        return self.module(x)


def registered_strategy(page: dict[str, Any]) -> None:
    """semantics.md, "Other wrappers": the page's `MyStrategy`, registered for `MyWrapper`,
    arms the wrapper before each forward (off, then on at the boundary) and restores it."""
    gradaccum = page["gradaccum"]
    wrapped = MyWrapper(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    with gradaccum.Accumulator(wrapped, optimizer, steps=2) as acc:
        for batch in acc.epoch(page["loader"]):
            with acc.microstep(wrapped(batch).square().mean()):
                pass
    assert wrapped.seen == [False, True] * 5
    assert wrapped.syncing


def migration_setup(page: dict[str, Any]) -> None:
    """migration.md: a model, SGD, a `0.9**k` LambdaLR, 10 microbatches, and 10 token
    microbatches of rows of 6 token slots, 1 to 6 of them valid."""
    import gradaccum

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    page.update(
        torch=torch,
        nn=nn,
        gradaccum=gradaccum,
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.9**k),
        loader=[(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(10)],
        token_loader=[
            (torch.randn(2, 6, 4), torch.randn(2, 6), torch.arange(6) < torch.randint(1, 7, (2, 1)))
            for _ in range(10)
        ],
    )


def token_setup(page: dict[str, Any]) -> None:
    """variable-length.md, "Passing num_items": a small token model, AdamW, and 4
    microbatches of 2 sequences of other lengths, their targets padded with -100."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))

    def padded(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        targets = torch.full((len(lengths), max(lengths)), -100)
        for row, n in enumerate(lengths):
            targets[row, :n] = torch.randint(16, (n,))
        return targets.clamp(min=0), targets

    page.update(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        loader=[padded([3, 9]), padded([12, 2]), padded([5, 5]), padded([16, 1])],
    )


def accelerate_setup(page: dict[str, Any]) -> None:
    """migration.md, "Hugging Face Accelerate": a DataLoader for Accelerate to prepare,
    keeping the page's plain loader and scheduler for the sections after it."""
    from torch.utils.data import DataLoader, TensorDataset

    page["plain_loader"], page["plain_scheduler"] = page["loader"], page["scheduler"]
    page["loader"] = DataLoader(TensorDataset(torch.randn(40, 4), torch.randn(40, 1)), batch_size=4)


def accelerate_check(page: dict[str, Any]) -> None:
    """migration.md, "Hugging Face Accelerate": the loop took 2 optimizer steps, its
    horizon; gradaccum stepped the torch objects inside the prepared ones, the scheduler
    once per window, not per process. Then Accelerate's state is reset and the page's
    plain objects are put back for the sections after it."""
    from accelerate.state import AcceleratorState, GradientState

    acc, scheduler, optimizer, model = (page[k] for k in ("acc", "scheduler", "optimizer", "model"))
    assert acc.global_step == 2 == page["horizon"]
    assert acc.schedulers[0] is scheduler.scheduler
    assert scheduler.scheduler.last_epoch == 2  # once per window, not per process
    assert acc.optimizers[0] is optimizer.optimizer
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    page["model"] = model.module if hasattr(model, "module") else model
    page["optimizer"] = optimizer.optimizer
    page["loader"], page["scheduler"] = page["plain_loader"], page["plain_scheduler"]
