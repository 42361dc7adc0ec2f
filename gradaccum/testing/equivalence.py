"""Check a training function's accumulation against one big float64 batch per window.

`check_accumulation` runs the user's own loop (any wrapping, with or without the
`Accumulator`, one optimizer or several), reads what its optimizers held at each step
(their hyperparameters, the full gradient) and compares the gradient each step saw and
the parameters after it with an unwrapped float64 copy of the model (in the parameters'
dtype where the loss or the forward casts to a fixed one) trained on one big batch per
window at those hyperparameters; it counts the optimizer and scheduler steps
and the collectives of each window. One call, one report to assert on.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from gradaccum.checks import check_choice, check_max_grad_norm
from gradaccum.errors import ConfigError, ConfigTypeError, describe
from gradaccum.ranks import Ranks
from gradaccum.schedule import check_bool, check_count, check_positive, check_steps, total_steps
from gradaccum.schedule import trained_microbatches as _trained
from gradaccum.sync import unwrap
from gradaccum.testing.counting import (
    KINDS,
    CollectiveCounter,
    Counts,
    WindowWatch,
    check_optimizers,
    in_words,
    kind_named,
    usual,
)
from gradaccum.testing.diagnosis import (
    blind_spots,
    clip_factor,
    collective_problem,
    ddp_problem,
    gap,
    gradient_problem,
    not_per_item_problem,
    per_microbatch,
    random_forward_problem,
    ranks_apart_problem,
    rate_problem,
    step_problem,
    worse,
)
from gradaccum.testing.observed import (
    Gradient,
    Observed,
    RateMoved,
    apply_hyperparameters,
    cpu64,
    flat,
    full_params,
)
from gradaccum.testing.ranks import check_timeout, run_ranks

__all__ = ["AccumulationReport", "check_accumulation", "expected_windows"]

Batch = Any
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]
MakeOptimizer = Callable[[Iterator[nn.Parameter]], Optimizers]
Train = Callable[[nn.Module, Any, Any, Sequence[Batch]], object]
Loss = Callable[[nn.Module, Batch], torch.Tensor]
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
    """What `check_accumulation` found; ``assert report.ok, str(report)`` in a test
    (pytest cuts a message that is not a string to 240 characters, unless ``-vv``).

    Attributes:
        steps: Microbatches per window.
        world_size: Ranks that trained.
        mode: ``"mean"`` (each microbatch's loss is a mean) or ``"items"`` (a sum, with
            ``num_items``).
        expected_steps: ``total_steps(n_batches, steps, epochs, drop_last)``.
        optimizer_steps: ``optimizer.step()`` calls (rank 0's; with several optimizers,
            those of the one farthest from ``expected_steps``).
        scheduler_steps: ``scheduler.step()`` calls, alike, or None without a scheduler.
        max_abs_diff: The largest gap, over every window, parameter and rank, between
            the trained parameters and the reference, float64 unless ``reference`` says
            otherwise (NaN if one was NaN).
        worst_window: The window (from 1) where it occurred, or None.
        max_grad_diff: The largest gap, over every window and rank, between the
            gradient the trainer's optimizers saw at their step and the reference
            window's gradient (clipped as the trainer's was): over every element, or of
            the norm alone with ``gradients == "norm"``.
        worst_grad_window: The window (from 1) where it occurred, or None.
        gradients: ``"full"``: the full gradient was compared, element by element;
            ``"norm"``: its norm only (FSDP1 keeps gradients in flat shards).
        learning_rates: The learning rate of every param group (optimizer by optimizer)
            that the trainer's optimizers held at each window's step, on rank 0: the
            hyperparameters the reference steps with (it applies every param-group
            entry the trainer's held, a scheduler given or not).
        tolerance: The largest gap accepted.
        per_window: What a window usually ran (per kind, the count most windows ran).
        windows: What each window ran on rank 0, up to the step that closed it.
        expected_collectives: The collectives per window asked for, by kind.
        ranks_agree: Every rank made as many optimizer and scheduler steps.
        problems: The promises broken, in words, each with the mistake it most likely
            comes from; empty when the check passes.
        blind_spots: The mistakes these batches cannot show (a loop making one trains
            exactly as the right one on them), with what batches would: an epoch that
            ``steps`` divides, one window, equal item counts. Shown, not failed.
        autocast: The dtype (``"bfloat16"``) of the ``torch.autocast`` the trainer's
            forwards ran under, where it is below the parameters' precision: the default
            tolerance is that dtype's. None otherwise.
        computed: Where no such autocast was seen around the forwards, the dtype below
            the parameters' precision that their autograd graph carries: an autocast
            inside the model's ``forward`` (Accelerate's ``mixed_precision`` puts one
            there) or a cast; the default tolerance is that dtype's. None otherwise.
        reference: The dtype the reference trained in: ``"float64"``, or the trainer's
            parameters' (``"float32"``) where make_model's model and the loss do not run
            in float64 (they cast to a fixed dtype, ``x.float()``); the tolerance is the
            trainer's dtype's either way.
        amplified: Where the parameters' gap is the optimizer's response to rounding, the
            gap of a copy stepped with the trainer's own gradients; else None.
        reduced_in_step: Where the optimizers reduce the gradient over the ranks inside
            their ``step()`` (nanochat's DistAdamW, ZeRO-style optimizers: no DDP), what a
            window usually ran there; the gradient compared is then the ranks' mean, and
            the reference steps its optimizers in a world of one rank. None otherwise.
        reordered: The trainer's forwards consumed the microbatches in another order
            than given (a sampler that shuffles them: Hugging Face's Trainer's, by
            default); the reference cut its windows in the order consumed.
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
    max_grad_diff: float = 0.0
    worst_grad_window: int | None = None
    gradients: Literal["full", "norm"] = "full"
    learning_rates: list[list[float]] = field(default_factory=list)
    blind_spots: list[str] = field(default_factory=list)
    autocast: str | None = None
    computed: str | None = None
    reference: str = "float64"
    amplified: float | None = None
    reduced_in_step: Counts | None = None
    reordered: bool = False

    @property
    def ok(self) -> bool:
        """The gradients, the parameters, the step counts and the collectives asked for
        all held."""
        return not self.problems

    def __repr__(self) -> str:
        """The verdict and the problems, then the figures: what ``assert report.ok,
        str(report)`` shows."""
        verdict = "ok" if self.ok else "FAILED"
        scheduler = "" if self.scheduler_steps is None else f"/{self.scheduler_steps}"
        grad = "grad" if self.gradients == "full" else "grad norm"
        rates = sorted(
            {f"{rate:.1e}" for window in self.learning_rates for rate in window}, key=float
        )
        lr = ""
        if len(rates) == 1:
            lr = f" (lr {rates[0]})"
        elif rates:
            lr = f" (lr in [{rates[0]}, {rates[-1]}])"
        amp = f", the forwards ran under autocast to {self.autocast}" if self.autocast else ""
        amp = f", the forwards computed in {self.computed}" if self.computed else amp
        lines = [
            f"accumulation at steps={self.steps} on {self.world_size} "
            f"rank{'s' if self.world_size > 1 else ''} ({self.mode} mode): {verdict}",
            *(f"  {problem}" for problem in self.problems),
            f"  optimizer{'/scheduler' if scheduler else ''} steps "
            f"{self.optimizer_steps}{scheduler} of {self.expected_steps}; "
            f"max |{grad} - reference| {self.max_grad_diff:.1e}, "
            f"|param - reference| {self.max_abs_diff:.1e} (tolerance {self.tolerance:.0e}{amp}); "
            f"per window: {self.per_window}",
            f"  the reference stepped with the hyperparameters the trainer's optimizers held{lr}",
            *(
                [
                    f"  the reference ran in {self.reference}: the loss or the model's forward "
                    "does not run in float64 (it casts to a fixed dtype)"
                ]
                if self.reference != "float64"
                else []
            ),
            *(
                [
                    f"  the parameters' gap to the reference is the optimizer's: its "
                    f"gradients matched, and stepping a {self.reference} copy of the "
                    "optimizer with them gives its parameters to "
                    f"{self.amplified:.1e} (an update that scales a gradient up, such as "
                    "Adam's, of a parameter whose true gradient is 0: a bias before a "
                    "batch norm, an attention's key bias)"
                ]
                if self.amplified is not None
                else []
            ),
            *([self._reduced_line()] if self.reduced_in_step is not None else []),
            *(
                [
                    "  the trainer consumed the microbatches in another order than given (it "
                    "shuffles them): the reference cut its windows in the order consumed"
                ]
                if self.reordered
                else []
            ),
            # (One heading, however many spots: what they are is said once.)
            *(["  not seen with these batches (never failed):"] if self.blind_spots else []),
            *(f"    - {spot}" for spot in self.blind_spots),
        ]
        return "\n".join(lines)

    def _reduced_line(self) -> str:
        """What the optimizers that reduce inside ``step()`` ran there, per window."""
        inside = self.reduced_in_step or Counts()
        ran = " + ".join(in_words(n, kind) for kind, n in inside.collectives.items())
        where = (
            "all at the boundary"
            if dict(inside.collectives) == dict(self.per_window.collectives)
            else f"of the window's {self.per_window}"
        )
        return (
            "  the optimizers average the gradients over the ranks inside step(): judged on "
            f"the averaged gradient, {ran} per window, {where}"
        )


def check_accumulation(
    make_model: Callable[[], nn.Module],
    make_optimizer: MakeOptimizer,
    train: Train,
    batches: Sequence[Sequence[Batch]],
    loss: Loss,
    *,
    steps: int,
    make_scheduler: Callable[[Any], Any] | None = None,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    num_items: Callable[[Batch], int | torch.Tensor] | None = None,
    drop_last: bool = True,
    epochs: int = 1,
    max_grad_norm: float | None = None,
    expect_collectives: Mapping[str, int] | None = None,
    tolerance: float | None = None,
    backend: str = "gloo",
    scheduler_per: Literal["window", "epoch"] = "window",
    timeout: float = 60.0,
) -> AccumulationReport:
    """Train with the user's own loop and check it against one big batch per window.

    On each rank: ``model = wrap(make_model())``, ``optimizer =
    make_optimizer(model.parameters())`` (one optimizer or a sequence of them),
    ``scheduler = make_scheduler(optimizer)``, then ``train(model, optimizer, scheduler,
    copy.deepcopy(list(batches[rank])))`` once per epoch. While it trains, a pre-hook on
    each optimizer reads,
    at each ``optimizer.step()``, every param-group entry (the learning rate however it
    was set: by a scheduler or by hand, ``param_group["lr"] = get_lr(it)``) and the full,
    unsharded gradient of its parameters (under FSDP1, the gradient's norm); a window
    ends once every optimizer has stepped, where the full parameters are read and the
    collectives of the window counted with a `CollectiveCounter`.

    Then an unwrapped copy, ``make_model()`` in float64 on the CPU (or, where its first
    microbatch's loss does not run in float64, as when the loss or the forward casts to
    ``float32``, in the trainer's parameters' dtype, which the report notes), starting
    from the wrapped model's parameters before training, is trained with its own
    ``make_optimizer`` on one big batch per window, as `expected_windows` cuts each
    epoch: the mean of the mean losses of every rank's microbatches of the window, or
    with ``num_items`` their summed losses over their total items; clipped to
    ``max_grad_norm`` if given (one norm over every parameter); each of its optimizers
    stepped with the hyperparameters the trainer's held at that window's step (its
    implementation flags, ``foreach``, ``fused``, ``capturable``, ``differentiable``,
    kept). ``make_scheduler``'s schedulers are only counted: each must step once per
    window. A learning rate that changes between two training forwards of one window
    (read by a forward pre-hook, whoever set it) is named as a schedule advanced every
    microbatch, which the reference, stepping with the rates held, cannot show. Model
    and loss must be deterministic (no dropout) and each microbatch's loss its own (no
    SyncBatchNorm over several ranks): the reference computes each microbatch's loss
    alone, so a plain batch norm, which normalizes each microbatch by its own
    statistics, is checked as the trainer runs it.

    Each window's gradient is compared with the reference's, then the parameters after
    it; a problem names the likely mistake where what was seen shows one: a gradient a
    constant factor off ("4.00x the reference's: is the loss divided by steps?"), the
    last partial window divided by ``steps``, the previous window's gradient left in
    (no ``zero_grad()``), a window boundary one microbatch off (``i % steps == 0``), in
    item mode a loop that averages its microbatches' means, a
    scheduler stepped per microbatch, a window never stepped or stepped with no
    gradient, DDP all-reducing on every microbatch.

    With ``len(batches)`` above 1, the ranks are launched with `run_ranks` (so every
    callable must be a module-level function or a ``functools.partial`` of one), unless
    this process is already one of as many ranks (under ``torchrun``, or inside
    `run_ranks`): then each rank checks its own share and all get the same report.

    Args:
        make_model: Builds the unwrapped model; called once to train and once for the
            reference (only its architecture is used there).
        make_optimizer: Builds the optimizer, or a sequence of optimizers (an SGD on the
            weights and an Adam on the biases), on the parameters given; the parameters
            come as an iterator, so a factory that splits them makes a list first.
        train: The loop under test: one epoch of ``batches[rank]``, with the
            accumulation, ``optimizer.step()`` and ``scheduler.step()`` it does itself;
            it gets what ``make_optimizer`` and ``make_scheduler`` returned, and a copy
            of the batches each epoch (it may pop from them), in any order: the
            reference's windows are cut in the order its training forwards consumed
            them (matched by value with the batches), which a shuffling loader changes.
        batches: Each rank's microbatches, ``batches[rank]``, the same number per rank.
        loss: ``loss(model, batch)``, the loss ``train`` back-propagates: a mean over
            the batch, or with ``num_items`` a sum.
        steps: Microbatches per window in ``train``.
        make_scheduler: Builds the LR scheduler on what ``make_optimizer`` returned:
            one scheduler (or None), or for a sequence of optimizers a sequence aligned
            with it, one scheduler or None per optimizer. None for none (a trainer that
            sets the learning rate by hand needs none).
        wrap: Wraps the model as ``train`` expects it (``DistributedDataParallel``, a
            function that applies ``fully_shard``), or None for the model itself.
        num_items: Item mode: the items (tokens) of a microbatch; the window's gradient
            must equal that of the summed loss over the window's items on every rank.
        drop_last: Each epoch's trailing partial window is dropped (else stepped).
        epochs: Epochs to train (``train`` is called once for each).
        max_grad_norm: The clipping ``train`` applies to each window's gradient.
        expect_collectives: Collectives a window must usually run, by kind, as a report
            names them (``"all_reduce"`` or ``"all-reduce"``, ``"reduce"``,
            ``"all_gather"``, ...: `gradaccum.testing.Counts` lists them), the trainer's
            own included: ``{"all_reduce": 1}`` for DDP that syncs once per window and
            all-reduces nothing else. Without an all-reduce count, a DDP model's sync is
            checked anyway: its all-reduces must run in one backward a window.
        tolerance: The largest gap accepted, for gradients and parameters; by default
            1e-10 for a float64 model, 1e-4 for float32, 5e-2 below, and 5e-2 too where
            the model's forwards computed in a lower precision: under ``torch.autocast``
            to it (seen by a forward pre-hook on the model), or in it by the autograd
            graph of their outputs (an autocast inside ``forward``, or a cast).
        backend: The launched ranks' backend, ``"gloo"`` or ``"nccl"``.
        scheduler_per: How often ``train`` steps ``make_scheduler``'s schedulers:
            ``"window"``, once per window (a schedule in optimizer steps), or
            ``"epoch"``, once per epoch (a schedule in epochs, as a ``StepLR`` by
            epochs); the learning rates are followed either way.
        timeout: Launched ranks: seconds a collective may wait; a rank still checking
            twice that after every rank started is killed (`run_ranks`). Raise it for a
            large model on a busy machine.

    Returns:
        The report: ``report.ok``, and ``str(report)`` says what broke.

    Raises:
        ConfigError, ConfigTypeError: An argument cannot be used (named in the message),
            or the trainer's optimizer grew param groups the reference cannot follow.
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
        ...             optimizer.param_groups[0]["lr"] = 0.1 / (1 + i)  # set by hand
        ...             optimizer.step()
        ...             optimizer.zero_grad()
        >>> data = [(torch.randn(4, 3).double(), torch.randn(4, 1).double()) for _ in range(5)]
        >>> report = check_accumulation(
        ...     make_model, lambda p: torch.optim.SGD(p, lr=0.1), train, [data], loss, steps=2
        ... )
        >>> report.ok, report.optimizer_steps, report.expected_steps
        (True, 2, 2)
        >>> report.learning_rates
        [[0.05], [0.025]]
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
        scheduler_per=check_choice(scheduler_per, "scheduler_per", ("window", "epoch")),
    )
    setup.check()
    check_choice(backend, "backend", ("gloo", "nccl"))
    timeout = check_timeout(timeout)
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
    return _merge(setup, run_ranks(_run_on_rank, world, (setup,), backend=backend, timeout=timeout))


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
    """``expect_collectives`` by kind, each name as a report prints it or as its kind."""
    if expected is None:
        return {}
    if not isinstance(expected, Mapping):
        msg = (
            "expect_collectives must be a mapping {kind: count per window} or None, got "
            f"{describe(expected)}"
        )
        raise ConfigTypeError(msg)
    kinds = {}
    for name, count in expected.items():
        kind = kind_named(name) if isinstance(name, str) else None
        if kind is None:
            msg = (
                f"expect_collectives has the key {name!r}; the kinds are "
                f"{', '.join(map(repr, KINDS))} (or as a report prints them: 'all-reduce')"
            )
            raise ConfigError(msg)
        kinds[kind] = check_count(count, f"expect_collectives[{name!r}]")
    return kinds


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
    make_optimizer: MakeOptimizer
    train: Train
    batches: tuple[tuple[Batch, ...], ...]
    loss: Loss
    steps: int
    make_scheduler: Callable[[Any], Any] | None
    wrap: Callable[[nn.Module], nn.Module] | None
    num_items: Callable[[Batch], int | torch.Tensor] | None
    drop_last: bool
    epochs: int
    max_grad_norm: float | None
    expect_collectives: dict[str, int]
    tolerance: float | None
    scheduler_per: str

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

    def optimizers(self, params: Iterator[nn.Parameter]) -> tuple[Any, tuple[Any, ...]]:
        """What ``make_optimizer(params)`` returned, and its optimizers as a tuple."""
        made = self.make_optimizer(params)
        expected = (
            "make_optimizer must return a torch.optim.Optimizer or a non-empty sequence of them"
        )
        return made, check_optimizers(made, expected)

    def item_counts(self) -> list[list[int]] | None:
        """Each rank's microbatches' items in item mode, else None."""
        count = self.num_items
        if count is None:
            return None
        return [[int(count(batch)) for batch in mine] for mine in self.batches]

    def windows(self) -> list[range]:
        """Each window of every epoch, in order: its microbatches' indices in the epoch."""
        epoch = expected_windows(len(self.batches[0]), self.steps, self.drop_last)
        return epoch * self.epochs

    def dropped_before(self, window: int) -> int:
        """The microbatches the previous epoch dropped, where ``window`` (from 1) is the
        first window of an epoch after the first; else 0."""
        n = len(self.batches[0])
        per_epoch = len(expected_windows(n, self.steps, self.drop_last))
        first = window > 1 and (window - 1) % per_epoch == 0
        return n % self.steps if first and self.drop_last else 0

    def window_lengths(self) -> list[int]:
        """The microbatches of each window of every epoch, in order."""
        return [len(window) for window in self.windows()]


def _schedulers(made: object, optimizers: int) -> dict[str, Any]:
    """What ``make_scheduler`` returned, by the name a report gives each: ``scheduler``,
    or ``schedulers[i]`` for a sequence aligned with the optimizers (None entries left
    out)."""
    if made is None:
        return {}
    if isinstance(made, Sequence) and not isinstance(made, str):
        if len(made) != optimizers:
            msg = (
                f"make_scheduler returned {len(made)} schedulers for {optimizers} "
                f"optimizer{'s' * (optimizers > 1)}; return one scheduler or None per optimizer"
            )
            raise ConfigError(msg)
        found = {f"schedulers[{i}]": one for i, one in enumerate(made) if one is not None}
    else:
        found = {"scheduler": made}
    for name, scheduler in found.items():
        if not callable(getattr(scheduler, "step", None)):
            msg = f"make_scheduler's {name} must have a step() method, got {describe(scheduler)}"
            raise ConfigTypeError(msg)
    return found


@dataclass
class _Run:
    """What one rank measured."""

    optimizer_steps: dict[str, int]  # by the name a report gives each
    scheduler_steps: dict[str, int]
    max_abs_diff: float
    worst_window: int | None
    tolerance: float
    windows: list[Counts]
    max_grad_diff: float
    worst_grad_window: int | None
    grad_problem: tuple[int, str] | None  # the first window whose gradient is off, and why
    gradients: Literal["full", "norm"]
    learning_rates: list[list[float]]
    ddp: bool
    norms: tuple[float, float]  # the reference's least and largest gradient norms, unclipped
    largest: float  # the largest entry (or norm, with gradients == "norm") compared
    autocast: str | None  # the dtype of the autocast that set the precision, if one did
    computed: str | None  # else the dtype in the forwards' graph that set it, if one did
    not_per_item: dict[str, str]  # the dropouts and synced batch norms in its forwards
    left_over: bool  # forwards after the last step left a gradient in the parameters
    random_forward: bool  # off the reference, and two forwards of a microbatch differ
    reference: str  # the dtype the reference ran in ("float64", or the parameters')
    rate_moved: RateMoved | None  # the first learning rate that moved inside a window
    ranks_apart: int | None  # the first window after which the ranks' parameters differ
    bypassed: int  # under DDP, training forwards of its inner module outside DDP's forward
    # Off the reference, its gradients on it: the gap to the optimizer stepped with the
    # trainer's own gradients (`_replayed`); None where not asked or not seen.
    replayed: float | None = None
    # The optimizers reduce inside step(): what a window ran there; None where not.
    reduced_in_step: Counts | None = None
    summed: bool = False  # their step applies the ranks' sum: a copy stepped so lands
    reordered: bool = False  # the trainer consumed its microbatches in another order
    sync_turned_off: bool | None = None  # under DDP, a backward ran with its sync off


def _run_on_rank(rank: int, world: int, setup: _Setup) -> _Run:
    return _run(setup, rank)


def _cast(batch: Batch, dtype: torch.dtype) -> Batch:
    """``batch`` with its floating-point tensors in ``dtype`` on the CPU (any nesting of
    tuples, lists and dicts)."""
    if isinstance(batch, torch.Tensor):
        return batch.to("cpu", dtype) if batch.is_floating_point() else batch.cpu()
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cast(item, dtype) for item in batch)
    if isinstance(batch, dict):
        return {key: _cast(value, dtype) for key, value in batch.items()}
    return batch


