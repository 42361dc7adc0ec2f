"""``python -m gradaccum verify``: the equivalence, cadence and communication table here.

Each row trains a small float64 model over 13 microbatches per rank, with different data
on every rank, and checks at every boundary the accumulated gradient against an
independent reference: one big batch of every rank's window through an unwrapped copy
of the model. It counts optimizer and scheduler steps, collectives (``c10d`` ops seen by
the dispatcher) per window for each sync policy, reductions that ran on deferred
microsteps although the policy defers them, and host synchronizations off the boundary.
The exit status is 1 if a row fails.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import multiprocessing
import os
import sys
import tempfile
import textwrap
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradaccum.accumulator import Accumulator
from gradaccum.schedule import check_steps, total_steps
from gradaccum.sync import SyncPolicy, full_tensor

__all__ = [
    "OpCounter",
    "Outcome",
    "Row",
    "add_options",
    "launch",
    "main",
    "report",
    "results",
    "run_command",
    "run_distributed",
    "run_single_process",
    "wrapper",
]

MICROBATCHES = 13
TOLERANCE = 1e-10
WIDTH = 100  # columns the default table fits in; --wide puts each row on one line
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional"})
# What each policy must not run on a deferred microstep, under every wrapping here: no
# all-reduce unless "every" (DDP, HSDP's replicas), no reduce-scatter under "boundary".
_DEFERRED: dict[str, frozenset[str]] = {
    "auto": frozenset({"allreduce_"}),
    "boundary": frozenset({"allreduce_", "_reduce_scatter_base_", "reduce_scatter_"}),
    "every": frozenset(),
}
_SHORT = {  # the table's abbreviations of the c10d ops
    "allreduce_": "ar",
    "_reduce_scatter_base_": "rs",
    "reduce_scatter_": "rs",
    "_allgather_base_": "ag",
    "allgather_": "ag",
    "broadcast_": "bc",
}


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Count, at the dispatcher, the collectives and the device-to-host syncs that ran.

    A host sync is ``aten._local_scalar_dense``: what ``.item()``, ``bool(tensor)`` and
    ``float(tensor)`` dispatch to.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.collectives: Counter[str] = Counter()
        self.host_syncs = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func.namespace in _COLLECTIVE_NAMESPACES:
            self.collectives[func.name()] += 1
        elif func is torch.ops.aten._local_scalar_dense.default:
            self.host_syncs += 1
        return func(*args, **(kwargs or {}))


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
    # epoch (the one most windows ran), and what ran beyond that once in the run (DDP's
    # bucket-rebuild broadcasts after the first backward).
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
            found["gradient"] = (
                f"gradient off the reference by {self.max_abs_diff:.1e} (> {TOLERANCE:.0e})"
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


# Launching ranks ---------------------------------------------------------------------


@dataclass
class Outcome:
    """What one rank returned, or the traceback it died with."""

    rank: int
    value: Any = None
    error: str | None = None


def launch(
    scenario: Callable[..., Any],
    world: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    backend: str = "gloo",
    timeout: float = 60.0,
) -> list[Outcome]:
    """Run ``scenario(rank, world, *args, **kwargs)`` on ``world`` local ranks.

    Ranks are forked from a server that has imported torch once and joined through a
    ``FileStore`` in a fresh directory. A rank's collectives time out after ``timeout``
    seconds; a rank that has not answered by twice that is killed. Every rank's result
    or traceback comes back, so a failure or a hang is reported, never waited on.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", scenario.__module__])
    answers = context.SimpleQueue()
    deadline = time.monotonic() + 2 * timeout
    with tempfile.TemporaryDirectory(prefix="gradaccum-") as directory:
        processes = [
            context.Process(
                target=_rank_main,
                args=(scenario, rank, world, backend, timeout, directory, args, kwargs, answers),
            )
            for rank in range(world)
        ]
        for process in processes:
            process.start()
        outcomes: dict[int, Outcome] = {}
        while len(outcomes) < world and time.monotonic() < deadline:
            if not answers.empty():
                outcome = answers.get()
                outcomes[outcome.rank] = outcome
            elif any(process.is_alive() for process in processes):
                time.sleep(0.01)
            elif answers.empty():
                break
        for process in processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
    for rank, process in enumerate(processes):
        if rank not in outcomes:
            error = f"rank {rank} gave no answer (exit code {process.exitcode})"
            outcomes[rank] = Outcome(rank, error=error)
    return [outcomes[rank] for rank in range(world)]


def results(outcomes: list[Outcome]) -> list[Any]:
    """Every rank's return value; raises with every rank's traceback if one failed."""
    errors = [f"--- rank {o.rank} ---\n{o.error}" for o in outcomes if o.error is not None]
    if errors:
        raise RuntimeError("\n".join(errors))
    # The payloads come from the ranks this process launched.
    return [torch.load(io.BytesIO(o.value), weights_only=False) for o in outcomes]


