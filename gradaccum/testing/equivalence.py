"""Check a training function's accumulation against one big float64 batch per window.

`check_accumulation` runs the user's own loop (any wrapping, with or without the
`Accumulator`) and compares its parameters after every window with an unwrapped float64
copy of the model trained on one big batch per window; it counts the optimizer and
scheduler steps and the collectives of each window. One call, one report to assert on.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from gradaccum.checks import check_choice, check_max_grad_norm
from gradaccum.errors import ConfigError, ConfigTypeError, describe
from gradaccum.schedule import check_bool, check_count, check_positive, check_steps, total_steps
from gradaccum.schedule import trained_microbatches as _trained
from gradaccum.sync import full_tensor, unwrap
from gradaccum.testing.counting import CollectiveCounter, Counts, in_words, usual
from gradaccum.testing.ranks import run_ranks

__all__ = ["AccumulationReport", "check_accumulation", "expected_windows"]

Batch = Any
Train = Callable[[nn.Module, torch.optim.Optimizer, Any, Sequence[Batch]], object]
Loss = Callable[[nn.Module, Batch], torch.Tensor]

_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
# The default tolerance by the dtype the user's model trains in: float64 must match to
# rounding; lower precisions drift from the float64 reference as windows go by.
_TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-4}
_LOW_PRECISION_TOLERANCE = 5e-2


def expected_windows(n_batches: int, steps: int, drop_last: bool = True) -> list[range]:
    """The windows an epoch of ``n_batches`` microbatches is cut into: the microbatch
    indices of each, in order. With ``drop_last`` the trailing ``n_batches % steps`` are
    in none; without it they form a last, shorter window. ``len()`` of the result is
    ``total_steps(n_batches, steps, 1, drop_last)``.

    Examples:
        >>> expected_windows(10, 4)
        [range(0, 4), range(4, 8)]
        >>> expected_windows(10, 4, drop_last=False)
        [range(0, 4), range(4, 8), range(8, 10)]
    """
    check_count(n_batches, "n_batches")
    check_steps(steps)
    check_bool(drop_last, "drop_last")
    end = _trained(n_batches, steps, drop_last)
    return [range(start, min(start + steps, end)) for start in range(0, end, steps)]


def _window_loss(
    model: nn.Module,
    loss: Loss,
    window: Sequence[Batch],
    num_items: Callable[[Batch], int | torch.Tensor] | None = None,
) -> torch.Tensor:
    """The loss of a window (every rank's microbatches of it) as one big batch: the mean
    of the microbatches' mean losses, or with ``num_items`` the summed losses over the
    window's total items (the token mean, whatever the microbatches' lengths)."""
    losses = [loss(model, batch) for batch in window]
    if num_items is None:
        return torch.stack(losses).sum() / len(window)
    items = sum(int(num_items(batch)) for batch in window)
    return torch.stack(losses).sum() / items


@dataclass
class AccumulationReport:
    """What `check_accumulation` found; ``assert report.ok, report`` in a test.

    Attributes:
        steps: Microbatches per window.
        world_size: Ranks that trained.
        mode: ``"mean"`` (each microbatch's loss is a mean) or ``"items"`` (a sum, with
            ``num_items``).
        expected_steps: ``total_steps(n_batches, steps, epochs, drop_last)``.
        optimizer_steps: ``optimizer.step()`` calls (rank 0's).
        scheduler_steps: ``scheduler.step()`` calls, or None without a scheduler.
        max_abs_diff: The largest gap, over every window, parameter and rank, between
            the trained parameters and the float64 reference (NaN if one was NaN).
        worst_window: The window (from 1) where it occurred, or None.
        tolerance: The largest gap accepted.
        per_window: What a window usually ran (per kind, the count most windows ran).
        windows: What each window ran on rank 0, up to each ``optimizer.step()``.
        expected_collectives: The collectives per window asked for, by kind.
        ranks_agree: Every rank made as many optimizer and scheduler steps.
        problems: The promises broken, in words; empty when the check passes.
    """

    steps: int
    world_size: int
    mode: Literal["mean", "items"]
    expected_steps: int
    optimizer_steps: int
    scheduler_steps: int | None
    max_abs_diff: float
    worst_window: int | None
    tolerance: float
    per_window: Counts
    windows: list[Counts] = field(default_factory=list)
    expected_collectives: dict[str, int] = field(default_factory=dict)
    ranks_agree: bool = True
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The parameters, the step counts and the collectives asked for all held."""
        return not self.problems

    def __repr__(self) -> str:
        """The verdict and the problems, then the figures: what ``assert report.ok,
        report`` shows (pytest cuts a long message, so the problems come first)."""
        verdict = "ok" if self.ok else "FAILED"
        scheduler = "" if self.scheduler_steps is None else f"/{self.scheduler_steps}"
        lines = [
            f"accumulation at steps={self.steps} on {self.world_size} "
            f"rank{'s' if self.world_size > 1 else ''} ({self.mode} mode): {verdict}",
            *(f"  {problem}" for problem in self.problems),
            f"  optimizer{'/scheduler' if scheduler else ''} steps "
            f"{self.optimizer_steps}{scheduler} of {self.expected_steps}; "
            f"max |param - reference| {self.max_abs_diff:.1e} "
            f"(tolerance {self.tolerance:.0e}); per window: {self.per_window}",
        ]
        return "\n".join(lines)


def check_accumulation(
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer],
    train: Train,
    batches: Sequence[Sequence[Batch]],
    loss: Loss,
    *,
    steps: int,
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    num_items: Callable[[Batch], int | torch.Tensor] | None = None,
    drop_last: bool = True,
    epochs: int = 1,
    max_grad_norm: float | None = None,
    expect_collectives: Mapping[str, int] | None = None,
    tolerance: float | None = None,
    backend: str = "gloo",
) -> AccumulationReport:
    """Train with the user's own loop and check it against one big batch per window.

    On each rank: ``model = wrap(make_model())``, ``optimizer =
    make_optimizer(model.parameters())``, ``scheduler = make_scheduler(optimizer)``, then
    ``train(model, optimizer, scheduler, batches[rank])`` once per epoch, counting
    collectives with a `CollectiveCounter` whose windows end at each
    ``optimizer.step()``, and reading the full parameters after each step. Then an
    unwrapped copy, ``make_model()`` in float64 on the CPU, starting from the wrapped
    model's parameters before training, is trained with its own ``make_optimizer`` and
    ``make_scheduler`` on one big batch per window, as `expected_windows` cuts each
    epoch: the mean of the mean losses of every rank's microbatches of the window, or
    with ``num_items`` their summed losses over their total items; clipped to
    ``max_grad_norm`` if given. Model and loss must be deterministic (no dropout, no
    batch norm): one big batch equals the microbatches only for per-item losses.

    With ``len(batches)`` above 1, the ranks are launched with `run_ranks` (so every
    callable must be a module-level function or a ``functools.partial`` of one), unless
    this process is already one of as many ranks (under ``torchrun``, or inside
    `run_ranks`): then each rank checks its own share and all get the same report.

    Args:
        make_model: Builds the unwrapped model; called once to train and once for the
            reference (only its architecture is used there).
        make_optimizer: Builds the optimizer on the parameters given.
        train: The loop under test: one epoch of ``batches[rank]``, with the
            accumulation, ``optimizer.step()`` and ``scheduler.step()`` it does itself.
        batches: Each rank's microbatches, ``batches[rank]``, the same number per rank.
        loss: ``loss(model, batch)``, the loss ``train`` back-propagates: a mean over
            the batch, or with ``num_items`` a sum.
        steps: Microbatches per window in ``train``.
        make_scheduler: Builds the LR scheduler on the optimizer, or None.
        wrap: Wraps the model as ``train`` expects it (``DistributedDataParallel``, a
            function that applies ``fully_shard``), or None for the model itself.
        num_items: Item mode: the items (tokens) of a microbatch; the window's gradient
            must equal that of the summed loss over the window's items on every rank.
        drop_last: Each epoch's trailing partial window is dropped (else stepped).
        epochs: Epochs to train (``train`` is called once for each).
        max_grad_norm: The clipping ``train`` applies to each window's gradient.
        expect_collectives: Collectives a window must usually run, by kind
            (``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"``, ``"broadcast"``),
            such as ``{"all_reduce": 1}`` for DDP that syncs once per window.
        tolerance: The largest gap accepted; by default 1e-10 for a float64 model, 1e-4
            for float32, 5e-2 below.
        backend: The launched ranks' backend, ``"gloo"`` or ``"nccl"``.

    Returns:
        The report: ``report.ok``, and ``str(report)`` says what broke.

    Raises:
        ConfigError, ConfigTypeError: An argument cannot be used (named in the message).
        LaunchError: A launched rank raised (with every rank's traceback).

    Examples:
        >>> def make_model():
        ...     torch.manual_seed(0)
        ...     return torch.nn.Linear(3, 1).double()
        >>> def loss(model, batch):
        ...     return (model(batch[0]) - batch[1]).square().mean()
        >>> def train(model, optimizer, scheduler, batches):  # accumulates 2 per step
        ...     for i, batch in enumerate(batches):
        ...         (loss(model, batch) / 2).backward()
        ...         if i % 2 == 1:
        ...             optimizer.step()
        ...             optimizer.zero_grad()
        >>> data = [(torch.randn(4, 3).double(), torch.randn(4, 1).double()) for _ in range(5)]
        >>> report = check_accumulation(
        ...     make_model, lambda p: torch.optim.SGD(p, lr=0.1), train, [data], loss, steps=2
        ... )
        >>> report.ok, report.optimizer_steps, report.expected_steps
        (True, 2, 2)
    """
    setup = _Setup(
        make_model=make_model,
        make_optimizer=make_optimizer,
        train=train,
        batches=_check_batches(batches),
        loss=loss,
        steps=check_steps(steps),
        make_scheduler=make_scheduler,
        wrap=wrap,
        num_items=num_items,
        drop_last=check_bool(drop_last, "drop_last"),
        epochs=check_positive(epochs, "epochs"),
        max_grad_norm=check_max_grad_norm(max_grad_norm),
        expect_collectives=_check_expected(expect_collectives),
        tolerance=_check_tolerance(tolerance),
    )
    setup.check()
    check_choice(backend, "backend", ("gloo", "nccl"))
    world = len(setup.batches)
    if world == 1 and not _group_up():
        return _merge(setup, [_run(setup, 0)])
    if _group_up():
        if dist.get_world_size() != world:
            msg = (
                f"batches holds the microbatches of {world} ranks but this process is one "
                f"of {dist.get_world_size()}; pass one sequence per rank"
            )
            raise ConfigError(msg)
        runs: list[Any] = [None] * world
        dist.all_gather_object(runs, _run(setup, dist.get_rank()))
        return _merge(setup, runs)
    setup.check_picklable()
    return _merge(setup, run_ranks(_run_on_rank, world, (setup,), backend=backend))


