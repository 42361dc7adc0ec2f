"""``python -m gradaccum verify``: the equivalence, cadence and communication table here.

Each row trains a small float64 model over 13 microbatches with the `Accumulator` and
checks, at every boundary, the accumulated gradient against an independent reference
(one big batch of the window's microbatches through a copy of the model). It counts
optimizer and scheduler steps, collectives (``c10d`` ops seen by the dispatcher) per
window for each sync policy, and host synchronizations on non-boundary microsteps.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, get_args

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradaccum.accumulator import Accumulator
from gradaccum.schedule import check_steps, total_steps
from gradaccum.sync import SyncPolicy

__all__ = ["OpCounter", "Row", "main", "run_single_process"]

MICROBATCHES = 13
TOLERANCE = 1e-10
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional"})


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
    collectives_per_window: dict[str, dict[str, float]] = field(default_factory=dict)
    peak_memory_bytes: int | None = None

    @property
    def ok(self) -> bool:
        """Cadence, numerics and the no-sync promise all hold."""
        return (
            self.optimizer_steps == self.scheduler_steps == self.expected_steps
            and self.max_abs_diff <= TOLERANCE
            and self.host_syncs_off_boundary == 0
        )


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device, torch.float64)


def _data(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000)
    return [
        (
            torch.randn(4, 8, generator=generator, dtype=torch.float64).to(device),
            torch.randn(4, 1, generator=generator, dtype=torch.float64).to(device),
        )
        for _ in range(MICROBATCHES)
    ]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.mse_loss(model(inputs), targets)


def _reference_grads(
    model: nn.Module, window: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor]:
    """The gradient of one big batch made of the window's microbatches."""
    twin = copy.deepcopy(model)
    big = (torch.cat([x for x, _ in window]), torch.cat([y for _, y in window]))
    return list(torch.autograd.grad(_loss(twin, big), list(twin.parameters())))


@dataclass
class _Epoch:
    optimizer_steps: int = 0
    scheduler_steps: int = 0
    windows: int = 0
    max_abs_diff: float = 0.0
    host_syncs_off_boundary: int = 0
    collectives: Counter[str] = field(default_factory=Counter)


def _train(steps: int, sync: SyncPolicy, device: torch.device) -> _Epoch:
    """Train one epoch of the design-card loop and measure it."""
    model = _model(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    result = _Epoch()

    def count_step(*_: object) -> None:
        result.optimizer_steps += 1

    optimizer.register_step_post_hook(count_step)
    counter = OpCounter()
    window: list[tuple[torch.Tensor, torch.Tensor]] = []
    with Accumulator(model, optimizer, scheduler, steps=steps, sync=sync) as acc:
        for batch in acc.epoch(_data(device)):
            window.append(batch)
            reference = _reference_grads(model, window) if acc.sync_gradients else []
            syncs = counter.host_syncs
            with counter:
                loss = _loss(model, batch)
                with acc.microstep(loss) as step:
                    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            if not step.boundary:
                result.host_syncs_off_boundary += counter.host_syncs - syncs
                continue
            for grad, ref in zip(grads, reference, strict=True):
                result.max_abs_diff = max(result.max_abs_diff, (grad - ref).abs().max().item())
            window = []
        result.windows = acc.global_step
    result.scheduler_steps = scheduler.last_epoch
    result.collectives = counter.collectives
    return result


def run_single_process(steps: int, device: torch.device) -> Row:
    """The single-process row: every sync policy trains the same epoch."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    epochs = {policy: _train(steps, policy, device) for policy in get_args(SyncPolicy)}
    runs = list(epochs.values())
    expected = total_steps(MICROBATCHES, steps)

    def worst(counts: list[int]) -> int:
        # Report the policy farthest from the expected cadence, so no run hides another.
        return max(counts, key=lambda count: abs(count - expected))

    return Row(
        path="single-process",
        launch="python",
        steps=steps,
        microbatches=MICROBATCHES,
        optimizer_steps=worst([run.optimizer_steps for run in runs]),
        scheduler_steps=worst([run.scheduler_steps for run in runs]),
        expected_steps=expected,
        max_abs_diff=max(run.max_abs_diff for run in runs),
        host_syncs_off_boundary=max(run.host_syncs_off_boundary for run in runs),
        collectives_per_window={
            policy: {name: n / run.windows for name, n in run.collectives.items()}
            for policy, run in epochs.items()
        },
        peak_memory_bytes=(
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        ),
    )


def _collectives(per_policy: dict[str, dict[str, float]]) -> str:
    """``auto|boundary|every`` counts per window, e.g. ``0|0|0`` or ``1 allreduce_|...``."""

    def one(counts: dict[str, float]) -> str:
        return "+".join(f"{n:g} {name}" for name, n in sorted(counts.items())) or "0"

    return "|".join(one(per_policy[policy]) for policy in get_args(SyncPolicy))


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
            "collectives/window auto|boundary|every",
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
                _collectives(row.collectives_per_window),
                memory,
                "ok" if row.ok else "FAIL",
            )
        )
    widths = [max(len(cell) for cell in column) for column in zip(*lines, strict=True)]
    for line in lines:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the table; return 0 when every row passes, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m gradaccum verify", description=__doc__)
    parser.add_argument("--steps", type=int, default=4, help="accumulation steps (default 4)")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="device for the single-process path (default: cuda if available, else cpu)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    try:
        steps = check_steps(args.steps, "--steps")
    except ValueError as error:
        parser.error(str(error))
    device = torch.device(args.device)
    rows = [run_single_process(n, device) for n in sorted({1, steps})]
    if args.json:
        print(json.dumps([asdict(row) | {"ok": row.ok} for row in rows], indent=2))
    else:
        _print_table(rows, device)
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
