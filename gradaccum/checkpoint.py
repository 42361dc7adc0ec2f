"""Save and load an accumulator's state (`Accumulator.state_dict`, `load_state_dict`): the
record's fields from the accumulator's parts, and back, each check before anything
changes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradaccum import record
from gradaccum.block import Microstep
from gradaccum.errors import ConfigError, UsageError, warn
from gradaccum.schedule import check_bool

__all__ = ["load", "save"]


def save(started: Microstep, include_grads: bool) -> dict[str, Any]:
    """What `Accumulator.state_dict` returns, from the parts of the accumulator whose block
    is ``started``."""
    check_bool(include_grads, "include_grads")
    window, plan, counts, options = started.window, started.plan, started.counts, started.options
    if window.in_block or (window.done and not include_grads):
        msg = (
            f"state_dict() was called mid-window ({window.progress()}); checkpoint after "
            "the `with` block of the window's last microstep has exited, e.g. when "
            "acc.global_step has just changed, or pass include_grads=True (outside a "
            "`with` block) to save the partial window"
        )
        raise UsageError(msg)
    position = plan.checkpoint_position(window.done)
    saved = None
    if window.done:
        _check_grads_in_params(started, "state_dict(include_grads=True) cannot save")
        saved = record.SavedWindow(
            microsteps=window.done,
            size=window.size,
            divisor=window.divisor,
            by_items=window.by_items,
            items=list(window.items),
            losses=list(window.losses),
            grads=[_grad_copy(param) for param in started.params.now()],
        )
    refusal = plan.refused_resume(position)
    if refusal is not None:
        warn(f"a run resumed from this state is refused when its first epoch begins: {refusal}")
    order = plan.order
    return dict(
        record.Checkpoint(
            steps=counts.steps,
            position=position,
            global_step=counts.global_step,
            skipped_steps=counts.skipped,
            drop_last=options.drop_last,
            sync=options.sync,
            window=saved,
            epochs_completed=plan.epochs_completed,
            world_size=started.ranks.count,
            epoch_length=plan.checkpoint_length(position),
            order=order,
            global_position=None if order is None else order.trained_after(position),
            by_items=plan.by_items,
            handed_out=plan.pending,
            microbatch=started.fit.state(),
        ).to_dict()
    )


def load(
    started: Microstep,
    state: Mapping[str, Any],
    allow_steps_change: bool,
    allow_world_size_change: bool,
) -> None:
    """What `Accumulator.load_state_dict` does: refuse what does not fit, then restore."""
    started.life.check("load_state_dict()")
    check_bool(allow_steps_change, "allow_steps_change")
    check_bool(allow_world_size_change, "allow_world_size_change")
    saved = record.parse(state, lambda value: isinstance(value, torch.Tensor))
    world_size = started.ranks.count
    rescale = saved.check_fits(
        world_size=world_size,
        steps=started.counts.steps,
        drop_last=started.options.drop_last,
        allow_steps_change=allow_steps_change,
        allow_world_size_change=allow_world_size_change,
    )
    plan = started.plan
    if started.window.is_open or plan.active:
        msg = (
            "load_state_dict() was called mid-window or while acc.epoch() is being "
            "iterated; load before the epoch loop"
        )
        raise UsageError(msg)
    params = started.params.now()
    if saved.window is not None:
        _check_window_fits(started, saved.window, params)
    started.counts.load(saved.global_step, saved.skipped_steps)
    started.fit.load(saved.microbatch)
    started.stepper.reread_schedulers()
    done = 0 if saved.window is None else saved.window.microsteps
    if rescale is None:
        plan.load(
            saved.position,
            done,
            epochs_completed=saved.epochs_completed,
            length=saved.epoch_length,
            order=saved.order,
            by_items=saved.by_items,
            handed_out=saved.handed_out,
        )
    else:  # the position in these ranks' microbatches; their epoch's length is checked then
        plan.load(
            rescale.skip(world_size),
            0,
            epochs_completed=saved.epochs_completed,
            by_items=saved.by_items,
            handed_out=saved.handed_out,
            rescale=rescale,
        )
    started.drop_window()
    if saved.window is not None:
        for param, grad in zip(params, saved.window.grads, strict=True):
            param.grad = None if grad is None else grad.to(param.device).clone()
        kept = saved.window
        started.window.restore(
            kept.microsteps, kept.size, kept.divisor, kept.by_items, kept.items, kept.losses
        )
        if started.arming.strategy.grads_in_params:
            started.grads.start(started.params.first(), started.params.watched())
        started.arm()


def _check_grads_in_params(started: Microstep, refused: str) -> None:
    """Refuse to save or load an open window where its gradient is not ``param.grad``."""
    strategy = started.arming.strategy
    if not strategy.grads_in_params:
        msg = (
            f"{refused} this window: under {type(strategy).__name__} its partial "
            "gradient is held by the wrapper (unsharded buffers, a pending all-reduce) "
            "or sharded over the ranks, which gradaccum does not save; checkpoint after "
            "a window's last microstep"
        )
        raise UsageError(msg)


def _check_window_fits(
    started: Microstep, window: record.SavedWindow, params: list[torch.Tensor]
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
    _check_grads_in_params(started, "load_state_dict() cannot restore")


def _grad_copy(param: torch.Tensor) -> torch.Tensor | None:
    return None if param.grad is None else param.grad.detach().clone()
