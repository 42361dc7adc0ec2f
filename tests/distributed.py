"""What the gloo ranks of the distributed tests run (a module the ranks can import)."""

from __future__ import annotations

import importlib.util
import io
import itertools
import sys
import warnings
from collections.abc import Callable
from contextlib import nullcontext, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

import gradaccum
from gradaccum.sync import full_tensor
from gradaccum.testing import CollectiveCounter, run_ranks
from gradaccum.verify import wrapper
from tests.helpers import (
    Batch,
    load_checkpoint,
    make_batches,
    make_model,
    mean_loss,
    save_checkpoint,
    split_optimizers,
    sum_loss,
)

# Seconds a rank may wait in a collective before it fails instead of hanging; a rank that
# has not answered twice this long after every rank started is killed. The longest
# launch takes about 6 s on 2 idle cores: 10 times that, so load alone fails nothing.
PROCESS_GROUP_TIMEOUT = 60.0


def run(scenario: Callable[..., Any], world: int, *args: Any, **kwargs: Any) -> list[Any]:
    """``scenario(rank, world, *args, **kwargs)`` on real gloo ranks; every rank's result,
    or an error carrying every rank's traceback."""
    return run_ranks(scenario, world, args, kwargs, timeout=PROCESS_GROUP_TIMEOUT)


UNITS = 2  # fully_shard units of make_model(): its two Linear layers


class PartlyUsed(nn.Module):
    """``body``, and a layer the forward never uses (what find_unused_parameters is for)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.unused = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


class Pair(nn.Module):
    """``make_model()``'s two layers, each wrapped by ``wrap`` on its own and held side by
    side (an encoder and a head wrapped apart, under one optimizer); its parameters are
    the model's, in order."""

    def __init__(self, model: nn.Module, wrap: Any) -> None:
        super().__init__()
        self.first = wrap(model[0])
        self.second = wrap(model[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))  # type: ignore[no-any-return]


def wrap(kind: str, model: nn.Module) -> nn.Module:
    """``model`` wrapped as ``kind``; the compiled ones use the default backend, inductor.
    Trained inside a `CollectiveCounter` (`train`) they run eagerly (torch compiles no
    frame under a dispatch mode): what they test there is that the accumulator finds DDP
    through the compiled wrapper; `tests.edges_distributed.compiled_step` compiles."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if kind == "ddp":
        return DistributedDataParallel(model)
    if kind == "ddp_pair":
        return Pair(model, DistributedDataParallel)
    if kind == "ddp_unused":
        return DistributedDataParallel(PartlyUsed(model), find_unused_parameters=True)
    if kind == "compile_ddp":
        return torch.compile(DistributedDataParallel(model))  # type: ignore[return-value]
    if kind == "ddp_compile":
        return DistributedDataParallel(torch.compile(model))
    if kind == "fsdp1":
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    if kind == "fsdp1_orig":  # the original parameters, so optimizers can split them
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    if kind == "fsdp1_no_shard":  # replicated: nothing sharded, so deferring costs nothing
        from torch.distributed.fsdp import ShardingStrategy

        return FullyShardedDataParallel(
            model, device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.NO_SHARD
        )
    if kind in ("replicate", "replicate_pair"):  # torchtitan's DDP: composable, DDP inside
        from torch.distributed._composable.replicate import replicate
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        if kind == "replicate_pair":  # each layer replicated on its own
            return Pair(model, lambda layer: replicate(layer, device_mesh=mesh))
        return replicate(model, device_mesh=mesh)
    if kind == "replicate_fsdp":  # replicate() built on fully_shard's machinery
        from torch.distributed._composable.replicate_with_fsdp import replicate as replicate2
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                replicate2(layer, mesh=mesh)
        return replicate2(model, mesh=mesh)
    if kind == "fully_shard_offload":  # CPU offloading (unpinned: no accelerator here)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        policy = CPUOffloadPolicy(pin_memory=False)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, offload_policy=policy)
        return fully_shard(model, mesh=mesh, offload_policy=policy)  # type: ignore[no-any-return]
    if kind in ("fully_shard", "hsdp"):
        return wrapper("fully_shard" if kind == "fully_shard" else "HSDP", torch.device("cpu"))(
            model
        )
    raise ValueError(kind)


def fully_shard_averaging_by_its_factor(model: nn.Module) -> nn.Module:
    """``fully_shard``, each unit told to divide its gradients by the world size: FSDP's
    own average, spelled out with ``set_gradient_divide_factor`` (accepted)."""
    from torch.distributed.fsdp import FSDPModule

    sharded = wrap("fully_shard", model)
    for module in sharded.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(dist.get_world_size()))
    return sharded


def full_params(model: nn.Module, kind: str) -> list[torch.Tensor]:
    """Every parameter, whole and in the original module's order, on every rank."""
    if kind.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]
    return [full_tensor(p).detach().clone() for p in model.parameters()]


