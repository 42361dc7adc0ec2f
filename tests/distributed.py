"""Real multi-process runs on gloo: a launcher that collects every rank's outcome, and
the scenarios the ranks run (importable by the children, hence a module of its own)."""

from __future__ import annotations

import io
import multiprocessing
import os
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradaccum
from gradaccum.verify import OpCounter
from tests.helpers import Batch, make_batches, make_model, mean_loss, sum_loss

PROCESS_GROUP_TIMEOUT = timedelta(seconds=15)
DEADLINE = 120.0  # seconds for a whole launch; a hang fails the test, it never stalls CI


@dataclass
class Outcome:
    """What one rank returned, or the traceback it died with."""

    rank: int
    value: Any = None
    error: str | None = None
    seconds: float = 0.0


def launch(
    scenario: Callable[..., Any], world: int, tmp_path: Path, *args: Any, **kwargs: Any
) -> list[Outcome]:
    """Run ``scenario(rank, world, *args, **kwargs)`` on ``world`` gloo ranks; one Outcome per rank.

    Ranks are forked from a server that has imported torch once. A rank that has not
    answered by the deadline is killed and reported as such, with every other rank's
    traceback, so a hang is a failure with evidence, not a stalled run.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "tests.distributed"])
    answers = context.SimpleQueue()
    store = str(tmp_path / f"store-{time.monotonic_ns()}")
    processes = [
        context.Process(
            target=_rank_main, args=(scenario, rank, world, store, args, kwargs, answers)
        )
        for rank in range(world)
    ]
    started = time.monotonic()
    for process in processes:
        process.start()
    outcomes: dict[int, Outcome] = {}
    while len(outcomes) < world and time.monotonic() - started < DEADLINE:
        if not answers.empty():
            outcome = answers.get()
            outcomes[outcome.rank] = outcome
        elif all(not p.is_alive() for p in processes) and answers.empty():
            break
        else:
            time.sleep(0.02)
    for process in processes:
        process.join(timeout=max(0.1, DEADLINE - (time.monotonic() - started)))
        if process.is_alive():
            process.kill()
            process.join()
    for rank in range(world):
        if rank not in outcomes:
            code = processes[rank].exitcode
            outcomes[rank] = Outcome(rank, error=f"rank {rank} gave no answer (exit code {code})")
    return [outcomes[rank] for rank in range(world)]


def run(
    scenario: Callable[..., Any], world: int, tmp_path: Path, *args: Any, **kwargs: Any
) -> list[Any]:
    """`launch`, and fail with every rank's traceback unless all ranks succeeded."""
    outcomes = launch(scenario, world, tmp_path, *args, **kwargs)
    errors = [f"--- rank {o.rank} ---\n{o.error}" for o in outcomes if o.error is not None]
    if errors:
        raise AssertionError("\n".join(errors))
    return [torch.load(io.BytesIO(o.value), weights_only=False) for o in outcomes]  # our own ranks


def _rank_main(
    scenario: Callable[..., Any],
    rank: int,
    world: int,
    store_path: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    answers: Any,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    started = time.monotonic()
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT
        )
        value = scenario(rank, world, *args, **kwargs)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        answers.put(Outcome(rank, value=buffer.getvalue(), seconds=time.monotonic() - started))
    except BaseException:
        answers.put(Outcome(rank, error=traceback.format_exc(), seconds=time.monotonic() - started))
        os._exit(1)  # leave at once: a broken group may hang in teardown
    dist.destroy_process_group()


# What the ranks run ------------------------------------------------------------------

UNITS = 2  # fully_shard units of make_model(): its two Linear layers


