"""``python -m gradaccum verify``: the equivalence, cadence and communication table here.

Each row trains a small float64 model over 13 microbatches per rank, with different data
on every rank, through `gradaccum.testing.check_accumulation`: the parameters after every
window against an independent reference (an unwrapped float64 copy of the model trained
on one big batch of every rank's window), optimizer and scheduler steps against
`total_steps`, and the collectives (``c10d`` ops seen by the dispatcher) per window for
each sync policy. Around each microstep it also counts reductions that ran on deferred
microsteps although the policy defers them, and host synchronizations off the boundary.
The exit status is 1 if a row fails.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, get_args

import torch
import torch.distributed as dist
from torch import nn

from gradaccum.accumulator import Accumulator
from gradaccum.schedule import total_steps
from gradaccum.sync import SyncPolicy
from gradaccum.testing import (
    AccumulationReport,
    CollectiveCounter,
    Counts,
    check_accumulation,
    run_ranks,
)

__all__ = [
    "Row",
    "add_options",
    "main",
    "report",
    "run_command",
    "run_distributed",
    "run_single_process",
    "wrapper",
]

MICROBATCHES = 13
TOLERANCE = 1e-10
WIDTH = 100  # columns the default table fits in; --wide puts each row on one line
# What each policy must not run on a deferred microstep, under every wrapping here: no
# all-reduce unless "every" (DDP, HSDP's replicas), no reduce-scatter under "boundary".
_DEFERRED: dict[str, tuple[str, ...]] = {
    "auto": ("all_reduce",),
    "boundary": ("all_reduce", "reduce_scatter"),
    "every": (),
}
_SHORT = {  # the table's abbreviations of the kinds of collectives
    "all_reduce": "ar",
    "reduce_scatter": "rs",
    "all_gather": "ag",
    "broadcast": "bc",
}


@dataclass
class Row:
    """One launch path and ``steps`` setting, with what was measured and whether it passed."""

    path: str
    launch: str
    steps: int
    microbatches: int
    optimizer_steps: int
    scheduler_steps: int
    expected_steps: int
    max_abs_diff: float
    host_syncs_off_boundary: int
    deferred_reductions: int = 0
    # Per sync policy, per collective kind ("ar", "rs", ...): the count in a window of the
    # epoch (the one most windows ran), and what ran beyond that once in the run (the
    # ranks' agreement on the epoch's length, DDP's bucket-rebuild broadcasts).
    collectives_per_window: dict[str, dict[str, int]] = field(default_factory=dict)
    collectives_one_time: dict[str, dict[str, int]] = field(default_factory=dict)
    peak_memory_bytes: int | None = None

    def broken(self) -> dict[str, str]:
        """The promises this row broke: a short name for each, and what happened."""
        found = {}
        if self.optimizer_steps < 0:
            found["step count"] = "ranks disagree on the step count"
        elif not self.optimizer_steps == self.scheduler_steps == self.expected_steps:
            found["step count"] = (
                f"{self.optimizer_steps} optimizer and {self.scheduler_steps} scheduler steps, "
                f"expected {self.expected_steps}"
            )
        if not self.max_abs_diff <= TOLERANCE:  # NaN fails too
            found["parameters"] = (
                f"parameters off the reference by {self.max_abs_diff:.1e} (> {TOLERANCE:.0e})"
            )
        if self.deferred_reductions:
            found["deferred reductions"] = (
                f"{_plural(self.deferred_reductions, 'deferred reduction')} ran"
            )
        if self.host_syncs_off_boundary:
            found["host syncs"] = f"{_plural(self.host_syncs_off_boundary, 'host sync')} mid-window"
        return found

    @property
    def problems(self) -> list[str]:
        """The promises this row broke, in words; empty when it passes."""
        return list(self.broken().values())

    @property
    def ok(self) -> bool:
        """Cadence, numerics, deferral and the no-host-sync promise all hold."""
        return not self.broken()


# One epoch, measured ------------------------------------------------------------------

Batch = tuple[torch.Tensor, torch.Tensor]


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device, torch.float64)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def _data(device: torch.device, rank: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(1000 + rank)
    return [
        (
            torch.randn(4, 8, generator=generator, dtype=torch.float64).to(device),
            torch.randn(4, 1, generator=generator, dtype=torch.float64).to(device),
        )
        for _ in range(MICROBATCHES)
    ]


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.mse_loss(model(inputs), targets)


@dataclass
class _Epoch:
    """One sync policy's epoch: `check_accumulation`'s report, and what ran on the
    microsteps inside a window."""

    report: AccumulationReport | None = None
    host_syncs_off_boundary: int = 0
    deferred_reductions: int = 0


def _train(
    steps: int,
    sync: SyncPolicy,
    device: torch.device,
    wrap: Callable[[nn.Module], nn.Module] | None,
    world: int = 1,
) -> _Epoch:
    """One epoch of the design-card loop on this rank, checked and measured."""
    result = _Epoch()
    counter = CollectiveCounter()  # around each microstep, inside the check's own

    def train(model: nn.Module, optimizer: Any, scheduler: Any, batches: Sequence[Batch]) -> None:
        with Accumulator(model, optimizer, scheduler, steps=steps, sync=sync) as acc:
            for batch in acc.epoch(batches):
                before = counter.counts
                with counter:
                    loss = _loss(model, batch)
                    with acc.microstep(loss) as step:
                        pass
                if not step.boundary:
                    ran = counter.counts - before
                    result.host_syncs_off_boundary += ran.host_syncs
                    result.deferred_reductions += sum(
                        ran.collectives.get(kind, 0) for kind in _DEFERRED[sync]
                    )

    result.report = check_accumulation(
        functools.partial(_model, device),
        _optimizer,
        train,
        [_data(device, rank) for rank in range(world)],
        _loss,
        steps=steps,
        make_scheduler=_scheduler,
        wrap=wrap,
        tolerance=TOLERANCE,
    )
    return result


def _short(counts: Counts) -> dict[str, int]:
    """Collectives by kind, abbreviated as in the table."""
    return {_SHORT.get(kind, kind): n for kind, n in counts.collectives.items()}


def _per_window(report: AccumulationReport) -> tuple[dict[str, int], dict[str, int]]:
    """A run's collectives by kind: the count in a window, and the one-time rest.

    A kind's count per window is the one most windows ran (the later ones on a tie);
    what the run ran beyond that many per window is one-time, e.g. the ranks'
    agreement on the epoch's length and DDP's bucket-rebuild broadcasts (negative if
    some window ran fewer).
    """
    total = sum(report.windows, Counts())
    steady = report.per_window
    windows = len(report.windows)
    once = total - Counts({k: n * windows for k, n in steady.collectives.items()})
    return _short(steady), _short(once)


def _row(
    path: str,
    launch: str,
    steps: int,
    wrap: Callable[[nn.Module], nn.Module] | None,
    device: torch.device,
    world: int = 1,
) -> Row:
    """Every sync policy trains the same epoch; the row reports the worst of them."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    epochs = {policy: _train(steps, policy, device, wrap, world) for policy in get_args(SyncPolicy)}
    reports = {policy: run.report for policy, run in epochs.items() if run.report is not None}
    runs = list(epochs.values())
    expected = total_steps(MICROBATCHES, steps)
    collectives = {policy: _per_window(report) for policy, report in reports.items()}

    def worst(counts: list[int]) -> int:
        # Report the policy farthest from the expected cadence, so no run hides another.
        return max(counts, key=lambda count: abs(count - expected))

    diffs = [report.max_abs_diff for report in reports.values()]
    return Row(
        path=path,
        launch=launch,
        steps=steps,
        microbatches=MICROBATCHES,
        optimizer_steps=(
            worst([report.optimizer_steps for report in reports.values()])
            if all(report.ranks_agree for report in reports.values())
            else -1
        ),
        scheduler_steps=worst([report.scheduler_steps or 0 for report in reports.values()]),
        expected_steps=expected,
        max_abs_diff=math.nan if any(map(math.isnan, diffs)) else max(diffs),
        host_syncs_off_boundary=max(run.host_syncs_off_boundary for run in runs),
        deferred_reductions=max(run.deferred_reductions for run in runs),
        collectives_per_window={policy: steady for policy, (steady, _) in collectives.items()},
        collectives_one_time={policy: once for policy, (_, once) in collectives.items()},
        peak_memory_bytes=(
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        ),
    )


