"""Watch a window's partial gradient between its microsteps: a ``zero_grad()`` that wiped
it is refused, and an in-place change (``clip_grad_norm_`` on a partial window) is
warned about, at the next microstep. Nothing outside the accumulator is wrapped, so
code that does not use it pays nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch

__all__ = ["Change", "GradWatch"]

Change = Literal["wiped", "changed"]
"""What happened to a window's partial gradient since its last backward."""


class GradWatch:
    """Catches ``optimizer.zero_grad()`` or ``model.zero_grad()``, and any other in-place
    change such as clipping, inside an open window.

    One gradient of each optimizer is watched from the end of each backward to the start
    of the next (so that any one optimizer's ``zero_grad()`` is seen). ``zero_grad()``
    replaces it (``set_to_none=True``, the default), or zeroes it in place; either way, or
    when clipping scales it, its version counter moves, and only then is the gradient
    read (one host sync) to tell a zeroed one from a changed one. Only where a deferred
    window's gradient is ``param.grad`` (a plain module, DDP); a few attribute reads a
    microstep.
    """

    __slots__ = ("_watched",)

    def __init__(self) -> None:
        self._watched: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # param, grad, version

    def start(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """After a window's first backward: watch each optimizer's first gradient."""
        self._watched = []
        for optimizer in optimizers:
            grad = _first_grad(optimizer)
            if grad is not None:
                self._watched.append((*grad, grad[1]._version))

    def update(self) -> None:
        """After a later backward, which accumulated into the watched gradients."""
        self._watched = [(param, grad, grad._version) for param, grad, _ in self._watched]

    def change(self) -> Change | None:
        """What happened to the watched gradients since the last backward: one dropped,
        replaced or zeroed (``"wiped"``), one changed in place otherwise (``"changed"``),
        or nothing (None)."""
        found: Change | None = None
        for index, (param, grad, version) in enumerate(self._watched):
            if param.grad is not grad:
                return "wiped"
            if grad._version != version:
                # Changed in place: wiped only if it is now all zero.
                self._watched[index] = (param, grad, grad._version)
                if not bool(grad.any()):
                    return "wiped"
                found = "changed"
        return found

    def stop(self) -> None:
        """The window closed."""
        self._watched = []


def _first_grad(optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The optimizer's first parameter that has a gradient, and that gradient."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                return param, param.grad
    return None
