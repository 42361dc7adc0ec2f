"""The exceptions and the warning gradaccum raises, rooted at `GradaccumError`."""

from __future__ import annotations


class GradaccumError(Exception):
    """Base of every exception gradaccum raises; each also subclasses a builtin."""


class ConfigError(GradaccumError, ValueError):
    """An argument, an epoch length or a loaded state has a value gradaccum cannot use."""


class ConfigTypeError(GradaccumError, TypeError):
    """An argument has a type gradaccum cannot use."""


class UsageError(GradaccumError, RuntimeError):
    """The accumulator was used out of order (nested microsteps, a mid-window checkpoint)."""


class NonFiniteError(GradaccumError, FloatingPointError):
    """A window's gradient held inf or NaN under ``on_nonfinite="raise"``; nothing was applied."""


class RankFailedError(GradaccumError, RuntimeError):
    """Another rank failed, so this one stopped mid-window without applying the window."""


class GradaccumWarning(UserWarning):
    """Something was dropped or ignored that the user may not have meant to drop."""


def describe(value: object) -> str:
    """Render a value as the user wrote it, with its type: ``True (bool)``."""
    return f"{value!r} ({type(value).__name__})"
