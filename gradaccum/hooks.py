"""The hook gradaccum puts on the user's model while an accumulator is open: one
``always_call`` forward hook, which tells its listeners that a forward ran (a sync
strategy that overrides `SyncStrategy.forward_done`) or that it raised (on several ranks,
where the forward runs a collective: one that fails because another rank did), and
raises the error a listener gives instead of the forward's (`_raise_instead`). DDP needs
no hook: what its last forward decided is read from DDP itself (`gradaccum.sync.DDPSync`).

The model keeps its type and its attributes. The hook is a plain module-level function,
registered once per model whatever the number of accumulators, and only while someone
listens (one hook, because each hook on a module costs its every call torch's slow path,
about 9,000 instructions); the listeners are kept here, keyed by the model's ``id()`` and
held weakly, not on the model. So a ``copy.deepcopy`` of the model (an EMA copy,
``AveragedModel``) or a pickled one (``torch.save(model)``) holds only a reference to
this function, which does nothing for a model it was not registered for, and
``torch.compile`` of the model sees no new type or attribute per accumulator; where the
hook is traced into a compiled forward (``model.compile()`` in place, or a compiled module
that holds the model), it does nothing there, so ``fullgraph=True`` compiles. The last
listener's removal removes the hook: the model is as it was.
"""

from __future__ import annotations

import ctypes
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradaccum import faults
from gradaccum.errors import UsageError

__all__ = ["Refusal", "Watch", "watch"]


class _Watched:
    """A model's hook, and the listeners it calls (weak references to bound methods)."""

    __slots__ = ("done", "failed", "finalizer", "handle")

    def __init__(self, model: nn.Module) -> None:
        self.done: list[weakref.WeakMethod[Callable[[], None]]] = []
        self.failed: list[weakref.WeakMethod[Callable[[BaseException], BaseException | None]]]
        self.failed = []
        self.handle: RemovableHandle = model.register_forward_hook(_after_forward, always_call=True)
        # A model that dies with listeners left (accumulators never closed) takes its entry.
        self.finalizer = weakref.finalize(model, _watched.pop, id(model), None)


_watched: dict[int, _Watched] = {}  # by id() of the model


def _after_forward(model: nn.Module, _: object, output: object) -> None:
    # Called after every forward, and with no output (None) when the forward raised: its
    # error is then the exception being handled. (A forward that returns None from inside
    # an `except` block of the caller's would look the same; no model of a loss does.)
    # Traced into a compiled forward (`model.compile()`, or torch.compile of a module that
    # holds this one), it is nothing: dynamo cannot trace the weak references, which
    # failed `fullgraph=True`, and what listens is a diagnosis, not the training.
    if torch.compiler.is_compiling():
        return
    watched = _watched.get(id(model))
    if watched is None:
        return
    error = sys.exc_info()[1] if output is None else None
    if error is None:
        for done in tuple(watched.done):  # (a listener may take itself off)
            method = done()
            if method is not None:
                method()
        return
    for failed in watched.failed:
        report = failed()
        if report is not None:
            instead = report(error)
            if instead is not None:
                _raise_instead(error, instead)


# CPython's setter of the exception being handled (3.11 and later; None elsewhere).
_set_handled: Any = getattr(getattr(ctypes, "pythonapi", None), "PyErr_SetHandledException", None)
if _set_handled is not None:
    _set_handled.argtypes, _set_handled.restype = (ctypes.py_object,), None


def _raise_instead(error: BaseException, instead: BaseException) -> None:
    """Make the model's call raise ``instead``, from ``error``, the forward's error.

    torch calls an ``always_call`` hook inside its ``except`` block around the forward and
    then re-raises with a bare ``raise``, which raises the exception being handled; an
    error the hook raises itself torch only warns about. So the hook sets ``instead`` as
    the exception being handled (CPython's ``PyErr_SetHandledException``), and torch's
    ``raise`` raises it, with ``error`` as its cause; the model's class is not changed to
    wrap its call. Where that is not available (Python 3.10), ``error`` is raised, with
    ``instead``'s type and message as a note (PEP 678). ``instead`` is one of gradaccum's
    errors."""
    instead.__cause__ = error
    if _set_handled is None:
        faults.add_note(error, f"gradaccum.{type(instead).__name__}: {instead}")
        return
    _set_handled(instead)


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
            listeners = watched.done if kind == "done" else watched.failed
            if listener in listeners:
                listeners.remove(listener)
        self._listeners = {}
        if not (watched.done or watched.failed):
            watched.handle.remove()
            watched.finalizer.detach()
            del _watched[self._key]


def watch(
    model: nn.Module,
    *,
    done: Callable[[], None] | None = None,
    failed: Callable[[BaseException], BaseException | None] | None = None,
) -> Watch:
    """Call the bound method ``done()`` after each forward of ``model`` that returned, and
    ``failed(error)`` when one raised (before the error leaves the call; ``failed`` must
    not raise, since ``torch`` would only warn about it, but may return the error the
    call raises instead, from ``error``: `_raise_instead`). Both are held weakly: a
    forgotten accumulator costs a dead reference.
    """
    key = id(model)
    watched = _watched.get(key)
    if watched is None:
        watched = _watched[key] = _Watched(model)
    listeners: dict[str, Any] = {}
    for kind, method, into in (("done", done, watched.done), ("failed", failed, watched.failed)):
        if method is not None:
            listeners[kind] = weakref.WeakMethod(method)
            into.append(listeners[kind])
    return Watch(key, listeners)


# The message each refusing model's forward raises, by id() of the model (a copy of the
# model carries the pre-hook inert, as it carries the forward hook).
_refusing: dict[int, str] = {}


def _refuse_forward(model: nn.Module, _: object) -> None:
    if torch.compiler.is_compiling():
        return
    message = _refusing.get(id(model))
    if message is not None:
        raise UsageError(message)


class Refusal:
    """Raise `UsageError` with ``message`` at every forward of ``model``, before any other
    forward pre-hook of it runs, until `remove`."""

    __slots__ = ("_finalizer", "_handle", "_key")

    def __init__(self, model: nn.Module, message: str) -> None:
        self._key = id(model)
        _refusing[self._key] = message
        # Before every other pre-hook, so before FSDP's all-gather.
        self._handle = model.register_forward_pre_hook(_refuse_forward, prepend=True)
        self._finalizer = weakref.finalize(model, _refusing.pop, self._key, None)

    def remove(self) -> None:
        """Let the model's forwards run again."""
        self._handle.remove()
        self._finalizer.detach()
        _refusing.pop(self._key, None)
