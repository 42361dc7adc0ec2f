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
    At the boundary, under any wrapping, the complete gradient is ``param.grad``: the
    watch is started there if it was not, so that a ``zero_grad()`` in the boundary's
    block, before the step, is caught (`dropped`).
    """

    __slots__ = ("grad", "lists", "param", "rest", "version")

    def __init__(self) -> None:
        # The first watched gradient is kept apart, so that the microstep reads it inline
        # (`gradaccum.block`): a version-counter compare, not a call.
        self.param: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None
        self.version = 0
        self.rest: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # param, grad, version
        self.lists: list[list[torch.Tensor]] = []  # what each wipe reaches (`start`)

    def start(self, first: torch.Tensor | None, candidates: list[list[torch.Tensor]]) -> None:
        """After a window's first backward: watch the first gradient of each list of
        ``candidates`` (each optimizer's parameters, and the model's in its order), or only
        ``first`` where every wipe reaches it (`gradaccum.boundary.Params.first`) and it
        has a gradient."""
        self.lists = candidates
        if first is not None:
            grad = first.grad
            if grad is not None:
                self.param, self.grad, self.version = first, grad, grad._version
                return
        found: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        for group in candidates:
            for param in group:
                grad = param.grad
                if grad is not None:
                    for seen, _, _ in found:
                        if seen is param:
                            break
                    else:
                        found.append((param, grad, grad._version))
                    break
        if found:
            (self.param, self.grad, self.version), *self.rest = found
        else:
            self.stop()

    def update(self) -> None:
        """After a later backward, which accumulated into the watched gradients: the
        versions of those after the first (whose version `gradaccum.block` reads inline)."""
        self.rest = [(param, grad, grad._version) for param, grad, _ in self.rest]

    def change(self) -> Change | None:
        """What happened to the watched gradients since the last backward: one dropped,
        zeroed or replaced by other values (``"wiped"``), one changed in place otherwise
        (``"changed"``), or nothing (None)."""
        if self.param is None or self.grad is None:
            return None
        found: Change | None = None
        now: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        for param, grad, version in [(self.param, self.grad, self.version), *self.rest]:
            if param.grad is not grad:
                replaced = param.grad
                if replaced is None or not _same(replaced, grad):
                    return "wiped"
                grad, version = replaced, replaced._version
            elif grad._version != version:
                # Changed in place: wiped only if it is now all zero, and so is every
                # other gradient that a wipe of it zeroes (`_zero_already`).
                version = grad._version
                if not bool(grad.any()) and not _zero_already(param, self.lists):
                    return "wiped"
                found = "changed"
            now.append((param, grad, version))
        (self.param, self.grad, self.version), *self.rest = now
        return found

    def dropped(self) -> bool:
        """A watched gradient was dropped since the watch started (a ``zero_grad()``, whose
        default ``set_to_none=True`` drops it); no host sync. Read at the boundary, once
        the window's gradient is complete."""
        param = self.param
        if param is None:
            return False
        if param.grad is None:
            return True
        return bool(self.rest) and any(other.grad is None for other, _, _ in self.rest)

    def stop(self) -> None:
        """The window closed."""
        self.param = self.grad = None
        if self.rest:  # (most windows watch one gradient: no new list for them)
            self.rest = []


def _zero_already(param: torch.Tensor, lists: list[list[torch.Tensor]]) -> bool:
    """``param``'s gradient, now all zero, was changed in place by something other than a
    ``zero_grad(set_to_none=False)``, which zeroes every gradient of its optimizer (or
    model): in each list of ``lists`` that holds it, another one is not zero. So it was
    zero already, as a LoRA adapter's is while its partner starts at zero, and was scaled
    (clipped, say). Host syncs, read only when a watched gradient is all zero after an
    in-place change."""
    return all(
        any(other.grad is not None and bool(other.grad.any()) for other in params)
        for params in lists
        if any(other is param for other in params)
    )


def _same(grad: torch.Tensor, other: torch.Tensor) -> bool:
    """The same values (one host sync; read only when ``param.grad`` was replaced)."""
    return grad.shape == other.shape and bool(torch.equal(grad, other))
