"""Which rank failed first: a record in the process group's store that the others read,
and a note that names it on the error of a failing forward's collective (FSDP's
all-gather, DDP's broadcast), whose ``model(x)`` runs outside any gradaccum call
(gradaccum.hooks reports it).

A rank whose microstep (or forward) raises writes one line in the default group's store,
under one key for the whole job (its tensor-parallel peers are in other data-parallel
groups, and their collectives fail with it); a rank whose collective then fails (the
peer exited, or the process group timed out) reads it, so its error can name the rank
that failed rather than only the broken connection.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch.distributed as dist

__all__ = ["Failure", "add_note", "first_failure", "record_failure"]


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


def add_note(error: BaseException, note: str) -> None:
    """Add ``note`` to ``error``'s traceback (PEP 678; kept in ``__notes__`` on 3.10, where
    tracebacks do not show it), without changing the error's type or message."""
    add = getattr(error, "add_note", None)
    if add is not None:
        add(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]
