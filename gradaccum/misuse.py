"""Watch for the user clipping a partial window: ``torch.nn.utils.clip_grad_norm_``,
wrapped once, warns when an open accumulator is between the microsteps of a window.

The wrapper forwards every call unchanged. It asks the open accumulators (a weak set,
so a forgotten accumulator costs nothing once collected) whether the parameters being
clipped hold a partial window's gradient. Code that imported the function by name
before the first `Accumulator` was built keeps the unwrapped one.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Protocol

import torch
from torch import nn

from gradaccum.errors import GradaccumWarning

__all__ = ["forget", "watch_clipping"]


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
            warnings.warn(
                f"clip_grad_norm_ was called on {where}, before the window's gradient is "
                "complete, so it clips a partial sum; pass max_grad_norm= to the "
                "Accumulator, or clip inside the boundary's block (when step.boundary is "
                "True)",
                GradaccumWarning,
                stacklevel=3,
            )
            break
    return parameters