def run_single_process(steps: int, device: torch.device) -> Row:
    """The single-process row: a plain module, nothing to communicate."""
    return _row("single-process", "python", steps, None, device)


# Distributed rows ---------------------------------------------------------------------


def wrapper(path: str, device: torch.device) -> Callable[[nn.Module], nn.Module]:
    """How ``path`` wraps a model on the initialized process group: ``"DDP"``, or
    ``"fully_shard"`` / ``"HSDP"`` (a 2 x world/2 mesh), sharding each ``nn.Linear``
    and then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    world = dist.get_world_size()
    if path == "DDP":
        return DistributedDataParallel
    if path == "fully_shard":
        mesh = init_device_mesh(device.type, (world,))
    else:
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))

    def shard(model: nn.Module) -> nn.Module:
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    return shard


def _rank_rows(rank: int, world: int, path: str, steps: list[int], launch: str) -> list[Row]:
    device = torch.device(f"cuda:{rank}") if dist.get_backend() == "nccl" else torch.device("cpu")
    wrap = wrapper(path, device)
    return [_row(path, launch, n, wrap, device, world) for n in steps]


def run_distributed(path: str, nproc: int, steps: list[int], backend: str = "gloo") -> list[Row]:
    """``path`` (DDP, fully_shard or HSDP) on ``nproc`` local ranks: one row per ``steps``.

    Each rank checks its own parameters; a row takes the worst rank.
    """
    launch_name = f"{nproc} ranks, {backend}"
    per_rank = run_ranks(_rank_rows, nproc, (path, steps, launch_name), backend=backend)
    rows = []
    for ranks in zip(*per_rank, strict=True):
        row = ranks[0]
        for other in ranks[1:]:
            row.max_abs_diff = max(row.max_abs_diff, other.max_abs_diff)
            row.host_syncs_off_boundary = max(
                row.host_syncs_off_boundary, other.host_syncs_off_boundary
            )
            row.deferred_reductions = max(row.deferred_reductions, other.deferred_reductions)
            if (other.optimizer_steps, other.scheduler_steps) != (
                row.optimizer_steps,
                row.scheduler_steps,
            ):
                row.optimizer_steps = -1  # ranks disagree: the row fails
        rows.append(row)
    return rows


# The table ----------------------------------------------------------------------------

SUMMARY = "check exact accumulation, step cadence and communication on this machine"
DESCRIPTION = (
    f"Train a small float64 model for one epoch of {MICROBATCHES} microbatches per rank, "
    "with steps=1 and steps=N under every sync policy: on one process, and under DDP and "
    "fully_shard on --nproc local ranks (HSDP with --hsdp). Check the parameters after "
    "every window against a float64 reference; count optimizer steps, collectives, "
    "deferred reductions and host syncs; print what held. Exit status 1 if a row fails."
)
_CHECKS = (
    "max |param-ref|: the worst gap, after any window, between the parameters and an "
    "unwrapped float64 copy of the model trained on one big batch of every rank's window "
    f"(must be <= {TOLERANCE:.0e}). host syncs: on microsteps inside a window (must be 0). "
    "deferred: reductions run inside a window although the policy defers them: ar under "
    '"auto" and "boundary", rs under "boundary" (must be 0).'
)
_COSTS = (
    "ar all-reduce, rs reduce-scatter, ag all-gather, bc broadcast: counted at the "
    "dispatcher in each window of the epoch; one-time: what a run adds once, not per "
    "window (the ranks agree on the epoch's length; DDP rebuilds its buckets after the "
    "first backward)."
)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _counts(counts: dict[str, int]) -> str:
    """``{"ag": 16, "rs": 8}`` as ``16 ag + 8 rs``; ``0`` when none ran."""
    return " + ".join(f"{n} {kind}" for kind, n in counts.items()) or "0"


def _one_time(row: Row) -> str:
    """The one-time collectives, once if every policy ran the same, else per policy."""
    cells = [_counts(row.collectives_one_time.get(p, {})) for p in get_args(SyncPolicy)]
    if len(set(cells)) == 1:
        return "" if cells[0] == "0" else cells[0]
    return " | ".join(cells)


def _columns(lines: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(*lines, strict=True)]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    ]


def _verdict(rows: list[Row]) -> list[str]:
    """The last lines: whether every row held, or which failed and why."""
    failed = [row for row in rows if not row.ok]
    if not failed:
        return [
            f"All {len(rows)} rows held: exact parameters, 1 step per window, "
            "no deferred reduction or host sync mid-window."
        ]
    lines = []
    for row in failed:
        for problem in row.problems:
            why = f"FAIL {row.path} ({row.launch}), steps {row.steps}: {problem}"
            lines += textwrap.wrap(why, WIDTH, subsequent_indent="    ")
    kinds = ", ".join(dict.fromkeys(kind for row in failed for kind in row.broken()))
    names = ", ".join(f"{row.path} steps {row.steps}" for row in failed)
    last = f"{len(failed)} of {len(rows)} rows FAILED ({kinds}): {names}."
    if len(last) > WIDTH:
        last = f"{len(failed)} of {len(rows)} rows FAILED ({kinds}): see FAIL above."
    return [*lines, last]


def report(rows: list[Row], device: str, *, wide: bool = False) -> str:
    """The table as ``verify`` prints it, ending in a line that says whether all held.

    It fits in `WIDTH` columns: a table of the checks, then one of the collectives per
    window under each sync policy. ``wide`` puts each row on one line, with peak memory.
    """
    out = [
        f"gradaccum verify: torch {torch.__version__}, device {device}, "
        f"{MICROBATCHES} microbatches per rank"
    ]
    policies = get_args(SyncPolicy)
    head: tuple[str, ...] = ("path", "launch", "steps", "opt/sched steps", "max |param-ref|")
    if wide:
        collectives = "collectives/window " + " | ".join(policies)
        head += ("host syncs", "deferred reductions", collectives, "one-time", "peak memory")
    else:
        head += ("host syncs", "deferred")
    head += ("result",)
    checks: list[tuple[str, ...]] = [head]
    costs: list[tuple[str, ...]] = [("path", "steps", *policies, "one-time")]
    for row in rows:
        per_policy = [_counts(row.collectives_per_window.get(p, {})) for p in policies]
        cells = (
            row.path,
            row.launch,
            str(row.steps),
            f"{row.optimizer_steps}/{row.scheduler_steps} of {row.expected_steps}",
            f"{row.max_abs_diff:.1e}",
            str(row.host_syncs_off_boundary),
            str(row.deferred_reductions),
        )
        result = "ok" if row.ok else "FAIL"
        if wide:
            memory = "n/a" if row.peak_memory_bytes is None else f"{row.peak_memory_bytes} B"
            checks.append((*cells, " | ".join(per_policy), _one_time(row), memory, result))
        else:
            checks.append((*cells, result))
            costs.append((row.path, str(row.steps), *per_policy, _one_time(row)))
    out += _columns(checks)
    out += textwrap.wrap(_CHECKS, WIDTH)
    if not wide:
        out += ["", "collectives per window under each sync policy:", *_columns(costs)]
    out += textwrap.wrap(_COSTS, WIDTH)
    out += ["", *_verdict(rows)]
    return "\n".join(out)


DEVICES = ("cpu", "cuda")


def add_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add verify's options to ``parser``: its own, or ``python -m gradaccum``'s command."""
    parser.add_argument(
        "--steps",
        type=int,
        default=4,
        metavar="N",
        help=f"accumulation steps, 1 to {MICROBATCHES} (default 4)",
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        choices=DEVICES,
        metavar="D",
        help="device type, cpu or cuda (default: cuda if available, else cpu); the "
        "distributed rows use NCCL when it is cuda with at least --nproc GPUs, else gloo "
        "on cpu",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=2,
        metavar="P",
        help="ranks for DDP and fully_shard, 2 or more (default 2)",
    )
    parser.add_argument("--hsdp", action="store_true", help="add HSDP on a 2 x 2 mesh (4 ranks)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument(
        "--wide",
        action="store_true",
        help=f"one line per row with every column and peak memory (wider than {WIDTH} columns)",
    )
    output.add_argument("--json", action="store_true", help="print the rows as JSON")
    return parser


