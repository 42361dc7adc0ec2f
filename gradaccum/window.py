"""Where the open window stands, and whether the accumulator takes calls at all.

Integers and opaque values only (no torch): the window and the lifecycle are what every
decision of the accumulator reads, each defined once here.
"""

from __future__ import annotations

import enum
from typing import Any, NoReturn

from gradaccum.errors import UsageError

__all__ = ["Counts", "Lifecycle", "State", "Window"]


class Window:
    """The open window: how many microsteps it has back-propagated and how many it takes.

    Attributes:
        done: Microsteps back-propagated (their blocks exited) in this window.
        size: Microsteps in this window: ``steps``, or fewer for an epoch's trailing window.
        last: ``size - 1``: ``done`` equals it when the next microstep is the boundary (one
            compare on the hot path; set with `resize`).
        divisor: What mean-mode losses were divided by; the size when the window opened
            (an epoch that ends sooner than planned is rescaled at the boundary).
        by_items: Whether this window passes ``num_items``; set by its first microstep.
        in_block: A microstep's ``with`` block is open.
        losses: The window's losses so far, as the user passed them but detached: holding
            a loss's autograd graph until the boundary would keep what it references alive.
        items: The window's ``num_items`` so far (ints or 0-dim tensors).
    """

    __slots__ = ("by_items", "divisor", "done", "in_block", "items", "last", "losses", "size")

    def __init__(self, size: int) -> None:
        self.in_block = False
        self.reset(size)

    def reset(self, size: int) -> None:
        """Close the window (applied, skipped or discarded); the next one takes ``size``."""
        self.done = 0
        self.size, self.last = size, size - 1
        self.divisor = size
        self.by_items = False
        self.losses: list[Any] = []  # (a new list: the boundary's `Step` keeps the last)
        self.items: list[Any] = []

    def resize(self, size: int) -> None:
        """The window takes ``size`` microsteps (the epoch's end is nearer than ``steps``)."""
        self.size, self.last = size, size - 1

    def open(self, by_items: bool) -> None:
        """The window's first microstep fixes its loss divisor and its mode."""
        self.divisor = self.size
        self.by_items = by_items

    @property
    def is_open(self) -> bool:
        """A microstep of this window was back-propagated, or its block is open."""
        return self.done > 0 or self.in_block

    @property
    def next_is_boundary(self) -> bool:
        """The next microstep (or the one in the open block) completes the window."""
        return self.done == self.last

    def where(self) -> str:
        """The microstep now due, for messages: ``"microstep 2 of 4"``."""
        return f"microstep {self.done + 1} of {self.size}"

    def progress(self) -> str:
        """How far the window is, for messages: ``"1 of 4 microsteps back-propagated"``,
        the microstep whose block is open counted (its backward ran on entering)."""
        return f"{self.done + self.in_block} of {self.size} microsteps back-propagated"

    def where_open(self) -> str | None:
        """`where` while the window is open, else None (between windows)."""
        return self.where() if self.is_open else None

    def restore(
        self,
        done: int,
        size: int,
        divisor: int,
        by_items: bool,
        items: list[Any],
        losses: list[Any],
    ) -> None:
        """Continue a window saved after ``done`` of its ``size`` microsteps."""
        self.done, self.divisor, self.by_items = done, divisor, by_items
        self.resize(size)
        self.items, self.losses = list(items), list(losses)


class Counts:
    """How many microsteps make a window, and how many windows were completed.

    Attributes:
        steps: Microbatches per optimizer step (``Accumulator.steps``).
        global_step: Windows completed: optimizer steps taken, plus the skipped ones.
        skipped: Windows completed without an optimizer step (inf/NaN).
    """

    __slots__ = ("global_step", "skipped", "steps")

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.global_step = self.skipped = 0

    def count(self, *, skipped: bool) -> None:
        """A window was completed (applied, or skipped)."""
        self.global_step += 1
        self.skipped += skipped

    def load(self, global_step: int, skipped: int) -> None:
        """Take the counts of a loaded state."""
        self.global_step, self.skipped = global_step, skipped


class State(enum.Enum):
    """Whether an accumulator takes calls."""

    OPEN = "open"
    BROKEN = "broken"  # a failure under several ranks: the ranks' windows no longer line up
    CLOSED = "closed"


class Lifecycle:
    """The accumulator's state and why it left `State.OPEN`; one place that refuses calls.

    ``stopped`` (an opaque callable) is called when the state leaves `State.OPEN`, so that
    the hot path can keep one flag instead of reading this state on every microstep.
    """

    __slots__ = ("reason", "state", "stopped")

    def __init__(self, stopped: Any = None) -> None:
        self.state = State.OPEN
        self.reason = ""
        self.stopped = stopped

    def close(self, reason: str = "") -> None:
        """Stop taking calls (``reason``: why, when not by `Accumulator.close`)."""
        if self.state is State.OPEN:
            self.state, self.reason = State.CLOSED, reason
            self._stop()

    def break_(self, reason: str) -> None:
        """Stop taking calls because the ranks' windows no longer line up."""
        self.state, self.reason = State.BROKEN, reason
        self._stop()

    def _stop(self) -> None:
        if self.stopped is not None:
            self.stopped()

    def check(self, call: str) -> None:
        """Refuse ``call`` unless the accumulator is open."""
        if self.state is not State.OPEN:
            self.refuse(call)

    def refuse(self, call: str) -> NoReturn:
        """Raise the refusal of ``call`` that the state calls for."""
        messages = {
            State.BROKEN: (
                f"{call} was called after {self.reason}: the ranks' windows no longer line "
                "up, so this accumulator takes no more microsteps; restart every rank from "
                "the last checkpoint"
            ),
            State.CLOSED: (
                f"{call} was called on a closed Accumulator{self.reason}; create a new one"
            ),
        }
        raise UsageError(messages.get(self.state, f"{call} was refused"))
