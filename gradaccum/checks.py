"""Argument checks for `Accumulator`: each refuses before any work, naming the argument,
the value and what is accepted (the catalog is docs/bad-input.md)."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from gradaccum import foreign
from gradaccum.boundary import params_of
from gradaccum.errors import ConfigError, ConfigTypeError, describe
from gradaccum.fitting import MicrobatchOption
from gradaccum.schedule import check_bool, check_count
from gradaccum.sync import SyncPolicy, SyncStrategy

__all__ = [
    "NonFinitePolicy",
    "Options",
    "Parts",
    "check_choice",
    "check_max_grad_norm",
    "check_microbatch",
    "check_num_items",
    "check_on_nonfinite",
    "check_options",
    "check_parts",
    "check_scaler",
    "refuse_auto",
    "refuse_loss",
]

T = TypeVar("T")

NonFinitePolicy = Literal["raise", "skip"]
"""What `Accumulator` does with a window whose gradient holds inf/NaN (``None``: nothing)."""


@dataclass(frozen=True)
class Parts:
    """The checked optimizers and schedulers, with the torch objects Accelerate's prepared
    ones wrap in their place.

    Attributes:
        optimizers: Every optimizer, in the order given.
        schedulers: One entry per optimizer, in the same order: its scheduler or None.
        params: Every optimizer's parameters, each once, in order.
    """

    optimizers: tuple[torch.optim.Optimizer, ...]
    schedulers: tuple[Any, ...]
    params: list[torch.Tensor]


def check_parts(
    model: object, optimizer: object, scheduler: object, scaler: object = None
) -> Parts:
    """Check the model, the optimizer(s) and the scheduler(s) together, before any work.

    ``optimizer`` is one optimizer or a sequence of them; ``scheduler`` is None, one
    scheduler (with one optimizer), or a sequence with an entry (a scheduler or None)
    for each optimizer. ``scaler`` is the checked GradScaler, which Accelerate's prepared
    fp16 optimizer must be given.
    """
    if not isinstance(model, nn.Module):
        msg = (
            f"model must be a torch.nn.Module, got {describe(model)}; pass the module the "
            "optimizer trains, as wrapped (the DDP or FSDP module, or what "
            "accelerator.prepare returned)"
        )
        raise ConfigTypeError(msg)
    if not any(param.requires_grad for param in model.parameters()):
        msg = (
            f"model ({type(model).__name__}) has no parameter that requires grad, so there "
            "is nothing to accumulate; unfreeze some parameters (requires_grad_(True))"
        )
        raise ConfigError(msg)
    named = _entries(optimizer, "optimizer", "a torch.optim.Optimizer")
    optimizers = tuple(_optimizer(value, name, scaler) for name, value in named)
    _check_holdings(model, [name for name, _ in named], optimizers)
    return Parts(
        optimizers=optimizers,
        schedulers=_schedulers(scheduler, optimizers, [name for name, _ in named]),
        params=params_of(optimizers),
    )


def _entries(value: object, name: str, one: str) -> list[tuple[str, object]]:
    """``value`` as ``(name, entry)`` pairs: itself, or the entries of a list or tuple
    (``name[i]``).

    Raises:
        ConfigError: An empty sequence.
    """
    if not isinstance(value, (list, tuple)):
        return [(name, value)]
    if not value:
        msg = f"{name} is an empty {type(value).__name__}; pass {one} or a sequence of them"
        raise ConfigError(msg)
    return [(f"{name}[{index}]", entry) for index, entry in enumerate(value)]


_WRAPPED = ("optimizer", "optim", "_optimizer", "base_optimizer", "_base_optimizer")
"""Where optimizer wrappers keep the optimizer they wrap (Accelerate and most; torch's
PostLocalSGDOptimizer; torch's _NamedOptimizer; SAM; timm's Lookahead)."""


def _optimizer(value: object, name: str, scaler: object) -> torch.optim.Optimizer:
    """``value`` as the torch optimizer gradaccum steps: Accelerate's prepared optimizer is
    unwrapped (see gradaccum.foreign); anything else must be an optimizer with torch's
    step hooks."""
    prepared = foreign.prepared_optimizer(value)
    if prepared is not None:
        value, its_scaler = prepared
        if its_scaler is not None and its_scaler is not scaler:
            msg = (
                f"{name} is Accelerate's prepared optimizer, which steps through "
                "Accelerate's GradScaler (mixed_precision='fp16'); pass "
                "scaler=accelerator.scaler to the Accumulator, which then scales, unscales "
                "and steps with it"
            )
            raise ConfigError(msg)
    if isinstance(value, (LRScheduler, ReduceLROnPlateau)):
        msg = (
            f"{name} is a scheduler ({type(value).__name__}), not an optimizer; pass "
            "Accumulator(model, optimizer, scheduler), the optimizer first"
        )
        raise ConfigTypeError(msg)
    inner = next(
        (
            (attribute, wrapped)
            for attribute in _WRAPPED
            if isinstance(wrapped := getattr(value, attribute, None), torch.optim.Optimizer)
            and wrapped is not value
        ),
        None,
    )
    forward = (
        ""
        if inner is None
        else f"; pass the torch optimizer it wraps, {name}.{inner[0]} (a "
        f"{type(inner[1]).__name__}), if its step() only forwards to it"
    )
    if not isinstance(value, torch.optim.Optimizer):
        msg = (
            f"{name} must be a torch.optim.Optimizer or a sequence of them, got "
            f"{describe(value)}{forward}"
        )
        raise ConfigTypeError(msg)
    if not hasattr(value, "_optimizer_step_pre_hooks"):
        msg = (
            f"{name} is a {type(value).__name__} that never ran torch.optim.Optimizer's "
            f"__init__, so it has no step hooks for gradaccum to watch its steps{forward}"
            f"{'' if forward else '; call super().__init__(params, defaults) in its __init__'}"
        )
        raise ConfigTypeError(msg)
    _refuse_closure_optimizer(value, name)
    return value


def _check_holdings(
    model: nn.Module, names: list[str], optimizers: tuple[torch.optim.Optimizer, ...]
) -> None:
    """Every optimizer holds some of the model's parameters, and no parameter is held by
    two of them. They may be frozen for now: an optimizer over layers unfrozen later (a
    backbone's, beside the head's) steps nothing until then, as in a hand loop.

    Raises:
        ConfigError: One holds none, or two share a parameter (or are the same object).
    """
    owned = {id(param) for param in model.parameters()}
    holder: dict[int, int] = {}
    for index, (name, optimizer) in enumerate(zip(names, optimizers, strict=True)):
        for first in range(index):
            if optimizers[first] is optimizer:
                msg = (
                    f"{names[first]} and {name} are the same {type(optimizer).__name__}; "
                    "pass each optimizer once"
                )
                raise ConfigError(msg)
        params = params_of((optimizer,))
        if not any(id(param) in owned for param in params):
            several = len(optimizers) > 1
            msg = (
                f"{name}{f' ({type(optimizer).__name__})' if several else ''} holds none of "
                "the model's parameters, so no step would change the model; build "
                f"{'each optimizer on some of' if several else 'it on'} model.parameters()"
            )
            raise ConfigError(msg)
        for param in params:
            first = holder.setdefault(id(param), index)
            if first != index:
                msg = (
                    f"{names[first]} ({type(optimizers[first]).__name__}) and {name} "
                    f"({type(optimizer).__name__}) both hold the parameter "
                    f"{_param_name(model, param)}, which would be updated twice a window; "
                    "give each parameter to one optimizer"
                )
                raise ConfigError(msg)


def _param_name(model: nn.Module, param: torch.Tensor) -> str:
    for name, candidate in model.named_parameters():
        if candidate is param:
            return repr(name)
    return f"of shape {tuple(param.shape)}"


def _schedulers(
    scheduler: object, optimizers: tuple[torch.optim.Optimizer, ...], names: list[str]
) -> tuple[Any, ...]:
    """One scheduler (or None) per optimizer, each checked against the optimizer at its
    position.

    Raises:
        ConfigError: A sequence of another length than the optimizers, one scheduler for
            several optimizers, or a scheduler bound to another optimizer.
        ConfigTypeError: An entry is not a scheduler.
    """
    if scheduler is None:
        return (None,) * len(optimizers)
    if not isinstance(scheduler, (list, tuple)):
        if len(optimizers) > 1:
            msg = (
                f"scheduler is one {type(scheduler).__name__} for {len(optimizers)} "
                "optimizers; pass a sequence with one scheduler (or None) per optimizer, in "
                "the optimizers' order"
            )
            raise ConfigError(msg)
        return (_scheduler(scheduler, "scheduler", optimizers, 0, names),)
    if len(scheduler) != len(optimizers):
        n = len(optimizers)
        several = (
            "; to run several schedules on one optimizer, chain them into one scheduler: "
            "torch.optim.lr_scheduler.SequentialLR (one after the other) or ChainedScheduler "
            "(together)"
            if len(scheduler) > n
            else ""
        )
        msg = (
            f"scheduler has {len(scheduler)} entr{'y' if len(scheduler) == 1 else 'ies'} for "
            f"{n} optimizer{'' if n == 1 else 's'}; pass one scheduler (or None) per "
            f"optimizer, in the optimizers' order{several}"
        )
        raise ConfigError(msg)
    return tuple(
        None
        if entry is None
        else _scheduler(entry, f"scheduler[{index}]", optimizers, index, names)
        for index, entry in enumerate(scheduler)
    )


def _scheduler(
    scheduler: object,
    name: str,
    optimizers: tuple[torch.optim.Optimizer, ...],
    index: int,
    names: list[str],
) -> Any:
    """``scheduler`` (Accelerate's prepared one unwrapped), checked to step
    ``optimizers[index]``."""
    scheduler = foreign.prepared_scheduler(scheduler) or scheduler
    if isinstance(scheduler, ReduceLROnPlateau):
        msg = (
            f"{name}=ReduceLROnPlateau needs a metric for each step; pass {name}=None and "
            "call its step(metric) yourself after a boundary"
        )
        raise ConfigTypeError(msg)
    if isinstance(scheduler, type):
        msg = (
            f"{name} is the class {scheduler.__name__}, not a scheduler; pass one built on "
            f"the optimizer: {name}={scheduler.__name__}(optimizer, ...)"
        )
        raise ConfigTypeError(msg)
    if isinstance(scheduler, torch.optim.Optimizer):
        msg = (
            f"{name} is an optimizer ({type(scheduler).__name__}), not a scheduler: each "
            "window would step it a second time; pass every optimizer as optimizer= (a "
            "sequence of them for several) and an LRScheduler, or None, as scheduler="
        )
        raise ConfigTypeError(msg)
    if not callable(getattr(scheduler, "step", None)):
        msg = f"{name} must have a step() method (an LRScheduler), got {describe(scheduler)}"
        raise ConfigTypeError(msg)
    expected = optimizers[index]
    bound = getattr(scheduler, "optimizer", expected)
    prepared = foreign.prepared_optimizer(bound)
    bound = bound if prepared is None else prepared[0]
    if bound is expected:
        return scheduler
    if any(bound is optimizer for optimizer in optimizers):
        position = next(i for i, optimizer in enumerate(optimizers) if optimizer is bound)
        msg = (
            f"{name} steps {names[position]} ({type(bound).__name__}), not {names[index]} "
            f"({type(expected).__name__}) at its position; pass the schedulers in the "
            "optimizers' order, None for an optimizer without one"
        )
    else:
        msg = (
            f"{name} steps another optimizer ({type(bound).__name__}) than the one given; "
            "create the scheduler on the optimizer passed to the Accumulator"
        )
    raise ConfigError(msg)


def _refuse_closure_optimizer(optimizer: torch.optim.Optimizer, name: str) -> None:
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
            f"{name} {type(optimizer).__name__} needs step({', '.join(needed)}): a "
            "closure that re-evaluates the loss, which a window of microbatches already "
            "back-propagated cannot provide; closure optimizers (LBFGS) are not supported, "
            "use one whose step() takes no argument (SGD, Adam, ...) or step it yourself"
        )
        raise ConfigError(msg)


@dataclass(frozen=True)
class Options:
    """An `Accumulator`'s validated keyword options, fixed at construction.

    Attributes:
        check_finite: The boundary checks the gradient for inf/NaN: asked for with
            ``on_nonfinite``, and with a GradScaler and several optimizers (the scaler
            would skip each on its own: one check decides for all of them).
    """

    max_grad_norm: float | None
    scaler: torch.amp.GradScaler | None
    drop_last: bool
    sync: SyncPolicy
    on_nonfinite: NonFinitePolicy | None
    global_loss: bool
    check_finite: bool
    microbatch: MicrobatchOption = None


def check_options(
    *,
    max_grad_norm: object,
    scaler: torch.amp.GradScaler | None,
    drop_last: object,
    sync: SyncPolicy,
    on_nonfinite: NonFinitePolicy | None,
    global_loss: object,
    optimizers: int,
    microbatch: object = None,
) -> Options:
    """Check the keyword options (``scaler`` checked already; ``optimizers``: how many)."""
    return Options(
        max_grad_norm=check_max_grad_norm(max_grad_norm),
        scaler=scaler,
        drop_last=check_bool(drop_last, "drop_last"),
        sync=check_choice(sync, "sync", get_args(SyncPolicy)),
        on_nonfinite=check_on_nonfinite(on_nonfinite, scaler),
        global_loss=check_bool(global_loss, "global_loss"),
        check_finite=on_nonfinite is not None or (scaler is not None and optimizers > 1),
        microbatch=check_microbatch(microbatch),
    )


def check_microbatch(value: object) -> MicrobatchOption:
    """Return ``microbatch`` if it is a positive int, ``"auto"`` or None, else refuse it."""
    if value is None or value == "auto":
        return value
    accepted = (
        "a positive int (rows per microbatch), 'auto' (the largest that fits, found by "
        "halving on out-of-memory errors) or None (the whole batch)"
    )
    if isinstance(value, str):
        msg = f"microbatch must be {accepted}, got {describe(value)}; pass microbatch='auto'"
        raise ConfigError(msg)
    if not isinstance(value, int) or isinstance(value, bool):
        msg = f"microbatch must be {accepted}, got {describe(value)}"
        raise ConfigTypeError(msg)
    if value < 1:
        msg = f"microbatch must be {accepted}, got {value}; pass microbatch=1 or more"
        raise ConfigError(msg)
    return value


def refuse_auto(strategy: SyncStrategy, ranks: int, sync: SyncPolicy) -> None:
    """Refuse ``microbatch="auto"`` on several ``ranks`` where a microstep other than the
    boundary's backward communicates: a rank that ran out of memory would leave the others
    inside that collective (FSDP's all-gather in every forward, DDP's buffer broadcast, an
    all-reduce in every backward under ``sync="every"``)."""
    if ranks == 1:
        return
    wrapping = type(strategy).__name__
    if strategy.forward_communicates:
        where = (
            "the model's forward runs a collective (FSDP's and fully_shard's all-gather of "
            "the parameters, DDP's broadcast of its buffers)"
        )
        fix = (
            "pass a fixed microbatch=<rows> (the largest that fits, found with "
            "microbatch='auto' on one rank, or under DDP); for DDP with buffers, "
            "broadcast_buffers=False makes its forward collective-free"
        )
    elif sync == "every":
        where = "sync='every' all-reduces the gradient in every microstep's backward"
        fix = "pass sync='auto' (the all-reduce in the window's last backward alone)"
    elif strategy.decides_in_forward and not getattr(strategy, "can_discard", lambda: False)():
        where = (
            "its forward prepares the all-reduce of a backward that a discarded window never "
            "runs, and this torch has no reducer reset (Reducer._reset_state) to forget it"
        )
        fix = "wrap the model in DistributedDataParallel itself, or pass a fixed microbatch=<rows>"
    else:
        return
    msg = (
        f"microbatch='auto' is refused under {wrapping} on {ranks} ranks: {where}, so a rank "
        "that runs out of memory would leave the others waiting inside it instead of "
        f"re-running the window smaller; {fix}"
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
        msg = (
            f"loss must be a torch.Tensor, got {describe(loss)}; pass the microbatch's loss "
            "tensor itself: not its .item(), nor the model's whole output (a Hugging Face "
            "model's loss is outputs.loss)"
        )
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


def check_num_items(num_items: object) -> int | torch.Tensor:
    """Return ``num_items`` as the window keeps it: a 0-dim tensor, or an int (a NumPy
    integer becomes one)."""
    if isinstance(num_items, torch.Tensor):
        if num_items.dim() != 0:
            msg = (
                f"num_items must be a 0-dim tensor, got shape {tuple(num_items.shape)}; "
                "pass the microbatch's item count, such as (labels != -100).sum()"
            )
            raise ConfigError(msg)
        return num_items
    return check_count(
        num_items,
        "num_items",
        "; pass the microbatch's item count as an int, or as the 0-dim tensor it was "
        "counted in (not its .item(), which waits for the device)",
    )
