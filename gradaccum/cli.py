"""Command-line integration: the ``--gradient-accumulation-steps`` flag for argparse."""

from __future__ import annotations

import argparse
from typing import Any, Protocol, TypeVar

from gradaccum.errors import ConfigTypeError, describe
from gradaccum.schedule import check_steps

__all__ = ["add_arguments", "parse_steps"]


class _ArgumentContainer(Protocol):
    def add_argument(self, *name_or_flags: str, **kwargs: Any) -> argparse.Action: ...


P = TypeVar("P", bound=_ArgumentContainer)


def parse_steps(text: str) -> int:
    """Parse the flag's value; argparse turns the error into a usage error (exit 2).

    Raises:
        argparse.ArgumentTypeError: ``text`` is not a positive integer.
    """
    try:
        return check_steps(int(text))
    except ValueError:  # int() refused it, or check_steps' ConfigError (a ValueError)
        msg = (
            f"must be a positive int (microbatches per optimizer step), got {text!r}; "
            "pass 1 for no accumulation"
        )
        raise argparse.ArgumentTypeError(msg) from None


def add_arguments(parser: P, *, default: int = 1) -> P:
    """Add ``--gradient-accumulation-steps N`` to a parser or argument group.

    The value lands in ``args.gradient_accumulation_steps``; 0, -3, 2.5 and ``abc``
    are refused with argparse's usage error (exit status 2).

    Args:
        parser: An ``argparse.ArgumentParser`` or argument group; returned.
        default: The value when the flag is not given: 1 (no accumulation) unless the
            script was written for another.

    Examples:
        >>> parser = add_arguments(argparse.ArgumentParser())
        >>> parser.parse_args(["--gradient-accumulation-steps", "4"]).gradient_accumulation_steps
        4
    """
    if isinstance(parser, type) or not callable(getattr(parser, "add_argument", None)):
        msg = f"parser must be an argparse.ArgumentParser or argument group, got {describe(parser)}"
        raise ConfigTypeError(msg)
    check_steps(default, "default")
    parser.add_argument(
        "--gradient-accumulation-steps",
        type=parse_steps,
        default=default,
        metavar="N",
        help=f"microbatches per optimizer step (default: {default}"
        + (", no accumulation)" if default == 1 else ")"),
    )
    return parser
