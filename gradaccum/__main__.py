"""``python -m gradaccum``: the command line; ``verify`` (see `gradaccum.verify`) is its
one command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from gradaccum import verify

PROG = "python -m gradaccum"


class _Parser(argparse.ArgumentParser):
    """The top-level parser: its usage and help go on with those of each command, built
    from the command's own parser, so that they list every option it takes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: list[argparse.ArgumentParser] = []

    def format_usage(self) -> str:
        return "\n".join([super().format_usage().rstrip(), *map(_usage, self.commands), ""])

    def format_help(self) -> str:
        own = super().format_help().split("\n\n", 1)[1]  # its own usage is format_usage's
        # Each command's help, under its name: its usage is already in the usage above.
        commands = [
            f"{command.prog}:\n" + command.format_help().split("\n\n", 1)[1]
            for command in self.commands
        ]
        return "\n".join([self.format_usage(), own, *commands])


def _usage(command: argparse.ArgumentParser) -> str:
    """``command``'s usage, lined up under the top-level ``usage:``."""
    usage = command.format_usage().rstrip()
    return " " * len("usage:") + usage.removeprefix("usage:")


def parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser, and each command's own parser by name."""
    top = _Parser(prog=PROG, description="gradaccum's command line.")
    commands = top.add_subparsers(
        title="commands",
        dest="command",
        metavar="COMMAND",
        required=True,
        prog=PROG,
        parser_class=argparse.ArgumentParser,
    )
    check = commands.add_parser("verify", help=verify.SUMMARY, description=verify.DESCRIPTION)
    verify.add_options(check)
    top.commands.append(check)
    return top, {"verify": check}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the command; usage errors exit 2, ``-h`` exits 0."""
    top, commands = parser()
    args = top.parse_args(argv)
    return verify.run_command(args, commands[args.command])


if __name__ == "__main__":
    sys.exit(main())
