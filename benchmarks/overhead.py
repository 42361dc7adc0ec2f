"""Per-microstep overhead of `gradaccum.Accumulator` against a hand-written accumulation loop.

What is measured:
    The wall time of one epoch of ``--microsteps`` microbatches, divided by the number of
    microbatches, on tiny CPU models (2-layer MLPs, each ``--width`` in turn, batches of
    ``--batch`` rows, MSE loss), for two loops that do the same training:

    * ``hand``: what a careful user writes by hand. For each microbatch: forward,
      ``(loss / steps).backward()``; on every ``steps``-th microbatch (optionally
      ``torch.nn.utils.clip_grad_norm_``), ``optimizer.step()``, ``scheduler.step()``,
      ``optimizer.zero_grad(set_to_none=True)``.
    * ``gradaccum``: ``for x, y in acc.epoch(data): loss = ...; with acc.microstep(loss):
      pass``, with ``acc = Accumulator(model, optimizer, scheduler, steps=4)`` (and
      ``max_grad_norm=1.0`` in the clipping configurations, and ``on_nonfinite="skip"``
      in the last one, whose hand loop reads ``torch.isfinite(norm)`` before stepping).

    Both sides get the same initial weights, the same data (a list of tensors made once),
    SGD with momentum, a ``LambdaLR`` scheduler and ``steps=4``. Building the model copy,
    the optimizer, the scheduler and the accumulator is outside the timed region; the
    epoch loop (including the accumulator's ``epoch`` generator) is inside it.

How it is measured:
    ``torch.set_num_threads(1)`` so that intra-op thread scheduling does not add noise on a
    small machine. After untimed warm-up rounds, each round times one ``hand`` epoch and
    one ``gradaccum`` epoch back to back, on fresh copies of the model and optimizer, with
    ``time.perf_counter_ns`` and a ``gc.collect()`` before each (the objects alive after
    set-up are frozen with ``gc.freeze()``, so that collection stays cheap). The order
    alternates from round to round, so drift (thermal, frequency, caches) and warm-up
    affect both sides equally. The three configurations (no clipping, clipping to norm
    1.0, clipping with the non-finite check) are interleaved in the same rounds.

How to read the ratio:
    Each round gives a ratio ``gradaccum time / hand time``; the report is the median of
    these per-round ratios (with their 10th and 90th percentiles to show the spread). A
    ratio of 1.012 means the accumulator adds 1.2 % to a microstep of this size; the
    absolute overhead in microseconds per microstep is about ``(ratio - 1) * hand µs``,
    and roughly constant, so on a larger model the ratio moves towards 1.0. The target is
    a median ratio of at most 1.03. Two widths are measured by default because the
    overhead is a fixed few microseconds of Python per microstep: on the 128-wide MLP
    (about 115 µs a microstep, most of it PyTorch's own dispatch) it is close to 3 %, on
    the 256-wide one (about 200 µs) it is well under; the printed ``+µs`` column is the
    number that carries over to other models. Besides the loop itself, the accumulator
    validates each loss, keeps it for the window's loss, and at each boundary reads the
    learning rate and builds the `gradaccum.Step` it returns (whose loss is computed only
    when read): that bookkeeping is part of what is measured.

The script only reports; it never fails on timings (exit status 0). It does report the
largest parameter difference between the two sides after the last round, which should
be 0.0: both loops do the same arithmetic.

Usage:
    python benchmarks/overhead.py [--rounds 40] [--microsteps 400] [--width 128 256]
        [--batch 32] [--json]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812  # the usual PyTorch alias
from torch.optim.lr_scheduler import LambdaLR

import gradaccum

# torch's own function, bound before any Accumulator wraps it to watch for clipping of a
# partial window: the hand-written loop is plain PyTorch.
clip_grad_norm_ = nn.utils.clip_grad_norm_
STEPS = 4
TARGET = 1.03
MAX_GRAD_NORM = 1.0
WARMUP_ROUNDS = 3
LR = 0.01

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Config:
    """One configuration compared on both sides.

    Attributes:
        name: The label printed in the report.
        max_grad_norm: Clip the window's gradient to this norm at the boundary, or
            ``None`` for no clipping.
        skip_nonfinite: Skip a window whose gradient norm is not finite: the
            accumulator's ``on_nonfinite="skip"``; by hand, ``torch.isfinite(norm)`` read
            on the host before stepping.
    """

    name: str
    max_grad_norm: float | None
    skip_nonfinite: bool = False


CONFIGS = (
    Config("no clipping", None),
    Config(f"max_grad_norm={MAX_GRAD_NORM}", MAX_GRAD_NORM),
    Config("+ on_nonfinite='skip'", MAX_GRAD_NORM, skip_nonfinite=True),
)


@dataclass
class Samples:
    """Per-round timings of one configuration, in nanoseconds per microstep.

    Attributes:
        hand: The hand-written loop's time per microstep, one entry per round.
        acc: The accumulator's time per microstep, one entry per round.
    """

    hand: list[float] = field(default_factory=list)
    acc: list[float] = field(default_factory=list)

    def ratios(self) -> list[float]:
        """The per-round ratios ``acc / hand``.

        Returns:
            One ratio per round, in round order.
        """
        return [a / h for a, h in zip(self.acc, self.hand, strict=True)]


def _decay(step: int) -> float:
    """The learning-rate factor of `LambdaLR` at ``step``: a slow inverse decay."""
    return 1.0 / (1.0 + 0.01 * step)


def _make_model(width: int) -> nn.Module:
    """A 2-layer MLP ``width -> width -> 1`` with ReLU."""
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))


def _make_data(microsteps: int, batch: int, width: int) -> list[Batch]:
    """``microsteps`` microbatches of ``batch`` rows, made once and shared by both sides."""
    return [(torch.randn(batch, width), torch.randn(batch, 1)) for _ in range(microsteps)]


def _make_optimizer(model: nn.Module) -> tuple[torch.optim.SGD, LambdaLR]:
    """A fresh SGD optimizer (with momentum) and `LambdaLR` scheduler on ``model``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    return optimizer, LambdaLR(optimizer, _decay)


