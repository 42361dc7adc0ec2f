"""``python -m gradaccum verify``: the equivalence, cadence and communication table here.

Each row trains a small float64 model over 13 microbatches per rank, with different data
on every rank, and checks at every boundary the accumulated gradient against an
independent reference: one big batch of every rank's window through an unwrapped copy
of the model. It counts optimizer and scheduler steps, collectives (``c10d`` ops seen by
the dispatcher) per window for each sync policy, reductions that ran on deferred
microsteps although the policy defers them, and host synchronizations off the boundary.
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
    "launch",
    "main",
    "results",
    "run_distributed",
    "run_single_process",
    "wrapper",
]

MICROBATCHES = 13
TOLERANCE = 1e-10
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
    collectives_per_window: dict[str, dict[str, float]] = field(default_factory=dict)
    peak_memory_bytes: int | None = None

    @property
    def ok(self) -> bool:
        """Cadence, numerics, deferral and the no-host-sync promise all hold."""
        return (
            self.optimizer_steps == self.scheduler_steps == self.expected_steps
            and self.max_abs_diff <= TOLERANCE
            and self.host_syncs_off_boundary == 0
            and self.deferred_reductions == 0
        )


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
    windows: int = 0
    max_abs_diff: float = 0.0
    host_syncs_off_boundary: int = 0
    deferred_reductions: int = 0
    collectives: Counter[str] = field(default_factory=Counter)


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
        result.windows = acc.global_step
    result.scheduler_steps = scheduler.last_epoch
    result.collectives = counter.collectives
    return result


def _per_window(collectives: Counter[str], windows: int) -> dict[str, float]:
    """Collectives per window by kind, abbreviated as in the table."""
    counts: Counter[str] = Counter()
    for name, n in collectives.items():
        op = name.split("::")[-1]
        counts[_SHORT.get(op, op)] += n
    return {kind: n / windows for kind, n in sorted(counts.items())}


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
        collectives_per_window={
            policy: _per_window(run.collectives, run.windows) for policy, run in epochs.items()
        },
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


def _collectives(per_policy: dict[str, dict[str, float]]) -> str:
    """Counts per window for ``auto | boundary | every``, e.g. ``1 ar | 1 ar | 4 ar``."""

    def one(counts: dict[str, float]) -> str:
        return " + ".join(f"{n:.3g} {name}" for name, n in counts.items()) or "0"

    return " | ".join(one(per_policy[policy]) for policy in get_args(SyncPolicy))


def _print_table(rows: list[Row], device: torch.device) -> None:
    print(f"gradaccum verify: torch {torch.__version__}, device {device}")
    lines = [
        (
            "path",
            "launch",
            "steps",
            "opt/sched steps",
            "max |grad - ref|",
            "host syncs",
            "deferred reductions",
            "collectives/window auto | boundary | every",
            "peak memory",
            "result",
        )
    ]
    for row in rows:
        memory = "n/a (cpu)" if row.peak_memory_bytes is None else f"{row.peak_memory_bytes} B"
        lines.append(
            (
                row.path,
                row.launch,
                str(row.steps),
                f"{row.optimizer_steps}/{row.scheduler_steps} of {row.expected_steps}",
                f"{row.max_abs_diff:.1e}",
                str(row.host_syncs_off_boundary),
                str(row.deferred_reductions),
                _collectives(row.collectives_per_window),
                memory,
                "ok" if row.ok else "FAIL",
            )
        )
    widths = [max(len(cell) for cell in column) for column in zip(*lines, strict=True)]
    for line in lines:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)))
    print(
        "collectives: ar all-reduce, rs reduce-scatter, ag all-gather, bc broadcast (DDP's "
        "one-time bucket rebuild), averaged over the epoch's windows. deferred reductions: "
        'ar under "auto" or "boundary", rs under "boundary", that ran on a non-boundary '
        "microstep (must be 0)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the table; return 0 when every row passes, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m gradaccum verify", description=__doc__)
    parser.add_argument("--steps", type=int, default=4, help="accumulation steps (default 4)")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="device type (default: cuda if available, else cpu); the distributed rows use "
        "NCCL when it is cuda with at least --nproc GPUs, else gloo on cpu",
    )
    parser.add_argument(
        "--nproc", type=int, default=2, help="ranks for DDP and fully_shard (default 2)"
    )
    parser.add_argument("--hsdp", action="store_true", help="add HSDP on a 2 x 2 mesh (4 ranks)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
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
        print(json.dumps([asdict(row) | {"ok": row.ok} for row in rows], indent=2))
    else:
        _print_table(rows, device)
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
