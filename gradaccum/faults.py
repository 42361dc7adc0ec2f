"""Which rank failed first: a record in the process group's store that the others read,
and a guard that lets a failing forward's collective (FSDP's all-gather, DDP's
broadcast) be named like a backward's.

A rank whose microstep (or forward) raises writes one line in the default group's store,
under one key for the whole job (its tensor-parallel peers are in other data-parallel
groups, and their collectives fail with it); a rank whose collective then fails (the
peer exited, or the process group timed out) reads it, so its error can name the rank
that failed rather than only the broken connection.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch.distributed as dist
from torch import nn

__all__ = ["Failure", "first_failure", "guard_forwards", "record_failure"]


class Failure(NamedTuple):
    """A rank's failure: in which window (numbered from 1), whether it had applied that
    window, and what it raised."""

    rank: int
    window: int
    applied: bool
    what: str


_KEY = "gradaccum/first-failure"


def _store() -> Any:
    """The store every rank of the default group shares, or None (torch has no public
    getter for it)."""
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get_store is None:
        return None
    try:
        return get_store()
    except (RuntimeError, ValueError):  # no default group, or it was destroyed
        return None


def record_failure(failure: Failure) -> None:
    """Record this rank's ``failure``, unless another rank recorded one first."""
    store = _store()
    if store is None:
        return
    line = ":".join(str(int(field)) for field in failure[:3]) + f":{failure.what}"
    try:
        # compare_set writes only where nothing was written: the first failure stays.
        store.compare_set(_KEY, "", line)
    except RuntimeError:  # the store went down with the rank that hosted it
        return


def first_failure() -> Failure | None:
    """The failure recorded first in the job, if any."""
    store = _store()
    if store is None:
        return None
    try:
        if not store.check([_KEY]):
            return None
        rank, window, applied, what = store.get(_KEY).decode().split(":", 3)
    except RuntimeError:
        return None
    return Failure(int(rank), int(window), applied == "1", what)


def guard_forwards(model: nn.Module, failed: Callable[[BaseException], None]) -> Callable[[], None]:
    """Call ``failed(error)`` when a forward of ``model`` raises, before the error leaves
    the call (``failed`` may raise another, from it); return the function that removes
    the guard.

    The wrapper's collectives in a forward (FSDP's all-gather, DDP's buffer and bucket
    broadcasts) run in its hooks, before ``forward``, so ``model`` gets a subclass of its
    own class whose ``__call__`` wraps the call (as ``fully_shard`` itself subclasses).
    ``failed`` is held weakly: a forgotten accumulator costs nothing.
    """
    original = type(model)
    handler = weakref.WeakMethod(failed)

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        try:
            return original.__call__(self, *args, **kwargs)
        except Exception as error:
            method = handler()
            if method is not None:
                method(error)
            raise

    namespace = {"__call__": call, "__module__": original.__module__}
    guarded = type(original.__name__, (original,), namespace)
    guarded.__qualname__ = original.__qualname__
    model.__class__ = guarded

    def remove() -> None:
        if type(model) is guarded:
            model.__class__ = original

    return remove
