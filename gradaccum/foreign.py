"""Objects that other libraries wrap around the user's optimizer and scheduler: Hugging
Face Accelerate's prepared ones are unwrapped to the torch objects they forward to.

``accelerator.prepare(optimizer, scheduler)`` returns an ``AcceleratedOptimizer`` and an
``AcceleratedScheduler``. Their ``step()`` forward to the objects they wrap only when
Accelerate's own accumulation state says so, and the scheduler steps ``num_processes``
times per call unless ``split_batches=True``: under gradaccum, which decides the window
itself, that schedule would run ``num_processes`` times too fast. So gradaccum steps the
wrapped optimizer (``.optimizer``) and scheduler (``.scheduler``) itself, once per window.
Its prepared DataLoader (a ``DataLoaderAdapter``) has ``state_dict`` and
``load_state_dict`` methods whether or not the loader it wraps has them (only a
``StatefulDataLoader``, with ``use_stateful_dataloader=True``, restores its position), so
what it wraps is what says (`prepared_loader`).

Detection is lazy: only a process that imported Accelerate can hold its objects.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["prepared_loader", "prepared_optimizer", "prepared_scheduler"]


def _accelerate_type(module: str, name: str) -> type | None:
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def prepared_optimizer(optimizer: object) -> tuple[Any, Any] | None:
    """What Accelerate's prepared ``optimizer`` wraps, or None when it is not one.

    Returns:
        ``(wrapped, scaler)``: the torch optimizer, and the GradScaler that Accelerate's
        step would have stepped it with (None without ``mixed_precision="fp16"``).
    """
    prepared = _accelerate_type("accelerate.optimizer", "AcceleratedOptimizer")
    if prepared is None or not isinstance(optimizer, prepared):
        return None
    return getattr(optimizer, "optimizer", None), getattr(optimizer, "scaler", None)


def prepared_scheduler(scheduler: object) -> Any:
    """The scheduler that Accelerate's prepared ``scheduler`` wraps, or None when it is not
    one."""
    prepared = _accelerate_type("accelerate.scheduler", "AcceleratedScheduler")
    if prepared is None or not isinstance(scheduler, prepared):
        return None
    return getattr(scheduler, "scheduler", None)


def prepared_loader(iterable: object) -> Any:
    """The loader that Accelerate's prepared DataLoader wraps (``DataLoaderShard``,
    ``DataLoaderDispatcher``, ``SkipDataLoader``: its ``base_dataloader``), or None when
    ``iterable`` is not one. (Such a loader claims DataLoader's ``__class__``; its real
    type says what it is.)"""
    prepared = _accelerate_type("accelerate.data_loader", "DataLoaderAdapter")
    if prepared is None or not issubclass(type(iterable), prepared):
        return None
    return vars(iterable).get("base_dataloader")
