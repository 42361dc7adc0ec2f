"""Communication saved by deferring gradient sync: DDP and ``fully_shard`` on 2 gloo ranks.

Two CPU ranks (`gradaccum.testing.run_ranks`: gloo, one thread each) train an MLP of 6
``Linear(2048, 2048)`` with ReLU (25.2 M float32 parameters, a 96 MiB gradient), MSE loss,
SGD and ``Accumulator(..., steps=8)`` on microbatches of one row, so that communication
dominates. Each rank has its own data. A *window* is the 8 microsteps of one optimizer step.

* DDP: ``sync="auto"`` (all-reduce on the window's last microstep) against ``"every"``.
* ``fully_shard`` (each Linear, then the root): ``sync="boundary"`` (the reduce-scatter waits
  for the last microstep, each rank holding unsharded gradients until then) against
  ``"every"``. Both all-gather the parameters on every microstep, so time gains less.

*ms/window*: from a barrier to the optimizer step, the slower rank's, median over ``--rounds``
windows per policy (half as many for ``fully_shard``) after a warm-up window; the policies
alternate window by window, which goes first alternating between rounds. The time ratio is
the median of the per-round ratios; DDP's target is every/auto >= 2.0.
*Calls and MiB*: one more, untimed window per policy under a dispatch mode counting the
``c10d`` ops and the bytes of their input tensors (what a rank hands to the collective, not
what crosses the wire). Expected ratio every/deferred: 8.0.
*Memory* (``fully_shard``; each policy in fresh processes that train two windows; the larger
rank): *grads held*, the gradient bytes alive after a non-boundary microstep (sharded
``.grad`` plus FSDP2's unsharded gradients; boundary/every should be 2.0, the world size);
*peak RSS*, ``ru_maxrss``, from the fork server's (torch imported) up, with glibc told to
mmap every block of 1 MiB or more so that RSS follows the live tensors, not its free lists.

*Against the hand loop* (``fully_shard``, an MLP of 4 ``Linear(2048, 2048)``, 16.8 M
parameters, steps=8): gradaccum's design-card loop against the hand-written loop that does
the same, on twin models with the same weights and data, one open accumulator per policy:
``"auto"`` against a loop that never toggles (forward, ``(loss / 8).backward()``, and at the
window's end ``optimizer.step()`` and ``zero_grad(set_to_none=True)``), ``"boundary"`` against
one that calls ``set_requires_gradient_sync(last)`` before each forward. The four loops take
turns window by window (the order reversed every other round) for ``--hand-windows`` windows
each after a warm-up window; each window's time is the slower rank's; printed: each policy's
gradaccum/hand ratio per window and their median. Target: <= 1.05. The largest difference
between the twins' parameters at the end should be 0.0: both do the same arithmetic.

The script only reports; a failing rank raises with every rank's traceback.
``--json PATH`` also writes the policies' rows (the columns printed) to ``PATH``, for
``benchmarks/plot_comm.py``.
Usage: ``python benchmarks/comm.py [--rounds 8] [--hand-windows 8] [--only hand] [--json PATH]``
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import itertools
import json
import resource
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from gradaccum import Accumulator, SyncPolicy
from gradaccum.testing import CollectiveCounter, run_ranks
from gradaccum.verify import wrapper

WORLD, STEPS, WIDTH, DEPTH = 2, 8, 2048, 6
TARGET = 2.0
HAND_DEPTH, HAND_TARGET = 4, 1.05  # the comparison against the hand loop
MIB = 1 << 20
INPUTS = frozenset({"tensors", "input", "inputs", "input_tensor", "input_tensors"})

Batch = tuple[torch.Tensor, torch.Tensor]
Result = dict[str, Any]


class ByteCounter(CollectiveCounter):  # type: ignore[misc]
    """`CollectiveCounter` that also adds up, per ``c10d`` op, the bytes of its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.input_bytes: Counter[str] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Sequence[type], args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        if func.namespace == "c10d":
            names = [argument.name for argument in func._schema.arguments]
            inputs = [value for name, value in zip(names, args, strict=False) if name in INPUTS]
            self.input_bytes[func.name()] += _nbytes(inputs)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _nbytes(value: object) -> int:
    """The bytes of a tensor (a DTensor's local shard), or of nested lists of them."""
    if isinstance(value, (list, tuple)):
        return sum(map(_nbytes, value))
    if isinstance(value, DTensor):
        value = value.to_local()
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _model(kind: str, depth: int = DEPTH) -> nn.Module:
    """The MLP, the same on every rank, in DDP or sharded layer by layer."""
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(depth)]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())][:-1])
    return wrapper("DDP" if kind == "ddp" else "fully_shard", torch.device("cpu"))(model)


