"""``python -m gradaccum verify``: see `gradaccum.verify`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gradaccum.verify import main as verify


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch the subcommand; ``verify`` is the only one."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "verify":
        usage = "usage: python -m gradaccum verify [--steps N] [--device D] [--json]"
        print(usage, file=sys.stderr)
        return 2
    return verify(args[1:])


if __name__ == "__main__":
    sys.exit(main())