def rank_batches(rank: int, sizes: list[int], dtype: torch.dtype = torch.float64) -> list[Batch]:
    """Rank ``rank``'s microbatches: different data on every rank."""
    return make_batches(sizes, seed=100 + rank, dtype=dtype)


@dataclass
class Training:
    """What one rank saw while training one epoch."""

    params: list[torch.Tensor]
    global_step: int
    collectives: dict[str, int]
    host_syncs: int
    grad_norms: list[torch.Tensor] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    loss_error: float = 0.0  # step.loss against this rank's own window loss


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
    unsized: bool = False,
    dtype: torch.dtype = torch.float64,
    split: bool = False,
) -> Training:
    """One epoch of the design-card loop on ``sizes[rank]``; collectives counted. With
    ``split``, two optimizers and their schedulers (`tests.helpers.split_optimizers`)."""
    model = wrap(kind, make_model(dtype=dtype))
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler: Any = None
    if split:
        optimizer, scheduler = split_optimizers(model)
    acc = gradaccum.Accumulator(
        model,
        optimizer,
        scheduler,
        steps=steps,
        sync=sync,
        drop_last=drop_last,
        max_grad_norm=max_grad_norm,
    )
    counter = CollectiveCounter()
    norms = []
    window: list[tuple[torch.Tensor, int]] = []  # this rank's losses and item counts
    losses = []  # (step.loss, this rank's own window loss), compared after counting
    batches = rank_batches(rank, sizes[rank], dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gradaccum.GradaccumWarning)
        epoch = iter(acc.epoch(iter(batches) if unsized else batches))
        # A sized epoch's first next() plans it: the ranks agree on its length, one
        # all-reduce per epoch, which is not counted per window.
        first = [] if unsized else [next(epoch)]
        with counter:
            for batch in itertools.chain(first, epoch):
                loss = sum_loss(model, batch) if items else mean_loss(model, batch)
                window.append((loss.detach(), len(batch[0]) if items else 1))
                with acc.microstep(loss, num_items=window[-1][1] if items else None) as step:
                    if step.boundary:
                        mine = sum(loss for loss, _ in window) / sum(n for _, n in window)
                        losses.append((step.loss, mine))
                        window = []
                    if step.boundary and step.grad_norm is not None:
                        norms.append(step.grad_norm.clone())
    return finish(
        model,
        kind,
        acc,
        counter,
        grad_norms=norms,
        warnings=[str(w.message) for w in caught],
        loss_error=max(abs(float(got - want)) for got, want in losses),
    )


def train_split_and_single(
    rank: int, world: int, kinds: dict[str, dict[str, Any]], sizes: list[list[int]], **options: Any
) -> dict[str, tuple[Training, Training]]:
    """`train` with two optimizers and with one, for each wrapping in ``kinds`` (with its
    own options), in one launch."""
    return {
        kind: (
            train(rank, world, kind, sizes, split=True, **options, **own),
            train(rank, world, kind, sizes, **options, **own),
        )
        for kind, own in kinds.items()
    }


