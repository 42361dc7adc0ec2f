"""Objects that other libraries wrap around the user's optimizer and scheduler: Hugging
Face Accelerate's prepared ones are unwrapped to the torch objects they forward to.

``accelerator.prepare(optimizer, scheduler)`` returns an ``AcceleratedOptimizer`` and an
``AcceleratedScheduler``. Their ``step()`` forward to the objects they wrap only when
Accelerate's own accumulation state says so, and the scheduler steps ``num_processes``
times per call unless ``split_batches=True``: under gradaccum, which decides the window
itself, that schedule would run ``num_processes`` times too fast. So gradaccum steps the
wrapped optimizer (``.optimizer``) and scheduler (``.scheduler``) itself, once per window.
Detection is lazy: only a process that imported Accelerate can hold its objects.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["prepared_optimizer", "prepared_scheduler"]


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
