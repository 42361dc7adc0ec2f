"""`Accumulator`: the window state machine that turns N microbatches into one optimizer step."""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, NoReturn, TypeVar, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau
from typing_extensions import Self

from gradaccum.errors import ConfigError, ConfigTypeError, GradaccumWarning, UsageError, describe
from gradaccum.schedule import check_count, check_steps, steps_per_epoch, total_steps
from gradaccum.sync import SyncPolicy, clip_grad_norm, strategy_for

__all__ = ["Accumulator", "Step"]

T = TypeVar("T")
_STATE_VERSION = 1


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
        skipped: The GradScaler found inf/NaN gradients and skipped the update (and the
            scheduler step). Known once the block has exited.
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

    Raises:
        ConfigTypeError: An argument has the wrong type.
        ConfigError: An argument has a value outside what is accepted, or the model's
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
    ) -> None:
        _check_parts(model, optimizer, scheduler)
        self._steps = check_steps(steps)
        self._max_grad_norm = _check_max_grad_norm(max_grad_norm)
        self._scaler = _check_scaler(scaler)
        if not isinstance(drop_last, bool):
            msg = f"drop_last must be a bool, got {describe(drop_last)}"
            raise ConfigTypeError(msg)
        if sync not in get_args(SyncPolicy):
            msg = f"sync must be one of 'auto', 'boundary', 'every', got {describe(sync)}"
            raise ConfigError(msg)
        # With steps=1 every microstep is a boundary: nothing is ever deferred.
        self._strategy = strategy_for(model, "every" if self._steps == 1 else sync)
        # Everything is validated: from here on the accumulator changes state.
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self._drop_last = drop_last
        self._sync: SyncPolicy = sync
        self._params = _unique_params(optimizer)
        self._group = self._strategy.group
        self._ranks = 1 if self._group is None else dist.get_world_size(self._group)
        self._device = self._params[0].device  # where the scalar collectives' tensors live
        self._clip = getattr(self._strategy, "clip_grad_norm", clip_grad_norm)
        self._warned_lengths = False
        self._global_step = 0
        self._position = 0  # microbatches of the current epoch handed out by `epoch`
        self._resume_at = 0  # microbatches `epoch` skips after `load_state_dict`
        self._in_block = False
        self._block = _Microstep(self)  # holds a loss from microstep() until it is entered
        self._stepping = False  # the accumulator itself is calling optimizer.step()
        self._closed = False
        self._armed: bool | None = None  # what the strategy was last told
        self._reset_window()
        optimizer.zero_grad(set_to_none=True)
        self._hook = optimizer.register_step_pre_hook(self._refuse_foreign_step)

    # Window state -----------------------------------------------------------------

    def _reset_window(self) -> None:
        self._pos = 0  # microsteps back-propagated in this window
        self._size = self._steps  # microsteps in this window
        self._den = self._steps  # what mean-mode losses were divided by
        self._by_items = False  # this window passes num_items (set by its first microstep)
        self._losses: list[torch.Tensor] = []
        self._items: list[int | torch.Tensor] = []
        self._pending: Step | None = None  # the boundary step, between enter and exit
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
        """Microbatches per optimizer step."""
        return self._steps

    @property
    def global_step(self) -> int:
        """Windows completed: optimizer steps taken, plus any the GradScaler skipped."""
        return self._global_step

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
                ``num_items`` is negative or not 0-dim.
        """
        # The checks are one cheap condition each on the hot path; messages are built on failure.
        if self._closed or self._in_block or self._block.loss is not None:
            self._refuse_microstep()
        if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.requires_grad):
            _refuse_loss(loss)
        by_items = num_items is not None
        if by_items:
            _check_num_items(num_items)
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
        if self._closed:
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
        except BaseException:
            self._in_block = False
            self._discard_window()
            raise
        return self._pending

    def _prepare_boundary(self) -> Step:
        """Normalize, unscale and clip the window's gradient: what the block body sees."""
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
        grad_norm = None
        if self._max_grad_norm is not None:
            grad_norm = self._clip(self._params, self._max_grad_norm)
        return Step(
            boundary=True,
            global_step=self._global_step + 1,
            losses=self._losses,
            divisor=divisor,
            grad_norm=grad_norm,
            lr=self.optimizer.param_groups[0]["lr"],
        )

    def _exit(self, failed: bool) -> None:
        self._in_block = False
        step = self._pending
        if failed:
            self._discard_window()
        elif step is None:
            self._pos += 1
            if self._pos == self._size - 1:  # the next microstep is the boundary
                self._arm()
        else:
            try:
                step.skipped = self._apply()
            except BaseException:
                self._discard_window()
                raise
            self.optimizer.zero_grad(set_to_none=True)
            self._global_step += 1
            self._reset_window()

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
        finally:
            self._stepping = False
        if self.scheduler is not None and not skipped:
            self.scheduler.step()
        return skipped

    def _discard_window(self) -> None:
        """Drop the open window's gradient so that the next microstep starts clean."""
        if self._unscaled and self._scaler is not None:
            # Clear the scaler's per-optimizer record of unscale_() without moving the scale.
            self._scaler.update(self._scaler.get_scale())
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_window()

    def _refuse_foreign_step(self, *_: object) -> None:
        if not self._stepping and (self._pos > 0 or self._in_block):
            msg = (
                f"optimizer.step() was called inside an accumulation window (microstep "
                f"{self._pos + 1} of {self._size}); the accumulator steps the optimizer "
                "when the window's last microstep block exits: remove the call"
            )
            raise UsageError(msg)

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
        return self._epoch(iterable, planned)

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

    def _epoch(self, iterable: Iterable[T], planned: int | None) -> Iterator[T]:
        if self._pos > 0:
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
        if planned is not None:
            for seen, item in enumerate(itertools.islice(iterator, planned - start), start + 1):
                self._hand_out(seen, planned - seen)
                yield item
            if seen < planned:
                msg = f"the iterable ended after {seen} items; its len() promised {planned}"
                raise ConfigError(msg)
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
            msg = "the epoch is empty: it gives no optimizer step"
        else:
            msg = (
                f"an epoch of {n} microbatches gives no optimizer step with steps={self._steps} "
                f"and drop_last=True; lower steps to at most {n}, or pass drop_last=False"
            )
        if discarded:
            msg += " (its gradient was discarded)"
        raise ConfigError(msg)

    # Checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The accumulator's state, to save beside the model's, optimizer's and scheduler's.

        Returns:
            ``steps``, the ``position`` in the current epoch (microbatches handed out),
            ``global_step`` and the policy (``drop_last``, ``sync``).

        Raises:
            UsageError: A window is open: checkpoint after the ``with`` block of a
                boundary microstep has exited.
        """
        if self._pos > 0 or self._in_block:
            msg = (
                f"state_dict() was called mid-window ({self._pos} of {self._size} microsteps "
                "back-propagated); checkpoint after the `with` block of the window's last "
                "microstep has exited, e.g. when acc.global_step has just changed"
            )
            raise UsageError(msg)
        return {
            "version": _STATE_VERSION,
            "steps": self._steps,
            "position": self._position,
            "global_step": self._global_step,
            "drop_last": self._drop_last,
            "sync": self._sync,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from `state_dict`: restores ``global_step`` and where the epoch was.

        The next `epoch` skips the ``position`` microbatches already trained on, so pass
        the same data in the same order.

        Raises:
            ConfigTypeError: ``state`` is not such a mapping.
            ConfigError: ``state`` was saved with another ``steps`` or ``drop_last``.
            UsageError: A window is open in this accumulator.
        """
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            msg = f"state must be a mapping from Accumulator.state_dict(), got {describe(state)}"
            raise ConfigTypeError(msg)
        steps = check_steps(state.get("steps"), "state['steps']")
        position = check_count(state.get("position"), "state['position']")
        global_step = check_count(state.get("global_step"), "state['global_step']")
        for name, saved, current in (
            ("steps", steps, self._steps),
            ("drop_last", state.get("drop_last"), self._drop_last),
        ):
            if saved != current:
                msg = (
                    f"the state was saved with {name}={saved!r} but this Accumulator has "
                    f"{name}={current!r}; construct it with {name}={saved!r} to resume"
                )
                raise ConfigError(msg)
        if self._pos > 0 or self._in_block:
            msg = "load_state_dict() was called mid-window; load before the first microstep"
            raise UsageError(msg)
        self._global_step = global_step
        self._position = self._resume_at = position

    # Lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Remove the optimizer hook and restore any sync state set on the model."""
        if not self._closed:
            self._closed = True
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

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self._acc._exit(exc_type is not None)