def train_each_policy(
    rank: int, world: int, kind: str, sizes: list[list[int]], **options: Any
) -> dict[str, Training]:
    """`train` under each sync policy in turn, in one launch: the ranks' start-up and
    process group, which dominate, are shared by the three."""
    policies: tuple[gradaccum.SyncPolicy, ...] = ("auto", "boundary", "every")
    return {sync: train(rank, world, kind, sizes, sync=sync, **options) for sync in policies}


def finish(
    model: nn.Module, kind: str, acc: gradaccum.Accumulator, counter: CollectiveCounter, **rest: Any
) -> Training:
    """Close ``acc`` and report the rank's `Training`; ``rest`` fills its other fields."""
    acc.close()
    return Training(
        params=full_params(model, kind),
        global_step=acc.global_step,
        collectives=dict(counter.ops),
        host_syncs=counter.host_syncs,
        **rest,
    )


def after_an_unclosed_accumulator(
    rank: int, world: int, kind: str, sync: gradaccum.SyncPolicy
) -> tuple[dict[str, int], list[torch.Tensor]]:
    """Two epochs, each with a new accumulator on the same model; the first is never
    closed, so it leaves the model deferring. The second epoch's collectives, and the
    parameters after both."""
    model = wrap(kind, make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = rank_batches(rank, [2] * 8)
    for _ in range(2):
        # The second takes the optimizer over from the first, with a warning.
        acc = gradaccum.Accumulator(model, optimizer, steps=4, sync=sync)
        epoch = iter(acc.epoch(batches))
        first = next(epoch)  # the length agreement, once per epoch: not counted
        counter = CollectiveCounter()
        with counter:
            for batch in itertools.chain([first], epoch):
                with acc.microstep(mean_loss(model, batch)):
                    pass
    return dict(counter.ops), full_params(model, kind)


def fail_mid_window(rank: int, world: int) -> None:
    """Rank 1 raises in its second microstep; the others reach the boundary all-reduce."""
    model = wrap("ddp", make_model())
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=4)
    for index, batch in enumerate(acc.epoch(rank_batches(rank, [2] * 8))):
        if rank == 1 and index == 1:
            raise RuntimeError("rank 1 fails on purpose")
        with acc.microstep(mean_loss(model, batch)):
            pass


def caught_and_carried_on(rank: int, world: int, kind: str) -> list[str]:
    """Rank 1 raises in its fifth microbatch's block (windows of 3), and the loop catches
    every error and goes on: what each microbatch after the fourth raised, by type and
    start."""
    model = wrap(kind, make_model())
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=3)
    seen = []
    for index, batch in enumerate(acc.epoch(rank_batches(rank, [2] * 9))):
        try:
            loss = mean_loss(model, batch)
            with acc.microstep(loss):
                if rank == 1 and index == 4:
                    raise ValueError("a bad batch")
        except Exception as error:  # (what the loop goes on after is the outcome)
            seen.append(f"{type(error).__name__}: {error}"[:100])
    acc.close()
    return seen


def skip_a_microbatch(rank: int, world: int) -> str:
    """Rank 1 leaves its fifth microbatch out (``continue`` before its block), in the second
    window of 3; the error each rank ends with."""
    model = wrap("ddp", make_model())
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=3)
    try:
        for index, batch in enumerate(acc.epoch(rank_batches(rank, [2] * 9))):
            if rank == 1 and index == 4:
                continue  # "a bad batch"
            with acc.microstep(mean_loss(model, batch)):
                pass
    except gradaccum.GradaccumError as error:
        return f"{type(error).__name__}: {error}"
    return "trained"


