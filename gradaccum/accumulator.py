"""`Accumulator`: the facade that turns N microbatches into one optimizer step.

It holds a few parts, each owning its own state: the open `Window` and the `Lifecycle`
(window.py), the `EpochPlan` (plan.py), the checkpoint record (record.py), the `Stepper`
(stepping.py), the boundary's tensor work (boundary.py), the `Ranks` (ranks.py) and the
sync strategy (sync.py). The facade wires them in the order a training loop calls it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar, get_args

import torch
from torch import nn
from typing_extensions import Self

from gradaccum import boundary, checks, faults, hooks, misuse, record, resuming, stepping
from gradaccum.checks import NonFinitePolicy
from gradaccum.errors import (
    ConfigError,
    ConfigTypeError,
    NonFiniteError,
    RankFailedError,
    UsageError,
    describe,
    warn,
)
from gradaccum.plan import EpochPlan, check_epoch_length
from gradaccum.ranks import Ranks
from gradaccum.schedule import check_bool, check_steps
from gradaccum.sync import SyncPolicy, SyncStrategy, strategy_for
from gradaccum.window import Lifecycle, State, Window

__all__ = ["Accumulator", "Step"]

T = TypeVar("T")
_END: Any = object()  # an iterator ran out


class Step:
    """What a microstep reports; the window fields are filled on the boundary only.

    Attributes:
        boundary: This microstep completes the window: the body of its ``with`` block
            sees the window's full gradient, clipped, not yet applied.
        global_step: The optimizer step this window becomes (``acc.global_step`` after
            the block exits); on other microsteps, the steps completed so far.
        loss: The window's loss on this rank, a detached 0-dim tensor, computed on first
            read; ``None`` off the boundary.
        global_loss: The window's loss over every rank, the same on each (see the
            property); ``None`` off the boundary.
        num_items: This rank's items in the window with ``num_items``; ``None`` in mean
            mode and off the boundary.
        grad_norm: The total gradient norm before clipping, a 0-dim tensor; ``None``
            without ``max_grad_norm``.
        lr: The learning rate of the first optimizer's first parameter group for this
            update, as it was at the boundary (a copy when it is a tensor); ``None``
            when that group has no ``"lr"``. The scheduler steps after the block, so
            ``scheduler.get_last_lr()`` read after it is the next window's.
        lrs: The same for each optimizer, in the order given: one entry per optimizer
            (``lrs[0]`` is ``lr``); ``()`` off the boundary.
        skipped: The window was not applied (no optimizer or scheduler step) because
            its gradient held inf/NaN: known in the block under ``on_nonfinite="skip"``
            (and with a GradScaler and several optimizers), and once the block has exited
            when a GradScaler skipped the step.
    """

    __slots__ = (
        "_alone",
        "_by_items",
        "_divisor",
        "_global",
        "_loss",
        "_losses",
        "boundary",
        "global_step",
        "grad_norm",
        "lr",
        "lrs",
        "skipped",
    )
    # Annotations without values, so they document the slots' types and leave __slots__
    # as it is (a class-level value would clash with its slot).
    boundary: bool
    global_step: int
    grad_norm: torch.Tensor | None
    lr: float | torch.Tensor | None
    lrs: tuple[float | torch.Tensor | None, ...]
    skipped: bool

    def __init__(
        self,
        boundary: bool,
        global_step: int,
        *,
        losses: Sequence[torch.Tensor] = (),
        divisor: int | torch.Tensor = 1,
        by_items: bool = False,
        grad_norm: torch.Tensor | None = None,
        lrs: tuple[float | torch.Tensor | None, ...] = (),
        alone: bool = True,
        global_totals: torch.Tensor | None = None,
    ) -> None:
        self.boundary = boundary
        self.global_step = global_step
        self.grad_norm = grad_norm
        self.lrs = lrs
        self.lr = lrs[0] if lrs else None
        self.skipped = False
        self._losses = losses
        self._divisor = divisor
        self._by_items = by_items
        self._alone = alone
        self._global = global_totals
        self._loss: torch.Tensor | None = None

    @property
    def loss(self) -> torch.Tensor | None:
        """The window's loss on this rank, a detached 0-dim tensor; ``None`` off the
        boundary.

        The mean of the microbatch losses, or with ``num_items`` the summed losses over
        the window's items. Computed on first read, so an unread loss costs nothing.
        """
        if self._loss is None and self._losses:
            total = torch.stack(list(self._losses)).sum()
            self._loss = total / self._divisor
        return self._loss

    @property
    def num_items(self) -> int | torch.Tensor | None:
        """This rank's items in the window (the sum of its ``num_items``, as passed: an
        int, or a 0-dim tensor); ``None`` in mean mode and off the boundary."""
        return self._divisor if self._by_items and self._losses else None

    @property
    def global_loss(self) -> torch.Tensor | None:
        """The window's loss over every rank, the same on each, a detached 0-dim tensor.

        With ``num_items``: the summed losses of every rank's items over their total,
        which rides on the item total's all-reduce (no extra collective or host sync).
        In mean mode: the mean of the ranks' window losses, all-reduced at the boundary
        when the accumulator was built with ``global_loss=True``, and ``None`` without it
        (on one process too, so that a loop behaves alike on any number of ranks). On
        one process it is `loss`. Reading it never launches a collective; ``None`` off
        the boundary.
        """
        if not self._losses:
            return None
        if self._alone:
            return self.loss
        totals = self._global
        if totals is None or totals.ndim == 0:
            return totals
        # items mode: (items, summed losses) over the ranks, in float64.
        self._global = (totals[1] / totals[0]).to(self._losses[0].dtype)
        return self._global

    def __repr__(self) -> str:
        fields = (
            "boundary",
            "global_step",
            "loss",
            "global_loss",
            "num_items",
            "grad_norm",
            "lr",
            "skipped",
        )
        shown = [f"{name}={getattr(self, name)!r}" for name in fields]
        if len(self.lrs) > 1:
            shown.insert(-1, f"lrs={self.lrs!r}")
        return f"Step({', '.join(shown)})"


class Accumulator:
    """Accumulate gradients over ``steps`` microbatches and step once per window.

    Args:
        model: The module whose forward produces the losses.
        optimizer: An optimizer, or a sequence of them (a Muon + AdamW split), each on
            its own share of the model's parameters; one window steps every one of them
            once, in the order given. The accumulator owns their ``step()`` and
            ``zero_grad()`` from now on, and clears any gradient it finds. Accelerate's
            prepared optimizer is unwrapped: gradaccum steps the optimizer it wraps.
        scheduler: Optional LR scheduler, stepped once per applied window: with one
            optimizer, a scheduler or None; with several, None or a sequence with one
            entry per optimizer, in their order (a scheduler on that optimizer, or None).
            Accelerate's prepared scheduler is unwrapped, so it steps once per window
            on any number of processes.
        steps: Microbatches per optimizer step (``1``: no accumulation).
        max_grad_norm: Clip the window's gradient to this total norm at the boundary,
            one norm over every optimizer's parameters (``math.inf`` reports the norm
            without clipping).
        scaler: An enabled ``torch.amp.GradScaler``: every microstep's loss is scaled,
            and the gradient is unscaled, clipped, stepped and the scale updated once
            per window (each optimizer unscaled and stepped, the scale updated once). A
            disabled scaler is the same as none. With several optimizers the window's
            gradient is checked for inf/NaN at the boundary (one host sync), so that
            either every optimizer steps or none does.
        drop_last: In `epoch`, skip each epoch's trailing microbatches that do not fill
            a window; when False they form one shorter window, scaled by its length.
        sync: When a wrapped model communicates gradients. ``"auto"`` defers to the
            boundary where that costs no memory (DDP; HSDP's all-reduce) and reduces
            every microstep where deferring would hold unsharded gradients (FSDP1,
            ``fully_shard``); ``"boundary"`` always defers; ``"every"`` never does. An
            unwrapped module never communicates, so all three agree.
        on_nonfinite: What a window whose gradient holds inf/NaN does at its boundary:
            ``None`` (no check, no cost, as plain PyTorch), ``"raise"`` `NonFiniteError`
            naming the window, or ``"skip"`` the whole window (every optimizer and
            scheduler). A check costs one host sync per window, and one scalar
            all-reduce when several ranks hold the gradients, so that every rank decides
            the same. With a GradScaler, which skips overflowing windows by design, only
            ``None`` and ``"skip"`` apply.
        global_loss: In mean mode, report `Step.global_loss`: each window's loss is
            all-reduced at its boundary (one scalar all-reduce per window under several
            ranks; nothing on one process). With ``num_items`` it is free and always
            reported.

    Raises:
        UsageError: An optimizer is owned by another open accumulator whose window is
            open (one between windows is closed, with a warning, and this one takes over).
        ConfigTypeError: An argument has the wrong type.
        ConfigError: An argument has a value outside what is accepted, the model has no
            trainable parameter, an optimizer holds none of them, two optimizers share
            a parameter, the schedulers do not line up with the optimizers, or the
            model's wrapping cannot defer as ``sync`` asks (DDP with
            ``static_graph=True``).

    Attributes:
        model: The model, as given.
        optimizer: The optimizer argument, as given (one, or the sequence).
        scheduler: The scheduler argument, as given.
        optimizers: The optimizers the accumulator steps, in order (Accelerate's
            prepared ones unwrapped).
        schedulers: Their schedulers, one entry per optimizer (None where it has none).

    Examples:
        >>> model = torch.nn.Linear(3, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> acc = Accumulator(model, optimizer, steps=2)
        >>> for x in acc.epoch(torch.randn(5, 3)):   # 2 windows; the 5th row is dropped
        ...     loss = model(x).square().mean()
        ...     with acc.microstep(loss) as step:
        ...         pass
        >>> acc.global_step
        2
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        scheduler: Any = None,
        *,
        steps: int = 1,
        max_grad_norm: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
        drop_last: bool = True,
        sync: SyncPolicy = "auto",
        on_nonfinite: NonFinitePolicy | None = None,
        global_loss: bool = False,
    ) -> None:
        scaler = checks.check_scaler(scaler)
        parts = checks.check_parts(model, optimizer, scheduler, scaler)
        steps = check_steps(steps)
        self._options = _Options(
            max_grad_norm=checks.check_max_grad_norm(max_grad_norm),
            scaler=scaler,
            drop_last=check_bool(drop_last, "drop_last"),
            sync=checks.check_choice(sync, "sync", get_args(SyncPolicy)),
            on_nonfinite=checks.check_on_nonfinite(on_nonfinite, scaler),
            global_loss=check_bool(global_loss, "global_loss"),
            # With several optimizers the scaler would skip each on its own: one check
            # decides for all of them.
            check_finite=on_nonfinite is not None
            or (scaler is not None and len(parts.optimizers) > 1),
        )
        previous = _owners_between_windows(parts.optimizers)
        self.model = model
        self._strategy = self._strategy_for(steps)
        # Everything is validated: from here on the accumulator changes state.
        for owner in previous:
            owner._take_over()
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.optimizers = parts.optimizers
        self.schedulers = parts.schedulers
        self._steps = steps
        self._ranks = Ranks(self._strategy.group, parts.params[0].device)
        self._window = Window(steps)
        self._plan = EpochPlan(self._options.drop_last)
        self._life = Lifecycle()
        self._grads = misuse.GradWatch()
        self._block = _Microstep(self)
        self._global_step = 0
        self._skipped = 0
        self._armed: bool | None = None  # what the strategy was last told
        for each in parts.optimizers:
            each.zero_grad(set_to_none=True)
        self._stepper = stepping.Stepper(
            self, parts.optimizers, parts.schedulers, scaler, self._open_where
        )
        # Hooks on the model, only where something listens: DDP's forward-time decision,
        # and a forward's collective failing under several ranks (gradaccum.hooks).
        several, decides = self._ranks.count > 1, self._strategy.decides_in_forward
        self._watch = (
            hooks.watch(
                model,
                before=self._forward_started if decides else None,
                failed=self._forward_failed if several else None,
            )
            if several or decides
            else None
        )
        self._arm()

    def _strategy_for(self, steps: int) -> SyncStrategy:
        # With steps=1 every microstep is a boundary: nothing is ever deferred.
        return strategy_for(self.model, "every" if steps == 1 else self._options.sync)

    def _arm(self) -> None:
        """Arm the next backward before its forward: sync if the next microstep is the
        boundary or the policy is "every"; the strategy is called only on a change."""
        sync = self._window.next_is_boundary or self._options.sync == "every"
        if sync is not self._armed:
            self._armed = sync
            self._strategy.arm(sync)

    def _open_where(self) -> str | None:
        """Where the open window stands ("microstep k of n"), or None between windows."""
        return self._window.where() if self._window.is_open else None

    # Properties -------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """Microbatches per optimizer step; settable between windows.

        A new value applies from the next window on, also in the middle of an epoch
        (whose remaining microbatches are then cut into windows of the new size), and
        also at the top of the loop body, after the next window's first microbatch was
        handed out: a warm-up of accumulation, e.g.
        ``acc.steps = steps_at_epoch(schedule, epoch)``.

        Raises:
            ConfigTypeError, ConfigError: The value is not a positive int.
            UsageError: A window is open, or the accumulator is closed.
            ConfigError: The wrapping cannot defer (DDP ``static_graph=True``) and the
                value is above 1.
        """
        return self._steps

    @steps.setter
    def steps(self, value: int) -> None:
        steps = check_steps(value)
        self._life.check("steps was set; it")
        if self._window.is_open:
            msg = (
                f"steps was set to {steps} mid-window ({self._window.done} of "
                f"{self._window.size} microsteps back-propagated); set it after the `with` "
                "block of the window's last microstep has exited"
            )
            raise UsageError(msg)
        if (steps == 1) is not (self._steps == 1):  # the policy becomes, or stops being, "every"
            strategy = self._strategy_for(steps)  # may refuse: then nothing has changed
            self._strategy.restore()
            self._strategy, self._armed = strategy, None
        self._steps = steps
        plan = self._plan
        plan.recut(steps)
        self._window.reset(plan.next_window_size(steps))
        self._arm()

    @property
    def global_step(self) -> int:
        """Windows completed: optimizer steps taken, plus the skipped ones."""
        return self._global_step

    @property
    def skipped_steps(self) -> int:
        """Windows completed without an optimizer step: their gradient held inf/NaN (under
        ``on_nonfinite="skip"``, or found by the GradScaler)."""
        return self._skipped

    @property
    def position(self) -> int:
        """Microbatches of the current epoch handed out by `epoch`; after `load_state_dict`,
        the microbatches the next `epoch` skips because they were trained on already."""
        return self._plan.position

    @property
    def epochs_completed(self) -> int:
        """Epochs that `epoch` ran to their end, saved in `state_dict`: the epoch to resume
        is ``epochs_completed``, also when a checkpoint fell on an epoch's last window."""
        return self._plan.epochs_completed

    @property
    def sync_gradients(self) -> bool:
        """True from before the window's last microbatch is handed out until its block exits."""
        return self._window.next_is_boundary

    # Microsteps -------------------------------------------------------------------

    def microstep(
        self, loss: torch.Tensor, num_items: int | torch.Tensor | None = None
    ) -> _Microstep:
        """Back-propagate one microbatch's loss on entering the returned ``with`` block.

        Args:
            loss: The microbatch's 0-dim loss: its mean, or its sum with ``num_items``.
            num_items: With a summed ``loss``, the items (tokens) it sums over; the
                window's gradient is divided by the window's total items. An int or a
                0-dim tensor, read without host synchronization.

        Returns:
            A context manager whose ``__enter__`` runs the backward and returns the
            `Step`; leaving the window's last block applies the update.

        Raises:
            UsageError: The accumulator is closed, a microstep block is already open,
                this window mixes ``num_items`` with plain mean losses, or the window's
                gradient was cleared by a ``zero_grad()`` since its last microstep.
            ConfigTypeError: ``loss`` or ``num_items`` has the wrong type.
            ConfigError: ``loss`` is not a 0-dim tensor that requires grad, or
                ``num_items`` is a negative int or a tensor that is not 0-dim (a
                tensor's value is not read, to avoid a host sync).
        """
        window = self._window
        # One cheap condition each on the hot path; messages are built on failure.
        if self._life.state is not State.OPEN or window.in_block or self._block.loss is not None:
            self._refuse_microstep()
        if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.requires_grad):
            checks.refuse_loss(loss)
        by_items = num_items is not None
        if by_items:
            checks.check_num_items(num_items)
        if window.done and by_items is not window.by_items:
            msg = (
                f"microstep {window.done + 1} of this window "
                f"{'passes' if by_items else 'omits'} num_items but the window's first "
                f"microstep did {'not' if by_items else 'so'}; pass num_items on every "
                "microstep of a window or on none"
            )
            raise UsageError(msg)
        self._block.loss = loss
        self._block.num_items = num_items
        return self._block

    def _refuse_microstep(self) -> NoReturn:
        self._life.check("microstep()")
        if self._block.loss is not None:
            self._block.loss = None  # drop the stale loss so that the corrected loop can run
            msg = (
                "the previous acc.microstep(...) was never entered, so its loss was not "
                "back-propagated; use it as `with acc.microstep(loss):`"
            )
        else:
            msg = (
                "microstep() was called inside another microstep block; "
                "leave the first `with acc.microstep(...)` block before starting the next"
            )
        raise UsageError(msg)

    def _enter(self, loss: torch.Tensor, num_items: int | torch.Tensor | None) -> Step:
        window = self._window
        window.in_block = True
        if self._plan.active:  # (a microstep outside the epoch uses no microbatch of it)
            self._plan.pending = False
        if window.done == 0:
            window.open(num_items is not None)
        else:
            change = self._grads.change()
            if change == "wiped":
                window.in_block = False
                self._refuse_wiped()
            elif change == "changed":
                self._warn_changed()
        try:
            actual = self._strategy.overridden()
            if actual is not None:
                self._warn_overridden(actual)
            scaled = loss if num_items is not None or window.divisor == 1 else loss / window.divisor
            if self._options.scaler is not None:
                scaled = self._options.scaler.scale(scaled)
            scaled.backward()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            window.losses.append(loss.detach())  # the value only: the graph is freed now
            if num_items is not None:
                window.items.append(num_items)
            if not window.next_is_boundary:
                if self._strategy.grads_in_params:
                    if window.done:
                        self._grads.update()
                    else:
                        self._grads.start(self.optimizers, self.model)
                return self._block.idle
            self._block.step = self._prepare_boundary()
        except BaseException as error:
            window.in_block = False
            failed = self._fail(error, in_collectives=True)
            if failed is not None:
                raise failed from error
            raise
        return self._block.step

    def _refuse_wiped(self) -> NoReturn:
        """The window's gradient was cleared by the user: discard the window and refuse.
        This rank's own refusal, not a collective's failure, so never `RankFailedError`."""
        msg = (
            f"the gradient of this window's first {self._window.done} microsteps was cleared "
            "since the last one, by optimizer.zero_grad() or model.zero_grad() inside the "
            "window; remove that call: the accumulator clears the gradients after each "
            "window's optimizer step (the window is discarded)"
        )
        error = UsageError(msg)
        self._fail(error)
        raise error

    def _warn_changed(self) -> None:
        window = self._window
        warn(
            f"the gradient of this window was changed in place after microstep {window.done} "
            f"of {window.size} (by clip_grad_norm_, say), so that change applied to a "
            "partial sum; pass max_grad_norm= to the Accumulator, or clip inside the "
            "boundary's block (when step.boundary is True)"
        )

    def _warn_overridden(self, actual: bool) -> None:
        """This backward will communicate otherwise than was armed: DDP's forward saw
        another flag (it ran ahead of its block, or inside a ``no_sync()`` of the user's
        own), or someone else turned the wrapper's sync off or on since it was armed."""
        window, strategy = self._window, self._strategy
        will = "reduce" if actual else "not reduce"
        lost = (
            ", so this window's gradient is not reduced over the ranks and its update is "
            "wrong (under DDP the ranks' parameters drift apart)"
            if not actual and window.next_is_boundary
            else ""
        )
        if strategy.decides_in_forward:
            cause = (
                f"the forward of {window.where()} ran while DDP was set to "
                f"{'all-reduce' if actual else 'defer'} (ahead of its block, or inside a "
                "no_sync() of your own)"
            )
            fix = (
                "run each microbatch's forward right before its `with acc.microstep(loss):` "
                "block, outside any no_sync(): the accumulator sets DDP's flag itself"
            )
        else:
            cause = (
                f"the sync state of {type(strategy).__name__} was changed since the accumulator "
                "armed it (by a no_sync() or set_requires_gradient_sync() of your own?)"
            )
            fix = "remove that call: the accumulator sets the wrapper's sync for every microstep"
        warn(
            f"the backward of {window.where()} will {will} the gradient, which is not "
            f"what the accumulator armed: {cause}{lost}; {fix}"
        )

    def _prepare_boundary(self) -> Step:
        """Normalize, unscale, clip and check the window's gradient: what the block sees."""
        window, options, ranks = self._window, self._options, self._ranks
        params = boundary.params_of(self.optimizers)
        divisor: int | torch.Tensor = len(window.losses)
        totals = None  # the window's loss over the ranks, for step.global_loss
        if window.by_items:
            divisor, totals = boundary.normalize(params, window, ranks)
        else:
            boundary.rescale(params, window)
            if options.global_loss and ranks.count > 1:
                totals = boundary.global_mean(window, ranks)
        self._stepper.unscale()
        norm = boundary.clip(self._strategy, params, options.max_grad_norm, self.model)
        step = Step(
            boundary=True,
            global_step=self._global_step + 1,
            losses=window.losses,
            divisor=divisor,
            by_items=window.by_items,
            grad_norm=norm,
            lrs=tuple(map(stepping.learning_rate, self.optimizers)),
            alone=ranks.count == 1 and (window.by_items or options.global_loss),
            global_totals=totals,
        )
        if options.check_finite and not boundary.all_finite(params, norm, ranks):
            if options.on_nonfinite == "raise":
                msg = (
                    f"the gradient of window {step.global_step} (the optimizer step after "
                    f"{self._global_step}) holds inf or NaN; nothing was applied. Pass "
                    "on_nonfinite='skip' to skip such windows, or find the microbatch "
                    "whose loss is not finite"
                )
                raise NonFiniteError(msg, step.global_step)
            step.skipped = True
        return step

    def _exit(self, error: BaseException | None) -> None:
        window = self._window
        window.in_block = False
        step, self._block.step = self._block.step, None
        if error is not None:
            self._fail(error)
        elif step is None:
            window.done += 1
            if window.next_is_boundary:
                self._arm()
        else:
            try:
                if step.skipped:
                    self._stepper.skip()
                else:
                    step.skipped = self._stepper.apply()
            except BaseException as failure:
                applied = self._stepper.applied
                if applied:  # the optimizer stepped: the window counts, though it failed
                    self._close_window(skipped=False)
                self._fail(failure, applied=applied)
                raise
            self._close_window(skipped=step.skipped)

    def _close_window(self, *, skipped: bool) -> None:
        """Count the window that closed (applied or skipped) and start the next."""
        self._skipped += skipped
        self._global_step += 1
        self._plan.close_window()
        self._clear_window()

    def _clear_window(self) -> None:
        """Clear the window's gradient and state, so that the next microstep starts clean."""
        self._stepper.clear()
        self._grads.stop()
        self._window.reset(self._steps)
        self._block.idle = Step(boundary=False, global_step=self._global_step)
        self._arm()

    def _fail(
        self, error: BaseException, *, applied: bool = False, in_collectives: bool = False
    ) -> RankFailedError | None:
        """After ``error``: drop the open window (unless it was applied, and so counted); under
        several ranks, say which rank failed.

        A rank that raises records the failure in the process group's store and refuses
        further microsteps: its windows no longer line up with the others'. A rank whose
        forward, backward or boundary (``in_collectives``: where the collectives run)
        fails after another rank recorded a failure gets the `RankFailedError` to raise
        from ``error``, naming that rank and the window each of the two stopped in.
        """
        if not applied:
            self._clear_window()
            self._plan.recut(self._steps)  # the next windows start after the failed microbatch
        if self._ranks.count == 1 or isinstance(error, NonFiniteError):  # every rank raised that
            return None
        number = self._global_step + (not applied)  # the window this rank stopped in
        peer = self._ranks.first_failure() if in_collectives else None
        if peer is not None:
            self._life.break_(f"rank {peer.rank} failed ({peer.what})")
            message = _rank_failed(self._ranks.rank, number, applied, peer)
            return RankFailedError(message, peer.rank, number, applied)
        self._ranks.record_failure(number, applied, error)
        reason = f"{type(error).__name__}: {error}"
        self._life.break_(f"this rank failed in window {number} ({reason})")
        return None

    def _forward_started(self) -> None:
        """Before each forward of the model (gradaccum.hooks): the strategy may record the
        state that forward decides by."""
        self._strategy.forward_started()

    def _forward_failed(self, error: BaseException) -> None:
        """A forward of the model raised, outside a microstep block (the block's exit sees an
        error raised in it). This rank failed, or its collective did because another rank
        had: ``model(x)`` runs outside any gradaccum call, so the error cannot be replaced
        by a `RankFailedError` there; it gets that error's message as a note instead, and
        the accumulator is broken with it."""
        if self._window.in_block or self._life.state is not State.OPEN:
            return
        failed = self._fail(error, in_collectives=True)
        if failed is not None:
            faults.add_note(error, f"gradaccum.RankFailedError: {failed}")

    # Epochs -----------------------------------------------------------------------

    def epoch(self, iterable: Iterable[T]) -> Iterator[T]:
        """Hand out the microbatches of one epoch, arming each window's boundary in advance.

        Windows never span epochs. With ``drop_last`` (the default) an epoch of known
        length yields ``steps_per_epoch(n, steps) * steps`` microbatches; for an
        iterable without ``len`` the trailing partial window's gradient is discarded.
        With ``drop_last=False`` the trailing microbatches form one shorter window.
        After `load_state_dict` the first epoch resumes after the microbatches already
        trained, and cuts the rest into windows with the saved ``steps``. An iterable that
        restores its own position (``state_dict`` and ``load_state_dict``, as torchdata's
        ``StatefulDataLoader``) resumes by its loaded state instead. A ``DataLoader`` over a
        map-style dataset skips by its batch sampler's indices, loading no skipped
        sample; any other iterable is drawn from and the trained microbatches dropped.

        The epoch is planned when its iteration starts (the first ``next()``), with the
        ``steps`` set by then, and re-planned from each window's start after a change.
        When the model's gradients are averaged over several ranks, the ranks agree on
        the epoch's length first (one all-reduce) and all train on the shortest; an
        iterable without ``len`` is drawn a window at a time and each window's length
        agreed (one all-reduce per window), so no rank waits on a collective that
        another never calls. Unequal lengths warn once, on rank 0.

        Raises:
            ConfigTypeError: ``iterable`` is not iterable.
            ConfigError: The epoch has too few microbatches for one optimizer step (for
                an iterable without ``len`` this is known only at its end), a loaded
                position lies in an epoch of another length or past its end, an iterable
                that restores its own position stands elsewhere in its epoch, or, in the
                first epoch after a load, a ``DataLoader`` with persistent workers draws
                its order from the generator of its workers' seed; raised by the first
                ``next()``, before anything is drawn.
            UsageError: The accumulator is closed, or another of its epochs is still
                being iterated (raised by the first ``next()``).
        """
        self._life.check("epoch()")
        if not (isinstance(iterable, Iterable) or hasattr(type(iterable), "__getitem__")):
            msg = f"iterable must be an iterable of microbatches, got {describe(iterable)}"
            raise ConfigTypeError(msg)
        return self._epoch(iterable)

    def _epoch(self, iterable: Iterable[T]) -> Iterator[T]:
        self._life.check("epoch()")
        plan = self._plan
        n = _length(iterable)
        if n is not None:
            n = self._ranks.agree(
                n,
                "the ranks' epochs have between {least} and {most} microbatches; every "
                "rank trains on the first {least}",
            )
        restores_itself = resuming.restores_own_position(iterable)
        resume = plan.begin(n, self._steps, restores_itself=restores_itself)
        started_at = self._global_step
        completed = False
        try:
            if self._window.is_open and resume is None:
                warn(
                    f"discarding the {self._window.done} microsteps of a window left open by "
                    "the previous epoch: windows never span epochs"
                )
                self._clear_window()
            iterator = resuming.resumed(iterable, resume or 0, resumes_run=plan.resumes_run)
            if restores_itself:
                iterator = self._counted(iterator)
            if n is not None:
                yield from self._sized(iterator, n)
            elif self._ranks.count > 1:
                yield from self._agreed(iterator)
            else:
                yield from self._look_ahead(iterator)
            completed = True
        finally:
            if not completed:
                plan.end(completed=False)
                self._unplanned_window()
        self._end_epoch(guard=n is None and not resume and self._global_step == started_at)

    def _sized(self, iterator: Iterator[T], n: int) -> Iterator[T]:
        """A sized epoch: up to where the plan ends its trained microbatches, asked anew
        before each hand-out (``steps`` may change between windows)."""
        plan = self._plan
        if plan.position >= (plan.trained_end or 0):
            return
        for item in iterator:
            self._hand_out(n - plan.position - 1)
            yield item
            if plan.position >= (plan.trained_end or 0):
                return
        msg = f"the iterable ended after {plan.position} items; its len() promised {n}"
        raise ConfigError(msg)

    def _counted(self, iterator: Iterator[T]) -> Iterator[T]:
        """``iterator``, counting what is drawn from it in the plan: the position of an
        iterable that restores its own position, which a checkpoint must match."""
        for item in iterator:
            self._plan.draw()
            yield item

    def _look_ahead(self, iterator: Iterator[T]) -> Iterator[T]:
        """An unsized epoch on one rank; without ``drop_last`` one item ahead, so that the
        last is known to be last (with it, a trailing window is dropped whatever its size)."""
        if self._options.drop_last:
            for item in iterator:
                self._hand_out(None)
                yield item
            return
        held = next(iterator, _END)
        while held is not _END:
            following = next(iterator, _END)
            self._hand_out(None if following is not _END else 0)
            yield held
            held = following

    def _agreed(self, iterator: Iterator[T]) -> Iterator[T]:
        """An unsized epoch on several ranks: what the open window still needs is drawn
        first, and the ranks agree on how much they drew (one all-reduce per window), so
        that none waits forever; every rank stops where the shortest did. Without
        ``drop_last`` one more is drawn, so that the epoch's last microbatch is known to
        be last before its forward."""
        ready: deque[T] = deque()
        ended = False
        ahead = 0 if self._options.drop_last else 1
        while True:
            need = self._window.size - self._window.done
            if len(ready) < need + ahead and not ended:
                wanted = need + ahead - len(ready)
                drawn = list(itertools.islice(iterator, wanted))
                count = self._ranks.agree(
                    len(drawn),
                    "the ranks' iterables ended at different points; every "
                    "rank stops where the shortest did",
                )
                ready.extend(drawn[:count])
                ended = count < wanted
            if not ready or (ended and self._options.drop_last and len(ready) < need):
                return  # the epoch's end, or a trailing partial window that is dropped
            item = ready.popleft()
            self._hand_out(len(ready) if ended else None)
            yield item

    def _hand_out(self, remaining: int | None) -> None:
        """Size the window before a microbatch reaches the user's forward, and arm its sync
        when that changed the size (otherwise the last block's exit armed it already)."""
        window = self._window
        size = self._plan.hand_out(remaining, self._steps, window.done)
        if size != window.size:
            window.size = size
            self._arm()

    def _end_epoch(self, *, guard: bool) -> None:
        """The epoch ran out: drop a window it left open, and apply the guard (``guard``: an
        unsized epoch, run from its start, that closed no window)."""
        plan, window = self._plan, self._window
        position, dropped = plan.position, plan.dropped()
        plan.end(completed=True)
        if window.is_open:
            if not dropped:
                warn(
                    f"discarding the {window.done} microsteps of an incomplete window at the "
                    "end of the epoch: call acc.microstep() once for every microbatch"
                )
            self._clear_window()
        self._unplanned_window()
        if guard:
            check_epoch_length(
                position, self._steps, self._options.drop_last, discarded=self._ranks.count == 1
            )

    def _unplanned_window(self) -> None:
        """Outside an epoch, a window that has not started takes ``steps`` microsteps: a
        trailing window's size, planned for the epoch, does not carry over."""
        if not self._window.is_open:
            self._window.reset(self._steps)
            self._arm()

    # Checkpoints ------------------------------------------------------------------

    def state_dict(self, *, include_grads: bool = False) -> dict[str, Any]:
        """The accumulator's state, to save beside the model's, optimizer's and scheduler's.

        Accepted between windows, also at the top of the loop body (a microbatch handed
        out but not back-propagated is handed out again after the resume), and with
        ``include_grads`` after any microstep's block.

        Args:
            include_grads: Also save an open window: its gradients so far (this rank's:
                under DDP every rank saves its own state) and its losses and item
                counts, so that `load_state_dict` resumes mid-window exactly. Only where
                the partial gradient is ``param.grad`` (a plain module, DDP).

        Returns:
            ``steps``, the ``position`` in the current epoch (microbatches trained on),
            ``global_step``, ``skipped_steps``, ``epochs_completed``, the policy
            (``drop_last``, ``sync``), the data-parallel ``world_size`` and, with a
            position in a sized epoch, that epoch's ``epoch_length`` (else None);
            with ``include_grads`` and an open window, also ``window``. See
            `gradaccum.record.StateDict`.

        Raises:
            UsageError: A window is open without ``include_grads``, a microstep block is
                open, the wrapping keeps the partial gradient outside ``param.grad``, or the
                epoch's iterable restores its own position and has handed out microbatches
                not trained on (at the top of the loop body).
        """
        check_bool(include_grads, "include_grads")
        window = self._window
        if window.in_block or (window.done and not include_grads):
            msg = (
                f"state_dict() was called mid-window ({window.done} of {window.size} "
                "microsteps back-propagated); checkpoint after the `with` block of the "
                "window's last microstep has exited, e.g. when acc.global_step has just "
                "changed, or pass include_grads=True (outside a `with` block) to save the "
                "partial window"
            )
            raise UsageError(msg)
        position = self._plan.checkpoint_position(window.done)
        saved = None
        if window.done:
            self._check_grads_in_params("state_dict(include_grads=True) cannot save")
            saved = record.SavedWindow(
                microsteps=window.done,
                size=window.size,
                divisor=window.divisor,
                by_items=window.by_items,
                items=list(window.items),
                losses=list(window.losses),
                grads=[_grad_copy(param) for param in boundary.params_of(self.optimizers)],
            )
        return dict(
            record.Checkpoint(
                steps=self._steps,
                position=position,
                global_step=self._global_step,
                skipped_steps=self._skipped,
                drop_last=self._options.drop_last,
                sync=self._options.sync,
                window=saved,
                epochs_completed=self._plan.epochs_completed,
                world_size=self._ranks.count,
                epoch_length=self._plan.checkpoint_length(position),
            ).to_dict()
        )

    def _check_grads_in_params(self, refused: str) -> None:
        """Refuse to save or load an open window where its gradient is not ``param.grad``."""
        if not self._strategy.grads_in_params:
            msg = (
                f"{refused} this window: under {type(self._strategy).__name__} its partial "
                "gradient is held by the wrapper (unsharded buffers, a pending all-reduce) "
                "or sharded over the ranks, which gradaccum does not save; checkpoint after "
                "a window's last microstep"
            )
            raise UsageError(msg)

    def load_state_dict(
        self, state: Mapping[str, Any], *, allow_steps_change: bool = False
    ) -> None:
        """Resume from `state_dict`: restores ``global_step``, ``epochs_completed`` and
        where the epoch was.

        The next `epoch` skips the ``position`` microbatches already trained on, so pass
        the same data in the same order (an iterable that restores its own position: with
        its state saved at the same point), and cuts the rest into windows of ``steps``. A
        state with a ``window`` restores its gradients: the next microstep continues
        that window. A state saved on another number of data-parallel ranks is refused
        here; one whose position lies in an epoch of another length is refused when the
        next epoch begins (a state saved between epochs resumes no position, and the next
        epoch may have any length).

        Args:
            state: From `state_dict`.
            allow_steps_change: Load a state saved with another ``steps`` and keep this
                accumulator's from the next window on; only between windows (no saved
                ``window``).

        Raises:
            ConfigTypeError: ``state`` is not such a mapping.
            ConfigError: ``state`` was saved on another number of data-parallel ranks,
                with another ``drop_last``, with another ``steps`` (unless allowed,
                between windows), or its window does not fit this optimizer's parameters.
            UsageError: The accumulator is closed, a window is open in it, or one of its
                epochs is being iterated.
        """
        self._life.check("load_state_dict()")
        check_bool(allow_steps_change, "allow_steps_change")
        saved = record.parse(state, lambda value: isinstance(value, torch.Tensor))
        saved.check_fits(
            world_size=self._ranks.count,
            steps=self._steps,
            drop_last=self._options.drop_last,
            allow_steps_change=allow_steps_change,
        )
        if self._window.is_open or self._plan.active:
            msg = (
                "load_state_dict() was called mid-window or while acc.epoch() is being "
                "iterated; load before the epoch loop"
            )
            raise UsageError(msg)
        params = boundary.params_of(self.optimizers)
        if saved.window is not None:
            self._check_window_fits(saved.window, params)
        self._global_step = saved.global_step
        self._skipped = saved.skipped_steps
        self._stepper.reread_schedulers()
        done = 0 if saved.window is None else saved.window.microsteps
        self._plan.load(
            saved.position,
            done,
            epochs_completed=saved.epochs_completed,
            length=saved.epoch_length,
        )
        self._clear_window()
        if saved.window is not None:
            for param, grad in zip(params, saved.window.grads, strict=True):
                param.grad = None if grad is None else grad.to(param.device).clone()
            window = self._window
            window.done, window.size = saved.window.microsteps, saved.window.size
            window.divisor, window.by_items = saved.window.divisor, saved.window.by_items
            window.items, window.losses = list(saved.window.items), list(saved.window.losses)
            if self._strategy.grads_in_params:
                self._grads.start(self.optimizers, self.model)
            self._arm()

    def _check_window_fits(self, window: record.SavedWindow, params: list[torch.Tensor]) -> None:
        if len(window.grads) != len(params) or not all(
            grad is None or grad.shape == param.shape
            for grad, param in zip(window.grads, params, strict=False)
        ):
            msg = (
                "state['window'] does not fit this optimizer's parameters (their number or "
                "shapes differ); load it into an Accumulator built like the saved one"
            )
            raise ConfigError(msg)
        self._check_grads_in_params("load_state_dict() cannot restore")

    # Lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Remove the optimizers' hooks and restore any sync state set on the model."""
        self._life.close()
        self._release()

    def _take_over(self) -> None:
        """A newer accumulator takes this one's optimizer: close this one, and say so."""
        self._life.close(" (a newer Accumulator took over its optimizer)")
        self._release()
        warn(
            "this Accumulator closed the previous Accumulator on the same optimizer (it was "
            "between windows), and steps the optimizer from now on; close() an accumulator "
            "when you are done with it"
        )

    def _release(self) -> None:
        """Give back the optimizer and the model's sync state (once)."""
        if self._stepper is not None:
            self._stepper.release(self)
            self._strategy.restore()
            if self._watch is not None:
                self._watch.remove()
            self._stepper = None  # type: ignore[assignment]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        names = ", ".join(type(optimizer).__name__ for optimizer in self.optimizers)
        several = f"optimizers=({names}), " if len(self.optimizers) > 1 else ""
        return (
            f"Accumulator({several}steps={self._steps}, global_step={self._global_step}, "
            f"window={self._window.done}/{self._window.size})"
        )