def _rank_main(
    scenario: Callable[..., Any],
    rank: int,
    world: int,
    backend: str,
    timeout: float,
    directory: str,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    answers: Any,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            store=dist.FileStore(os.path.join(directory, "store"), world),  # type: ignore[attr-defined]
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout),
        )
        buffer = io.BytesIO()
        torch.save(scenario(rank, world, *args, **(kwargs or {})), buffer)
        answers.put(Outcome(rank, value=buffer.getvalue()))
    except BaseException:
        answers.put(Outcome(rank, error=traceback.format_exc()))
        os._exit(1)  # leave at once: a broken group may hang in its teardown
    gc.collect()  # models hold the group in reference cycles; free them before destroying it
    dist.destroy_process_group()


# One epoch, measured ------------------------------------------------------------------

Batch = tuple[torch.Tensor, torch.Tensor]


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device, torch.float64)


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


def _reference_grads(model: nn.Module, window: list[Batch]) -> list[torch.Tensor]:
    """The gradient of one big batch of the window (every rank's) at ``model``'s weights."""
    twin = _model(full_tensor(next(model.parameters())).device)
    with torch.no_grad():
        for mine, theirs in zip(twin.parameters(), model.parameters(), strict=True):
            mine.copy_(full_tensor(theirs))
    big = (torch.cat([x for x, _ in window]), torch.cat([y for _, y in window]))
    return list(torch.autograd.grad(_loss(twin, big), list(twin.parameters())))


@dataclass
class _Epoch:
    optimizer_steps: int = 0
    scheduler_steps: int = 0
    max_abs_diff: float = 0.0
    host_syncs_off_boundary: int = 0
    deferred_reductions: int = 0
    collectives: Counter[str] = field(default_factory=Counter)
    per_window: list[Counter[str]] = field(default_factory=list)  # each window's collectives