def restore_flags(rank: int, world: int, kind: str, dropped: bool = False) -> list[Any]:
    """The module's sync flags before, while deferring, and after ``close()`` (or, with
    ``dropped``, after the loop dropped the accumulator mid-window, never closed)."""

    def flags(model: Any) -> Any:
        if kind == "ddp":
            return model.require_backward_grad_sync
        if kind == "replicate":
            from torch.distributed._composable.replicate import replicate

            return replicate.state(model)._no_sync  # type: ignore[attr-defined]
        return [
            (group.reduce_grads, group.all_reduce_grads)
            for module in model.modules()
            if hasattr(module, "_get_fsdp_state")
            for group in module._get_fsdp_state()._fsdp_param_groups
        ]

    model = wrap(kind, make_model())
    if kind == "fully_shard":
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
    if dropped:
        del acc  # (freed at once, without the garbage collector)
    else:
        acc.close()
    seen.append(flags(model))
    with gradaccum.no_sync(model):
        seen.append(flags(model))
    seen.append(flags(model))
    return seen


class Holder(nn.Module):
    """``model`` inside a model of its own (what a DDP around a larger model holds)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)  # type: ignore[no-any-return]


class OwnGradientSync(Holder):
    """A wrapper of the user's own with a ``set_requires_gradient_sync()``, unregistered."""

    def set_requires_gradient_sync(self, sync: bool) -> None:
        self.syncs = sync


def unknown_gradient_sync(rank: int, world: int) -> str:
    """The error an Accumulator over an `OwnGradientSync` raises on several ranks."""
    model = OwnGradientSync(make_model())
    try:
        gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
    except gradaccum.ConfigError as error:
        return str(error)
    return "accepted"


def no_sync_counted(rank: int, world: int, kinds: list[str]) -> dict[str, list[dict[str, int]]]:
    """For each wrapping, the collectives of a forward and backward inside
    ``gradaccum.no_sync(model)``, then of one outside it (the first forward, which may
    build the wrapper, runs before), in one launch."""
    batch = rank_batches(rank, [2])[0]
    found = {}
    for kind in kinds:
        model = wrap(kind, make_model())
        mean_loss(model, batch).backward()
        counted = []
        for inside in (True, False):
            within = gradaccum.no_sync(model) if inside else nullcontext()
            with CollectiveCounter() as counter, within:
                mean_loss(model, batch).backward()
            counted.append(dict(counter.ops))
        found[kind] = counted
    return found


def verify_rows_with_late_arming(rank: int, world: int) -> Any:
    """verify's DDP rows, with the accumulator patched to arm each microstep in its
    backward, after DDP's forward has already decided: the bug verify must catch."""
    from gradaccum import verify
    from gradaccum.arming import Arming
    from gradaccum.block import Microstep

    enter = Microstep.__enter__

    def arm_then_enter(self: Microstep) -> Any:
        self.arming.strategy.arm(self.window.next_is_boundary or self.arming.every)
        return enter(self)

    Arming.arm = lambda self, boundary: None  # type: ignore[method-assign]
    Microstep.__enter__ = arm_then_enter  # type: ignore[method-assign]
    return verify._rank_rows(rank, world, "DDP", [4], "late arming")


# Reliability: resume, non-finite windows, faults, misuse ---------------------------------