# Validation and helpers -----------------------------------------------------------


def _check_parts(model: object, optimizer: object, scheduler: object) -> None:
    if not isinstance(model, nn.Module):
        msg = f"model must be a torch.nn.Module, got {describe(model)}"
        raise ConfigTypeError(msg)
    if not isinstance(optimizer, torch.optim.Optimizer):
        msg = f"optimizer must be a torch.optim.Optimizer, got {describe(optimizer)}"
        raise ConfigTypeError(msg)
    if scheduler is None:
        return
    if isinstance(scheduler, ReduceLROnPlateau):
        msg = (
            "scheduler=ReduceLROnPlateau needs a metric for each step; pass scheduler=None "
            "and call its step(metric) yourself after a boundary"
        )
        raise ConfigTypeError(msg)
    if not callable(getattr(scheduler, "step", None)):
        msg = f"scheduler must have a step() method (an LRScheduler), got {describe(scheduler)}"
        raise ConfigTypeError(msg)
    bound = getattr(scheduler, "optimizer", optimizer)
    if bound is not optimizer:
        msg = (
            f"scheduler steps another optimizer ({type(bound).__name__}) than the one given; "
            "create the scheduler on the optimizer passed to the Accumulator"
        )
        raise ConfigError(msg)


def _check_max_grad_norm(value: object) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        msg = f"max_grad_norm must be a positive number or None, got {describe(value)}"
        raise ConfigTypeError(msg)
    if math.isnan(value) or value <= 0:
        msg = (
            f"max_grad_norm must be a positive number or None, got {value}; "
            "pass None for no clipping or math.inf to only report the norm"
        )
        raise ConfigError(msg)
    return float(value)