def _held_grad_bytes(model: nn.Module) -> int:
    """Gradient bytes alive: the sharded ``.grad`` plus FSDP2's unsharded gradients."""
    total = _nbytes([param.grad for param in model.parameters()])
    for module in model.modules():
        if isinstance(module, FSDPModule):  # FSDP2's private state: exact, but may change
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
            for param in (p for group in groups if group for p in group.fsdp_params):
                total += _nbytes(param._unsharded_param.grad)
                total += _nbytes(param.unsharded_accumulated_grad)
    return total


def _window(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[Batch],
    sync: SyncPolicy,
    counter: ByteCounter | None = None,
) -> tuple[int, int]:
    """One window with a fresh accumulator, counted under ``counter`` if one is given.

    Returns the nanoseconds from a barrier to the step and, when counted, the most gradient
    bytes held after a non-boundary microstep.
    """
    held = 0
    with Accumulator(model, optimizer, steps=STEPS, sync=sync) as acc:
        epoch = iter(acc.epoch(data))
        first = next(epoch)  # the ranks agree on its length here, before the clock
        gc.collect()
        dist.barrier()
        start = time.perf_counter_ns()
        with counter if counter is not None else contextlib.nullcontext():
            for inputs, targets in itertools.chain([first], epoch):
                with acc.microstep(nn.functional.mse_loss(model(inputs), targets)) as step:
                    pass
                if counter is not None and not step.boundary:
                    held = max(held, _held_grad_bytes(model))
        return time.perf_counter_ns() - start, held


def scenario(rank: int, world: int, kind: str, policies: list[SyncPolicy], rounds: int) -> Result:
    """One rank: a warm-up and ``rounds`` timed windows per policy, then one counted each."""
    if not rounds:  # a memory run: glibc mmaps each block >= 1 MiB, so RSS follows live tensors
        ctypes.CDLL(None).mallopt(-3, MIB)  # -3: M_MMAP_THRESHOLD
    model = _model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = _data(rank)
    gc.collect()
    gc.freeze()
    times: dict[str, list[int]] = {policy: [] for policy in policies}
    for index in range(1 + rounds):
        for policy in policies[:: -1 if index % 2 else 1]:
            elapsed, _ = _window(model, optimizer, data, policy)
            if index:
                times[policy].append(elapsed)
    counted: Result = {}
    for policy in policies:
        counter = ByteCounter()
        _, held = _window(model, optimizer, data, policy, counter)
        counted[policy] = {"calls": counter.ops, "bytes": counter.input_bytes, "held": held}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"times": times, "counted": counted, "peak": peak}


def _data(rank: int) -> list[Batch]:
    """Rank ``rank``'s window: ``STEPS`` microbatches of one row, its own data."""
    generator = torch.Generator().manual_seed(1000 + rank)
    return [
        (torch.randn(1, WIDTH, generator=generator), torch.randn(1, WIDTH, generator=generator))
        for _ in range(STEPS)
    ]


