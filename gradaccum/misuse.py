"""Watch a window's partial gradient between its microsteps: a ``zero_grad()`` that wiped
it is refused, and an in-place change (``clip_grad_norm_`` on a partial window) is
warned about, at the next microstep. Nothing outside the accumulator is wrapped, so
code that does not use it pays nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["Change", "GradWatch"]

Change = Literal["wiped", "changed"]
"""What happened to a window's partial gradient since its last backward."""


class GradWatch:
    """Catches ``optimizer.zero_grad()`` or ``model.zero_grad()``, and any other in-place
    change such as clipping, inside an open window.

    From the end of each backward to the start of the next, it watches one gradient that
    each possible wipe reaches: the first of each optimizer (its ``zero_grad()`` clears
    only its own), and the model's first (``model.zero_grad()`` clears only the model's,
    while an optimizer may start with a parameter outside it, such as a learnable loss
    temperature). ``zero_grad()`` drops such a gradient (``set_to_none=True``, the
    default) or zeroes it in place; either way, or when clipping scales it, its version
    counter moves, and only then is the gradient read (one host sync) to tell a zeroed one
    from a changed one. A gradient replaced by another tensor of the same values is not a
    wipe (DDP re-points ``param.grad`` at rebuilt buckets after its first all-reducing
    backward with ``gradient_as_bucket_view=True``). Only where a deferred window's
    gradient is ``param.grad`` (a plain module, DDP); a few attribute reads a microstep.
    """

    __slots__ = ("_watched",)

    def __init__(self) -> None:
        self._watched: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # param, grad, version

    def start(self, optimizers: Iterable[torch.optim.Optimizer], model: nn.Module) -> None:
        """After a window's first backward: watch each optimizer's first gradient and the
        model's."""
        found = [_first_grad(optimizer.param_groups) for optimizer in optimizers]
        found.append(_first_grad([{"params": model.parameters()}]))
        self._watched = []
        for pair in found:
            if pair is not None and all(pair[0] is not param for param, _, _ in self._watched):
                self._watched.append((*pair, pair[1]._version))

    def update(self) -> None:
        """After a later backward, which accumulated into the watched gradients."""
        self._watched = [(param, grad, grad._version) for param, grad, _ in self._watched]

    def change(self) -> Change | None:
        """What happened to the watched gradients since the last backward: one dropped,
        zeroed or replaced by other values (``"wiped"``), one changed in place otherwise
        (``"changed"``), or nothing (None)."""
        found: Change | None = None
        for index, (param, grad, version) in enumerate(self._watched):
            if param.grad is not grad:
                replaced = param.grad
                if replaced is None or not _same(replaced, grad):
                    return "wiped"
                self._watched[index] = (param, replaced, replaced._version)
            elif grad._version != version:
                # Changed in place: wiped only if it is now all zero.
                self._watched[index] = (param, grad, grad._version)
                if not bool(grad.any()):
                    return "wiped"
                found = "changed"
        return found

    def stop(self) -> None:
        """The window closed."""
        self._watched = []


def _first_grad(groups: Iterable[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The first parameter of ``groups`` that has a gradient, and that gradient."""
    for group in groups:
        for param in group["params"]:
            if param.grad is not None:
                return param, param.grad
    return None


def _same(grad: torch.Tensor, other: torch.Tensor) -> bool:
    """The same values (one host sync; read only when ``param.grad`` was replaced)."""
    return grad.shape == other.shape and bool(torch.equal(grad, other))