def _train(
    steps: int,
    sync: SyncPolicy,
    device: torch.device,
    wrap: Callable[[nn.Module], nn.Module],
    world: int = 1,
    rank: int = 0,
) -> _Epoch:
    """Train one epoch of the design-card loop on this rank and measure it."""
    model = wrap(_model(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    result = _Epoch()

    def count_step(*_: object) -> None:
        result.optimizer_steps += 1

    optimizer.register_step_post_hook(count_step)
    counter = OpCounter()
    everyone = [_data(device, r) for r in range(world)]
    window: list[Batch] = []
    before: Counter[str] = Counter()  # the collectives before this window
    with Accumulator(model, optimizer, scheduler, steps=steps, sync=sync) as acc:
        for index, batch in enumerate(acc.epoch(everyone[rank])):
            window.extend(data[index] for data in everyone)
            reference = _reference_grads(model, window) if acc.sync_gradients else []
            syncs, reductions = counter.host_syncs, _reductions(counter, sync)
            with counter:
                loss = _loss(model, batch)
                with acc.microstep(loss) as step:
                    seen = counter.collectives.copy()
                    grads = [full_tensor(p.grad) for p in model.parameters() if p.grad is not None]
                    counter.collectives = seen  # gathering them for the check is not training
            if not step.boundary:
                result.host_syncs_off_boundary += counter.host_syncs - syncs
                result.deferred_reductions += _reductions(counter, sync) - reductions
                continue
            for grad, ref in zip(grads, reference, strict=True):
                result.max_abs_diff = max(result.max_abs_diff, (grad - ref).abs().max().item())
            window = []
            result.per_window.append(counter.collectives - before)
            before = counter.collectives.copy()
    result.scheduler_steps = scheduler.last_epoch
    result.collectives = counter.collectives
    return result


def _kinds(collectives: Counter[str]) -> Counter[str]:
    """Collectives by kind, abbreviated as in the table."""
    counts: Counter[str] = Counter()
    for name, n in collectives.items():
        op = name.split("::")[-1]
        counts[_SHORT.get(op, op)] += n
    return counts


def _per_window(run: _Epoch) -> tuple[dict[str, int], dict[str, int]]:
    """A run's collectives by kind: the count in a window, and the one-time rest.

    A kind's count per window is the one most windows ran (the later ones on a tie);
    what the run ran beyond that many per window is one-time, e.g. DDP's bucket-rebuild
    broadcasts after the first backward (negative if some window ran fewer).
    """
    windows = [_kinds(counts) for counts in run.per_window]
    total = _kinds(run.collectives)
    steady: dict[str, int] = {}
    once: dict[str, int] = {}
    for kind in sorted(total):
        tally = Counter(counts[kind] for counts in reversed(windows))
        usual = tally.most_common(1)[0][0] if tally else 0
        if usual:
            steady[kind] = usual
        if total[kind] != usual * len(windows):
            once[kind] = total[kind] - usual * len(windows)
    return steady, once


def _reductions(counter: OpCounter, sync: SyncPolicy) -> int:
    """The reductions so far that ``sync`` must defer."""
    ops = _DEFERRED[sync]
    return sum(n for name, n in counter.collectives.items() if name.split("::")[-1] in ops)


def _row(
    path: str,
    launch: str,
    steps: int,
    wrap: Callable[[nn.Module], nn.Module],
    device: torch.device,
    world: int = 1,
    rank: int = 0,
) -> Row:
    """Every sync policy trains the same epoch; the row reports the worst of them."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    epochs = {
        policy: _train(steps, policy, device, wrap, world, rank) for policy in get_args(SyncPolicy)
    }
    runs = list(epochs.values())
    expected = total_steps(MICROBATCHES, steps)
    collectives = {policy: _per_window(run) for policy, run in epochs.items()}

    def worst(counts: list[int]) -> int:
        # Report the policy farthest from the expected cadence, so no run hides another.
        return max(counts, key=lambda count: abs(count - expected))

    return Row(
        path=path,
        launch=launch,
        steps=steps,
        microbatches=MICROBATCHES,
        optimizer_steps=worst([run.optimizer_steps for run in runs]),
        scheduler_steps=worst([run.scheduler_steps for run in runs]),
        expected_steps=expected,
        max_abs_diff=max(run.max_abs_diff for run in runs),
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
    return _row("single-process", "python", steps, lambda model: model, device)


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
    return [_row(path, launch, n, wrap, device, world, rank) for n in steps]


def run_distributed(path: str, nproc: int, steps: list[int], backend: str = "gloo") -> list[Row]:
    """``path`` (DDP, fully_shard or HSDP) on ``nproc`` local ranks: one row per ``steps``.

    Each rank checks its own gradients; a row takes the worst rank.
    """
    launch_name = f"{nproc} ranks, {backend}"
    per_rank = results(launch(_rank_rows, nproc, (path, steps, launch_name), backend=backend))
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
    "fully_shard on --nproc local ranks (HSDP with --hsdp). Check every window's gradient "
    "against a float64 reference; count optimizer steps, collectives, deferred reductions "
    "and host syncs; print what held. Exit status 1 if a row fails."
)
_CHECKS = (
    "max |grad-ref|: the worst gap, at any boundary, between the accumulated gradient and "
    "one big float64 batch of the window through an unwrapped copy of the model (must be "
    f"<= {TOLERANCE:.0e}). host syncs: on microsteps inside a window (must be 0). "
    "deferred: reductions run inside a window although the policy defers them: ar under "
    '"auto" and "boundary", rs under "boundary" (must be 0).'
)
_COSTS = (
    "ar all-reduce, rs reduce-scatter, ag all-gather, bc broadcast: counted at the "
    "dispatcher in each window of the epoch; one-time: what a run adds once, not per "
    "window (DDP rebuilds its buckets after the first backward)."
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
            f"All {len(rows)} rows held: exact gradients, 1 step per window, "
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
    head: tuple[str, ...]
    if wide:
        head = (
            "path",
            "launch",
            "steps",
            "opt/sched steps",
            "max |grad-ref|",
            "host syncs",
            "deferred reductions",
            "collectives/window " + " | ".join(policies),
            "one-time",
            "peak memory",
            "result",
        )
    else:
        head = (
            "path",
            "launch",
            "steps",
            "opt/sched steps",
            "max |grad-ref|",
            "host syncs",
            "deferred",
            "result",
        )
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


def add_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add verify's options to ``parser``: its own, or ``python -m gradaccum``'s command."""
    parser.add_argument(
        "--steps", type=int, default=4, metavar="N", help="accumulation steps (default 4)"
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        metavar="D",
        help="device type (default: cuda if available, else cpu); the distributed rows use "
        "NCCL when it is cuda with at least --nproc GPUs, else gloo on cpu",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=2,
        metavar="P",
        help="ranks for DDP and fully_shard (default 2)",
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


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the table for ``args`` (parsed by ``parser``, which reports usage errors)."""
    try:
        steps = check_steps(args.steps, "--steps")
        nproc = check_steps(args.nproc, "--nproc")
    except ValueError as error:
        parser.error(str(error))
    device = torch.device(args.device)
    settings = sorted({1, steps})
    rows = [run_single_process(n, device) for n in settings]
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    launches = [("DDP", nproc), ("fully_shard", nproc)] + ([("HSDP", 4)] if args.hsdp else [])
    for path, ranks in launches:
        if ranks > 1:
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