def resume(rank: int, world: int, stop: int, include_grads: bool) -> dict[str, bool]:
    """Two DDP epochs uninterrupted, against a run stopped after ``stop`` microsteps,
    checkpointed (every rank its own state), rebuilt from scratch and resumed."""
    batches = rank_batches(rank, [2] * 13, torch.float32)

    def build() -> tuple[Any, Any, Any, gradaccum.Accumulator]:
        model = wrap("ddp", make_model(dtype=torch.float32))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=6)
        acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=4, max_grad_norm=1.0)
        return model, optimizer, scheduler, acc

    def train_on(parts: Any, epochs: int, budget: int | None = None) -> int:
        model, _, _, acc = parts
        done = 0
        for _ in range(epochs):
            for batch in acc.epoch(batches):
                with acc.microstep(mean_loss(model, batch)):
                    pass
                done += 1
                if done == budget:
                    return done
        return done

    whole = build()
    train_on(whole, 2)
    first = build()
    train_on(first, 2, stop)
    blob = save_checkpoint(first, include_grads=include_grads)
    first[3].close()
    del first
    model, optimizer, scheduler, acc = load_checkpoint(build(), blob)
    for batch in acc.epoch(batches):  # the rest of the interrupted epoch
        with acc.microstep(mean_loss(model, batch)):
            pass
    train_on((model, optimizer, scheduler, acc), 1 if stop < 12 else 0)
    a, b = whole[0], model
    return {
        "params": all(
            torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True)
        ),
        "optimizer": all(
            torch.equal(value, optimizer.state[q][key])
            for p, q in zip(a.parameters(), b.parameters(), strict=True)
            for key, value in whole[1].state[p].items()
        ),
        "lr": whole[1].param_groups[0]["lr"] == optimizer.param_groups[0]["lr"],
        "global_step": whole[3].global_step == acc.global_step == 6,
    }


def checkpoint_mid_window(rank: int, world: int, kind: str) -> list[str]:
    """``state_dict(include_grads=True)`` after 2 of 4 microsteps under ``kind``; then
    loading, into a fresh accumulator on it, a window saved by a plain module of the same
    shapes. What each raised."""
    model = wrap(kind, make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, optimizer, steps=4)
    batches = rank_batches(rank, [2] * 2)
    for batch in batches:
        with acc.microstep(mean_loss(model, batch)):
            pass
    refused = []
    try:
        acc.state_dict(include_grads=True)
    except gradaccum.UsageError as error:
        refused.append(str(error))
    acc.close()
    plain = make_model()
    local = gradaccum.Accumulator(plain, torch.optim.SGD(plain.parameters(), lr=0.1), steps=4)
    with local.microstep(mean_loss(plain, batches[0])):
        pass
    fresh = gradaccum.Accumulator(model, optimizer, steps=4)
    try:  # as if saved on these ranks, so that the window is what is refused
        fresh.load_state_dict(dict(local.state_dict(include_grads=True), world_size=world))
    except gradaccum.GradaccumError as error:
        refused.append(f"{type(error).__name__}: {error}")
    return refused


def nonfinite(rank: int, world: int, kind: str, on_nonfinite: str) -> Training:
    """Three windows of 4; rank 1 alone poisons window 2. Under DDP its loss is NaN (the
    all-reduce spreads it); under FSDP1 one element of its own flat gradient shard
    becomes NaN after the reduce-scatter, so only rank 1 holds a non-finite value."""
    model = wrap(kind, make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, optimizer, steps=4, on_nonfinite=on_nonfinite)
    skipped = []
    counter = CollectiveCounter()
    with counter:
        for index, batch in enumerate(acc.epoch(rank_batches(rank, [2] * 12))):
            loss = mean_loss(model, batch)
            poison = rank == 1 and index == 5
            if poison and kind == "ddp":
                loss = loss * torch.nan
            try:
                with acc.microstep(loss) as step:
                    if step.boundary:
                        skipped.append(step.skipped)
            except gradaccum.NonFiniteError as error:
                skipped.append(str(error))  # type: ignore[arg-type]
            if poison and kind == "fsdp1":
                with torch.no_grad():  # the flat gradient shard that rank 1 holds
                    next(model.parameters()).grad.view(-1)[0] = torch.nan
    return finish(model, kind, acc, counter, warnings=[repr(skipped), str(acc.skipped_steps)])