def _run(setup: _Setup, rank: int) -> _Run:
    """Train with the user's loop on this rank, then check it against the reference."""
    from torch.distributed._composable.replicate import DDP as Replicated  # noqa: N811
    from torch.nn.parallel import DistributedDataParallel

    wrapped = setup.make_model()
    if not isinstance(wrapped, nn.Module):
        msg = f"make_model must return a torch.nn.Module, got {describe(wrapped)}"
        raise ConfigTypeError(msg)
    if setup.wrap is not None:
        wrapped = setup.wrap(wrapped)
    made, optimizers = setup.optimizers(wrapped.parameters())
    scheduler = setup.make_scheduler(made) if setup.make_scheduler is not None else None
    schedulers = _schedulers(scheduler, len(optimizers))
    start = full_params(wrapped)
    counter = CollectiveCounter()
    observed = Observed(wrapped, optimizers, counter)
    # Refuses a model whose parameters it cannot match, or that it cannot run.
    reference = _Reference(setup, start, observed.dtype)
    after: list[list[torch.Tensor]] = []

    def window_closed() -> None:
        counter.end_window()
        observed.end_window()
        with counter.paused():  # gathering shards to compare them is not training
            after.append(full_params(wrapped))

    scheduler_steps = dict.fromkeys(schedulers, 0)
    for name, one in schedulers.items():
        one.step = _counted(one.step, scheduler_steps, name)  # through the instance
    try:
        with observed, WindowWatch(optimizers, window_closed), counter:
            for _ in range(setup.epochs):
                # A copy each epoch: a loop that consumes its batches (torchtune's
                # ``labels = batch.pop("labels")``) or shuffles the list in place is
                # checked, as it runs for its users, rather than crashing on a tuple or
                # on what the previous epoch left. The order its forwards consume them
                # in is the reference's (`Observed.orders`).
                given = copy.deepcopy(list(setup.batches[rank]))
                observed.new_epoch(given)
                setup.train(wrapped, made, scheduler, given)
    finally:
        for one in schedulers.values():
            del one.step  # its class's step again
    # The tolerance follows the lowest precision the trainer computes in: its parameters',
    # that of the autocast its forwards ran under, or one their graph carries.
    lowest = max(
        [observed.dtype, *observed.autocast, *observed.computed],
        key=lambda kind: torch.finfo(kind).eps,
    )
    precision = str(lowest).removeprefix("torch.")
    autocast = precision if lowest in observed.autocast else None
    tolerance = setup.tolerance
    if tolerance is None:
        tolerance = _TOLERANCES.get(lowest, _LOW_PRECISION_TOLERANCE)
    world = len(setup.batches)
    orders: list[Any] = [observed.orders()]
    if world > 1:  # (the reference takes every rank's microbatches)
        orders = orders * world
        dist.all_gather_object(orders, orders[0])
    reference.orders = [list(epoch) for epoch in zip(*orders, strict=True)]
    reduced = world > 1 and _reduced_in_step(observed, counter.counts)
    if reduced:
        observed.average_over_ranks([param.shape for param in start])
        reference.alone = _world_of_one()
    windows = list(reference.windows(observed.hyperparameters))
    worst, where = 0.0, None
    for index, (got, want) in enumerate(zip(after, windows, strict=False)):
        for mine, theirs in zip(got, want.params, strict=True):
            if worse(candidate := gap(mine, theirs), worst):
                worst, where = candidate, index + 1
    grad_diff, grad_window, grad_problem = _compare_gradients(
        setup,
        observed,
        windows,
        tolerance,
        len(setup.batches),
        lambda index: reference.microbatches_alone(
            index, windows[index - 1].params if index else start, beyond=1
        ),
        str(reference.dtype).removeprefix("torch."),
        lambda index: reference.mean_of_means(index, windows[index - 1].params if index else start),
    )
    several = len(optimizers) > 1
    replayed = None  # (every gradient on the reference, the parameters not)
    if not worst <= tolerance and grad_diff <= tolerance and not observed.norm_only:
        replayed = reference.replayed(start, observed, after)
    # An optimizer that sums the ranks' gradients in step(): stepped so from the trainer's
    # own (averaged) gradients, a copy lands on its parameters; each window's gradient
    # after the first is then read at parameters already off, and is no cause.
    summed = reduced and not worst <= tolerance
    summed = summed and reference.replayed(start, observed, after, world) <= tolerance
    if summed:
        grad_problem = None
    off = grad_problem is not None or not worst <= tolerance
    drawn = off and not observed.not_per_item and reference.random_forward()
    apart = _ranks_apart(after, tolerance)  # (on every rank: collectives, off or not)
    return _Run(
        optimizer_steps={
            f"optimizers[{i}]" if several else "optimizer": n
            for i, n in enumerate(observed.steps())
        },
        scheduler_steps=scheduler_steps,
        max_abs_diff=worst,
        worst_window=where,
        tolerance=tolerance,
        windows=counter.windows,
        max_grad_diff=grad_diff,
        worst_grad_window=grad_window,
        grad_problem=grad_problem,
        gradients="norm" if observed.norm_only else "full",
        learning_rates=observed.learning_rates(),
        ddp=isinstance(unwrap(wrapped), (DistributedDataParallel, Replicated)),
        norms=_extremes([float(flat(window.raw).norm()) for window in windows]),
        largest=_largest(windows, observed.norm_only),
        autocast=autocast,
        computed=precision if autocast is None and lowest in observed.computed else None,
        not_per_item=observed.not_per_item,
        left_over=observed.forwards_after > 0 and _left_over(wrapped),
        random_forward=drawn,
        rate_moved=observed.rate_moved,
        ranks_apart=apart,
        bypassed=observed.bypassed,
        reference=str(reference.dtype).removeprefix("torch."),
        replayed=replayed,
        reduced_in_step=usual(observed.in_step) if reduced else None,
        summed=summed,
        reordered=any(order != sorted(order) for epoch in reference.orders for order in epoch),
        sync_turned_off=observed.sync_turned_off,
    )


