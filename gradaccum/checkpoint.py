"""Save and load an accumulator's state (`Accumulator.state_dict`, `load_state_dict`): the
record's fields from the accumulator's parts, and back, each check before anything
changes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from gradaccum import block, record
from gradaccum.errors import ConfigError, UsageError
from gradaccum.schedule import check_bool

if TYPE_CHECKING:
    from gradaccum.accumulator import Accumulator

__all__ = ["load", "save"]


def save(acc: Accumulator, include_grads: bool) -> dict[str, Any]:
    """What `Accumulator.state_dict` returns."""
    check_bool(include_grads, "include_grads")
    window = acc._window
    if window.in_block or (window.done and not include_grads):
        msg = (
            f"state_dict() was called mid-window ({window.progress()}); checkpoint after "
            "the `with` block of the window's last microstep has exited, e.g. when "
            "acc.global_step has just changed, or pass include_grads=True (outside a "
            "`with` block) to save the partial window"
        )
        raise UsageError(msg)
    plan = acc._plan
    position = plan.checkpoint_position(window.done)
    saved = None
    if window.done:
        _check_grads_in_params(acc, "state_dict(include_grads=True) cannot save")
        saved = record.SavedWindow(
            microsteps=window.done,
            size=window.size,
            divisor=window.divisor,
            by_items=window.by_items,
            items=list(window.items),
            losses=list(window.losses),
            grads=[_grad_copy(param) for param in acc._params.now()],
        )
    order = plan.order
    return dict(
        record.Checkpoint(
            steps=acc._steps,
            position=position,
            global_step=acc._global_step,
            skipped_steps=acc._skipped,
            drop_last=acc._options.drop_last,
            sync=acc._options.sync,
            window=saved,
            epochs_completed=plan.epochs_completed,
            world_size=acc._ranks.count,
            epoch_length=plan.checkpoint_length(position),
            order=order,
            global_position=None if order is None else order.trained_after(position),
            by_items=plan.by_items,
            handed_out=plan.pending,
        ).to_dict()
    )


def load(
    acc: Accumulator,
    state: Mapping[str, Any],
    allow_steps_change: bool,
    allow_world_size_change: bool,
) -> None:
    """What `Accumulator.load_state_dict` does: refuse what does not fit, then restore."""
    acc._life.check("load_state_dict()")
    check_bool(allow_steps_change, "allow_steps_change")
    check_bool(allow_world_size_change, "allow_world_size_change")
    saved = record.parse(state, lambda value: isinstance(value, torch.Tensor))
    world_size = acc._ranks.count
    rescale = saved.check_fits(
        world_size=world_size,
        steps=acc._steps,
        drop_last=acc._options.drop_last,
        allow_steps_change=allow_steps_change,
        allow_world_size_change=allow_world_size_change,
    )
    if acc._window.is_open or acc._plan.active:
        msg = (
            "load_state_dict() was called mid-window or while acc.epoch() is being "
            "iterated; load before the epoch loop"
        )
        raise UsageError(msg)
    params = acc._params.now()
    if saved.window is not None:
        _check_window_fits(acc, saved.window, params)
    acc._global_step = saved.global_step
    acc._skipped = saved.skipped_steps
    acc._stepper.reread_schedulers()
    done = 0 if saved.window is None else saved.window.microsteps
    if rescale is None:
        acc._plan.load(
            saved.position,
            done,
            epochs_completed=saved.epochs_completed,
            length=saved.epoch_length,
            order=saved.order,
            by_items=saved.by_items,
            handed_out=saved.handed_out,
        )
    else:  # the position in these ranks' microbatches; their epoch's length is checked then
        acc._plan.load(
            rescale.skip(world_size),
            0,
            epochs_completed=saved.epochs_completed,
            by_items=saved.by_items,
            handed_out=saved.handed_out,
            rescale=rescale,
        )
    block.clear_window(acc)
    if saved.window is not None:
        for param, grad in zip(params, saved.window.grads, strict=True):
            param.grad = None if grad is None else grad.to(param.device).clone()
        window = acc._window
        window.done = saved.window.microsteps
        window.resize(saved.window.size)
        window.divisor, window.by_items = saved.window.divisor, saved.window.by_items
        window.items, window.losses = list(saved.window.items), list(saved.window.losses)
        if acc._block.watch:
            acc._grads.start(acc._params.first, acc._params.watched())
        acc._block.arm()


def _check_grads_in_params(acc: Accumulator, refused: str) -> None:
    """Refuse to save or load an open window where its gradient is not ``param.grad``."""
    strategy = acc._block.strategy
    if not strategy.grads_in_params:
        msg = (
            f"{refused} this window: under {type(strategy).__name__} its partial "
            "gradient is held by the wrapper (unsharded buffers, a pending all-reduce) "
            "or sharded over the ranks, which gradaccum does not save; checkpoint after "
            "a window's last microstep"
        )
        raise UsageError(msg)


def _check_window_fits(
    acc: Accumulator, window: record.SavedWindow, params: list[torch.Tensor]
) -> None:
    if len(window.grads) != len(params) or not all(
        grad is None or grad.shape == param.shape
        for grad, param in zip(window.grads, params, strict=False)
    ):
        msg = (
            "state['window'] does not fit this optimizer's parameters (their number or "
            "shapes differ); load it into an Accumulator built like the saved one"
        )
        raise ConfigError(msg)
    _check_grads_in_params(acc, "load_state_dict() cannot restore")


def _grad_copy(param: torch.Tensor) -> torch.Tensor | None:
    return None if param.grad is None else param.grad.detach().clone()
