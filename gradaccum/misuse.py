"""Watch for the user clipping a partial window: ``torch.nn.utils.clip_grad_norm_``,
wrapped once, warns when an open accumulator is between the microsteps of a window.

The wrapper forwards every call unchanged. It asks the open accumulators (a weak set,
so a forgotten accumulator costs nothing once collected) whether the parameters being
clipped hold a partial window's gradient. Code that imported the function by name
before the first `Accumulator` was built keeps the unwrapped one.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch import nn

from gradaccum.errors import warn

__all__ = ["GradWatch", "forget", "watch_clipping"]


class _Watched(Protocol):
    def _partial_window(self, clipped: set[int]) -> str | None: ...


_open: weakref.WeakSet[Any] = weakref.WeakSet()
_original: list[Any] = []  # torch's function, once wrapped


def watch_clipping(acc: _Watched) -> None:
    """Watch ``acc`` until `forget`; wrap ``clip_grad_norm_`` the first time."""
    _open.add(acc)
    if _original:
        return
    original = nn.utils.clip_grad_norm_
    _original.append(original)

    def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if _open:
            parameters = _warn_if_partial(parameters)
        return original(parameters, *args, **kwargs)

    clip_grad_norm_.__doc__ = original.__doc__
    clip_grad_norm_.__wrapped__ = original  # type: ignore[attr-defined]
    for module in (nn.utils, nn.utils.clip_grad):
        module.clip_grad_norm_ = clip_grad_norm_  # type: ignore[attr-defined]


def forget(acc: _Watched) -> None:
    """Stop watching ``acc`` (it was closed)."""
    _open.discard(acc)


def _warn_if_partial(parameters: Any) -> Any:
    """Warn if a watched accumulator's open window is among ``parameters``; return them
    (as a list: a generator can be read only once)."""
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    clipped = {id(param) for param in parameters}
    for acc in list(_open):
        where = acc._partial_window(clipped)
        if where is not None:
            warn(
                f"clip_grad_norm_ was called on {where}, before the window's gradient is "
                "complete, so it clips a partial sum; pass max_grad_norm= to the "
                "Accumulator, or clip inside the boundary's block (when step.boundary is "
                "True)"
            )
            break
    return parameters


class GradWatch:
    """Catches ``optimizer.zero_grad()`` or ``model.zero_grad()`` inside an open window.

    One gradient of the window is watched from the end of each backward to the start of
    the next. ``zero_grad()`` replaces it (``set_to_none=True``, the default), or zeroes
    it in place, which moves its version counter; other in-place changes (clipping a
    partial window, which warns by itself) move it too, so only then is the gradient read
    (one host sync) to tell a zeroed one apart. Only where a deferred window's gradient is
    ``param.grad`` (a plain module, DDP); a few attribute reads a microstep.
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

    def wiped(self) -> bool:
        """The watched gradient was dropped, replaced or zeroed since the last backward."""
        param, grad = self._param, self._grad
        if param is None or grad is None:
            return False
        if param.grad is not grad:
            return True
        if grad._version == self._version:
            return False
        self._version = grad._version  # changed in place: wiped only if it is now all zero
        return not bool(grad.any())

    def stop(self) -> None:
        """The window closed."""
        self._param = self._grad = None