def _reduced_in_step(observed: Observed, counts: Counts) -> bool:
    """Whether every rank's optimizers reduced the gradient inside ``step()``
    (`Observed.reduced_in_step`): one collective, so that all average, or none."""
    device = Ranks(dist.group.WORLD, torch.device("cpu")).device
    flag = torch.tensor([int(observed.reduced_in_step(counts))], device=device)
    dist.all_reduce(flag, dist.ReduceOp.MIN)
    return bool(flag.item())


def _world_of_one() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A context in which the default process group is this rank's alone, so that an
    optimizer that reduces over the ranks inside ``step()`` (``dist.all_reduce(grad)``,
    ``dist.get_world_size()``) steps the reference as on one process: its averaging is
    then checked, not repeated on every rank's copy of the same gradient. (torch keeps
    the default group in ``distributed_c10d._world``, which has no public setter; a torch
    without it steps the reference on every rank alike, which checks the loop but not
    the averaging.)"""
    from torch.distributed import distributed_c10d

    state: Any = getattr(distributed_c10d, "_world", None)
    if not hasattr(state, "default_pg"):
        return contextlib.nullcontext
    alone = dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)

    @contextlib.contextmanager
    def inside() -> Iterator[None]:
        world, state.default_pg = state.default_pg, alone
        try:
            yield
        finally:
            state.default_pg = world

    return inside


def _ranks_apart(after: list[list[torch.Tensor]], tolerance: float) -> int | None:
    """On several ranks, the first window after which the ranks' parameters (``after``, by
    window) differ by more than ``tolerance``, the same on every rank; else None. One
    collective over the default group a window, up to that one (the spread is the same on
    every rank, so all stop there), after one that agrees on the windows closed: every
    rank's check reaches them."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    # The parameters compared are on the CPU: a group that takes no CPU tensor (NCCL
    # alone) compares them on its own device.
    device = Ranks(dist.group.WORLD, torch.device("cpu")).device
    closed = torch.tensor([len(after)], device=device)
    dist.all_reduce(closed, dist.ReduceOp.MIN)
    for index, params in enumerate(after[: int(closed.item())]):
        values = flat(params).to(device)
        if not values.numel():  # (no parameter: nothing to differ, on any rank)
            return None
        extremes = torch.cat([values, -values])  # the largest, and (negated) the least
        dist.all_reduce(extremes, dist.ReduceOp.MAX)
        if float((extremes[: len(values)] + extremes[len(values) :]).max()) > tolerance:
            return index + 1
    return None


