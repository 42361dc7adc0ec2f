"""The exceptions and the warning gradaccum raises, rooted at `GradaccumError`."""

from __future__ import annotations

import sys
import warnings

__all__ = [
    "ConfigError",
    "ConfigTypeError",
    "GradaccumError",
    "GradaccumWarning",
    "NonFiniteError",
    "OutOfMemoryError",
    "RankFailedError",
    "UsageError",
    "describe",
    "warn",
]


class GradaccumError(Exception):
    """Base of every exception gradaccum raises; each also subclasses a builtin."""


class ConfigError(GradaccumError, ValueError):
    """An argument, an epoch length or a loaded state has a value gradaccum cannot use."""


class ConfigTypeError(GradaccumError, TypeError):
    """An argument has a type gradaccum cannot use."""


class UsageError(GradaccumError, RuntimeError):
    """The accumulator was used out of order (nested microsteps, a mid-window checkpoint)."""


class NonFiniteError(GradaccumError, FloatingPointError):
    """A window's gradient held inf or NaN under ``on_nonfinite="raise"``; nothing was applied.

    Attributes:
        window: The window, numbered from 1 (the optimizer step it would have become).
    """

    def __init__(self, msg: str, window: int) -> None:
        super().__init__(msg)
        self.window = window

    def __reduce__(self) -> tuple[type, tuple[str, int]]:
        return type(self), (str(self), self.window)


class RankFailedError(GradaccumError, RuntimeError):
    """Another rank failed, so this one stopped mid-window.

    Attributes:
        rank: The rank that failed first.
        window: The window it failed in, numbered from 1.
        applied: Whether this rank had applied that window (its optimizer stepped) when
            it stopped.
    """

    def __init__(self, msg: str, rank: int, window: int, applied: bool = False) -> None:
        super().__init__(msg)
        self.rank = rank
        self.window = window
        self.applied = applied

    def __reduce__(self) -> tuple[type, tuple[str, int, int, bool]]:
        return type(self), (str(self), self.rank, self.window, self.applied)


class OutOfMemoryError(GradaccumError, RuntimeError):
    """A window of `Accumulator.step` ran out of memory where it cannot be re-run smaller:
    its microbatch was one row, or the boundary's gradient all-reduce had started on the
    other ranks. Nothing was applied. Not ``torch.OutOfMemoryError``, which it is raised
    from on the rank that ran out.

    Attributes:
        rank: The rank that ran out of memory.
        microbatch: The rows per microbatch that did not fit.
        window: The window, numbered from 1 (the optimizer step it would have become).
    """

    def __init__(self, msg: str, rank: int, microbatch: int, window: int) -> None:
        super().__init__(msg)
        self.rank = rank
        self.microbatch = microbatch
        self.window = window

    def __reduce__(self) -> tuple[type, tuple[str, int, int, int]]:
        return type(self), (str(self), self.rank, self.microbatch, self.window)


class GradaccumWarning(UserWarning):
    """Something was dropped or ignored that the user may not have meant to drop."""


def describe(value: object) -> str:
    """Render a value as the user wrote it, with its type: ``True (bool)``; an object whose
    repr would not fit on a line (an optimizer, a dict of them) by its type alone: ``a
    dict``."""
    text = repr(value)
    if "\n" in text or len(text) > 60:
        return f"an object of type {type(value).__name__}"
    return f"{text} ({type(value).__name__})"


_INTERNAL = ("gradaccum.", "torch.", "contextlib")


def warn(message: str) -> None:
    """Warn with `GradaccumWarning` at the user's line: the first caller outside gradaccum
    and torch (whose hooks and module calls may stand in between)."""
    frame = sys._getframe(1)
    level = 2  # warnings.warn's stacklevel of warn()'s caller
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(_INTERNAL):
        frame = frame.f_back
        level += 1
    warnings.warn(message, GradaccumWarning, stacklevel=level)
