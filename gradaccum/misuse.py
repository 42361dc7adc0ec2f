"""Watch a window's partial gradient between its microsteps: a ``zero_grad()`` that wiped
it is refused, and an in-place change (``clip_grad_norm_`` on a partial window) is
warned about, at the next microstep. Nothing outside the accumulator is wrapped, so
code that does not use it pays nothing.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["Change", "GradWatch"]

Change = Literal["wiped", "changed"]
"""What happened to a window's partial gradient since its last backward."""


class GradWatch:
    """Catches ``optimizer.zero_grad()`` or ``model.zero_grad()``, and any other in-place
    change such as clipping, inside an open window.

    One gradient of the window is watched from the end of each backward to the start of
    the next. ``zero_grad()`` replaces it (``set_to_none=True``, the default), or zeroes
    it in place; either way, or when clipping scales it, its version counter moves, and
    only then is the gradient read (one host sync) to tell a zeroed one from a changed
    one. Only where a deferred window's gradient is ``param.grad`` (a plain module, DDP);
    a few attribute reads a microstep.
    """

    __slots__ = ("_grad", "_param", "_version")

    def __init__(self) -> None:
        self._param: torch.Tensor | None = None
        self._grad: torch.Tensor | None = None
        self._version = 0

    def start(self, optimizer: torch.optim.Optimizer) -> None:
        """After a window's first backward: watch the optimizer's first gradient."""
        self._param = self._grad = None
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._param, self._grad = param, param.grad
                    self._version = param.grad._version
                    return

    def update(self) -> None:
        """After a later backward, which accumulated into the watched gradient."""
        if self._grad is not None:
            self._version = self._grad._version

    def change(self) -> Change | None:
        """What happened to the watched gradient since the last backward: dropped,
        replaced or zeroed (``"wiped"``), changed in place otherwise (``"changed"``), or
        nothing (None)."""
        param, grad = self._param, self._grad
        if param is None or grad is None:
            return None
        if param.grad is not grad:
            return "wiped"
        if grad._version == self._version:
            return None
        self._version = grad._version  # changed in place: wiped only if it is now all zero
        return "changed" if bool(grad.any()) else "wiped"

    def stop(self) -> None:
        """The window closed."""
        self._param = self._grad = None