def _refusal(args: argparse.Namespace) -> str | None:
    """Why ``args`` cannot run as verify's help promises, naming the option, the value and
    the fix; None when they can."""
    if args.steps < 1:
        return (
            f"argument --steps: must be a positive int, got {args.steps}; "
            "pass 1 for no accumulation"
        )
    if args.steps > MICROBATCHES:
        return (
            f"argument --steps: {args.steps} is more than the {MICROBATCHES} microbatches of "
            f"verify's epoch, which would give no optimizer step; pass --steps {MICROBATCHES} "
            "or less"
        )
    if args.nproc < 2:
        return (
            f"argument --nproc: must be 2 or more, got {args.nproc}: the DDP and fully_shard "
            "rows need ranks that communicate; pass --nproc 2 (the default)"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        return (
            "argument --device: 'cuda' is not available on this machine "
            "(torch.cuda.is_available() is False); pass --device cpu"
        )
    return None


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the table for ``args`` (parsed by ``parser``, which reports usage errors,
    exit status 2, before any row runs)."""
    refusal = _refusal(args)
    if refusal is not None:
        parser.error(refusal)
    steps, nproc, device = args.steps, args.nproc, torch.device(args.device)
    settings = sorted({1, steps})
    rows = [run_single_process(n, device) for n in settings]
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    launches = [("DDP", nproc), ("fully_shard", nproc)] + ([("HSDP", 4)] if args.hsdp else [])
    for path, ranks in launches:
        backend = "nccl" if gpus >= ranks else "gloo"
        rows += run_distributed(path, ranks, settings, backend)
    if args.json:
        print(
            json.dumps(
                [asdict(row) | {"ok": row.ok, "problems": row.problems} for row in rows],
                indent=2,
            )
        )
    else:
        print(report(rows, str(device), wide=args.wide))
    return 0 if all(row.ok for row in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the table; return 0 when every row passes, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m gradaccum verify", description=DESCRIPTION)
    return run_command(add_options(parser).parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