@dataclass(frozen=True)
class _Options:
    """The validated keyword options that do not change after construction."""

    max_grad_norm: float | None
    scaler: torch.amp.GradScaler | None
    drop_last: bool
    sync: SyncPolicy
    on_nonfinite: NonFinitePolicy | None
    global_loss: bool
    check_finite: bool  # the boundary checks the gradient for inf/NaN


class _Microstep:
    """The ``with`` block of a microstep, one per accumulator; see `Accumulator.microstep`.

    It holds the loss from ``microstep()`` until the block is entered, and the boundary's
    `Step` until it exits; ``idle`` is what every other microstep of the window reports.
    """

    __slots__ = ("_acc", "idle", "loss", "num_items", "step")

    def __init__(self, acc: Accumulator) -> None:
        self._acc = acc
        self.loss: torch.Tensor | None = None
        self.num_items: int | torch.Tensor | None = None
        self.step: Step | None = None
        self.idle = Step(boundary=False, global_step=0)

    def __enter__(self) -> Step:
        loss, self.loss = self.loss, None
        if loss is None:
            msg = "a microstep block was entered twice; call acc.microstep(loss) for each one"
            raise UsageError(msg)
        return self._acc._enter(loss, self.num_items)

    def __exit__(self, _: object, error: BaseException | None, *__: object) -> None:
        self._acc._exit(error)