def _group_up() -> bool:
    return dist.is_available() and dist.is_initialized()


def _check_batches(batches: object) -> tuple[tuple[Batch, ...], ...]:
    if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence):
        msg = f"batches must be a sequence of each rank's microbatches, got {describe(batches)}"
        raise ConfigTypeError(msg)
    if not batches:
        msg = "batches must hold each rank's microbatches, got none (0 ranks); pass [microbatches]"
        raise ConfigError(msg)
    for rank, mine in enumerate(batches):
        if isinstance(mine, (str, bytes)) or not isinstance(mine, Sequence):
            msg = (
                f"batches[{rank}] must be a sequence of rank {rank}'s microbatches, got "
                f"{describe(mine)}; for one process pass batches=[microbatches]"
            )
            raise ConfigTypeError(msg)
    lengths = [len(mine) for mine in batches]
    if len(set(lengths)) > 1:
        msg = f"batches must give every rank as many microbatches, got {lengths}"
        raise ConfigError(msg)
    return tuple(tuple(mine) for mine in batches)


def _check_expected(expected: object) -> dict[str, int]:
    if expected is None:
        return {}
    if not isinstance(expected, Mapping):
        msg = (
            "expect_collectives must be a mapping {kind: count per window} or None, got "
            f"{describe(expected)}"
        )
        raise ConfigTypeError(msg)
    for kind, count in expected.items():
        if kind not in _KINDS:
            msg = (
                f"expect_collectives has the key {kind!r}; the kinds are "
                f"{', '.join(map(repr, _KINDS))}"
            )
            raise ConfigError(msg)
        check_count(count, f"expect_collectives[{kind!r}]")
    return dict(expected)


