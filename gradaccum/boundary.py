"""The tensor work at a window's boundary, in the order it runs: normalize, then (the
stepper's unscale) clip and check, over every optimizer's parameters. No host sync unless
the check is asked for.

The parameters, their order in the model and their grouping by device and dtype are
worked out once (`Params`) and again only when the optimizers' groups change
(``optimizer.add_param_group``, a new group list from ``load_state_dict``), so
that a boundary costs no Python work per parameter beyond the optimizer's own; parameters
added between windows are treated like the others.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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
    """The optimizers' parameters, cached until their groups change.

    Worked out when made; `now` checks the groups (each optimizer's list of them, by
    identity and length: a few reads) and, when they changed, works out again the list,
    its order in the model, its grouping by device and dtype and where a wipe is watched;
    `ordered` and `watched` read what `now` made, and `grads_by_kind` checks the first
    parameter of each device and dtype first (converted in place by ``model.to(...)``),
    only where a factor is multiplied in.

    Attributes:
        first: The one gradient that every wipe reaches, where there is one (one
            optimizer, whose first parameter is the model's first): the window's watch
            reads only it (`gradaccum.misuse.GradWatch`); else None.
    """

    __slots__ = (
        "_by_kind",
        "_groups",
        "_kinds",
        "_list",
        "_model",
        "_one",
        "_one_count",
        "_one_groups",
        "_optimizers",
        "_ordered",
        "_watched",
        "first",
    )

    def __init__(self, optimizers: tuple[torch.optim.Optimizer, ...], model: nn.Module) -> None:
        self._optimizers = optimizers
        self._model = model
        self._one = optimizers[0] if len(optimizers) == 1 else None
        self._one_groups: list[dict[str, Any]] | None = None
        self._one_count = 0
        # Set by `_work_out`, here and whenever the groups change:
        self._groups: list[tuple[list[dict[str, Any]], int]]
        self._list: list[torch.Tensor]
        self._ordered: list[torch.Tensor]
        # (device, dtype, parameters, the dtype a factor is multiplied in, and whether a
        # Python scalar factor is multiplied in the gradient's own dtype)
        self._by_kind: list[tuple[torch.device, torch.dtype, list[torch.Tensor], torch.dtype, bool]]
        self._kinds: list[tuple[torch.Tensor, torch.dtype, int]]  # each kind's first, as made
        self._watched: list[list[torch.Tensor]]
        self.first: torch.Tensor | None
        self._work_out()

    def now(self) -> list[torch.Tensor]:
        """Every optimizer's parameters as they are now, each once, in order."""
        # An optimizer's groups change by add_param_group (one more) or a new list
        # (load_state_dict): the list's identity and length tell.
        one = self._one
        if one is not None:
            groups = one.param_groups
            if groups is self._one_groups and len(groups) == self._one_count:
                return self._list
        elif (seen := self._groups) and all(
            optimizer.param_groups is groups and len(groups) == length
            for optimizer, (groups, length) in zip(self._optimizers, seen, strict=True)
        ):
            return self._list
        self._work_out()
        return self._list

    def _kinds_hold(self) -> bool:
        """The grouping by device and dtype still holds: ``model.to(torch.float64)``,
        ``.half()`` or ``.to(device)`` between windows converts the parameters in place
        (the same objects, in the same groups), and the first of each group tells. A
        conversion of some parameters only, none of them first in its group, is not seen:
        their factor is then multiplied in the dtype worked out before. The device is
        read as its index (``get_device()``, -1 on the CPU): making a ``torch.device`` at
        each boundary would cost more than the rest of `now`."""
        for first, dtype, index in self._kinds:
            if first.dtype is not dtype or first.get_device() != index:
                return False
        return True

    def _work_out(self) -> None:
        optimizers = self._optimizers
        self._groups = [
            (optimizer.param_groups, len(optimizer.param_groups)) for optimizer in optimizers
        ]
        if self._one is not None:  # what `now` reads of one optimizer, kept apart
            self._one_groups, self._one_count = self._groups[0]
        self._list = params_of(optimizers)
        self._ordered = in_model_order(self._model, self._list)
        kinds: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for param in self._list:
            kinds.setdefault((param.device, param.dtype), []).append(param)
        self._by_kind = [
            (
                device,
                dtype,
                group,
                torch.float64 if dtype == torch.float64 else torch.float32,
                dtype in (torch.float32, torch.float64),
            )
            for (device, dtype), group in kinds.items()
        ]
        self._kinds = [
            (group[0], dtype, group[0].get_device()) for _, dtype, group, _, _ in self._by_kind
        ]
        self._watched = [
            [param for group in optimizer.param_groups for param in group["params"]]
            for optimizer in optimizers
        ]
        in_model = {id(param) for param in self._model.parameters()}
        # (the model's own: model.zero_grad() clears none outside it)
        self._watched.append([param for param in self._ordered if id(param) in in_model])
        own, model = self._watched[0], self._ordered
        one = len(optimizers) == 1 and own and model and own[0] is model[0]
        self.first = own[0] if one else None

    def watched(self) -> list[list[torch.Tensor]]:
        """Where a wipe of the window is seen (`gradaccum.misuse.GradWatch`): each
        optimizer's parameters (its ``zero_grad()`` clears them), and the model's in its
        order (``model.zero_grad()``), as of the last `now` (each boundary's: a group
        added between windows is watched from the next window's boundary on)."""
        return self._watched

    def ordered(self) -> list[torch.Tensor]:
        """`now`'s parameters in the order of ``model.parameters()``, then those the model
        lacks (as of the last `now`)."""
        return self._ordered

    def grads_by_kind(
        self,
    ) -> list[tuple[torch.device, torch.dtype, list[torch.Tensor], torch.dtype, bool]]:
        """The gradients there are, grouped by device and dtype (as of the last `now`, worked
        out again where a conversion moved them), each group with the dtype a factor is
        multiplied in and whether a Python scalar is."""
        if not self._kinds_hold():
            self._work_out()
        return [
            (
                device,
                dtype,
                [grad for param in group if (grad := param.grad) is not None],
                wide,
                plain,
            )
            for device, dtype, group, wide, plain in self._by_kind
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
    params: Params, window: Window, ranks: Ranks
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


def rescale(params: Params, window: Window) -> None:
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


def scale_grads(params: Params, factor: float | torch.Tensor) -> None:
    """Multiply every gradient by ``factor`` in place, without host sync.

    The factor reaches the multiply in float64 for float64 gradients and in float32
    otherwise, never rounded to the gradient's own dtype first: float16 would turn the
    inverse of an item total into a subnormal (or the total above 65504 into inf).
    """
    for device, _, grads, wide, plain in params.grads_by_kind():
        if not grads:
            continue
        if not isinstance(factor, float):  # a tensor (read cheaply: a float as a rule)
            torch._foreach_mul_(grads, factor.to(device=device, dtype=wide))
        elif plain:
            torch._foreach_mul_(grads, factor)  # a Python scalar: multiplied in the dtype
        else:
            torch._foreach_mul_(grads, torch.full((), factor, dtype=wide, device=device))
