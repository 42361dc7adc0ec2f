"""`Accumulator`: the window state machine that turns N microbatches into one optimizer step."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeVar, get_args

import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau
from typing_extensions import Self

from gradaccum.errors import ConfigError, ConfigTypeError, GradaccumWarning, UsageError, describe
from gradaccum.schedule import check_count, check_steps, total_steps
from gradaccum.sync import strategy_for

__all__ = ["Accumulator", "Step", "SyncPolicy"]

T = TypeVar("T")
SyncPolicy = Literal["auto", "boundary", "every"]
_STATE_VERSION = 1


@dataclass(slots=True)
class Step:
    """What a microstep reports; the window fields are filled on the boundary only.

    Attributes:
        boundary: This microstep completes the window: the body of its ``with`` block
            sees the window's full gradient, clipped, not yet applied.
        global_step: The optimizer step this window becomes (``acc.global_step`` after
            the block exits); on other microsteps, the steps completed so far.
        loss: The window's loss as a detached 0-dim tensor: the mean of the microbatch
            losses, or the summed losses over the window's items with ``num_items``.
        grad_norm: The total gradient norm before clipping, a 0-dim tensor; ``None``
            without ``max_grad_norm``.
        lr: The learning rate of the first parameter group for this update.
        skipped: The GradScaler found inf/NaN gradients and skipped the update (and the
            scheduler step). Known once the block has exited.
    """

    boundary: bool
    global_step: int
    loss: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None
    lr: float | torch.Tensor | None = None
    skipped: bool = False


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
        sync: When a wrapped model communicates gradients: ``"auto"``, ``"boundary"``
            or ``"every"``. An unwrapped module never communicates, so all three agree.

    Raises:
        ConfigTypeError: An argument has the wrong type, or ``model`` is wrapped in a
            module that communicates gradients (not supported by this release).
        ConfigError: An argument has a value outside what is accepted.

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
        self._strategy = strategy_for(model)
        # Everything is validated: from here on the accumulator changes state.
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self._drop_last = drop_last
        self._sync: SyncPolicy = sync
        self._params = _unique_params(optimizer)
        self._global_step = 0
        self._position = 0  # microbatches of the current epoch handed out by `epoch`
        self._resume_at = 0  # microbatches `epoch` skips after `load_state_dict`
        self._in_block = False
        self._stepping = False  # the accumulator itself is calling optimizer.step()
        self._closed = False
        self._reset_window()
        optimizer.zero_grad(set_to_none=True)
        self._hook = optimizer.register_step_pre_hook(self._refuse_foreign_step)

    # Window state -----------------------------------------------------------------

    def _reset_window(self) -> None:
        self._pos = 0  # microsteps back-propagated in this window
        self._size = self._steps  # microsteps in this window
        self._den = self._steps  # what mean-mode losses were divided by
        self._mode: Literal["mean", "items"] | None = None
        self._losses: list[torch.Tensor] = []
        self._items: list[int | torch.Tensor] = []
        self._pending: Step | None = None  # the boundary step, between enter and exit
        self._unscaled = False
        self._arm()

    def _arm(self) -> None:
        self._strategy.arm(self.sync_gradients or self._sync == "every")

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
        if self._closed:
            msg = "microstep() was called on a closed Accumulator; create a new one"
            raise UsageError(msg)
        if self._in_block:
            msg = (
                "microstep() was called inside another microstep block; "
                "leave the first `with acc.microstep(...)` block before starting the next"
            )
            raise UsageError(msg)
        _check_loss(loss)
        mode: Literal["mean", "items"] = "mean" if num_items is None else "items"
        if mode == "items":
            _check_num_items(num_items)
        if self._mode is not None and mode != self._mode:
            msg = (
                f"microstep {self._pos + 1} of this window "
                f"{'passes' if mode == 'items' else 'omits'} num_items but the window's "
                f"first microstep did {'not' if mode == 'items' else 'so'}; pass num_items "
                "on every microstep of a window or on none"
            )
            raise UsageError(msg)
        return _Microstep(self, loss, num_items)

    def _enter(self, loss: torch.Tensor, num_items: int | torch.Tensor | None) -> Step:
        self._in_block = True
        if self._pos == 0:
            self._den = self._size
            self._mode = "mean" if num_items is None else "items"
        try:
            scaled = loss if num_items is not None or self._den == 1 else loss / self._den
            if self._scaler is not None:
                scaled = self._scaler.scale(scaled)
            scaled.backward()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            self._losses.append(loss.detach())
            if num_items is not None:
                self._items.append(num_items)
            if not self.sync_gradients:
                return Step(boundary=False, global_step=self._global_step)
            self._pending = self._prepare_boundary()
        except BaseException:
            self._in_block = False
            self._discard_window()
            raise
        return self._pending

    def _prepare_boundary(self) -> Step:
        """Normalize, unscale and clip the window's gradient: what the block body sees."""
        count = len(self._losses)
        loss = self._losses[0] if count == 1 else torch.stack(self._losses).sum()
        if self._mode == "items":
            total = sum(self._items, start=0)
            if isinstance(total, int) and total == 0:
                msg = f"the {count} microsteps of this window passed num_items summing to 0"
                raise ConfigError(msg)
            _scale_grads(self._params, total, divide=True)
            loss = loss / total
        else:
            if self._den != self._size:  # the epoch ended early: 1/den becomes 1/size
                _scale_grads(self._params, self._den / self._size, divide=False)
            if count > 1:
                loss = loss / count
        if self._scaler is not None:
            self._scaler.unscale_(self.optimizer)
            self._unscaled = True
        grad_norm = None
        if self._max_grad_norm is not None:
            grad_norm = nn.utils.clip_grad_norm_(self._params, self._max_grad_norm)
        return Step(
            boundary=True,
            global_step=self._global_step + 1,
            loss=loss,
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

        Raises:
            ConfigError: The epoch has too few microbatches for one optimizer step;
                for an iterable without ``len`` this is known only at its end.
            UsageError: The accumulator is closed.
        """
        if self._closed:
            msg = "epoch() was called on a closed Accumulator; create a new one"
            raise UsageError(msg)
        n = _length(iterable)
        planned = None
        if n is not None:
            self._check_epoch_length(n, known=True)
            planned = n if not self._drop_last else n - n % self._steps
            if self._resume_at > planned:
                msg = (
                    f"the loaded state resumes at microbatch {self._resume_at} of the epoch, "
                    f"past the {planned} this epoch of {n} trains on; pass the same data"
                )
                raise ConfigError(msg)
        return self._epoch(iterable, planned)

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
        seen = 0
        for index, (item, last) in enumerate(_flag_last(iter(iterable), planned)):
            seen = index + 1
            if index < skip:
                continue
            if self._pos == 0:
                self._size = self._steps
                if planned is not None and not self._drop_last:
                    self._size = min(self._steps, planned - index)
            if last and not self._drop_last:
                self._size = self._pos + 1
            self._arm()
            self._position = seen
            yield item
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
            self._check_epoch_length(seen, known=False)

    def _check_epoch_length(self, n: int, *, known: bool) -> None:
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
        if not known:
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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Accumulator(steps={self._steps}, global_step={self._global_step}, "
            f"window={self._pos}/{self._size})"
        )


class _Microstep:
    """The ``with`` block of one microstep; see `Accumulator.microstep`."""

    __slots__ = ("_acc", "_loss", "_num_items")

    def __init__(
        self, acc: Accumulator, loss: torch.Tensor, num_items: int | torch.Tensor | None
    ) -> None:
        self._acc = acc
        self._loss = loss
        self._num_items = num_items

    def __enter__(self) -> Step:
        return self._acc._enter(self._loss, self._num_items)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._acc._exit(failed=exc_type is not None)


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


def _check_loss(loss: object) -> None:
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


def _flag_last(iterator: Iterator[T], planned: int | None) -> Iterator[tuple[T, bool]]:
    """Pair each item with whether it is the epoch's last: counted, or one looked ahead."""
    if planned is not None:
        for index in range(planned):
            try:
                yield next(iterator), index == planned - 1
            except StopIteration:
                msg = f"the iterable ended after {index} items; its len() promised {planned}"
                raise ConfigError(msg) from None
        return
    held: tuple[T] | None = None
    for item in iterator:
        if held is not None:
            yield held[0], False
        held = (item,)
    if held is not None:
        yield held[0], True
