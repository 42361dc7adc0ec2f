"""What Composer's way of surviving an out-of-memory error under FSDP would cost gradaccum.

With ``microbatch="auto"``, a rank that runs out of memory in a forward leaves the others
inside the next all-gather. Composer avoids that by all-reducing a flag, read on the host,
before every FSDP unit's all-gather; gradaccum refuses ``"auto"`` under ``fully_shard`` and
FSDP1 instead (docs/memory.md). This script measures the flag's price on 2 gloo CPU ranks
(`gradaccum.testing.run_ranks`, one thread each): a ``fully_shard`` model of ``--layers``
units of ``Linear(--width, --width)`` + ReLU (each unit and the root sharded), trained by an
``Accumulator(steps=4)`` on microbatches of ``--rows`` rows, windows timed from a barrier to
the step (the slower rank's), with and without a forward pre-hook on every unit that
all-reduces a one-element flag and reads it (``.item()``), alternating window by window.
Printed: the flag's cost alone, flags per window, and the median ratio with/without.

The script only reports. Usage: ``python benchmarks/oom_flag.py [--layers 8] [--width 512]
[--rows 16] [--windows 10]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import gradaccum
from gradaccum.testing import run_ranks

STEPS = 4


def _flag(module: nn.Module, args: Any) -> None:
    """Composer's check before a unit's all-gather: did any rank run out of memory?"""
    flag = torch.zeros(1, dtype=torch.uint8)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise RuntimeError("a rank ran out of memory")


def _window(acc: gradaccum.Accumulator, model: nn.Module, x: torch.Tensor) -> float:
    """One window of `STEPS` microsteps; this rank's seconds from a barrier to the step."""
    dist.barrier()
    started = time.perf_counter()
    for _ in range(STEPS):
        loss = model(x).square().mean()
        with acc.microstep(loss):
            pass
    return time.perf_counter() - started


def measure(rank: int, world: int, layers: int, width: int, rows: int, windows: int) -> Any:
    """This rank's flag cost and window times without and with the flags."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers))
    )
    units = list(model)
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    acc = gradaccum.Accumulator(model, optimizer, steps=STEPS)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rank))
    flag = torch.zeros(1, dtype=torch.uint8)
    for _ in range(20):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    started = time.perf_counter()
    for _ in range(400):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        flag.item()
    per_flag = (time.perf_counter() - started) / 400
    plain: list[float] = []
    flagged: list[float] = []
    _window(acc, model, x)  # warm-up
    for round_ in range(windows):
        for with_flags in (round_ % 2 == 0, round_ % 2 == 1):
            hooks = [u.register_forward_pre_hook(_flag) for u in units] if with_flags else []
            (flagged if with_flags else plain).append(_window(acc, model, x))
            for hook in hooks:
                hook.remove()
    acc.close()
    return per_flag, plain, flagged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--windows", type=int, default=10)
    args = parser.parse_args()
    results = run_ranks(measure, 2, (args.layers, args.width, args.rows, args.windows))
    per_flag = max(result[0] for result in results)
    plain = [max(times) for times in zip(*(result[1] for result in results), strict=True)]
    flagged = [max(times) for times in zip(*(result[2] for result in results), strict=True)]
    ratios = [f / p for f, p in zip(flagged, plain, strict=True)]
    flags = args.layers * STEPS
    print(f"fully_shard, {args.layers} units of Linear({args.width}, {args.width}), steps={STEPS}")
    print(f"one flag all-reduced and read: {per_flag * 1e6:.0f} us; {flags} flags per window")
    print(
        f"window: {statistics.median(plain) * 1e3:.1f} ms without, "
        f"{statistics.median(flagged) * 1e3:.1f} ms with the flags; "
        f"median ratio {statistics.median(ratios):.3f}"
    )


if __name__ == "__main__":
    main()
