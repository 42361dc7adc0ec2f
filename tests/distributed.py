"""What the gloo ranks of the distributed tests run (a module the ranks can import)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import gradaccum
from gradaccum.sync import full_tensor
from gradaccum.verify import OpCounter, launch, results, wrapper
from tests.helpers import Batch, make_batches, make_model, mean_loss, sum_loss

PROCESS_GROUP_TIMEOUT = 30.0  # seconds: a rank stuck in a collective fails, not hangs


def run(scenario: Callable[..., Any], world: int, *args: Any, **kwargs: Any) -> list[Any]:
    """``scenario(rank, world, *args, **kwargs)`` on real gloo ranks; every rank's result,
    or an error carrying every rank's traceback."""
    return results(launch(scenario, world, args, kwargs, timeout=PROCESS_GROUP_TIMEOUT))


UNITS = 2  # fully_shard units of make_model(): its two Linear layers


class PartlyUsed(nn.Module):
    """``body``, and a layer the forward never uses (what find_unused_parameters is for)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.unused = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


def wrap(kind: str, model: nn.Module) -> nn.Module:
    """``model`` wrapped as ``kind``; the compiled ones use the default backend, inductor."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if kind == "ddp":
        return DistributedDataParallel(model)
    if kind == "ddp_unused":
        return DistributedDataParallel(PartlyUsed(model), find_unused_parameters=True)
    if kind == "compile_ddp":
        return torch.compile(DistributedDataParallel(model))  # type: ignore[return-value]
    if kind == "ddp_compile":
        return DistributedDataParallel(torch.compile(model))
    if kind == "fsdp1":
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    if kind in ("fully_shard", "hsdp"):
        return wrapper("fully_shard" if kind == "fully_shard" else "HSDP", torch.device("cpu"))(
            model
        )
    raise ValueError(kind)


def full_params(model: nn.Module, kind: str) -> list[torch.Tensor]:
    """Every parameter, whole and in the original module's order, on every rank."""
    if kind == "fsdp1":
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
) -> Training:
    """One epoch of the design-card loop on ``sizes[rank]``; collectives counted."""
    model = wrap(kind, make_model(dtype=dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(
        model, optimizer, steps=steps, sync=sync, drop_last=drop_last, max_grad_norm=max_grad_norm
    )
    counter = OpCounter()
    norms = []
    window: list[tuple[torch.Tensor, int]] = []  # this rank's losses and item counts
    losses = []  # (step.loss, this rank's own window loss), compared after counting
    batches = rank_batches(rank, sizes[rank], dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gradaccum.GradaccumWarning)
        epoch = acc.epoch(iter(batches) if unsized else batches)
        with counter:
            for batch in epoch:
                loss = sum_loss(model, batch) if items else mean_loss(model, batch)
                window.append((loss.detach(), len(batch[0]) if items else 1))
                with acc.microstep(loss, num_items=window[-1][1] if items else None) as step:
                    if step.boundary:
                        mine = sum(loss for loss, _ in window) / sum(n for _, n in window)
                        losses.append((step.loss, mine))
                        window = []
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
        loss_error=max(abs(float(got - want)) for got, want in losses),
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
        acc = gradaccum.Accumulator(model, optimizer, steps=4, sync=sync)
        epoch = acc.epoch(batches)
        counter = OpCounter()
        with counter:
            for batch in epoch:
                with acc.microstep(mean_loss(model, batch)):
                    pass
    return dict(counter.collectives), full_params(model, kind)


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


def verify_rows_with_late_arming(rank: int, world: int) -> Any:
    """verify's DDP rows, with the accumulator patched to arm each microstep in its
    backward, after DDP's forward has already decided: the bug verify must catch."""
    from gradaccum import verify
    from gradaccum.accumulator import Accumulator

    enter = Accumulator._enter

    def arm_then_enter(self: Accumulator, *args: Any) -> Any:
        self._strategy.arm(self.sync_gradients or self._sync == "every")
        return enter(self, *args)

    Accumulator._arm = lambda self: None  # type: ignore[method-assign]
    Accumulator._enter = arm_then_enter  # type: ignore[method-assign]
    return verify._rank_rows(rank, world, "DDP", [4], "late arming")
