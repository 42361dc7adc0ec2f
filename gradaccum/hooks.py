"""The hooks gradaccum puts on the user's model while an accumulator is open: a forward
pre-hook (for a wrapper that decides in its forward whether the backward communicates)
and an ``always_call`` forward hook (for a forward's collective that fails because
another rank did).

The model keeps its type and its attributes. Each hook is a plain module-level function,
registered once per model whatever the number of accumulators, and only while someone
listens; the listeners are kept here, keyed by the model's ``id()`` and held weakly, not
on the model. So a ``copy.deepcopy`` of the model (an EMA copy, ``AveragedModel``) or a
pickled one (``torch.save(model)``) holds only a reference to these functions, which do
nothing for a model they were not registered for, and ``torch.compile`` of the model
does not trace them (they run around its compiled call) nor sees a new type or attribute
per accumulator. The last listener's removal removes the hooks: the model is as it was.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["Watch", "watch"]


class _Watched:
    """A model's hooks, and the listeners each calls (weak references to bound methods)."""

    __slots__ = ("before", "failed", "finalizer", "handles", "model")

    def __init__(self, model: nn.Module) -> None:
        self.model = weakref.ref(model)
        self.before: list[weakref.WeakMethod[Callable[[], None]]] = []
        self.failed: list[weakref.WeakMethod[Callable[[BaseException], None]]] = []
        self.handles: dict[str, RemovableHandle] = {}
        # A model that dies with listeners left (accumulators never closed) takes its entry.
        self.finalizer = weakref.finalize(model, _watched.pop, id(model), None)

    def listen(self, kind: str, listener: Any) -> None:
        """Add ``listener`` to ``kind`` ("before" or "failed"), hooking the model for it."""
        model = self.model()
        listeners = self.before if kind == "before" else self.failed
        if not listeners and model is not None:
            self.handles[kind] = (
                model.register_forward_pre_hook(_before_forward)
                if kind == "before"
                else model.register_forward_hook(_after_forward, always_call=True)
            )
        listeners.append(listener)

    def leave(self, kind: str, listener: Any) -> None:
        """Remove ``listener``; the last listener of ``kind`` removes its hook."""
        listeners = self.before if kind == "before" else self.failed
        if listener in listeners:
            listeners.remove(listener)
        if not listeners and kind in self.handles:
            self.handles.pop(kind).remove()


_watched: dict[int, _Watched] = {}  # by id() of the model


def _before_forward(model: nn.Module, _: object) -> None:
    watched = _watched.get(id(model))
    if watched is not None:
        for listener in watched.before:
            method = listener()
            if method is not None:
                method()


def _after_forward(model: nn.Module, _: object, output: object) -> None:
    # Called after every forward, and with no output (None) when the forward raised: its
    # error is then the exception being handled. (A forward that returns None from inside
    # an `except` block of the caller's would look the same; no model of a loss does.)
    if output is not None:
        return
    error = sys.exc_info()[1]
    watched = _watched.get(id(model))
    if error is None or watched is None:
        return
    for listener in watched.failed:
        method = listener()
        if method is not None:
            method(error)


class Watch:
    """One accumulator's listeners on a model; `remove` takes them back."""

    __slots__ = ("_key", "_listeners")

    def __init__(self, key: int, listeners: dict[str, Any]) -> None:
        self._key = key
        self._listeners = listeners

    def remove(self) -> None:
        """Stop listening; the model's last listener leaves it as it was."""
        watched = _watched.get(self._key)
        if watched is None:
            return
        for kind, listener in self._listeners.items():
            watched.leave(kind, listener)
        self._listeners = {}
        if not watched.handles:
            watched.finalizer.detach()
            del _watched[self._key]


def watch(
    model: nn.Module,
    *,
    before: Callable[[], None] | None = None,
    failed: Callable[[BaseException], None] | None = None,
) -> Watch:
    """Call the bound method ``before()`` before each forward of ``model``, and
    ``failed(error)`` when a forward raises (before the error leaves the call; ``failed``
    must not raise: ``torch`` would only warn about it). Both are held weakly: a forgotten
    accumulator costs a dead reference.
    """
    key = id(model)
    watched = _watched.get(key)
    if watched is None:
        watched = _watched[key] = _Watched(model)
    listeners: dict[str, Any] = {}
    for kind, method in (("before", before), ("failed", failed)):
        if method is not None:
            listeners[kind] = weakref.WeakMethod(method)
            watched.listen(kind, listeners[kind])
    return Watch(key, listeners)