def wrap(kind: str, model: nn.Module) -> nn.Module:
    """``model`` wrapped as ``kind``; compiled variants use the aot_eager backend (no C++)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if kind == "ddp":
        return DistributedDataParallel(model)
    if kind == "ddp_unused":
        return DistributedDataParallel(model, find_unused_parameters=True)
    if kind == "compile_ddp":
        return torch.compile(DistributedDataParallel(model), backend="aot_eager")  # type: ignore[return-value]
    if kind == "ddp_compile":
        return DistributedDataParallel(torch.compile(model, backend="aot_eager"))
    if kind == "fsdp1":
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    if kind in ("fully_shard", "hsdp"):
        world = dist.get_world_size()
        if kind == "fully_shard":
            mesh = init_device_mesh("cpu", (world,))
        else:
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    raise ValueError(kind)


def full_params(model: nn.Module, kind: str) -> list[torch.Tensor]:
    """Every parameter, whole and in the original module's order, on every rank."""
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]
    return [
        p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach().clone()
        for p in model.parameters()
    ]


def rank_batches(rank: int, sizes: list[int]) -> list[Batch]:
    """Rank ``rank``'s microbatches: different data on every rank."""
    return make_batches(sizes, seed=100 + rank)


@dataclass
class Training:
    """What one rank saw while training one epoch."""

    params: list[torch.Tensor]
    global_step: int
    collectives: dict[str, int]
    host_syncs: int
    grad_norms: list[torch.Tensor] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def train(
    rank: int,
    world: int,
    kind: str,
    sizes: list[list[int]],
    *,
    steps: int = 4,
    sync: gradaccum.SyncPolicy = "auto",
    items: bool = False,
    drop_last: bool = True,
    max_grad_norm: float | None = None,
) -> Training:
    """One epoch of the design-card loop on ``sizes[rank]``; collectives counted."""
    model = wrap(kind, make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(
        model, optimizer, steps=steps, sync=sync, drop_last=drop_last, max_grad_norm=max_grad_norm
    )
    counter = OpCounter()
    norms = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gradaccum.GradaccumWarning)
        epoch = acc.epoch(rank_batches(rank, sizes[rank]))
    with counter:
        for batch in epoch:
            if items:
                microstep = acc.microstep(sum_loss(model, batch), num_items=len(batch[0]))
            else:
                microstep = acc.microstep(mean_loss(model, batch))
            with microstep as step:
                if step.boundary and step.grad_norm is not None:
                    norms.append(step.grad_norm.clone())
    acc.close()
    return Training(
        params=full_params(model, kind),
        global_step=acc.global_step,
        collectives=dict(counter.collectives),
        host_syncs=counter.host_syncs,
        grad_norms=norms,
        warnings=[str(w.message) for w in caught],
    )


def fail_mid_window(rank: int, world: int) -> None:
    """Rank 1 raises in its second microstep; the others reach the boundary all-reduce."""
    model = wrap("ddp", make_model())
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=4)
    for index, batch in enumerate(acc.epoch(rank_batches(rank, [2] * 8))):
        if rank == 1 and index == 1:
            raise RuntimeError("rank 1 fails on purpose")
        with acc.microstep(mean_loss(model, batch)):
            pass


def restore_flags(rank: int, world: int, kind: str) -> list[Any]:
    """The module's sync flags before, while deferring, and after ``close()``."""

    def flags(model: Any) -> Any:
        if kind == "ddp":
            return model.require_backward_grad_sync
        return [
            (group.reduce_grads, group.all_reduce_grads)
            for module in model.modules()
            if hasattr(module, "_get_fsdp_state")
            for group in module._get_fsdp_state()._fsdp_param_groups
        ]

    model = wrap(kind, make_model())
    if kind != "ddp":
        model.set_requires_all_reduce(False)  # a state the user chose: it must come back
    seen = [flags(model)]
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), steps=4, sync="boundary"
    )
    batches = rank_batches(rank, [2] * 4)
    for batch in acc.epoch(batches):
        with acc.microstep(mean_loss(model, batch)):
            pass
        if not acc.sync_gradients:
            seen.append(flags(model))
        break
    acc.close()
    seen.append(flags(model))
    with gradaccum.no_sync(model):
        seen.append(flags(model))
    seen.append(flags(model))
    return seen