def run_hand(base: nn.Module, data: Sequence[Batch], config: Config) -> tuple[int, nn.Module]:
    """Train one epoch with the hand-written loop on a copy of ``base``.

    Args:
        base: The initial model; it is copied, never trained.
        data: The epoch's microbatches; ``len(data)`` is a multiple of `STEPS`.
        config: Whether to clip at the boundary.

    Returns:
        The epoch's wall time in nanoseconds, and the trained copy.
    """
    model = copy.deepcopy(base)
    optimizer, scheduler = _make_optimizer(model)
    steps = STEPS
    max_grad_norm = config.max_grad_norm
    gc.collect()
    start = time.perf_counter_ns()
    for index, (x, y) in enumerate(data, start=1):
        loss = F.mse_loss(model(x), y)
        (loss / steps).backward()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        if index % steps == 0:
            norm = None
            if max_grad_norm is not None:
                norm = clip_grad_norm_(model.parameters(), max_grad_norm)
            if norm is None or not config.skip_nonfinite or torch.isfinite(norm).item():
                optimizer.step()
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter_ns() - start
    return elapsed, model


def run_acc(base: nn.Module, data: Sequence[Batch], config: Config) -> tuple[int, nn.Module]:
    """Train one epoch with `gradaccum.Accumulator` on a copy of ``base``.

    Args:
        base: The initial model; it is copied, never trained.
        data: The epoch's microbatches; ``len(data)`` is a multiple of `STEPS`.
        config: Whether to clip at the boundary (``max_grad_norm``).

    Returns:
        The epoch's wall time in nanoseconds, and the trained copy.
    """
    model = copy.deepcopy(base)
    optimizer, scheduler = _make_optimizer(model)
    with gradaccum.Accumulator(
        model,
        optimizer,
        scheduler,
        steps=STEPS,
        max_grad_norm=config.max_grad_norm,
        on_nonfinite="skip" if config.skip_nonfinite else None,
    ) as acc:
        gc.collect()
        start = time.perf_counter_ns()
        for x, y in acc.epoch(data):
            loss = F.mse_loss(model(x), y)
            with acc.microstep(loss):
                pass
        elapsed = time.perf_counter_ns() - start
    return elapsed, model


