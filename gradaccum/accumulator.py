"""`Accumulator`: the window state machine that turns N microbatches into one optimizer step."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, NamedTuple, NoReturn, TypeVar, get_args

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import Self

from gradaccum import checks, faults, misuse
from gradaccum.checks import NonFinitePolicy
from gradaccum.errors import (
    ConfigError,
    ConfigTypeError,
    GradaccumWarning,
    NonFiniteError,
    RankFailedError,
    UsageError,
    describe,
)
from gradaccum.schedule import check_bool, check_count, check_steps, steps_per_epoch, total_steps
from gradaccum.sync import (
    DDPSync,
    SyncPolicy,
    SyncStrategy,
    clip_grad_norm,
    grad_norm,
    strategy_for,
)

__all__ = ["Accumulator", "Step"]

T = TypeVar("T")
_STATE_VERSION = 2


class Step:
    """What a microstep reports; the window fields are filled on the boundary only.

    Attributes:
        boundary: This microstep completes the window: the body of its ``with`` block
            sees the window's full gradient, clipped, not yet applied.
        global_step: The optimizer step this window becomes (``acc.global_step`` after
            the block exits); on other microsteps, the steps completed so far.
        grad_norm: The total gradient norm before clipping, a 0-dim tensor; ``None``
            without ``max_grad_norm``.
        lr: The learning rate of the first parameter group for this update.
        skipped: The window was not applied (no optimizer or scheduler step) because
            its gradient held inf/NaN: known in the block under ``on_nonfinite="skip"``,
            and once the block has exited when a GradScaler skipped the step.
    """

    __slots__ = (
        "_divisor",
        "_loss",
        "_losses",
        "boundary",
        "global_step",
        "grad_norm",
        "lr",
        "skipped",
    )

    def __init__(
        self,
        boundary: bool,
        global_step: int,
        *,
        losses: Sequence[torch.Tensor] = (),
        divisor: int | torch.Tensor = 1,
        grad_norm: torch.Tensor | None = None,
        lr: float | torch.Tensor | None = None,
    ) -> None:
        self.boundary = boundary
        self.global_step = global_step
        self.grad_norm = grad_norm
        self.lr = lr
        self.skipped = False
        self._losses = losses
        self._divisor = divisor
        self._loss: torch.Tensor | None = None

    @property
    def loss(self) -> torch.Tensor | None:
        """The window's loss, a detached 0-dim tensor; ``None`` off the boundary.

        The mean of the microbatch losses, or with ``num_items`` the summed losses over
        the window's items. Computed on first read, so an unread loss costs nothing.
        """
        if self._loss is None and self._losses:
            total = torch.stack([loss.detach() for loss in self._losses]).sum()
            self._loss = total / self._divisor
        return self._loss

    def __repr__(self) -> str:
        fields = ("boundary", "global_step", "loss", "grad_norm", "lr", "skipped")
        return f"Step({', '.join(f'{name}={getattr(self, name)!r}' for name in fields)})"


class Accumulator:
    """Accumulate gradients over ``steps`` microbatches and step once per window.

    Args:
        model: The module whose forward produces the losses.
        optimizer: Steps once per window; the accumulator owns its ``step()`` and
            ``zero_grad()`` from now on, and clears any gradient it finds.
        scheduler: Optional LR scheduler, stepped once per applied window.
        steps: Microbatches per optimizer step (``1``: no accumulation).
        max_grad_norm: Clip the window's gradient to this total norm at the boundary
            (``math.inf`` reports the norm without clipping).
        scaler: An enabled ``torch.amp.GradScaler``: every microstep's loss is scaled,
            and the gradient is unscaled, clipped, stepped and the scale updated once
            per window. A disabled scaler is the same as none.
        drop_last: In `epoch`, skip each epoch's trailing microbatches that do not fill
            a window; when False they form one shorter window, scaled by its length.
        sync: When a wrapped model communicates gradients. ``"auto"`` defers to the
            boundary where that costs no memory (DDP; HSDP's all-reduce) and reduces
            every microstep where deferring would hold unsharded gradients (FSDP1,
            ``fully_shard``); ``"boundary"`` always defers; ``"every"`` never does. An
            unwrapped module never communicates, so all three agree.
        on_nonfinite: What a window whose gradient holds inf/NaN does at its boundary:
            ``None`` (no check, no cost, as plain PyTorch), ``"raise"`` `NonFiniteError`
            naming the window, or ``"skip"`` the whole window. A check costs one host
            sync per window, and one scalar all-reduce when several ranks hold the
            gradients, so that every rank decides the same. With a GradScaler, which
            skips overflowing windows by design, only ``None`` and ``"skip"`` apply.

    Raises:
        ConfigTypeError: An argument has the wrong type.
        ConfigError: An argument has a value outside what is accepted, the model has
            no trainable parameter or the optimizer holds none of them, or the model's
            wrapping cannot defer as ``sync`` asks (DDP with ``static_graph=True``).

    Example:
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
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        steps: int = 1,
        max_grad_norm: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
        drop_last: bool = True,
        sync: SyncPolicy = "auto",
        on_nonfinite: NonFinitePolicy | None = None,
    ) -> None:
        params = checks.check_parts(model, optimizer, scheduler)
        self._steps = check_steps(steps)
        self._max_grad_norm = checks.check_max_grad_norm(max_grad_norm)
        self._scaler = checks.check_scaler(scaler)
        check_bool(drop_last, "drop_last")
        checks.check_choice(sync, "sync", get_args(SyncPolicy))
        checks.check_on_nonfinite(on_nonfinite, self._scaler)
        self._sync: SyncPolicy = sync
        self.model = model
        self._use(self._strategy_for(self._steps))
        # Everything is validated: from here on the accumulator changes state.
        self.optimizer = optimizer
        self.scheduler = scheduler
        self._drop_last = drop_last
        self._on_nonfinite = on_nonfinite
        self._params = params
        self._device = self._params[0].device  # where the scalar collectives' tensors live
        self._warned_lengths = False
        self._global_step = 0
        self._skipped = 0
        self._position = 0  # microbatches of the current epoch handed out by `epoch`
        self._length: int | None = None  # the current epoch's agreed length, when known
        self._end = 0  # the microbatches of the current sized epoch that are trained on
        self._resume_at = 0  # microbatches `epoch` skips after `load_state_dict`
        self._in_block = False
        self._block = _Microstep(self)  # holds a loss from microstep() until it is entered
        self._stepping = False  # the accumulator itself is stepping optimizer or scheduler
        # scheduler.step() by hand shows as a last_epoch that moved between our steps.
        self._scheduled = _scheduler_steps(scheduler)
        self._watch_scheduler = self._scheduled is not None
        self._closed = False  # closed, or broken by a failure under several ranks
        self._released = False  # the hook is removed and the module state restored
        self._broken: str | None = None
        self._armed: bool | None = None  # what the strategy was last told
        self._reset_window()
        optimizer.zero_grad(set_to_none=True)
        self._hook = optimizer.register_step_pre_hook(self._refuse_foreign_step)
        misuse.watch_clipping(self)

    def _strategy_for(self, steps: int) -> SyncStrategy:
        # With steps=1 every microstep is a boundary: nothing is ever deferred.
        return strategy_for(self.model, "every" if steps == 1 else self._sync)

    def _use(self, strategy: SyncStrategy) -> None:
        self._strategy = strategy
        self._group = strategy.group
        self._ranks = 1 if self._group is None else dist.get_world_size(self._group)
        self._clip = getattr(strategy, "clip_grad_norm", clip_grad_norm)
        self._ddp = strategy if isinstance(strategy, DDPSync) else None

    # Window state -----------------------------------------------------------------

    def _reset_window(self) -> None:
        self._pos = 0  # microsteps back-propagated in this window
        self._size = self._steps  # microsteps in this window
        self._den = self._steps  # what mean-mode losses were divided by
        self._by_items = False  # this window passes num_items (set by its first microstep)
        self._losses: list[torch.Tensor] = []
        self._items: list[int | torch.Tensor] = []
        self._pending: Step | None = None  # the boundary step, between enter and exit
        self._closed_at = self._position  # a later hand-out opens the next window
        self._unscaled = False
        self._idle = Step(boundary=False, global_step=self._global_step)
        self._arm()

    def _arm(self) -> None:
        """Set the next backward's communication, calling the strategy only on a change."""
        sync = self.sync_gradients or self._sync == "every"
        if sync is not self._armed:
            self._armed = sync
            self._strategy.arm(sync)

    @property
    def steps(self) -> int:
        """Microbatches per optimizer step; settable between windows.

        A new value applies from the next window on, also in the middle of an epoch
        (whose remaining microbatches are then cut into windows of the new size): a
        warm-up of accumulation, e.g. ``acc.steps = steps_at_epoch(schedule, epoch)``.

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
        if self._closed:
            msg = "steps was set on a closed Accumulator; create a new one"
            raise UsageError(msg)
        if self._pos > 0 or self._in_block:
            msg = (
                f"steps was set to {steps} mid-window ({self._pos} of {self._size} "
                "microsteps back-propagated); set it after the `with` block of the window's "
                "last microstep has exited"
            )
            raise UsageError(msg)
        if (steps == 1) is not (self._steps == 1):  # the policy becomes, or stops being, "every"
            self._strategy.restore()
            try:
                strategy = self._strategy_for(steps)
            except BaseException:
                self._use(self._strategy_for(self._steps))  # as it was: it was accepted
                self._armed = None
                self._arm()
                raise
            self._use(strategy)
            self._armed = None
        self._steps = steps
        # The new window's first microbatch may be handed out already (set at the top of
        # the loop body): then the window starts one before the position.
        handed, closed_at = self._position > self._closed_at, self._closed_at
        self._reset_window()
        self._closed_at = closed_at
        start = self._position - handed
        if self._length is not None:  # re-plan the rest of the sized epoch
            if self._drop_last:
                self._end = start + (self._length - start) // steps * steps
            elif handed:
                self._size = min(steps, self._length - start)
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
        return self._position

    @property
    def sync_gradients(self) -> bool:
        """True from before the window's last microbatch is handed out until its block exits."""
        return self._pos == self._size - 1

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
                or this window mixes ``num_items`` with plain mean losses.
            ConfigTypeError: ``loss`` or ``num_items`` has the wrong type.
            ConfigError: ``loss`` is not a 0-dim tensor that requires grad, or
                ``num_items`` is a negative int or a tensor that is not 0-dim (a
                tensor's value is not read, to avoid a host sync).
        """
        # The checks are one cheap condition each on the hot path; messages are built on failure.
        if self._closed or self._in_block or self._block.loss is not None:
            self._refuse_microstep()
        if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.requires_grad):
            checks.refuse_loss(loss)
        by_items = num_items is not None
        if by_items:
            checks.check_num_items(num_items)
        if self._pos > 0 and by_items is not self._by_items:
            msg = (
                f"microstep {self._pos + 1} of this window "
                f"{'passes' if by_items else 'omits'} num_items but the window's first "
                f"microstep did {'not' if by_items else 'so'}; pass num_items on every "
                "microstep of a window or on none"
            )
            raise UsageError(msg)
        self._block.loss = loss
        self._block.num_items = num_items
        return self._block

    def _refuse_microstep(self) -> NoReturn:
        if self._broken is not None:
            msg = (
                f"microstep() was called after {self._broken}: the ranks' windows no longer "
                "line up, so this accumulator takes no more microsteps; restart every rank "
                "from the last checkpoint"
            )
        elif self._closed:
            msg = "microstep() was called on a closed Accumulator; create a new one"
        elif self._block.loss is not None:
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
        self._in_block = True
        if self._ddp is not None and self._ddp.seen:
            self._check_forward(self._ddp)
        if self._pos == 0:
            self._den = self._size
            self._by_items = num_items is not None
        try:
            scaled = loss if num_items is not None or self._den == 1 else loss / self._den
            if self._scaler is not None:
                scaled = self._scaler.scale(scaled)
            scaled.backward()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            self._losses.append(loss)
            if num_items is not None:
                self._items.append(num_items)
            if self._pos != self._size - 1:  # sync_gradients, inlined on the hot path
                return self._idle
            self._pending = self._prepare_boundary()
        except BaseException as error:
            self._in_block = False
            self._fail(error)
            raise
        return self._pending

    def _check_forward(self, ddp: DDPSync) -> None:
        """Warn when this loss's forward (the oldest not yet back-propagated) saw another
        sync flag than this backward needs: DDP decided in that forward."""
        seen = ddp.seen.popleft()
        if seen is not ddp.armed:
            warnings.warn(
                f"the forward of microstep {self._pos + 1} of {self._size} ran while DDP was "
                f"set to {'all-reduce' if seen else 'defer'} for another microstep, so this "
                f"backward will {'' if seen else 'not '}all-reduce"
                f"{' and the window gradient is not synced' if not seen else ''}; run each "
                "microbatch's forward right before its `with acc.microstep(loss):` block",
                GradaccumWarning,
                stacklevel=4,
            )

    def _prepare_boundary(self) -> Step:
        """Normalize, unscale, clip and check the window's gradient: what the block sees."""
        count = len(self._losses)
        divisor: int | torch.Tensor = count
        if self._by_items:
            divisor = sum(self._items, start=0)
            if self._ranks > 1:
                # Sum the items over ranks, and undo the wrapper's 1/ranks averaging. A copy:
                # `divisor` stays this rank's count, for step.loss.
                total = torch.as_tensor(divisor, device=self._device).clone()
                dist.all_reduce(total, group=self._group)
                _scale_grads(self._params, total / self._ranks, divide=True)
            elif isinstance(divisor, int) and divisor == 0:
                msg = f"the {count} microsteps of this window passed num_items summing to 0"
                raise ConfigError(msg)
            else:
                _scale_grads(self._params, divisor, divide=True)
        elif self._den != self._size:  # the epoch ended early: 1/den becomes 1/size
            _scale_grads(self._params, self._den / self._size, divide=False)
        if self._scaler is not None:
            self._scaler.unscale_(self.optimizer)
            self._unscaled = True
        norm = None
        if self._max_grad_norm is not None:
            norm = self._clip(self._params, self._max_grad_norm)
        step = Step(
            boundary=True,
            global_step=self._global_step + 1,
            losses=self._losses,
            divisor=divisor,
            grad_norm=norm,
            lr=self.optimizer.param_groups[0]["lr"],
        )
        if self._on_nonfinite is not None and not self._finite(norm):
            if self._on_nonfinite == "raise":
                msg = (
                    f"the gradient of window {step.global_step} (the optimizer step after "
                    f"{self._global_step}) holds inf or NaN; nothing was applied. Pass "
                    "on_nonfinite='skip' to skip such windows, or find the microbatch "
                    "whose loss is not finite"
                )
                raise NonFiniteError(msg)
            step.skipped = True
        return step

    def _finite(self, norm: torch.Tensor | None) -> bool:
        """Whether the window's gradient is finite on every rank: one host sync, and one
        scalar all-reduce when several ranks hold the gradients."""
        if norm is None:
            norm = grad_norm(self._params)
        finite = torch.isfinite(norm)
        if self._ranks > 1:
            finite = finite.to(device=self._device, dtype=torch.int32)
            dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=self._group)
        return bool(finite.item())

    def _exit(self, error: BaseException | None) -> None:
        self._in_block = False
        step = self._pending
        if error is not None:
            self._fail(error)
        elif step is None:
            self._pos += 1
            if self._pos == self._size - 1:  # the next microstep is the boundary
                self._arm()
        else:
            try:
                if step.skipped:
                    self._skip()
                else:
                    step.skipped = self._apply()
            except BaseException as failure:
                self._fail(failure)
                raise
            self._skipped += step.skipped
            self.optimizer.zero_grad(set_to_none=True)
            self._global_step += 1
            self._reset_window()
            if self._ddp is not None:
                self._ddp.seen.clear()  # a forward that no block used is not carried over

    def _apply(self) -> bool:
        """Step the optimizer (and scaler) and the scheduler; return whether it was skipped."""
        self._stepping = True
        try:
            if self._scaler is None:
                self.optimizer.step()
                skipped = False
            else:
                scale = self._scaler.get_scale()
                self._scaler.step(self.optimizer)
                self._scaler.update()
                # The scale only shrinks when inf/NaN gradients made step() skip.
                skipped = self._scaler.get_scale() < scale
            if self.scheduler is not None and not skipped:
                if self._watch_scheduler:
                    moved = self.scheduler.last_epoch
                    if self._scheduled is not None and moved != self._scheduled:
                        self._warn_scheduler(moved)
                self.scheduler.step()
                if self._watch_scheduler:
                    self._scheduled = self.scheduler.last_epoch
        finally:
            self._stepping = False
        return skipped

    def _skip(self) -> None:
        """A skipped window: no optimizer or scheduler step; a scaler still backs off."""
        if self._scaler is not None:
            self._scaler.update()  # unscale_ recorded the inf/NaN: the scale shrinks

    def _warn_scheduler(self, moved: int | None) -> None:
        warnings.warn(
            f"the scheduler was stepped outside the accumulator (its last_epoch moved from "
            f"{self._scheduled} to {moved} between the accumulator's steps); the "
            "accumulator steps it once per applied window: remove the scheduler.step() call "
            "(after loading a scheduler's state, also load the accumulator's)",
            GradaccumWarning,
            stacklevel=5,
        )

    def _fail(self, error: BaseException) -> None:
        """Drop the open window after ``error``; under several ranks, say which one failed.

        A rank that raises while the others are inside the window's collectives records
        the failure in the process group's store and refuses further microsteps: its
        windows no longer line up with the others'. A rank whose collective fails raises
        `RankFailedError` naming the rank that failed first, when it is recorded.
        """
        self._discard_window()
        if self._ranks == 1 or isinstance(error, NonFiniteError):  # every rank raised that
            return
        window = f"window {self._global_step + 1}"
        self._closed = True
        peer = faults.first_failure(self._group)
        if peer is not None and peer[0] != dist.get_rank():
            self._broken = f"rank {peer[0]} failed ({peer[1]})"
            raise RankFailedError(
                f"rank {dist.get_rank()} stopped in {window} because rank {peer[0]} failed "
                f"there first: {peer[1]}; no rank applied {window}. Restart every rank from "
                "the last checkpoint"
            ) from error
        faults.record_failure(self._group, f"{type(error).__name__}: {error} (in {window})")
        self._broken = f"this rank failed in {window} ({type(error).__name__}: {error})"

    def _discard_window(self) -> None:
        """Drop the open window's gradient so that the next microstep starts clean."""
        if self._unscaled and self._scaler is not None:
            # Clear the scaler's per-optimizer record of unscale_() without moving the scale.
            self._scaler.update(self._scaler.get_scale())
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_window()

    def _partial_window(self, clipped: set[int]) -> str | None:
        """Why clipping the parameters whose ids are ``clipped`` now would clip a partial
        window of this accumulator, or None."""
        if self._pending is not None or not (self._pos > 0 or self._in_block):
            return None  # between windows, or in the boundary block: the whole window
        if not any(id(param) in clipped for param in self._params):
            return None
        return f"microstep {self._pos + 1} of {self._size}"

    def _refuse_foreign_step(self, *_: object) -> None:
        if self._stepping:
            return
        if self._pos > 0 or self._in_block:
            msg = (
                f"optimizer.step() was called inside an accumulation window (microstep "
                f"{self._pos + 1} of {self._size}); the accumulator steps the optimizer "
                "when the window's last microstep block exits: remove the call"
            )
            raise UsageError(msg)
        warnings.warn(
            "optimizer.step() was called between windows while an Accumulator owns the "
            "optimizer; it steps once when each window's last microstep block exits: "
            "remove the call (or close() the accumulator first)",
            GradaccumWarning,
            stacklevel=3,
        )

    # Epochs -----------------------------------------------------------------------

    def epoch(self, iterable: Iterable[T]) -> Iterator[T]:
        """Hand out the microbatches of one epoch, arming each window's boundary in advance.

        Windows never span epochs. With ``drop_last`` (the default) an epoch of known
        length yields ``steps_per_epoch(n, steps) * steps`` microbatches; for an
        iterable without ``len`` the trailing partial window's gradient is discarded.
        With ``drop_last=False`` the trailing microbatches form one shorter window.
        After `load_state_dict` the first epoch skips the microbatches already trained.

        When the model's gradients are averaged over several ranks, the ranks agree on
        the epoch's length first (one all-reduce) and all train on the shortest; an
        iterable without ``len`` is drawn a window at a time and each window's length
        agreed (one all-reduce per window), so no rank waits on a collective that
        another never calls. Unequal lengths warn once, on rank 0.

        Raises:
            ConfigError: The epoch has too few microbatches for one optimizer step (for
                an iterable without ``len`` this is known only at its end), or a loaded
                position lies past its end.
            UsageError: The accumulator is closed.
        """
        if self._closed:
            msg = "epoch() was called on a closed Accumulator; create a new one"
            raise UsageError(msg)
        if not (isinstance(iterable, Iterable) or hasattr(type(iterable), "__getitem__")):
            msg = f"iterable must be an iterable of microbatches, got {describe(iterable)}"
            raise ConfigTypeError(msg)
        n = _length(iterable)
        planned = None
        if n is not None and self._ranks > 1:
            n, most = self._agree(n)
            if most > n:
                self._warn_unequal(
                    f"the ranks' epochs have between {n} and {most} microbatches; every rank "
                    f"trains on the first {n}"
                )
        if n is not None:
            self._check_epoch_length(n, discarded=False)
            planned = steps_per_epoch(n, self._steps) * self._steps if self._drop_last else n
            if self._resume_at > planned:
                msg = (
                    f"the loaded state resumes at microbatch {self._resume_at} of the epoch, "
                    f"past the {planned} this epoch of {n} trains on; pass the same data"
                )
                raise ConfigError(msg)
        return self._epoch(iterable, n, planned)

    def _agree(self, n: int) -> tuple[int, int]:
        """The least and the most of ``n`` over the ranks: one all-reduce, read on the host."""
        ends = torch.tensor([n, -n], device=self._device)
        dist.all_reduce(ends, op=dist.ReduceOp.MIN, group=self._group)
        least, negated_most = ends.tolist()
        return int(least), -int(negated_most)

    def _warn_unequal(self, what: str) -> None:
        """Warn once, on rank 0, that ranks had different amounts of data."""
        if not self._warned_lengths and dist.get_rank() == 0:
            warnings.warn(
                f"{what}, so that no rank waits on a collective the others never call; "
                "shard the data evenly (e.g. DistributedSampler) to train on all of it",
                GradaccumWarning,
                stacklevel=4,
            )
        self._warned_lengths = True

    def _epoch(self, iterable: Iterable[T], n: int | None, planned: int | None) -> Iterator[T]:
        self._length = None
        if self._pos > 0 and self._resume_at == 0:  # (a loaded partial window carries on)
            warnings.warn(
                f"discarding the {self._pos} microsteps of a window left open by the previous "
                "epoch: windows never span epochs",
                GradaccumWarning,
                stacklevel=2,
            )
            self._discard_window()
        skip, self._resume_at = self._resume_at, 0
        iterator = iter(iterable)
        seen = start = sum(1 for _ in itertools.islice(iterator, skip))
        if start < skip:
            msg = (
                f"the loaded state resumes at microbatch {skip} of the epoch, but the "
                f"iterable ended after {start}; pass the same data"
            )
            raise ConfigError(msg)
        self._position = self._closed_at = start
        if n is not None and planned is not None:
            # `steps` may change at a window boundary: the setter re-plans `_end`.
            self._length, self._end = n, planned
            while seen < self._end:
                end = self._end
                for item in itertools.islice(iterator, end - seen):
                    seen += 1
                    self._hand_out(seen, n - seen)
                    yield item
                    if self._end != end:
                        break
                else:
                    if seen < end:
                        msg = f"the iterable ended after {seen} items; its len() promised {n}"
                        raise ConfigError(msg)
            self._length = None
        elif self._ranks > 1:
            seen = yield from self._agreed_windows(iterator, seen)
        else:
            seen = yield from self._look_ahead(iterator, seen)
        self._position = 0
        if self._pos > 0:
            if planned is not None or not self._drop_last:
                warnings.warn(
                    f"discarding the {self._pos} microsteps of an incomplete window at the end "
                    "of the epoch: call acc.microstep() once for every microbatch",
                    GradaccumWarning,
                    stacklevel=2,
                )
            self._discard_window()
        if planned is None:
            self._check_epoch_length(seen, discarded=self._ranks == 1)

    def _look_ahead(self, iterator: Iterator[T], seen: int) -> Generator[T, None, int]:
        """An unsized epoch on one rank: one item ahead, so the last one is a boundary."""
        held: tuple[T] | None = None
        for item in iterator:
            if held is not None:
                self._hand_out(seen := seen + 1, None)
                yield held[0]
            held = (item,)
        if held is not None:
            self._hand_out(seen := seen + 1, 0)
            yield held[0]
        return seen

    def _agreed_windows(self, iterator: Iterator[T], seen: int) -> Generator[T, None, int]:
        """An unsized epoch on several ranks: each window's items are drawn first, and the
        ranks agree on its length (one all-reduce per window), so none waits forever."""
        while True:
            window = list(itertools.islice(iterator, self._steps))
            count, most = self._agree(len(window))
            if most > count:
                self._warn_unequal(
                    "the ranks' iterables ended at different points; every rank stops "
                    "where the shortest did"
                )
            if count == 0 or (count < self._steps and self._drop_last):
                return seen + count
            for offset, item in enumerate(window[:count]):
                self._hand_out(seen := seen + 1, count - offset - 1)
                yield item
            if count < self._steps:
                return seen

    def _hand_out(self, position: int, remaining: int | None) -> None:
        """Size the window and arm its sync before a microbatch reaches the user's forward.

        Args:
            position: Microbatches of the epoch handed out, this one included.
            remaining: How many follow it in the epoch, when known.
        """
        self._position = position
        if self._drop_last:
            return
        if self._pos == 0 and remaining is not None:
            self._size = min(self._steps, remaining + 1)
        if remaining == 0:
            self._size = self._pos + 1  # the epoch's last microbatch closes the window
        self._arm()

    def _check_epoch_length(self, n: int, *, discarded: bool) -> None:
        """The guard: an epoch that gives no optimizer step is a configuration error."""
        if total_steps(n, self._steps, 1, self._drop_last) > 0:
            return
        if n == 0:
            msg = "the epoch's iterable is empty: it gives no optimizer step"
        else:
            msg = (
                f"the iterable's epoch of {n} microbatches gives no optimizer step with "
                f"steps={self._steps} and drop_last=True; lower steps to at most {n}, or "
                "pass drop_last=False"
            )
        if discarded:
            msg += " (its gradient was discarded)"
        raise ConfigError(msg)

    # Checkpoints ------------------------------------------------------------------

    def state_dict(self, *, include_grads: bool = False) -> dict[str, Any]:
        """The accumulator's state, to save beside the model's, optimizer's and scheduler's.

        Args:
            include_grads: Also save an open window: its gradients so far (this rank's:
                under DDP every rank saves its own state) and its losses and item
                counts, so that `load_state_dict` resumes mid-window exactly. Only where
                the partial gradient is ``param.grad`` (a plain module, DDP).

        Returns:
            ``steps``, the ``position`` in the current epoch (microbatches handed out),
            ``global_step``, ``skipped_steps`` and the policy (``drop_last``, ``sync``);
            with ``include_grads`` and an open window, also ``window``.

        Raises:
            UsageError: A window is open without ``include_grads``, a microstep block is
                open, or the wrapping keeps the partial gradient outside ``param.grad``.
        """
        check_bool(include_grads, "include_grads")
        if self._in_block or (self._pos > 0 and not include_grads):
            msg = (
                f"state_dict() was called mid-window ({self._pos} of {self._size} microsteps "
                "back-propagated); checkpoint after the `with` block of the window's last "
                "microstep has exited, e.g. when acc.global_step has just changed, or pass "
                "include_grads=True (outside a `with` block) to save the partial window"
            )
            raise UsageError(msg)
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "steps": self._steps,
            "position": self._position,
            "global_step": self._global_step,
            "skipped_steps": self._skipped,
            "drop_last": self._drop_last,
            "sync": self._sync,
        }
        if self._pos > 0:
            self._check_grads_in_params("state_dict(include_grads=True) cannot save")
            state["window"] = _Window(
                microsteps=self._pos,
                size=self._size,
                divisor=self._den,
                by_items=self._by_items,
                items=list(self._items),
                losses=[loss.detach() for loss in self._losses],
                grads=[_grad_copy(param) for param in self._params],
            )._asdict()
        return state

    def _check_grads_in_params(self, refused: str) -> None:
        """Refuse to save or load an open window where its gradient is not ``param.grad``."""
        if not getattr(self._strategy, "grads_in_params", False):
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
        """Resume from `state_dict`: restores ``global_step`` and where the epoch was.

        The next `epoch` skips the ``position`` microbatches already trained on, so pass
        the same data in the same order. A state with a ``window`` restores its
        gradients: the next microstep continues that window.

        Args:
            state: From `state_dict`.
            allow_steps_change: Load a state saved with another ``steps`` and keep this
                accumulator's; only at an epoch boundary (``position`` 0, no window).

        Raises:
            ConfigTypeError: ``state`` is not such a mapping.
            ConfigError: ``state`` was saved with another ``drop_last``, with another
                ``steps`` (unless allowed, at an epoch boundary), or its window does not
                fit this optimizer's parameters.
            UsageError: A window is open in this accumulator.
        """
        if not isinstance(state, Mapping):
            msg = f"state must be a mapping from Accumulator.state_dict(), got {describe(state)}"
            raise ConfigTypeError(msg)
        check_bool(allow_steps_change, "allow_steps_change")
        version = check_count(state.get("version"), "state['version']")
        if version not in (1, _STATE_VERSION):
            msg = (
                f"state['version'] is {version}, but this gradaccum reads versions 1 and "
                f"{_STATE_VERSION}; load it with the gradaccum that saved it"
            )
            raise ConfigError(msg)
        steps = check_steps(state.get("steps"), "state['steps']")
        position = check_count(state.get("position"), "state['position']")
        global_step = check_count(state.get("global_step"), "state['global_step']")
        skipped = check_count(state.get("skipped_steps", 0), "state['skipped_steps']")
        if skipped > global_step:
            msg = f"state['skipped_steps'] is {skipped}, more than its {global_step} windows"
            raise ConfigError(msg)
        drop_last = check_bool(state.get("drop_last"), "state['drop_last']")
        window = state.get("window")
        if drop_last != self._drop_last:
            msg = (
                f"the state was saved with drop_last={drop_last!r} but this Accumulator has "
                f"drop_last={self._drop_last!r}; construct it with drop_last={drop_last!r} "
                "to resume"
            )
            raise ConfigError(msg)
        if steps != self._steps and not (allow_steps_change and position == 0 and not window):
            msg = (
                f"the state was saved with steps={steps} but this Accumulator has "
                f"steps={self._steps}; construct it with steps={steps} to resume"
            )
            if position or window:
                msg += " (it was saved mid-epoch, where steps cannot change)"
            else:
                msg += f", or pass allow_steps_change=True to keep steps={self._steps}"
            raise ConfigError(msg)
        if self._pos > 0 or self._in_block:
            msg = "load_state_dict() was called mid-window; load before the first microstep"
            raise UsageError(msg)
        saved = self._check_window(window) if window else None
        self._global_step = global_step
        self._skipped = skipped
        self._scheduled = None  # the scheduler's state may be loaded too: read it afresh
        self._position = self._resume_at = position
        self._reset_window()
        if saved is not None:
            for param, grad in zip(self._params, saved.grads, strict=True):
                param.grad = None if grad is None else grad.to(param.device).clone()
            self._pos, self._size, self._den = saved.microsteps, saved.size, saved.divisor
            self._by_items, self._items, self._losses = saved.by_items, saved.items, saved.losses
            self._arm()

    def _check_window(self, window: object) -> _Window:
        """The saved window, once every field is what `state_dict` writes and fits here."""
        fields = window if isinstance(window, Mapping) else {}
        pos, size, divisor = fields.get("microsteps"), fields.get("size"), fields.get("divisor")
        by_items, items, losses = fields.get("by_items"), fields.get("items"), fields.get("losses")
        grads = fields.get("grads")
        if not (
            type(pos) is int
            and type(size) is int
            and type(divisor) is int
            and isinstance(by_items, bool)
            and isinstance(items, list)
            and isinstance(losses, list)
            and isinstance(grads, list)
            and 0 < pos < size
            and len(losses) == pos
            and all(isinstance(item, (int, torch.Tensor)) for item in items)
            and all(isinstance(loss, torch.Tensor) for loss in losses)
        ):
            msg = f"state['window'] is not a window from state_dict(), got {describe(window)}"
            raise ConfigError(msg)
        if len(grads) != len(self._params) or not all(
            grad is None or (isinstance(grad, torch.Tensor) and grad.shape == param.shape)
            for grad, param in zip(grads, self._params, strict=False)
        ):
            msg = (
                "state['window'] does not fit this optimizer's parameters (their number or "
                "shapes differ); load it into an Accumulator built like the saved one"
            )
            raise ConfigError(msg)
        self._check_grads_in_params("load_state_dict() cannot restore")
        return _Window(pos, size, divisor, by_items, list(items), list(losses), grads)

    # Lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Remove the optimizer hook and restore any sync state set on the model."""
        self._closed = True
        misuse.forget(self)
        if not self._released:
            self._released = True
            self._hook.remove()
            self._strategy.restore()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Accumulator(steps={self._steps}, global_step={self._global_step}, "
            f"window={self._pos}/{self._size})"
        )


