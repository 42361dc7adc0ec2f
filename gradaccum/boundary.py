"""The tensor work at a window's boundary, in the order it runs: normalize, then (the
stepper's unscale) clip and check, over every optimizer's parameters. No host sync unless
the check is asked for.

The parameters, each once, and their order in the model are kept (`Params`) and worked
out again whenever any optimizer's parameter lists are not those they were worked out
from, so a boundary costs no Python work per parameter beyond a compare by identity.
Nothing that a conversion changes (a parameter's dtype or device) is kept: a factor is
multiplied in by the gradients' kinds as they are at that boundary.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import is_

import torch
from torch import nn

from gradaccum.errors import ConfigError
from gradaccum.ranks import Ranks
from gradaccum.sync import SyncStrategy, grad_norm
from gradaccum.window import Window

__all__ = [
    "Params",
    "all_finite",
    "clip",
    "global_mean",
    "in_model_order",
    "normalize",
    "params_of",
    "rescale",
    "scale_grads",
]


class Params:
    """The optimizers' parameters, each once, in order; kept while their lists hold.

    The key is every optimizer's parameter groups' lists, compared element by element by
    identity on each `now`: a group added, removed or swapped, ``group["params"]``
    replaced or edited in place, a new group list from ``load_state_dict``, each rebuilds.
    `ordered`, `watched` and `first` are worked out with it and read as of the last `now`.

    Attributes:
        optimizers: The optimizers, in order.
    """

    __slots__ = ("_first", "_key", "_list", "_model", "_ordered", "_watched", "optimizers")

    def __init__(self, optimizers: tuple[torch.optim.Optimizer, ...], model: nn.Module) -> None:
        self.optimizers = optimizers
        self._model = model
        self._key: list[list[torch.Tensor]] = []
        # Set by `_work_out`, here and whenever the key changes:
        self._list: list[torch.Tensor]
        self._ordered: list[torch.Tensor]
        self._watched: list[list[torch.Tensor]]
        self._first: torch.Tensor | None
        self._work_out()

    def now(self) -> list[torch.Tensor]:
        """Every optimizer's parameters as they are now, each once, in order."""
        if not self._holds():
            self._work_out()
        return self._list

    def _holds(self) -> bool:
        key = iter(self._key)
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                params, kept = group["params"], next(key, None)
                if kept is None or len(params) != len(kept) or not all(map(is_, params, kept)):
                    return False
        return next(key, None) is None

    def _work_out(self) -> None:
        optimizers = self.optimizers
        self._key = [
            list(group["params"]) for optimizer in optimizers for group in optimizer.param_groups
        ]
        self._list = params_of(optimizers)
        self._ordered = in_model_order(self._model, self._list)
        self._watched = [
            [param for group in optimizer.param_groups for param in group["params"]]
            for optimizer in optimizers
        ]
        in_model = {id(param) for param in self._model.parameters()}
        # (the model's own: model.zero_grad() clears none outside it)
        self._watched.append([param for param in self._ordered if id(param) in in_model])
        own, model = self._watched[0], self._ordered
        one = len(optimizers) == 1 and own and model and own[0] is model[0]
        self._first = own[0] if one else None

    def first(self) -> torch.Tensor | None:
        """The one parameter whose gradient every wipe reaches, where there is one (one
        optimizer, whose first parameter is the model's first): the window's watch reads
        only it (`gradaccum.misuse.GradWatch`); else None."""
        return self._first

    def watched(self) -> list[list[torch.Tensor]]:
        """Where a wipe of the window is seen (`gradaccum.misuse.GradWatch`): each
        optimizer's parameters (its ``zero_grad()`` clears them), and the model's in its
        order (``model.zero_grad()``)."""
        return self._watched

    def ordered(self) -> list[torch.Tensor]:
        """`now`'s parameters in the order of ``model.parameters()``, then those the model
        lacks."""
        return self._ordered


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
        # (isinstance(x, int), not (x, torch.Tensor): the Tensor metaclass's check is dear)
        if isinstance(local, int):
            if local == 0:
                msg = (
                    f"the {window.done + 1} microsteps of this window passed num_items summing to 0"
                )
                raise ConfigError(msg)
            scale_grads(params, 1 / local)
            return local, None
        scale_grads(params, 1 / local.to(ranks.device, torch.float64))
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


def clip(strategy: SyncStrategy, params: Params, max_norm: float | None) -> torch.Tensor | None:
    """Clip the window's gradient to ``max_norm`` (the wrapper's own clipping where it has
    one); return the total norm before clipping, a 0-dim tensor, or None without clipping.

    The norm runs over ``params`` in the model's order (then those outside the model), so
    that it is bit for bit what ``clip_grad_norm_(model.parameters(), max_norm)`` computes
    in a hand loop, whatever the optimizers' order.
    """
    if max_norm is None:
        return None
    return strategy.clip_grad_norm(params.ordered(), max_norm)


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
    """Multiply every gradient of ``params`` by ``factor`` in place, without host sync.

    The factor reaches the multiply in float64 for float64 gradients and in float32
    otherwise, never rounded to the gradient's own dtype first: float16 would turn the
    inverse of an item total into a subnormal (or the total above 65504 into inf). The
    gradients' dtypes (and, for a tensor factor, devices) are read as they are now, so a
    model converted in part between windows is seen at once; a Python float needs no
    device, and float32 and float64 gradients take it as it is.
    """
    scalar = isinstance(factor, float)
    wide: list[torch.Tensor] = []  # (float32 and float64 gradients, for a Python float)
    kinds: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if scalar and grad.dtype in _WIDE:
            wide.append(grad)
        else:
            kinds.setdefault((grad.device, grad.dtype), []).append(grad)
    if wide:
        torch._foreach_mul_(wide, factor)  # (a Python scalar: multiplied in the dtype)
    for (device, dtype), grads in kinds.items():
        exact = torch.float64 if dtype == torch.float64 else torch.float32
        if isinstance(factor, float):
            torch._foreach_mul_(grads, torch.full((), factor, dtype=exact, device=device))
        else:
            torch._foreach_mul_(grads, factor.to(device=device, dtype=exact))


_WIDE = (torch.float32, torch.float64)  # (a Python scalar factor is exact in these)