def _max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between corresponding parameters of two models."""
    with torch.no_grad():
        return max(
            (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
        )


def measure(
    rounds: int, microsteps: int, width: int, batch: int
) -> tuple[dict[str, Samples], dict[str, float]]:
    """Run the warm-up and the interleaved rounds of every configuration.

    Args:
        rounds: Timed rounds; each times one epoch per side and configuration.
        microsteps: Microbatches per epoch, a multiple of `STEPS`.
        width: The MLP's input and hidden width.
        batch: Rows per microbatch.

    Returns:
        The per-round samples of each configuration, and the largest parameter
        difference between the two sides after the last round of each.
    """
    torch.manual_seed(0)
    base = _make_model(width)
    data = _make_data(microsteps, batch, width)
    samples = {config.name: Samples() for config in CONFIGS}
    # Move everything alive now (torch's own objects included) out of the collector's
    # reach, so that the gc.collect() before each timed epoch is quick and no full
    # collection of them can land inside one side's timing.
    gc.collect()
    gc.freeze()
    diffs: dict[str, float] = {}
    for index in range(WARMUP_ROUNDS + rounds):
        for config in CONFIGS:
            # Alternate which side goes first, so neither always runs on a warmer cache.
            if index % 2 == 0:
                hand_ns, hand_model = run_hand(base, data, config)
                acc_ns, acc_model = run_acc(base, data, config)
            else:
                acc_ns, acc_model = run_acc(base, data, config)
                hand_ns, hand_model = run_hand(base, data, config)
            if index >= WARMUP_ROUNDS:
                samples[config.name].hand.append(hand_ns / microsteps)
                samples[config.name].acc.append(acc_ns / microsteps)
            diffs[config.name] = _max_param_diff(hand_model, acc_model)
    return samples, diffs


def _quantiles(values: Sequence[float]) -> tuple[float, float, float]:
    """The 10th percentile, median and 90th percentile of ``values`` (at least 2)."""
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return deciles[0], statistics.median(values), deciles[-1]


def summarize(samples: Samples, diff: float) -> dict[str, float | bool]:
    """Reduce one configuration's samples to what the report prints.

    Args:
        samples: The configuration's per-round timings.
        diff: The largest parameter difference between the two sides.

    Returns:
        Median µs per microstep of both sides, the ratio's p10, median and p90, whether
        the median is within `TARGET`, and ``diff``.
    """
    p10, median, p90 = _quantiles(samples.ratios())
    return {
        "hand_us": statistics.median(samples.hand) / 1000,
        "gradaccum_us": statistics.median(samples.acc) / 1000,
        "overhead_us": (statistics.median(samples.acc) - statistics.median(samples.hand)) / 1000,
        "ratio_p10": p10,
        "ratio_median": median,
        "ratio_p90": p90,
        "within_target": median <= TARGET,
        "max_param_diff": diff,
    }


def _multiple_of_steps(text: str) -> int:
    """Parse ``--microsteps``: a positive multiple of `STEPS`, so no window is partial."""
    value = int(text)
    if value <= 0 or value % STEPS:
        msg = f"must be a positive multiple of {STEPS}, got {value}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers of at least ``low``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            msg = f"must be at least {low}, got {value}"
            raise argparse.ArgumentTypeError(msg)
        return value

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line.

    Args:
        argv: The arguments, or ``None`` for ``sys.argv[1:]``.

    Returns:
        The parsed flags.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=_at_least(2), default=40, help="timed rounds (40)")
    parser.add_argument(
        "--microsteps",
        type=_multiple_of_steps,
        default=400,
        help=f"microbatches per epoch and side, a multiple of {STEPS} (400)",
    )
    parser.add_argument(
        "--width",
        type=_at_least(1),
        nargs="+",
        default=[128, 256],
        help="MLP widths, each measured in turn (128 256)",
    )
    parser.add_argument("--batch", type=_at_least(1), default=32, help="rows per microbatch (32)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, then print the table (or JSON).

    Args:
        argv: The arguments, or ``None`` for ``sys.argv[1:]``.

    Returns:
        The exit status: always 0, timings are reported, never asserted on.
    """
    args = parse_args(argv)
    torch.set_num_threads(1)
    reports = []
    for width in args.width:
        started = time.perf_counter()
        samples, diffs = measure(args.rounds, args.microsteps, width, args.batch)
        results = {name: summarize(samples[name], diffs[name]) for name in samples}
        setup = {
            "model": f"MLP {width}->{width}->1 (ReLU), MSE loss",
            "batch": args.batch,
            "steps": STEPS,
            "optimizer": "SGD(lr=0.01, momentum=0.9) + LambdaLR",
            "rounds": args.rounds,
            "warmup_rounds": WARMUP_ROUNDS,
            "microsteps": args.microsteps,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "gradaccum": gradaccum.__version__,
            "python": platform.python_version(),
            "target": TARGET,
            "seconds": round(time.perf_counter() - started, 1),
        }
        reports.append({"setup": setup, "results": results})
        if not args.json:
            _print_report(setup, results)
    if args.json:
        print(json.dumps(reports, indent=None))
    return 0


def _print_report(setup: dict[str, object], results: dict[str, dict[str, float | bool]]) -> None:
    """Print one width's table and verdicts."""
    print(
        f"gradaccum overhead: {setup['model']}, batch {setup['batch']}, steps={STEPS}, "
        f"{setup['optimizer']}"
    )
    print(
        f"torch {torch.__version__} on CPU, torch.set_num_threads(1); {setup['rounds']} rounds "
        f"(+{WARMUP_ROUNDS} warm-up) x {setup['microsteps']} microsteps per side, "
        f"interleaved; {setup['seconds']} s"
    )
    header = (
        f"{'configuration':<20}{'hand µs':>10}{'gradaccum µs':>14}{'+µs':>8}"
        f"{'ratio p10':>11}{'median':>9}{'p90':>8}{'max |Δparam|':>14}"
    )
    print(header)
    print("-" * len(header))
    for name, row in results.items():
        print(
            f"{name:<20}{row['hand_us']:>10.1f}{row['gradaccum_us']:>14.1f}"
            f"{row['overhead_us']:>8.1f}{row['ratio_p10']:>11.3f}{row['ratio_median']:>9.3f}"
            f"{row['ratio_p90']:>8.3f}{row['max_param_diff']:>14.1e}"
        )
    print("(µs: median per microstep; ratio: gradaccum / hand per round)")
    for name, row in results.items():
        verdict = "within target" if row["within_target"] else "over target"
        print(f"{name}: median ratio {row['ratio_median']:.3f} (target <= {TARGET}): {verdict}")
    print()


if __name__ == "__main__":
    sys.exit(main())