# Helpers -----------------------------------------------------------------------


def _owners_between_windows(
    optimizers: Sequence[torch.optim.Optimizer],
) -> list[Accumulator]:
    """The open accumulators that own any of ``optimizers``, to be taken over.

    Raises:
        UsageError: One's window is open: taking over would lose that window.
    """
    previous: list[Accumulator] = []
    for optimizer in optimizers:
        owner: Accumulator | None = stepping.owner_of(optimizer)
        if owner is None or any(owner is seen for seen in previous):
            continue
        if owner._window.is_open:
            msg = (
                f"optimizer is owned by another open Accumulator, whose window is open "
                f"({owner._window.where()}); finish that window and close() it, or pass "
                "another optimizer"
            )
            raise UsageError(msg)
        previous.append(owner)
    return previous


def _rank_failed(me: int, window: int, applied: bool, peer: faults.Failure) -> str:
    """What `RankFailedError` says: the window each of the two ranks stopped in, whether
    it applied it, the windows this rank applied that the failed one did not, the fix."""
    where = "there first" if peer.window == window else f"first, in window {peer.window}"
    first, last = peer.window + peer.applied, window - (not applied)  # applied here only
    ahead = ""
    if last >= first:
        windows = f"window {first}" if last == first else f"windows {first} to {last}"
        ahead = f", so rank {me} applied {windows} that rank {peer.rank} did not"
    return (
        f"rank {me} stopped in window {window} because rank {peer.rank} failed {where}: "
        f"{peer.what}; rank {peer.rank} {'applied' if peer.applied else 'did not apply'} "
        f"window {peer.window}, rank {me} {'applied' if applied else 'did not apply'} "
        f"window {window}{ahead}. Restart every rank from the last checkpoint"
    )


def _grad_copy(param: torch.Tensor) -> torch.Tensor | None:
    return None if param.grad is None else param.grad.detach().clone()


def _length(iterable: Iterable[Any]) -> int | None:
    if not isinstance(iterable, Sized):
        return None
    try:
        return len(iterable)
    except TypeError:  # a DataLoader over an IterableDataset has __len__ but may raise
        return None
