"""Which rank failed first: a record in the process group's store that the others read.

A rank whose microstep raises writes one line under a key of its group; a rank whose
collective then fails (the peer exited, or the process group timed out) reads it, so its
error can name the rank that failed rather than only the broken connection.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["first_failure", "record_failure"]


def _store_and_key(group: dist.ProcessGroup | None) -> tuple[Any, str] | None:
    # torch has no public getter for the store every rank of the default group shares.
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get_store is None:
        return None
    try:
        store = get_store()
    except (RuntimeError, ValueError):  # no default group, or it was destroyed
        return None
    name = "default" if group is None else dist.distributed_c10d._get_process_group_name(group)
    return store, f"gradaccum/first-failure/{name}"


def record_failure(group: dist.ProcessGroup | None, what: str) -> None:
    """Record that this rank failed with ``what``, unless another rank did first."""
    found = _store_and_key(group)
    if found is None:
        return
    store, key = found
    try:
        # compare_set writes only where nothing was written: the first failure stays.
        store.compare_set(key, "", f"{dist.get_rank()}:{what}")
    except RuntimeError:  # the store went down with the rank that hosted it
        return


def first_failure(group: dist.ProcessGroup | None) -> tuple[int, str] | None:
    """The rank that failed first in ``group`` and what it raised, if one was recorded."""
    found = _store_and_key(group)
    if found is None:
        return None
    store, key = found
    try:
        if not store.check([key]):
            return None
        rank, _, what = store.get(key).decode().partition(":")
    except RuntimeError:
        return None
    return int(rank), what