def _hand_window(
    model: Any, optimizer: torch.optim.Optimizer, data: list[Batch], toggle: bool
) -> int:
    """One window of the hand-written loop; nanoseconds from a barrier to the step."""
    gc.collect()
    dist.barrier()
    start = time.perf_counter_ns()
    for index, (inputs, targets) in enumerate(data):
        if toggle:  # what "boundary" does: reduce-scatter on the window's last microstep only
            model.set_requires_gradient_sync(index == len(data) - 1)
        (nn.functional.mse_loss(model(inputs), targets) / len(data)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter_ns() - start


def _acc_window(model: nn.Module, acc: Accumulator, data: list[Batch]) -> int:
    """One window (an epoch of one window) of the design-card loop; nanoseconds from a
    barrier to the step. The epoch's length agreement, once per epoch, is before the clock."""
    epoch = acc.epoch(data)
    first = next(epoch)
    gc.collect()
    dist.barrier()
    start = time.perf_counter_ns()
    for inputs, targets in itertools.chain([first], epoch):
        with acc.microstep(nn.functional.mse_loss(model(inputs), targets)):
            pass
    return time.perf_counter_ns() - start


def against_hand(rank: int, world: int, windows: int) -> Result:
    """One rank: per policy, a gradaccum twin and a hand twin take turns window by window."""
    data = _data(rank)
    loops: dict[str, Any] = {}
    twins = []
    for policy in ("auto", "boundary"):
        ours, hand = _model("fully_shard", HAND_DEPTH), _model("fully_shard", HAND_DEPTH)
        acc = Accumulator(
            ours, torch.optim.SGD(ours.parameters(), lr=1e-4), steps=STEPS, sync=policy
        )
        optimizer = torch.optim.SGD(hand.parameters(), lr=1e-4)
        loops[f"gradaccum {policy}"] = functools.partial(_acc_window, ours, acc, data)
        loops[f"hand {policy}"] = functools.partial(
            _hand_window, hand, optimizer, data, policy == "boundary"
        )
        twins.append((ours, hand, acc))
    gc.collect()
    gc.freeze()
    times: dict[str, list[int]] = {name: [] for name in loops}
    for index in range(1 + windows):
        for name in list(loops)[:: -1 if index % 2 else 1]:
            elapsed = loops[name]()
            if index:
                times[name].append(elapsed)
    diff = max(
        (p.to_local() - q.to_local()).abs().max().item()
        for ours, hand, _ in twins
        for p, q in zip(ours.parameters(), hand.parameters(), strict=True)
    )
    for _, _, acc in twins:
        acc.close()
    return {"times": times, "diff": diff}


def _run(kind: str, policies: list[SyncPolicy], rounds: int) -> list[Result]:
    """`scenario` on `WORLD` fresh ranks: what each returned."""
    return run_ranks(scenario, WORLD, (kind, policies, rounds), timeout=120.0)


def _ms(ranks: list[Result], policy: str) -> list[float]:
    """Per round, the slower rank's window time for ``policy``, in milliseconds."""
    return [max(times) / 1e6 for times in zip(*(r["times"][policy] for r in ranks), strict=True)]


def _ops(counted: Result, op: str) -> tuple[int, float]:
    """Calls and input MiB of the c10d ops named like ``op``, in one counted window."""
    calls = sum(n for name, n in counted["calls"].items() if op in name)
    return calls, sum(n for name, n in counted["bytes"].items() if op in name) / MIB


def _report(
    title: str, ranks: list[Result], op: str, columns: Sequence[str], extra: Result
) -> dict[str, list[float]]:
    """Print a policy's row per line (ms, calls and MiB of ``op``, ``extra``); return them."""
    print(f"\n{title:<12}" + "".join(f"{column:>17}" for column in columns))
    rows = {}
    for policy, counted in ranks[0]["counted"].items():  # both ranks run the same collectives
        ms = statistics.median(_ms(ranks, policy))
        rows[policy] = [ms, *_ops(counted, op), *extra.get(policy, [])]
        print(f"{policy:<12}" + "".join(f"{round(value, 1):>17g}" for value in rows[policy]))
    return rows


def _ratio(ranks: list[Result], slow: str, fast: str) -> float:
    """The median over rounds of the ``slow / fast`` time ratio."""
    return statistics.median(s / f for s, f in zip(_ms(ranks, slow), _ms(ranks, fast), strict=True))


def _report_hand(ranks: list[Result], windows: int) -> None:
    """Each policy's gradaccum/hand time ratio per window, the median, and the twins' gap."""
    print(
        f"\nagainst the hand loop: fully_shard, {HAND_DEPTH} x Linear({WIDTH}, {WIDTH}), batch 1, "
        f"steps={STEPS}, {WORLD} gloo ranks; {windows} timed windows per loop, interleaved"
    )
    for policy in ("auto", "boundary"):
        ours, hand = _ms(ranks, f"gradaccum {policy}"), _ms(ranks, f"hand {policy}")
        ratios = [a / b for a, b in zip(ours, hand, strict=True)]
        ratio = statistics.median(ratios)
        print(
            f"{policy:<9} gradaccum {statistics.median(ours):7.1f} ms, hand "
            f"{statistics.median(hand):7.1f} ms; ratio per window "
            f"{' '.join(f'{r:.3f}' for r in ratios)}; median {ratio:.3f} (target <= "
            f"{HAND_TARGET}: {'met' if ratio <= HAND_TARGET else 'NOT met'})"
        )
    print(f"largest parameter difference, gradaccum vs hand: {max(r['diff'] for r in ranks)}")


def main() -> None:
    """Launch the ranks (four launches of two, and one for the hand loops), then print
    each section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=8, help="timed DDP windows per policy")
    parser.add_argument(
        "--hand-windows", type=int, default=8, help="timed windows per loop against the hand loop"
    )
    parser.add_argument(
        "--only", choices=["policies", "hand"], help="run only that part (default: both)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the policies' rows to PATH")
    args = parser.parse_args()
    if args.only != "hand":
        tables = _policies(max(2, args.rounds))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as file:
                json.dump(tables, file, indent=1)
    if args.only != "policies":
        windows = max(1, args.hand_windows)
        hand = run_ranks(against_hand, WORLD, (windows,), timeout=120.0 + 10.0 * windows)
        _report_hand(hand, windows)


def _policies(rounds: int) -> dict[str, Result]:
    """gradaccum's policies against each other: DDP, fully_shard and memory. Returns each
    wrapping's columns and its rows, one per policy."""
    ddp = _run("ddp", ["auto", "every"], rounds)
    fsdp = _run("fully_shard", ["boundary", "every"], rounds // 2)
    fresh = {policy: _run("fully_shard", [policy], 0) for policy in ("boundary", "every")}
    print(
        f"gradaccum comm: {DEPTH} x Linear({WIDTH}, {WIDTH}) MLP, batch 1, steps={STEPS}, "
        f"{WORLD} gloo ranks; timed windows per policy: {rounds} DDP, {rounds // 2} fully_shard\n"
        "ms: the slower rank's, median; calls and MiB: per window; memory: the larger rank"
    )
    ddp_columns = ["ms/window", "all-reduces", "MiB all-reduced"]
    rows = _report("DDP", ddp, "allreduce", ddp_columns, {})
    tables = {"DDP": {"columns": ddp_columns, "rows": rows}}
    ratio = _ratio(ddp, "every", "auto")
    print(
        f"every/auto: time {ratio:.2f} (target >= {TARGET}: "
        f"{'met' if ratio >= TARGET else 'NOT met'}), MiB {rows['every'][2] / rows['auto'][2]:.2f}"
    )
    memory = {
        policy: [
            max(rank["counted"][policy]["held"] for rank in ranks) / MIB,
            max(rank["peak"] for rank in ranks) / MIB,
        ]
        for policy, ranks in fresh.items()
    }
    columns = ["ms/window", "reduce-scatters", "MiB scattered", "grads held MiB", "peak RSS MiB"]
    rows = _report("fully_shard", fsdp, "reduce_scatter", columns, memory)
    tables["fully_shard"] = {"columns": columns, "rows": rows}
    boundary, every = rows["boundary"], rows["every"]
    print(
        f"every/boundary: time {_ratio(fsdp, 'every', 'boundary'):.2f}, MiB "
        f"{every[2] / boundary[2]:.2f}; boundary/every: grads held {boundary[3] / every[3]:.2f}, "
        f"peak RSS {boundary[4] / every[4]:.2f}"
    )
    return tables


if __name__ == "__main__":
    main()
