"""The tensor work at a window's boundary, in the order it runs: normalize, then (the
stepper's unscale) clip and check, over every optimizer's parameters. Each step reads
the optimizers' parameters as they are now, so parameters added with
``optimizer.add_param_group`` are treated like the others. No host sync unless the check
is asked for."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from gradaccum.errors import ConfigError
from gradaccum.ranks import Ranks
from gradaccum.sync import SyncStrategy, grad_norm
from gradaccum.window import Window

__all__ = [
    "all_finite",
    "clip",
    "global_mean",
    "in_model_order",
    "normalize",
    "params_of",
    "rescale",
    "scale_grads",
]


def params_of(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The optimizers' parameters as they are now, each once, in order."""
    seen: dict[int, torch.Tensor] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                seen.setdefault(id(param), param)
    return list(seen.values())


def normalize(
    params: list[torch.Tensor], window: Window, ranks: Ranks
) -> tuple[int | torch.Tensor, torch.Tensor | None]:
    """Turn the window's summed gradient into the item-mean over every rank's window: divide
    by the items summed over the ranks (one all-reduce, in float64) and undo the wrapper's
    averaging over the ranks.

    Returns:
        This rank's item total, for ``step.loss``; and under several ranks the items and
        the summed losses over every rank (a float64 pair, from the same all-reduce), for
        ``step.global_loss``.

    Raises:
        ConfigError: One process, whose int item counts sum to 0.
    """
    local: int | torch.Tensor = sum(window.items, start=0)
    if ranks.count == 1:
        if isinstance(local, torch.Tensor):
            scale_grads(params, 1 / local.to(ranks.device, torch.float64))
            return local, None
        if local == 0:
            msg = f"the {window.done + 1} microsteps of this window passed num_items summing to 0"
            raise ConfigError(msg)
        scale_grads(params, 1 / local)
        return local, None
    # A new tensor, summed over the ranks in place: `local` stays this rank's, for step.loss.
    totals = torch.stack(
        [
            torch.as_tensor(local).to(ranks.device, torch.float64),
            torch.stack(window.losses).to(ranks.device, torch.float64).sum(),
        ]
    )
    ranks.total(totals)
    scale_grads(params, ranks.count / totals[0])
    return local, totals


def global_mean(window: Window, ranks: Ranks) -> torch.Tensor:
    """The mean over the ranks of their window losses (mean mode): one scalar all-reduce."""
    mean = torch.stack(window.losses).sum() / len(window.losses)
    total = mean.to(ranks.device, torch.float64)
    return (ranks.total(total) / ranks.count).to(mean.dtype)


def rescale(params: list[torch.Tensor], window: Window) -> None:
    """Mean mode, an epoch that ended early: the losses were divided by the planned size,
    so the gradient is rescaled to 1/size of the microsteps it holds."""
    if window.divisor != window.size:
        scale_grads(params, window.divisor / window.size)


def clip(
    strategy: SyncStrategy, params: list[torch.Tensor], max_norm: float | None, model: nn.Module
) -> torch.Tensor | None:
    """Clip the window's gradient to ``max_norm`` (the wrapper's own clipping where it has
    one); return the total norm before clipping, a 0-dim tensor, or None without clipping.

    The norm runs over ``params`` in the model's order (then those outside the model), so
    that it is bit for bit what ``clip_grad_norm_(model.parameters(), max_norm)`` computes
    in a hand loop, whatever the optimizers' order.
    """
    if max_norm is None:
        return None
    return strategy.clip_grad_norm(in_model_order(model, params), max_norm)


def in_model_order(model: nn.Module, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` in the order of ``model.parameters()``, then those the model lacks."""
    held = {id(param) for param in params}
    ordered: list[torch.Tensor] = [param for param in model.parameters() if id(param) in held]
    if len(ordered) == len(params):
        return ordered
    inside = {id(param) for param in ordered}
    return ordered + [param for param in params if id(param) not in inside]


def all_finite(params: list[torch.Tensor], norm: torch.Tensor | None, ranks: Ranks) -> bool:
    """Whether the window's gradient is finite on every rank (its norm is, when clipping
    computed it): one host sync, and one scalar all-reduce over several ranks."""
    return ranks.all(torch.isfinite(grad_norm(params) if norm is None else norm))


def scale_grads(params: list[torch.Tensor], factor: float | torch.Tensor) -> None:
    """Multiply every gradient by ``factor`` in place, without host sync.

    The factor reaches the multiply in float64 for float64 gradients and in float32
    otherwise, never rounded to the gradient's own dtype first: float16 would turn the
    inverse of an item total into a subnormal (or the total above 65504 into inf).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            groups.setdefault((param.grad.device, param.grad.dtype), []).append(param.grad)
    for (device, dtype), grads in groups.items():
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        if isinstance(factor, torch.Tensor):
            torch._foreach_mul_(grads, factor.to(device=device, dtype=wide))
        elif dtype in (torch.float32, torch.float64):
            torch._foreach_mul_(grads, factor)  # a Python scalar: multiplied in the dtype
        else:
            torch._foreach_mul_(grads, torch.full((), factor, dtype=wide, device=device))