def _check_tolerance(tolerance: object) -> float | None:
    if tolerance is None:
        return None
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool):
        msg = f"tolerance must be a non-negative number or None, got {describe(tolerance)}"
        raise ConfigTypeError(msg)
    if not tolerance >= 0:
        msg = f"tolerance must be a non-negative number or None, got {tolerance}"
        raise ConfigError(msg)
    return float(tolerance)


@dataclass(frozen=True)
class _Setup:
    """Everything a rank needs to run the check (pickled to launched ranks)."""

    make_model: Callable[[], nn.Module]
    make_optimizer: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]
    train: Train
    batches: tuple[tuple[Batch, ...], ...]
    loss: Loss
    steps: int
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None
    wrap: Callable[[nn.Module], nn.Module] | None
    num_items: Callable[[Batch], int | torch.Tensor] | None
    drop_last: bool
    epochs: int
    max_grad_norm: float | None
    expect_collectives: dict[str, int]
    tolerance: float | None

    def callables(self) -> dict[str, object]:
        return {
            "make_model": self.make_model,
            "make_optimizer": self.make_optimizer,
            "train": self.train,
            "loss": self.loss,
            "make_scheduler": self.make_scheduler,
            "wrap": self.wrap,
            "num_items": self.num_items,
        }

    def check(self) -> None:
        """Refuse what cannot be run, before any work."""
        optional = ("make_scheduler", "wrap", "num_items")
        for name, value in self.callables().items():
            if not callable(value) and not (value is None and name in optional):
                msg = f"{name} must be callable{' or None' if name in optional else ''}"
                raise ConfigTypeError(f"{msg}, got {describe(value)}")
        n, world = len(self.batches[0]), len(self.batches)
        if total_steps(n, self.steps, 1, self.drop_last) == 0:
            ranks = (
                f" (batches holds {world} ranks' microbatches; for one process pass "
                "batches=[microbatches])"
                if world > 1
                else ""
            )
            msg = (
                f"an epoch of {n} microbatches gives no optimizer step with "
                f"steps={self.steps} and drop_last={self.drop_last}{ranks}; pass at least "
                f"{self.steps} microbatches per rank, or a smaller steps"
            )
            raise ConfigError(msg)

    def check_picklable(self) -> None:
        for name, value in self.callables().items():
            try:
                pickle.dumps(value)
            except Exception as error:
                msg = (
                    f"{name} cannot be sent to the launched ranks ({type(error).__name__}: "
                    f"{error}); pass a module-level function or a functools.partial of one, "
                    "not a lambda or a local function"
                )
                raise ConfigTypeError(msg) from None


