"""Step arithmetic in optimizer (macro) steps: the one source of truth for epoch lengths.

Nothing here imports torch, so trainers and launchers can use it on their own.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping

from gradaccum.errors import ConfigError, ConfigTypeError, describe

__all__ = [
    "check_bool",
    "check_count",
    "check_positive",
    "check_steps",
    "divisors",
    "interval",
    "kept_on",
    "listed",
    "steps_at_epoch",
    "steps_for",
    "steps_per_epoch",
    "total_steps",
    "trained_microbatches",
]


def check_steps(steps: object, name: str = "steps") -> int:
    """Return ``steps`` if it is a positive int, else raise naming ``name`` and the value.

    Raises:
        ConfigTypeError: ``steps`` is not an int (``True``, ``1.5`` and ``"4"`` are not).
        ConfigError: ``steps`` is an int below 1.
    """
    return _check_int(steps, name, "a positive int", 1, "; pass 1 for no accumulation")


def check_bool(value: object, name: str) -> bool:
    """Return ``value`` if it is a bool, else raise `ConfigTypeError` naming ``name``."""
    if not isinstance(value, bool):
        msg = f"{name} must be a bool, got {describe(value)}"
        raise ConfigTypeError(msg)
    return value


def check_count(value: object, name: str, fix: str = "") -> int:
    """Return ``value`` as an int if it is an integer >= 0 (a NumPy one too), else raise
    naming ``name`` and the value (and ``fix``, what to pass instead).

    Raises:
        ConfigTypeError: ``value`` is not an integer (bools are refused).
        ConfigError: ``value`` is negative.
    """
    return _check_int(value, name, "a non-negative int", 0, fix)


def check_positive(value: object, name: str) -> int:
    """Return ``value`` if it is an int >= 1, else raise naming ``name`` and the value."""
    return _check_int(value, name, "a positive int", 1, "")


def _check_int(value: object, name: str, expected: str, minimum: int, fix: str) -> int:
    # Any integer type is an int here (a NumPy count from a collate function), as a
    # ``numbers.Integral``: not a bool, nor a tensor (whose value is not read).
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        msg = f"{name} must be {expected}, got {describe(value)}{fix}"
        raise ConfigTypeError(msg)
    if value < minimum:
        msg = f"{name} must be {expected}, got {value}{fix}"
        raise ConfigError(msg)
    return int(value)


def steps_per_epoch(n_batches: int, steps: int) -> int:
    """Optimizer steps in an epoch of ``n_batches`` microbatches when the remainder is dropped.

    Args:
        n_batches: Microbatches in the epoch (``len(loader)``).
        steps: Microbatches per optimizer step.

    Returns:
        ``n_batches // steps``; the trailing ``n_batches % steps`` microbatches are not
        trained on.

    Examples:
        >>> steps_per_epoch(13, 4)
        3
    """
    return check_count(n_batches, "n_batches") // check_steps(steps)


def total_steps(
    n_batches: int, steps: int | Mapping[int, int], epochs: int = 1, drop_last: bool = True
) -> int:
    """Optimizer steps over ``epochs`` epochs: the horizon to give an LR scheduler.

    Args:
        n_batches: Microbatches per epoch.
        steps: Microbatches per optimizer step, or a schedule ``{epoch: steps}`` that
            changes it from the given (0-based) epochs on, as in `steps_at_epoch`.
        epochs: Number of epochs.
        drop_last: Drop each epoch's trailing partial window (the `Accumulator` default);
            when False it is one more, shorter, optimizer step.

    Returns:
        The number of optimizer steps.

    Examples:
        >>> total_steps(13, 4, epochs=2)
        6
        >>> total_steps(13, 4, epochs=2, drop_last=False)
        8
        >>> total_steps(13, {0: 1, 1: 4}, epochs=2)  # 13 steps, then 3
        16
    """
    n_batches = check_count(n_batches, "n_batches")
    epochs = check_count(epochs, "epochs")
    check_bool(drop_last, "drop_last")
    if not isinstance(steps, Mapping):
        return epochs * _per_epoch(n_batches, check_steps(steps), drop_last)
    _check_schedule(steps, "steps")
    return sum(
        _per_epoch(n_batches, steps_at_epoch(steps, epoch), drop_last) for epoch in range(epochs)
    )


def trained_microbatches(n_batches: int, steps: int, drop_last: bool) -> int:
    """How many of ``n_batches`` microbatches are trained on when windows of ``steps`` are
    cut from the first: all of them, or with ``drop_last`` those that fill whole windows.

    The one formula behind `total_steps` and the accumulator's epoch plan (which applies
    it from the start of each window, so that ``steps`` may change between windows).
    """
    return n_batches // steps * steps if drop_last else n_batches


def _per_epoch(n_batches: int, steps: int, drop_last: bool) -> int:
    return -(
        -trained_microbatches(n_batches, steps, drop_last) // steps
    )  # whole windows, rounded up


def steps_for(global_batch: int, micro_batch: int, world_size: int) -> int:
    """The ``steps`` that keep a global batch: ``global_batch`` samples per optimizer step,
    with ``micro_batch`` samples per rank and microstep on ``world_size`` data-parallel ranks
    (what a run resumed on another number of ranks needs).

    Args:
        global_batch: Samples per optimizer step, over all the ranks.
        micro_batch: Samples per microbatch on each rank (the DataLoader's ``batch_size``).
        world_size: Data-parallel ranks.

    Returns:
        ``global_batch // (micro_batch * world_size)``.

    Raises:
        ConfigTypeError, ConfigError: An argument is not a positive int, or
            ``micro_batch * world_size`` does not divide ``global_batch``; the message
            names the numbers of ranks it is kept on.

    Examples:
        >>> steps_for(256, 8, 4)
        8
        >>> steps_for(256, 8, 2)  # the same global batch on half the ranks
        16
    """
    check_positive(global_batch, "global_batch")
    check_positive(micro_batch, "micro_batch")
    check_positive(world_size, "world_size")
    steps, rest = divmod(global_batch, micro_batch * world_size)
    if not rest:
        return steps
    msg = (
        f"global_batch={global_batch} is not a multiple of micro_batch * world_size = "
        f"{micro_batch} * {world_size} = {micro_batch * world_size}"
    )
    if global_batch % micro_batch:
        msg += f"; pass a micro_batch that divides {global_batch}"
    else:
        msg += f"; with micro_batch={micro_batch} it is kept {kept_on(global_batch // micro_batch)}"
    raise ConfigError(msg)


def kept_on(rows: int) -> str:
    """Where a global window of ``rows`` microbatches (over all the ranks) is kept, for
    messages: ``"on 1, 2 or 4 ranks with steps 4, 2 or 1"``."""
    ranks = divisors(rows)
    return (
        f"on {listed(ranks)} rank{'s' if rows > 1 else ''} with steps "
        f"{listed([rows // each for each in ranks])}"
    )


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` (>= 1), in order."""
    low = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def listed(values: list[int]) -> str:
    """``[1, 2, 4]`` in words, for messages: ``"1, 2 or 4"``."""
    *rest, last = map(str, values)
    return f"{', '.join(rest)} or {last}" if rest else last


def steps_at_epoch(schedule: Mapping[int, int], epoch: int) -> int:
    """The ``steps`` a schedule of accumulation gives an epoch (like Lightning's
    ``GradientAccumulationScheduler``): the value at the largest key ``<= epoch``.

    Args:
        schedule: ``{first_epoch: steps}``, 0-based epochs; it must have the key 0.
        epoch: The 0-based epoch.

    Examples:
        >>> warm_up = {0: 1, 2: 4, 5: 8}
        >>> [steps_at_epoch(warm_up, epoch) for epoch in range(7)]
        [1, 1, 4, 4, 4, 8, 8]
    """
    _check_schedule(schedule, "schedule")
    check_count(epoch, "epoch")
    return schedule[max(start for start in schedule if start <= epoch)]


def _check_schedule(schedule: object, name: str) -> None:
    if not isinstance(schedule, Mapping):
        msg = f"{name} must be a mapping {{epoch: steps}}, got {describe(schedule)}"
        raise ConfigTypeError(msg)
    for epoch, steps in schedule.items():
        check_count(epoch, f"a key of {name}")
        check_steps(steps, f"{name}[{epoch!r}]")
    if 0 not in schedule:
        msg = f"{name} must give the steps of epoch 0, got keys {sorted(schedule)}; add the key 0"
        raise ConfigError(msg)


def interval(freq: int | float, steps_per_epoch: int) -> int:
    """A log or checkpoint cadence in optimizer steps.

    Args:
        freq: An int >= 1 is a number of optimizer steps; a float in (0, 1) is a
            fraction of an epoch.
        steps_per_epoch: Optimizer steps per epoch.

    Returns:
        ``freq`` itself for an int, else ``max(1, round(freq * steps_per_epoch))``.

    Examples:
        >>> interval(50, 1000)
        50
        >>> interval(0.25, 1000)
        250
    """
    steps_per_epoch = check_count(steps_per_epoch, "steps_per_epoch")
    if isinstance(freq, numbers.Integral) and not isinstance(freq, bool):  # (NumPy's too)
        if freq < 1:
            msg = f"freq must be an int >= 1 or a float in (0, 1), got {freq}"
            raise ConfigError(msg)
        return int(freq)
    if isinstance(freq, numbers.Real) and not isinstance(freq, (float, bool)):  # NumPy float
        freq = float(freq)
    if not isinstance(freq, float):
        msg = f"freq must be an int >= 1 or a float in (0, 1), got {describe(freq)}"
        raise ConfigTypeError(msg)
    if not 0.0 < freq < 1.0:
        msg = (
            f"freq must be an int >= 1 or a float in (0, 1), got {freq}; "
            "pass an int for a number of optimizer steps"
        )
        raise ConfigError(msg)
    return max(1, round(freq * steps_per_epoch))
