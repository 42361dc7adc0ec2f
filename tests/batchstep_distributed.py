"""What the gloo ranks of the acc.step tests run (a module the ranks can import): windows
that rank 1 alone runs out of memory in, recovered or failed on both ranks, the wrappings
where microbatch="auto" is refused, and the cost of a flag all-reduce."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradaccum
from gradaccum.testing import CollectiveCounter
from tests.distributed import full_params, rank_batches, wrap
from tests.helpers import POINTS, items_fn, make_model, mean_fn, oom_at

ROWS = 32  # per rank and window; microbatches of 8 run out of memory where injected, 4 fit


def train(
    rank: int,
    kind: str,
    microbatch: int | str,
    loss_fn: Callable[..., Any],
    *,
    loaded: int | None = None,
    windows: int = 2,
) -> dict[str, Any]:
    """``windows`` calls of acc.step on ``ROWS``-row batches (different on each rank) under
    ``kind``; with ``loaded``, an "auto" accumulator that found that microbatch already.
    Parameters, collectives, the microbatch found and each step's."""
    model = wrap(kind, make_model())
    acc = gradaccum.Accumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        microbatch=microbatch,  # type: ignore[arg-type]
    )
    if loaded is not None:
        acc.load_state_dict(dict(acc.state_dict(), microbatch=loaded))
    counter = CollectiveCounter()
    used = []
    with counter:
        for seed in range(windows):
            batch = rank_batches(rank, [ROWS] * (seed + 1))[seed]
            used.append(acc.step(batch, loss_fn).microbatch)
    acc.close()
    return {
        "params": full_params(model, kind),
        "collectives": dict(counter.ops),
        "microbatch": acc.microbatch,
        "used": used,
        "global_step": acc.global_step,
    }


def recoveries(rank: int, world: int) -> dict[str, Any]:
    """Under DDP, in mean and item mode: the run with microbatch=4 from the start, and for
    each recoverable point of a window an "auto" run (found 8) whose microbatches of 8 run
    out of memory on rank 1 alone there. Under fully_shard, the fixed microbatch=4 run."""
    runs: dict[str, Any] = {}
    for mode, fn in (("mean", mean_fn), ("items", items_fn)):
        runs[f"{mode}/fixed"] = train(rank, "ddp", 4, fn)
        for point in POINTS:
            if point == "last-backward":
                continue  # its all-reduce has started on rank 0: `unrecoverable`
            loss_fn = oom_at(point, 4, fn) if rank == 1 else fn
            runs[f"{mode}/{point}"] = train(rank, "ddp", "auto", loss_fn, loaded=8)
        runs[f"{mode}/fully_shard"] = train(rank, "fully_shard", 4, fn)
    # The first window probes 32, 16, 8 and 4 rows: rank 1 runs out of memory above 4.
    runs["probe"] = train(rank, "ddp", "auto", oom_at("first-forward", 4) if rank else mean_fn)
    return runs


class Normed(nn.Module):
    """make_model() after a BatchNorm, whose buffers DDP broadcasts in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(5, dtype=torch.float64)
        self.body = make_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.norm(x))  # type: ignore[no-any-return]


def refusals(rank: int, world: int) -> dict[str, str]:
    """microbatch="auto" built on 2 ranks where a microstep other than the last backward
    communicates: each refusal's message (none, for the plain DDP accepted beside them)."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    with warnings.catch_warnings():  # (torch 2.13 renames broadcast_buffers; both work)
        warnings.simplefilter("ignore", FutureWarning)
        unbroadcast = DistributedDataParallel(Normed(), broadcast_buffers=False)
    models: dict[str, tuple[nn.Module, str]] = {
        "fully_shard": (wrap("fully_shard", make_model()), "auto"),
        "fsdp1": (wrap("fsdp1", make_model()), "auto"),
        "ddp_buffers": (DistributedDataParallel(Normed()), "auto"),
        "ddp_every": (wrap("ddp", make_model()), "every"),
        "ddp_no_broadcast": (unbroadcast, "auto"),
    }
    messages = {}
    for name, (model, sync) in models.items():
        try:
            acc = gradaccum.Accumulator(
                model, torch.optim.SGD(model.parameters(), lr=0.1), microbatch="auto", sync=sync
            )
        except gradaccum.ConfigError as error:
            messages[name] = str(error)
        else:
            acc.close()
            messages[name] = ""
    return messages


def unrecoverable(rank: int, world: int) -> dict[str, Any]:
    """First, microbatches of one row run out of memory on rank 1: both ranks raise
    OutOfMemoryError naming it, nothing applied, and train on. Then rank 1's last backward
    runs out of memory after rank 0's all-reduce started: rank 1 raises (and exits),
    rank 0 raises RankFailedError naming it; rank 0's parameters are unchanged."""
    outcome: dict[str, Any] = {}

    def never(model: nn.Module, batch: Any) -> torch.Tensor:
        if rank == 1:
            raise torch.OutOfMemoryError("injected")
        return mean_fn(model, batch)

    model = wrap("ddp", make_model())
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), microbatch="auto"
    )
    start = full_params(model, "ddp")
    batch = rank_batches(rank, [ROWS])[0]
    try:
        acc.step(batch, never)
    except gradaccum.OutOfMemoryError as error:
        outcome["no_row"] = (str(error), error.rank, error.microbatch, error.window)
    outcome["no_row_unchanged"] = all(
        torch.equal(p, q) for p, q in zip(start, full_params(model, "ddp"), strict=True)
    )
    acc.step(batch, mean_fn)  # the ranks still line up
    outcome["then"] = acc.global_step
    after = full_params(model, "ddp")
    loss_fn = oom_at("last-backward", 4) if rank == 1 else mean_fn
    acc.load_state_dict(dict(acc.state_dict(), microbatch=8))
    try:
        acc.step(batch, loss_fn)
    except gradaccum.RankFailedError as error:
        outcome["failed"] = (str(error), error.rank, error.window)
        outcome["unchanged"] = all(
            torch.equal(p, q) for p, q in zip(after, full_params(model, "ddp"), strict=True)
        )
        outcome["global_step"] = acc.global_step
    except gradaccum.OutOfMemoryError as error:  # rank 1: leave, as a failed rank does
        raise RuntimeError(f"{error} [rank={error.rank} microbatch={error.microbatch}]") from None
    return outcome


def flag_cost(rank: int, world: int, repeats: int = 400) -> float:
    """Seconds per all-reduce of a one-element flag read on the host (what Composer runs
    before each FSDP unit's all-gather with auto microbatching), on these gloo ranks."""
    flag = torch.zeros(1, dtype=torch.uint8)
    for _ in range(20):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    started = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        flag.item()
    return (time.perf_counter() - started) / repeats