def _left_over(model: nn.Module) -> bool:
    """A nonzero gradient is left in this rank's part of the parameters (no collective)."""
    for param in model.parameters():
        grad = param.grad
        if grad is not None:
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if bool(local.any()):
                return True
    return False


def _largest(windows: list[_Window], norm_only: bool) -> float:
    """The largest value compared with a window's gradient: an entry of the reference's,
    or its norm where only the norm is compared."""
    return max(
        (
            float(flat(window.grad).norm() if norm_only else flat(window.grad).abs().max())
            for window in windows
            if window.grad
        ),
        default=0.0,
    )


def _extremes(values: list[float]) -> tuple[float, float]:
    return (min(values), max(values)) if values else (0.0, 0.0)


def _counted(step: Callable[..., Any], counts: dict[str, int], name: str) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[name] += 1
        return step(*args, **kwargs)

    return counted


def _compare_gradients(
    setup: _Setup,
    observed: Observed,
    windows: list[_Window],
    tolerance: float,
    world: int,
    microbatches_alone: Callable[[int], list[list[torch.Tensor]]],
    reference: str = "float64",
    mean_of_means: Callable[[int], list[torch.Tensor]] | None = None,
) -> tuple[float, int | None, tuple[int, str] | None]:
    """The largest gap between each window's gradient and the reference's, its window,
    and what the first window off the reference shows (``microbatches_alone(index)``:
    the gradient of each of that window's microbatches alone, then of the one after it
    in its epoch, where there is one, `_Reference.microbatches_alone`; in item mode,
    ``mean_of_means(index)``, its gradient as mean mode weighs it,
    `_Reference.mean_of_means`)."""
    worst, where, problem = 0.0, None, None
    shapes = [grad.shape for grad in windows[0].grad] if windows else []
    lengths = setup.window_lengths()
    extra = max(observed.steps(), default=0) > len(lengths)  # more steps than windows
    previous: Gradient | None = None
    for index, (got, want) in enumerate(
        zip(observed.window_gradients(shapes), windows, strict=False)
    ):
        expected = want.seen_as(got.positions)
        if worse(candidate := gap(got.values, expected), worst):
            worst, where = candidate, index + 1
        # (More steps than windows: the steps do not line up with the windows, and their
        # count names the mistake.)
        if problem is None and not candidate <= tolerance and not extra:
            accumulated = None  # what the step would have seen had the last one's stayed
            kept: dict[str, torch.Tensor] = {}  # had one optimizer's stayed, by its name
            if got.positions is not None and previous and previous.positions == got.positions:
                accumulated = _clipped(
                    previous.values + want.raw_seen_as(got.positions), setup.max_grad_norm
                )
                if len(observed.grads) > 1 and setup.max_grad_norm is None:
                    kept = _kept_by_one(
                        observed, index, got.positions, shapes, expected, accumulated
                    )
            norm, max_norm = float(flat(want.raw).norm()), setup.max_grad_norm
            # The window's last microbatches alone, (one process, mean mode) what
            # clipping after every backward steps with, and, for an epoch's first window,
            # what its first microbatches step with, where the window has more than one.
            last = clipped_each = None
            first: dict[int, torch.Tensor] = {}
            positions = got.positions
            if positions is not None and lengths[index] > 1:
                alone = microbatches_alone(index)
                within = alone[: lengths[index]]
                last = flat([within[-1][i] for i in positions])
                if world == 1 and max_norm is not None and setup.num_items is None:
                    each = _clipped_each(within, max_norm)
                    clipped_each = flat([each[i] for i in positions])
                if setup.windows()[index].start == 0:
                    first = _first_microbatches(setup, alone, positions)
            means = None  # (item mode) what a loop averaging its microbatches' means gives
            if positions is not None and setup.num_items is not None and mean_of_means:
                # (clipped as the trainer clips its own: the clip factor is no mismatch)
                whole = mean_of_means(index)
                cut = 1.0 if max_norm is None else clip_factor(float(flat(whole).norm()), max_norm)
                means = flat([whole[i] * cut for i in positions])

            text = gradient_problem(
                index + 1,
                got.values,
                expected,
                accumulated,
                kept=kept,
                last=last,
                clipped_each=clipped_each,
                first=first,
                means=means,
                length=lengths[index],
                steps=setup.steps,
                world=world,
                items=setup.num_items is not None,
                norm_only=got.positions is None,
                tolerance=tolerance,
                clip=None if max_norm is None else (norm, max_norm),
                # (A loop that stepped the dropped microbatches is named by its step count.)
                dropped_before=0 if extra else setup.dropped_before(index + 1),
                reference=reference,
            )
            problem = (index + 1, text)
        previous = got
    return worst, where, problem