def _check_scaler(scaler: object) -> torch.amp.GradScaler | None:
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        msg = f"scaler must be a torch.amp.GradScaler or None, got {describe(scaler)}"
        raise ConfigTypeError(msg)
    return scaler if scaler.is_enabled() else None


def _refuse_loss(loss: object) -> None:
    """Raise the error that says why ``loss`` cannot be back-propagated as a microstep."""
    if not isinstance(loss, torch.Tensor):
        msg = f"loss must be a torch.Tensor, got {describe(loss)}"
        raise ConfigTypeError(msg)
    if loss.dim() != 0:
        msg = (
            f"loss must be a 0-dim tensor, got shape {tuple(loss.shape)}; reduce it with "
            ".mean(), or with .sum() and num_items=..."
        )
        raise ConfigError(msg)
    if not loss.requires_grad:
        msg = (
            "loss does not require grad; compute it from the model's output, "
            "outside torch.no_grad()"
        )
        raise ConfigError(msg)


def _check_num_items(num_items: object) -> None:
    if isinstance(num_items, torch.Tensor):
        if num_items.dim() != 0:
            msg = f"num_items must be a 0-dim tensor, got shape {tuple(num_items.shape)}"
            raise ConfigError(msg)
        return
    check_count(num_items, "num_items")


def _unique_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            seen.setdefault(id(param), param)
    return list(seen.values())


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


def _length(iterable: Iterable[Any]) -> int | None:
    if not isinstance(iterable, Sized):
        return None
    try:
        return len(iterable)
    except TypeError:  # a DataLoader over an IterableDataset has __len__ but may raise
        return None
