"""Stepping the optimizer (through the GradScaler) and the scheduler once per window, and
watching both for steps taken by hand; which accumulator owns an optimizer."""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any

import torch

from gradaccum.errors import UsageError, warn

__all__ = ["Stepper", "learning_rate"]


class Stepper:
    """Steps the optimizers, the scaler and the schedulers for one accumulator.

    One window steps every optimizer once, in order, then every scheduler once (an
    optimizer's entry may be None). Each optimizer's step pre-hook refuses
    ``optimizer.step()`` by hand inside a window and warns about it between windows; a
    scheduler whose ``last_epoch`` moved between the accumulator's steps was stepped by
    hand, which is reported at its next step (once per accumulator: a loop that does it
    does it every window), unless an optimizer's state was loaded since (a resume, which
    loads the schedulers' states with it).

    Attributes:
        applied: The current window's optimizer steps have run (a scheduler step may
            still fail): the window is applied.
    """

    def __init__(
        self,
        optimizers: tuple[torch.optim.Optimizer, ...],
        schedulers: tuple[Any, ...],
        scaler: torch.amp.GradScaler | None,
        where: Callable[[], str | None],
    ) -> None:
        self.optimizers = optimizers
        self.scaler = scaler
        self.applied = False
        self._where = where  # "microstep k of n" while a window is open, else None
        self._stepping = False
        self._stepped = 0  # optimizer steps taken while the accumulator steps them
        # Optimizers that take the scaler into their step (fused=True): GradScaler always
        # calls their step(), and they skip on the device.
        self._scaled_inside = any(
            getattr(optimizer, "_step_supports_amp_scaling", False) for optimizer in optimizers
        )
        self._unscaled = False
        # [scheduler, its last_epoch after the accumulator's last step of it, or None, and
        # how to read it: as an attribute where it is its own int (torch's schedulers)]
        self._scheduled: list[list[Any]] = [
            [scheduler, _last_epoch(scheduler), _reader(scheduler)]
            for scheduler in schedulers
            if scheduler is not None
        ]
        self._told_stepped = False  # a schedule stepped by hand is said once, not every window
        # Its hooks on the optimizers (`release` removes them). The handles hold nothing
        # alive: the owner's release may keep them where it must not keep this stepper.
        self.hooks = [
            optimizer.register_step_pre_hook(self._foreign_step) for optimizer in optimizers
        ]
        # A resume loads the optimizers' states with the schedulers': the schedules are
        # then taken as they are, not as stepped by hand.
        self.hooks += [
            optimizer.register_load_state_dict_post_hook(self._loaded) for optimizer in optimizers
        ]

    def unscale(self) -> None:
        """Unscale the window's gradient (once, at its boundary) when there is a scaler."""
        if self.scaler is not None:
            for optimizer in self.optimizers:
                self.scaler.unscale_(optimizer)
            self._unscaled = True

    def learning_rates(self) -> tuple[float | torch.Tensor | None, ...]:
        """Each optimizer's learning rate as it is now (`learning_rate`), in order."""
        optimizers = self.optimizers
        return (
            (learning_rate(optimizers[0]),)
            if len(optimizers) == 1
            else tuple(map(learning_rate, optimizers))
        )

    def apply(self, skip: bool) -> bool:
        """Step every optimizer (through the scaler), then every scheduler, and clear the
        gradients; return whether the window was skipped: ``skip`` (inf/NaN found at the
        boundary: nothing steps, and the scale backs off by the scaler's
        ``backoff_factor``, also when only the norm overflowed, every value finite, so the
        scaler itself found nothing), or the scaler skipped the step (found inf/NaN), in
        which case no scheduler steps. With several optimizers the accumulator has
        checked the gradient first, so that the scaler steps all of them or none."""
        scaler = self.scaler
        self._stepping = True
        try:
            if skip:
                if scaler is not None:
                    scale = scaler.get_scale()
                    scaler.update()
                    if scaler.get_scale() >= scale:
                        scaler.update(scale * scaler.get_backoff_factor())
                    self._unscaled = False
            elif scaler is None:
                for optimizer in self.optimizers:
                    optimizer.step()
            else:
                skip = self._scaled_step(scaler)
            if not skip:
                self.applied = True
                for record in self._scheduled:
                    scheduler, last, read = record
                    if last is not None and not self._told_stepped:
                        now = read(scheduler)
                        if now != last:
                            self._told_stepped = True
                            _warn_stepped(last, now)
                    scheduler.step()
                    record[1] = read(scheduler)
        finally:
            self._stepping = False
        self.clear()
        return skip

    def _scaled_step(self, scaler: torch.amp.GradScaler) -> bool:
        """Step every optimizer through ``scaler`` and update it; return whether the scaler
        skipped the step. GradScaler calls an optimizer's ``step()`` only when its
        gradient is finite (its own one host sync), which the step pre-hook sees: no read
        of ours. An optimizer that takes the scaler into its step (``fused=True``) is
        always called and skips on the device; there the skip is read as the scale
        shrinking (two host syncs). An optimizer with no gradient in the window is not
        given to the scaler (it would assert "No inf checks were recorded"), and counts
        as stepped."""
        inside = self._scaled_inside
        scale = scaler.get_scale() if inside else 0.0
        self._stepped = 0
        checked = False
        for optimizer in self.optimizers:
            if _has_grad(optimizer):
                scaler.step(optimizer)
                checked = True
            else:
                # No gradient in this window (its layers frozen, or unused): its step would
                # change nothing, and GradScaler, which found nothing to check, asserts.
                self._stepped += 1
        # (With no gradient at all, update() would assert: the scale is kept.)
        scaler.update(None if checked else scaler.get_scale())
        if inside:
            return scaler.get_scale() < scale  # it shrinks only on a skip
        return not self._stepped

    def clear(self) -> None:
        """After a window, whatever became of it: gradients cleared, scaler record reset."""
        if self._unscaled:
            if not self.applied and self.scaler is not None:  # it failed
                # Clear the scaler's per-optimizer record of unscale_() without moving the
                # scale.
                self.scaler.update(self.scaler.get_scale())
            self._unscaled = False
        self.applied = False
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def reread_schedulers(self) -> None:
        """The schedulers' states may have been loaded: take their ``last_epoch`` as ours."""
        for record in self._scheduled:
            record[1] = None

    def _loaded(self, _: torch.optim.Optimizer) -> None:
        self.reread_schedulers()

    def release(self) -> None:
        """Remove the hooks from the optimizers."""
        for hook in self.hooks:
            hook.remove()

    def _foreign_step(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        if self._stepping:
            self._stepped += 1
            return
        where = self._where()
        if where is not None:
            msg = (
                f"optimizer.step() was called inside an accumulation window ({where}); the "
                "accumulator steps the optimizer when the window's last microstep block "
                "exits: remove the call"
            )
            raise UsageError(msg)
        if all(_is_zero(group.get("lr")) for group in optimizer.param_groups):
            return  # changes nothing: torch.distributed.checkpoint creating a fresh state
        warn(
            "optimizer.step() was called between windows while an Accumulator owns the "
            "optimizer; it steps once when each window's last microstep block exits: "
            "remove the call (or close() the accumulator first)"
        )


def _warn_stepped(scheduled: int | None, moved: object) -> None:
    warn(
        f"the scheduler was stepped outside the accumulator (its last_epoch moved from "
        f"{scheduled} to {moved} between the accumulator's steps); the accumulator steps it "
        "once per applied window: remove the scheduler.step() call (after loading a "
        "scheduler's state, also load the accumulator's); said once per accumulator"
    )


def learning_rate(optimizer: torch.optim.Optimizer) -> float | torch.Tensor | None:
    """The first parameter group's learning rate as it is now: a copy when it is a tensor
    (which the scheduler changes in place), None when the group has no ``"lr"``."""
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    if type(lr) is float:  # (as a rule: no isinstance, which costs a Tensor's metaclass check)
        return lr
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr


def _has_grad(optimizer: torch.optim.Optimizer) -> bool:
    """Some parameter of ``optimizer`` has a gradient (found at the first, as a rule)."""
    return any(
        param.grad is not None for group in optimizer.param_groups for param in group["params"]
    )


def _is_zero(lr: object) -> bool:
    """A learning rate of 0 (a float or a tensor; read only on a step taken by hand)."""
    return isinstance(lr, (int, float, torch.Tensor)) and float(lr) == 0


def _reader(scheduler: Any) -> Callable[[Any], int | None]:
    """How to read ``scheduler``'s `_last_epoch` on each window: its attribute, read in C,
    where it is its own int (torch's schedulers), else `_last_epoch`."""
    return (
        attrgetter("last_epoch")
        if type(getattr(scheduler, "last_epoch", None)) is int
        else _last_epoch
    )


def _last_epoch(scheduler: Any) -> int | None:
    """How far ``scheduler`` has stepped (``last_epoch``), when it says; a
    ``ChainedScheduler``, which has none, by its first scheduler's (it steps them all)."""
    steps = getattr(scheduler, "last_epoch", None)
    if steps is None and type(scheduler) is torch.optim.lr_scheduler.ChainedScheduler:
        steps = getattr(scheduler._schedulers[0], "last_epoch", None)
    return steps if isinstance(steps, int) else None
