"""Argument checks for `Accumulator`: each refuses before any work, naming the argument,
the value and what is accepted (the catalog is docs/bad-input.md)."""

from __future__ import annotations

import inspect
import math
from typing import Literal, TypeVar, get_args

import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau

from gradaccum.boundary import params_of
from gradaccum.errors import ConfigError, ConfigTypeError, describe
from gradaccum.schedule import check_count

__all__ = [
    "NonFinitePolicy",
    "check_choice",
    "check_max_grad_norm",
    "check_num_items",
    "check_on_nonfinite",
    "check_parts",
    "check_scaler",
    "refuse_loss",
]

T = TypeVar("T")

NonFinitePolicy = Literal["raise", "skip"]
"""What `Accumulator` does with a window whose gradient holds inf/NaN (``None``: nothing)."""


def check_parts(model: object, optimizer: object, scheduler: object) -> list[torch.Tensor]:
    """Check the model, optimizer and scheduler together; return the optimizer's
    parameters, each once, in order."""
    if not isinstance(model, nn.Module):
        msg = f"model must be a torch.nn.Module, got {describe(model)}"
        raise ConfigTypeError(msg)
    if not isinstance(optimizer, torch.optim.Optimizer):
        msg = f"optimizer must be a torch.optim.Optimizer, got {describe(optimizer)}"
        raise ConfigTypeError(msg)
    trainable = {id(param) for param in model.parameters() if param.requires_grad}
    if not trainable:
        msg = (
            f"model ({type(model).__name__}) has no parameter that requires grad, so there "
            "is nothing to accumulate; unfreeze some parameters (requires_grad_(True))"
        )
        raise ConfigError(msg)
    params = params_of(optimizer)
    if not any(id(param) in trainable for param in params):
        msg = (
            "optimizer holds none of the model's trainable parameters, so no step would "
            "change the model; build it on model.parameters()"
        )
        raise ConfigError(msg)
    _refuse_closure_optimizer(optimizer)
    if scheduler is None:
        return params
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
    return params


def _refuse_closure_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose ``step()`` needs a closure (LBFGS): it re-evaluates the
    loss several times per step, which a window of microbatches already back-propagated
    cannot do."""
    try:  # the class's method (a scheduler may have wrapped the instance's): after self
        _, *parameters = inspect.signature(type(optimizer).step).parameters.values()
    except (TypeError, ValueError):  # no signature to read: assume step() takes no argument
        return
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    needed = [p.name for p in parameters if p.default is p.empty and p.kind not in variadic]
    if needed:
        msg = (
            f"optimizer {type(optimizer).__name__} needs step({', '.join(needed)}): a "
            "closure that re-evaluates the loss, which a window of microbatches already "
            "back-propagated cannot provide; closure optimizers (LBFGS) are not supported, "
            "use one whose step() takes no argument (SGD, Adam, ...) or step it yourself"
        )
        raise ConfigError(msg)


def check_choice(value: T, name: str, choices: tuple[object, ...]) -> T:
    """Return ``value`` if it is one of the (str or None) ``choices``, else refuse it."""
    if value in choices and isinstance(value, (str, type(None))):
        return value
    accepted = ", ".join(repr(choice) for choice in choices)
    msg = f"{name} must be one of {accepted}, got {describe(value)}"
    raise ConfigTypeError(msg) if not isinstance(value, str) else ConfigError(msg)


def check_on_nonfinite(value: T, scaler: torch.amp.GradScaler | None) -> T:
    check_choice(value, "on_nonfinite", (None, *get_args(NonFinitePolicy)))
    if value == "raise" and scaler is not None:
        msg = (
            "on_nonfinite='raise' with an enabled GradScaler would raise on the overflows "
            "the scaler expects and skips; pass on_nonfinite='skip' or None"
        )
        raise ConfigError(msg)
    return value


def check_max_grad_norm(value: object) -> float | None:
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


def check_scaler(scaler: object) -> torch.amp.GradScaler | None:
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        msg = f"scaler must be a torch.amp.GradScaler or None, got {describe(scaler)}"
        raise ConfigTypeError(msg)
    return scaler if scaler.is_enabled() else None


def refuse_loss(loss: object) -> None:
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


def check_num_items(num_items: object) -> None:
    if isinstance(num_items, torch.Tensor):
        if num_items.dim() != 0:
            msg = f"num_items must be a 0-dim tensor, got shape {tuple(num_items.shape)}"
            raise ConfigError(msg)
        return
    check_count(num_items, "num_items")
