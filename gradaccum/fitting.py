"""The microbatch of `Accumulator.step` (integers only, no torch): the whole batch, a fixed
size, or the largest found to fit (``microbatch="auto"``), halved after running out of
memory; and the one agreement over the ranks that keeps every rank's decision the same."""

from __future__ import annotations

from typing import Literal

__all__ = ["NO_RANK", "Fit", "MicrobatchOption", "agreed", "proposal"]

MicrobatchOption = int | Literal["auto"] | None
"""The ``microbatch`` argument of `Accumulator`: rows per microbatch, ``"auto"``, or None
(the whole batch in one microbatch)."""

NO_RANK = 2**62
"""What a rank that did not run out of memory proposes as the failing rank (the least
over the ranks is then a rank that did, if any did)."""


class Fit:
    """The microbatch `Accumulator.step` cuts batches into.

    With a fixed size (or None, the whole batch) it never changes. With ``"auto"`` it is
    unknown until the first window completes, which starts from the batch's rows and is
    halved on every out-of-memory error; a later window that runs out of memory halves it
    again. It never grows back.

    Checkpoint behavior: `state` is saved as ``state_dict()["microbatch"]``; `load` takes
    it back under ``"auto"`` (so that a resumed run cuts as the uninterrupted one), and a
    fixed size keeps its own.

    Attributes:
        auto: Out-of-memory errors inside a window are recovered from (``"auto"``).
        microbatch: The rows per microbatch now: fixed, or found; None for the whole batch
            or before the first window under ``"auto"``.
    """

    __slots__ = ("auto", "microbatch")

    def __init__(self, option: MicrobatchOption) -> None:
        self.auto = option == "auto"
        self.microbatch: int | None = None if option == "auto" else option

    def size_for(self, rows: int) -> int:
        """The microbatch of a window of a batch of ``rows``."""
        microbatch = self.microbatch
        return rows if microbatch is None else min(microbatch, rows)

    def fitted(self, size: int) -> None:
        """A window completed with microbatches of ``size`` rows (the least over the
        ranks): under ``"auto"``, the first one fixes the microbatch."""
        if self.auto and self.microbatch is None:
            self.microbatch = size

    def shrink(self, size: int) -> None:
        """Ran out of memory: the next try, and every later window, takes ``size`` rows."""
        self.microbatch = size

    def state(self) -> int | None:
        """What `state_dict` saves."""
        return self.microbatch

    def load(self, saved: int | None) -> None:
        """Take the saved microbatch back under ``"auto"``; a fixed one keeps its own."""
        if self.auto and saved is not None:
            self.microbatch = saved


def proposal(size: int, out_of_memory: bool, rank: int) -> list[int]:
    """What a rank that ran a window's microbatches of ``size`` rows puts into the agreement
    (an element-wise minimum over the ranks): the next size (halved, 0 below one row, after
    running out of memory) and its rank if it ran out, else `NO_RANK`."""
    if out_of_memory:
        return [size // 2, rank]
    return [size, NO_RANK]


def agreed(least: list[int]) -> tuple[int, int | None]:
    """The agreement's outcome: the size every rank takes (0: a row does not fit) and the
    least rank that ran out of memory, or None when none did."""
    size, rank = least
    return size, None if rank == NO_RANK else rank