class _Window(NamedTuple):
    """An open window as `Accumulator.state_dict` saves it."""

    microsteps: int
    size: int
    divisor: int
    by_items: bool
    items: list[int | torch.Tensor]
    losses: list[torch.Tensor]
    grads: list[torch.Tensor | None]


class _Microstep:
    """The ``with`` block of a microstep, one per accumulator; see `Accumulator.microstep`."""

    __slots__ = ("_acc", "loss", "num_items")

    def __init__(self, acc: Accumulator) -> None:
        self._acc = acc
        self.loss: torch.Tensor | None = None
        self.num_items: int | torch.Tensor | None = None

    def __enter__(self) -> Step:
        loss, self.loss = self.loss, None
        if loss is None:
            msg = "a microstep block was entered twice; call acc.microstep(loss) for each one"
            raise UsageError(msg)
        return self._acc._enter(loss, self.num_items)

    def __exit__(self, _: object, error: BaseException | None, *__: object) -> None:
        self._acc._exit(error)


# Helpers -----------------------------------------------------------------------


def _scheduler_steps(scheduler: Any) -> int | None:
    """How far ``scheduler`` has stepped (``last_epoch``), when it says."""
    steps = getattr(scheduler, "last_epoch", None)
    return steps if isinstance(steps, int) else None


def _scale_grads(
    params: list[torch.Tensor], factor: float | int | torch.Tensor, *, divide: bool
) -> None:
    """Multiply (or divide) every gradient by ``factor`` in place, without host sync."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            groups.setdefault((param.grad.device, param.grad.dtype), []).append(param.grad)
    for (device, dtype), grads in groups.items():
        if isinstance(factor, torch.Tensor):
            local = factor.to(device=device, dtype=dtype)
            torch._foreach_mul_(grads, local.reciprocal() if divide else local)
        else:
            torch._foreach_mul_(grads, 1.0 / factor if divide else factor)


def _grad_copy(param: torch.Tensor) -> torch.Tensor | None:
    return None if param.grad is None else param.grad.detach().clone()


def _length(iterable: Iterable[Any]) -> int | None:
    if not isinstance(iterable, Sized):
        return None
    try:
        return len(iterable)
    except TypeError:  # a DataLoader over an IterableDataset has __len__ but may raise
        return None