def fail_inside_a_block(rank: int, world: int) -> Any:
    """Rank 1's second microstep block raises; rank 0 goes on to its boundary."""
    model = wrap("ddp", make_model())
    start = [p.detach().clone() for p in model.parameters()]
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=4)
    batches = rank_batches(rank, [2] * 8)
    try:
        for index, batch in enumerate(acc.epoch(batches)):
            with acc.microstep(mean_loss(model, batch)):
                if rank == 1 and index == 1:
                    raise KeyError("rank 1 fails on purpose")
    except gradaccum.RankFailedError as error:
        unchanged = all(torch.equal(p, q) for p, q in zip(start, model.parameters(), strict=True))
        return str(error), unchanged, acc.global_step
    except KeyError:
        try:  # the failed rank cannot carry on: its windows no longer line up
            acc.microstep(mean_loss(model, batches[2]))
        except gradaccum.UsageError as refused:
            raise RuntimeError(f"refused: {refused}") from None
    return "finished"


def forwards_ahead(rank: int, world: int) -> list[str]:
    """Both microbatches' forwards first, then both microstep blocks (steps=2): the
    boundary's forward ran while DDP was set to defer."""
    model = wrap("ddp", make_model())
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
    first, second = rank_batches(rank, [2] * 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gradaccum.GradaccumWarning)
        losses = [mean_loss(model, first), mean_loss(model, second)]
        for loss in losses:
            with acc.microstep(loss):
                pass
        for batch in acc.epoch([first, second]):  # the right order: no warning
            with acc.microstep(mean_loss(model, batch)):
                pass
    acc.close()
    return [str(w.message) for w in caught]


def warm_up(rank: int, world: int) -> tuple[list[dict[str, int]], list[torch.Tensor], int]:
    """``steps`` from a schedule, epoch by epoch (1, then 4); collectives per epoch."""
    model = wrap("ddp", make_model())
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    schedule = {0: 1, 1: 4}
    counts = []
    for epoch in range(2):
        acc.steps = gradaccum.steps_at_epoch(schedule, epoch)
        counter = CollectiveCounter()
        with counter:
            for batch in acc.epoch(rank_batches(rank, [2] * 9)):
                with acc.microstep(mean_loss(model, batch)):
                    pass
        counts.append(dict(counter.ops))
    acc.close()
    return counts, full_params(model, "ddp"), acc.global_step


def global_losses(
    rank: int, world: int, sizes: list[list[int]], items: bool, asked: bool, reader: int | None
) -> dict[str, Any]:
    """One DDP epoch of the design-card loop (steps=4), ``global_loss=asked``; only rank
    ``reader`` reads ``step.global_loss`` (every rank when None). What it read, and the
    collectives and host syncs of the epoch's windows (the reads' ``.item()`` after them)."""
    model = wrap("ddp", make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = CollectiveCounter()
    read = []
    with gradaccum.Accumulator(model, optimizer, steps=4, global_loss=asked) as acc:
        epoch = iter(acc.epoch(rank_batches(rank, sizes[rank])))
        first = next(epoch)  # the length agreement, once per epoch: not counted
        with counter:
            for batch in itertools.chain([first], epoch):
                loss = sum_loss(model, batch) if items else mean_loss(model, batch)
                with acc.microstep(loss, num_items=len(batch[0]) if items else None) as step:
                    if step.boundary and reader in (None, rank):
                        read.append(step.global_loss)
    return {
        "read": [None if value is None else value.item() for value in read],
        "collectives": dict(counter.ops),
        "host_syncs": counter.host_syncs,
    }


def example_main(rank: int, world: int, script: str, *argv: str) -> str:
    """``examples/<script>``'s ``main()`` with ``argv`` on this rank, in the launcher's group
    (its own ``init_process_group`` and ``destroy_process_group`` left out: the group is
    made already, from the variables torchrun sets); what it printed. One torchrun launch
    runs examples/distributed.py whole (tests/test_distributed.py): this runs the examples'
    other launches without a process start per rank."""
    path = Path(__file__).resolve().parents[1] / "examples" / script
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    printed = io.StringIO()
    with (
        mock.patch.object(sys, "argv", [str(path), *argv]),
        mock.patch.object(dist, "init_process_group"),
        mock.patch.object(dist, "destroy_process_group"),
        redirect_stdout(printed),
    ):
        example.main()
    return printed.getvalue()