def _kept_by_one(
    observed: Observed,
    index: int,
    positions: tuple[int, ...],
    shapes: Sequence[torch.Size],
    expected: torch.Tensor,
    accumulated: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """For each of several optimizers, by its name: window ``index``'s gradient (flat, at
    ``positions``) had that optimizer's parameters kept the previous window's
    (``accumulated``) and the others' not (``expected``): one optimizer not zeroed."""
    sizes = [shapes[i].numel() for i in positions]
    found = {}
    for number, steps in enumerate(observed.grads):
        mine = set(steps[index]) if index < len(steps) else set()
        if not mine:
            continue
        pieces, start = [], 0
        for position, size in zip(positions, sizes, strict=True):
            source = accumulated if position in mine else expected
            pieces.append(source[start : start + size])
            start += size
        found[f"optimizers[{number}]"] = torch.cat(pieces)
    return found


def _first_microbatches(
    setup: _Setup, alone: list[list[torch.Tensor]], positions: tuple[int, ...]
) -> dict[int, torch.Tensor]:
    """The gradient (flat, at ``positions``) of the epoch's first ``m`` microbatches as one
    window, up to a factor, by ``m``, for every ``m`` of ``alone`` (each microbatch's
    gradient alone, `_Reference.microbatches_alone`): their sum, each weighed by its
    items in item mode (its gradient alone is its loss over them)."""
    counts = setup.item_counts()
    weights = (
        [1] * len(alone) if counts is None else [sum(each) for each in zip(*counts, strict=True)]
    )
    found = {}
    total = [torch.zeros_like(grad) for grad in alone[0]]
    for m, (grads, weight) in enumerate(zip(alone, weights, strict=False), start=1):
        total = [sum_ + grad * weight for sum_, grad in zip(total, grads, strict=True)]
        found[m] = flat([total[i] for i in positions])
    return found


def _clipped_each(microbatches: list[list[torch.Tensor]], max_norm: float) -> list[torch.Tensor]:
    """The gradient (per parameter) that a loop clipping after every backward steps with:
    each microbatch's share (its gradient over the window's microbatches) added to the
    running sum, which ``clip_grad_norm_`` then clips, in turn."""
    share = 1 / len(microbatches)
    running = [torch.zeros_like(grad) for grad in microbatches[0]]
    for grads in microbatches:
        running = [total + grad * share for total, grad in zip(running, grads, strict=True)]
        norm = float(torch.linalg.vector_norm(flat(running)))
        running = [total * clip_factor(norm, max_norm) for total in running]
    return running


def _clipped(grad: torch.Tensor, max_norm: float | None) -> torch.Tensor:
    """``grad`` (flat) clipped as ``clip_grad_norm_`` clips to ``max_norm``."""
    if max_norm is None:
        return grad
    return grad * clip_factor(float(grad.norm()), max_norm)


@dataclass
class _Window:
    """The reference after one window."""

    params: list[torch.Tensor]
    grad: list[torch.Tensor]  # clipped as the trainer's must be
    raw: list[torch.Tensor]  # before clipping

    def seen_as(self, positions: tuple[int, ...] | None) -> torch.Tensor:
        """The gradient as a `Gradient` at ``positions`` holds it: those parameters',
        flat, or for None the whole gradient's norm."""
        if positions is None:
            norm: torch.Tensor = torch.linalg.vector_norm(flat(self.grad))
            return norm.reshape(1)
        return flat([self.grad[i] for i in positions])

    def raw_seen_as(self, positions: tuple[int, ...]) -> torch.Tensor:
        return flat([self.raw[i] for i in positions])


class _Reference:
    """The unwrapped copy of the model on the CPU, trained one big batch per window: in
    float64, or in ``fallback`` (the trainer's parameters' dtype) where make_model's model
    and the loss do not run in float64 (a cast to a fixed dtype, ``x.float()``, in the
    loss or the forward), so that such a model is checked rather than crashed on after
    the trainer ran; ``dtype`` is the one it runs in.

    Raises:
        ConfigError: The wrapped model's parameters are not make_model's, or the first
            microbatch's loss raises in float64 and in ``fallback``.
    """

    def __init__(self, setup: _Setup, start: list[torch.Tensor], fallback: torch.dtype) -> None:
        self.setup = setup
        # Where the optimizers step: as they are, or in a world of one (`_world_of_one`).
        self.alone: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
        # Per epoch, per rank, the order the trainer consumed the microbatches in.
        self.orders: list[list[list[int]]] = []
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
        raised: list[tuple[torch.dtype, Exception]] = []
        for dtype in dict.fromkeys((torch.float64, fallback)):
            self.dtype = dtype
            self.model.to(dtype)
            self._load(start)
            self.data = [[_cast(batch, dtype) for batch in mine] for mine in setup.batches]
            error = self._first_loss()
            if error is None:
                return
            raised.append((dtype, error))
        tried = ", then ".join(
            f"in {str(dtype).removeprefix('torch.')} raised {type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            for dtype, error in raised
        )
        msg = (
            "the reference cannot run make_model's model and the loss: loss(model, "
            f"batches[0][0]) on its copy on the CPU {tried}. The reference trains a copy "
            "in float64, or else in the trainer's parameters' dtype, so a cast in the loss "
            "or the model's forward must follow the parameters' dtype rather than a fixed "
            "one: x.to(next(model.parameters()).dtype), not x.float()"
        )
        raise ConfigError(msg) from raised[-1][1]

    def _first_loss(self) -> Exception | None:
        """What the first microbatch's loss raises on the model as it is, or None: under a
        forked random state and no grad, before the trainer runs, so nothing it draws
        moves and nothing is half done when the model cannot run here."""
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            try:
                self.setup.loss(self.model, self.data[0][0])
            except Exception as error:  # (whatever the user's code raises, named)
                return error
        return None

    def _load(self, values: list[torch.Tensor]) -> None:
        """Set the model's parameters to ``values``."""
        with torch.no_grad():
            for param, value in zip(self.model.parameters(), values, strict=True):
                param.copy_(value)

    def _at(self, window: int, places: Iterable[int]) -> list[Batch]:
        """Every rank's microbatches at ``places`` of the epoch of window ``window`` (from
        0), rank by rank, in the order the trainer consumed that epoch's (`orders`)."""
        epoch = window * self.setup.epochs // len(self.setup.windows())
        orders = self.orders[epoch] if self.orders else [None] * len(self.data)
        return [
            mine[place if order is None else order[place]]
            for mine, order in zip(self.data, orders, strict=True)
            for place in places
        ]

    def random_forward(self) -> bool:
        """Two losses of the first microbatch, at the same parameters, differ: the forward
        draws random numbers (a functional ``F.dropout``, say, which no module shows).
        Under a forked random state: nothing the trainer draws moves."""
        batch = self.data[0][0]
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            first = self.setup.loss(self.model, batch)
            second = self.setup.loss(self.model, batch)
        return not torch.equal(first, second)

    def microbatches_alone(
        self, index: int, at: list[torch.Tensor], beyond: int = 0
    ) -> list[list[torch.Tensor]]:
        """The gradient, at the parameters ``at``, of each microbatch of window ``index``
        (from 0) alone (every rank's at that place, as one window's loss weighs them),
        then of the ``beyond`` microbatches after it in its epoch (those there are): the
        window's last is what a loop that clears the gradient before every backward
        steps with (up to a factor), and sums of the first ones what a loop whose
        window ends a microbatch off does. Leaves the model at ``at``; read after
        `windows`."""
        self._load(at)
        params = list(self.model.parameters())
        found = []
        window = self.setup.windows()[index]
        for place in range(window.start, min(window.stop + beyond, len(self.data[0]))):
            self.model.zero_grad(set_to_none=True)
            micro = self._at(index, [place])
            _window_loss(self.model, self.setup.loss, micro, self.setup.num_items).backward()  # type: ignore[no-untyped-call]
            found.append([_grad_of(param) for param in params])
        return found

    def mean_of_means(self, index: int, at: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradient, at the parameters ``at``, of window ``index`` (from 0) in item
        mode as mean mode's reference weighs it: the mean over its microbatches (every
        rank's) of each one's summed loss over its own items, what a loop that averages
        its microbatches' means steps with. Leaves the model at ``at``; read after
        `windows`."""
        loss, count = self.setup.loss, self.setup.num_items

        def item_mean(model: nn.Module, batch: Batch) -> torch.Tensor:
            return loss(model, batch) / (1 if count is None else int(count(batch)))

        self._load(at)
        self.model.zero_grad(set_to_none=True)
        micro = self._at(index, self.setup.windows()[index])
        _window_loss(self.model, item_mean, micro).backward()  # type: ignore[no-untyped-call]
        return [_grad_of(param) for param in self.model.parameters()]

    def replayed(
        self,
        start: list[torch.Tensor],
        observed: Observed,
        after: list[list[torch.Tensor]],
        scale: float = 1.0,
    ) -> float:
        """The largest gap between the trainer's parameters after each window and those
        of the reference's optimizers stepped from ``start`` with the gradients the
        trainer's steps saw (times ``scale``), at the hyperparameters they held. Leaves
        the model there; read after `windows`.

        Where the trainer's gradients match the reference's and its parameters do not,
        this tells what the optimizer made of their rounding-level differences: Adam's
        update of a gradient that is 0 in exact arithmetic (a bias before a batch norm,
        the key bias of an attention) and about 1e-9 in float32 is a step of the learning
        rate, where the float64 reference's, of a gradient of about 1e-17, is none."""
        self._load(start)
        params = list(self.model.parameters())
        _, optimizers = self.setup.optimizers(self.model.parameters())
        worst = 0.0
        steps = zip(*observed.grads, *observed.hyperparameters, strict=False)
        for index, (seen, got) in enumerate(zip(steps, after, strict=False)):
            grads, held = seen[: len(optimizers)], seen[len(optimizers) :]
            self.model.zero_grad(set_to_none=True)
            for step in grads:
                for position, grad in step.items():
                    params[position].grad = None if grad is None else grad.to(self.dtype) * scale
            for optimizer, groups in zip(optimizers, held, strict=True):
                apply_hyperparameters(optimizer, groups, index)
                with self.alone():
                    optimizer.step()
            for mine, theirs in zip(got, params, strict=True):
                worst = max(worst, gap(mine, cpu64(theirs)))
        return worst

    def windows(self, hyperparameters: list[list[Any]]) -> Iterator[_Window]:
        """The reference after each window, every epoch, each optimizer stepped at the
        hyperparameters the trainer's held at its step of that window (its own
        ``make_optimizer``'s, where the trainer's made fewer steps)."""
        setup = self.setup
        _, optimizers = setup.optimizers(self.model.parameters())
        params = list(self.model.parameters())
        for step, window in enumerate(setup.windows()):
            self.model.zero_grad(set_to_none=True)
            micro = self._at(step, window)
            big = _window_loss(self.model, setup.loss, micro, setup.num_items)
            big.backward()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            raw = [_grad_of(param) for param in params]
            if setup.max_grad_norm is not None:
                nn.utils.clip_grad_norm_(params, setup.max_grad_norm)
            grad = [_grad_of(param) for param in params]
            for optimizer, seen in zip(optimizers, hyperparameters, strict=True):
                if step < len(seen):
                    apply_hyperparameters(optimizer, seen[step], step)
                with self.alone():
                    optimizer.step()
            yield _Window([cpu64(param) for param in params], grad, raw)


def _grad_of(param: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(param) if param.grad is None else cpu64(param.grad)


def _merge(setup: _Setup, runs: list[_Run]) -> AccumulationReport:
    """One report from every rank's run: the worst gaps, rank 0's counts, the first
    window whose gradient is off on any rank, and whether the ranks agree."""
    first = runs[0]
    n = len(setup.batches[0])
    expected = total_steps(n, setup.steps, setup.epochs, setup.drop_last)
    worst, where = first.max_abs_diff, first.worst_window
    grad_worst, grad_where = first.max_grad_diff, first.worst_grad_window
    for run in runs[1:]:
        if worse(run.max_abs_diff, worst):
            worst, where = run.max_abs_diff, run.worst_window
        if worse(run.max_grad_diff, grad_worst):
            grad_worst, grad_where = run.max_grad_diff, run.worst_grad_window
    per_window = usual(first.windows)
    problems = []
    active = {name: kind for run in runs for name, kind in run.not_per_item.items()}
    if active:
        problems.append(not_per_item_problem(active))
    elif any(run.random_forward for run in runs):
        problems.append(random_forward_problem())
    agree = True
    for name in [*first.optimizer_steps, *first.scheduler_steps]:
        counts = [{**run.optimizer_steps, **run.scheduler_steps}[name] for run in runs]
        if len(set(counts)) > 1:
            agree = False
            problems.append(f"the ranks disagree on the {name} steps: {counts}")
        elif problem := step_problem(
            name,
            counts[0],
            n_batches=n,
            steps=setup.steps,
            epochs=setup.epochs,
            drop_last=setup.drop_last,
            per_epoch=setup.scheduler_per == "epoch" and name.startswith("scheduler"),
        ):
            problems.append(problem)
    # A learning rate that moved inside a window: the reference steps with the rates held
    # at each step, so nothing else shows it; a scheduler counted one per microbatch
    # already names the mistake.
    moved = [run.rate_moved for run in runs if run.rate_moved is not None]
    counted = any(
        per_microbatch(
            count, n_batches=n, steps=setup.steps, epochs=setup.epochs, drop_last=setup.drop_last
        )
        for count in first.scheduler_steps.values()
    )
    if moved and not counted:
        rate = min(moved, key=lambda found: found.window)
        label = f"optimizers[{rate.optimizer}]" if len(first.optimizer_steps) > 1 else "optimizer"
        if rate.groups > 1:
            label += f".param_groups[{rate.group}]"
        problems.append(rate_problem(label, rate.window, rate.before, rate.after, setup.steps))
    backwards = per_window.backwards
    made_inside = (
        len(runs) > 1
        and backwards.get("all_reduce", 0) > 1
        and not backwards.get("reduce_scatter", 0)
    )
    if first.ranks_apart is not None and (
        problem := ranks_apart_problem(
            first.ranks_apart,
            backwards.get("all_reduce", 0),
            setup.steps,
            ddp=first.ddp or made_inside,
        )
    ):
        problems.append(problem)
    off = [run.grad_problem for run in runs if run.grad_problem is not None]
    if off:
        problems.append(min(off, key=lambda found: found[0])[1])
    # Parameters off the reference with the gradients on it are the optimizer's response
    # to rounding where stepping them with the trainer's own gradients lands on them.
    amplified = [run.replayed for run in runs if run.replayed is not None]
    if any(
        not run.max_abs_diff <= first.tolerance
        and not (run.replayed is not None and run.replayed <= first.tolerance)
        for run in runs
    ):
        summed = (
            f": the optimizers' step() applies the sum of the {len(runs)} ranks' gradients "
            f"(a copy stepped with {len(runs)}x their mean lands on the trainer's "
            f"parameters); does it reduce them without dividing by the {len(runs)} ranks?"
            if any(run.summed for run in runs)
            else ""
        )
        problems.append(
            f"parameters off the {first.reference} big-batch reference by {worst:.1e} after window "
            f"{where} (tolerance {first.tolerance:.0e}){summed}"
        )
        amplified = []
    for kind, count in setup.expect_collectives.items():
        if problem := collective_problem(
            kind,
            per_window.collectives.get(kind, 0),
            count,
            outside=per_window.outside_backward.get(kind, 0),
            backwards=per_window.backwards.get(kind, 0),
            steps=setup.steps,
            ddp=first.ddp,
            gradient_off=bool(off),
            bypassed=first.bypassed,
            turned_off=first.sync_turned_off,
        ):
            problems.append(problem)
    # Under DDP, where no all-reduce count is expected, DDP's sync is still checked: the
    # check's own wrap, or one the trainer makes (accelerator.prepare inside train), seen
    # on several ranks as all-reduces in more than one backward a window, with no
    # reduce-scatter (HSDP's all-reduce follows its reduce-scatter every microbatch).
    if (
        (first.ddp or made_inside)
        and "all_reduce" not in setup.expect_collectives
        and (
            why := ddp_problem(
                per_window.backwards.get("all_reduce", 0),
                setup.steps,
                bool(off),
                bypassed=first.bypassed,
                turned_off=first.sync_turned_off,
            )
        )
    ):
        problems.append(
            f"{in_words(per_window.all_reduces, 'all_reduce')} per window at "
            f"steps={setup.steps}: {why}"
        )
    return AccumulationReport(
        steps=setup.steps,
        world_size=len(setup.batches),
        mode="mean" if setup.num_items is None else "items",
        expected_steps=expected,
        optimizer_steps=_farthest(first.optimizer_steps.values(), expected),
        scheduler_steps=(
            _farthest(first.scheduler_steps.values(), expected) if first.scheduler_steps else None
        ),
        max_abs_diff=worst,
        worst_window=where,
        tolerance=first.tolerance,
        per_window=per_window,
        windows=first.windows,
        expected_collectives=dict(setup.expect_collectives),
        ranks_agree=agree,
        problems=problems,
        max_grad_diff=grad_worst,
        worst_grad_window=grad_where,
        gradients=first.gradients,
        learning_rates=first.learning_rates,
        blind_spots=blind_spots(
            setup.windows(),
            n_batches=n,
            steps=setup.steps,
            items=setup.item_counts(),
            clip=(setup.max_grad_norm, *first.norms),
            scale=(first.tolerance, first.largest),
            epochs=setup.epochs,
            drop_last=setup.drop_last,
            left_over=first.left_over,
        ),
        autocast=first.autocast,
        computed=first.computed,
        reference=first.reference,
        amplified=max(amplified) if amplified else None,
        reduced_in_step=first.reduced_in_step,
        reordered=any(run.reordered for run in runs),
    )


def _farthest(counts: Iterable[int], expected: int) -> int:
    """The count farthest from ``expected``, so that no optimizer hides another."""
    return max(counts, key=lambda count: abs(count - expected))