@dataclass
class _Run:
    """What one rank measured."""

    optimizer_steps: int
    scheduler_steps: int | None
    max_abs_diff: float
    worst_window: int | None
    tolerance: float
    windows: list[Counts]


def _run_on_rank(rank: int, world: int, setup: _Setup) -> _Run:
    return _run(setup, rank)


def _full_params(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter, whole, in float64 on the CPU, in the unwrapped module's order."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return [_cpu64(param) for param in model.parameters()]
    return [_cpu64(full_tensor(param.detach())) for param in unwrap(model).parameters()]


def _cpu64(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", torch.float64).clone()


def _to64(batch: Batch) -> Batch:
    """``batch`` with its floating-point tensors in float64 on the CPU (any nesting of
    tuples, lists and dicts)."""
    if isinstance(batch, torch.Tensor):
        return batch.to("cpu", torch.float64) if batch.is_floating_point() else batch.cpu()
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to64(item) for item in batch)
    if isinstance(batch, dict):
        return {key: _to64(value) for key, value in batch.items()}
    return batch


def _run(setup: _Setup, rank: int) -> _Run:
    """Train with the user's loop on this rank, then check it against the reference."""
    wrapped = setup.make_model()
    if not isinstance(wrapped, nn.Module):
        msg = f"make_model must return a torch.nn.Module, got {describe(wrapped)}"
        raise ConfigTypeError(msg)
    if setup.wrap is not None:
        wrapped = setup.wrap(wrapped)
    optimizer = setup.make_optimizer(wrapped.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        msg = f"make_optimizer must return a torch.optim.Optimizer, got {describe(optimizer)}"
        raise ConfigTypeError(msg)
    scheduler = setup.make_scheduler(optimizer) if setup.make_scheduler is not None else None
    start = _full_params(wrapped)
    dtype = next((p.dtype for p in wrapped.parameters() if p.is_floating_point()), torch.float64)
    tolerance = setup.tolerance
    if tolerance is None:
        tolerance = _TOLERANCES.get(dtype, _LOW_PRECISION_TOLERANCE)
    reference = _Reference(setup, start)  # refuses a model whose parameters it cannot match
    counter = CollectiveCounter(optimizer)
    after: list[list[torch.Tensor]] = []

    def snapshot(*_: object) -> None:
        with counter.paused():  # gathering shards to compare them is not training
            after.append(_full_params(wrapped))

    scheduler_steps = [0]
    if scheduler is not None:
        step = scheduler.step  # counted through the instance, whatever its class

        def counted(*args: Any, **kwargs: Any) -> Any:
            scheduler_steps[0] += 1
            return step(*args, **kwargs)

        scheduler.step = counted
    hook = optimizer.register_step_post_hook(snapshot)
    try:
        with counter:
            for _ in range(setup.epochs):
                setup.train(wrapped, optimizer, scheduler, setup.batches[rank])
    finally:
        hook.remove()
        if scheduler is not None:
            del scheduler.step  # its class's step again
    worst, where = 0.0, None
    for index, (got, want) in enumerate(zip(after, reference.trajectory(), strict=False)):
        for mine, theirs in zip(got, want, strict=True):
            gap = (mine - theirs).abs().max().item() if mine.numel() else 0.0
            if not math.isnan(worst) and (math.isnan(gap) or gap > worst):
                worst, where = gap, index + 1
    return _Run(
        optimizer_steps=len(after),
        scheduler_steps=None if scheduler is None else scheduler_steps[0],
        max_abs_diff=worst,
        worst_window=where,
        tolerance=tolerance,
        windows=counter.windows,
    )


class _Reference:
    """The unwrapped float64 copy of the model, trained one big batch per window."""

    def __init__(self, setup: _Setup, start: list[torch.Tensor]) -> None:
        self.setup = setup
        self.model = setup.make_model().to("cpu", torch.float64)
        params = list(self.model.parameters())
        shapes = [tuple(p.shape) for p in params]
        if shapes != [tuple(p.shape) for p in start]:
            msg = (
                f"the wrapped model's parameters (shapes {[tuple(p.shape) for p in start]}) "
                f"do not match make_model()'s ({shapes}); wrap must keep the model's "
                "parameters and their order"
            )
            raise ConfigError(msg)
        with torch.no_grad():
            for param, value in zip(params, start, strict=True):
                param.copy_(value)

    def trajectory(self) -> Iterator[list[torch.Tensor]]:
        """The parameters after each window, every epoch."""
        setup = self.setup
        data = [[_to64(batch) for batch in mine] for mine in setup.batches]
        optimizer = setup.make_optimizer(self.model.parameters())
        scheduler = setup.make_scheduler(optimizer) if setup.make_scheduler else None
        params = list(self.model.parameters())
        for _ in range(setup.epochs):
            for window in expected_windows(len(data[0]), setup.steps, setup.drop_last):
                optimizer.zero_grad(set_to_none=True)
                micro = [mine[i] for mine in data for i in window]
                big = _window_loss(self.model, setup.loss, micro, setup.num_items)
                big.backward()  # type: ignore[no-untyped-call]  # torch leaves it untyped
                if setup.max_grad_norm is not None:
                    nn.utils.clip_grad_norm_(params, setup.max_grad_norm)
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                yield [param.detach().clone() for param in params]


def _merge(setup: _Setup, runs: list[_Run]) -> AccumulationReport:
    """One report from every rank's run: the worst gap, rank 0's counts, and whether the
    ranks agree."""
    first = runs[0]
    n = len(setup.batches[0])
    expected = total_steps(n, setup.steps, setup.epochs, setup.drop_last)
    worst, where = first.max_abs_diff, first.worst_window
    for run in runs[1:]:
        if not math.isnan(worst) and (math.isnan(run.max_abs_diff) or run.max_abs_diff > worst):
            worst, where = run.max_abs_diff, run.worst_window
    per_window = usual(first.windows)
    problems = []
    agree = True
    formula = f"total_steps({n}, {setup.steps}, {setup.epochs}, drop_last={setup.drop_last})"
    for name, counts in (
        ("optimizer", [run.optimizer_steps for run in runs]),
        ("scheduler", [run.scheduler_steps for run in runs if run.scheduler_steps is not None]),
    ):
        if len(set(counts)) > 1:
            agree = False
            problems.append(f"the ranks disagree on the {name} steps: {counts}")
        elif counts and counts[0] != expected:
            problems.append(f"{counts[0]} {name} steps, expected {expected} = {formula}")
    if not worst <= first.tolerance:
        problems.append(
            f"parameters off the float64 big-batch reference by {worst:.1e} after window "
            f"{where} (tolerance {first.tolerance:.0e})"
        )
    for kind, count in setup.expect_collectives.items():
        got = per_window.collectives.get(kind, 0)
        if got != count:
            problems.append(
                f"{in_words(got, kind)} per window at steps={setup.steps}, expected {count}"
            )
    return AccumulationReport(
        steps=setup.steps,
        world_size=len(setup.batches),
        mode="mean" if setup.num_items is None else "items",
        expected_steps=expected,
        optimizer_steps=first.optimizer_steps,
        scheduler_steps=first.scheduler_steps,
        max_abs_diff=worst,
        worst_window=where,
        tolerance=first.tolerance,
        per_window=per_window,
        windows=first.windows,
        expected_collectives=dict(setup.expect_collectives),
        ranks_agree=agree,
        problems=problems,
    )
