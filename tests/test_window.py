"""The open window and the accumulator's lifecycle (gradaccum/window.py): integers and
opaque values only, so these tests need no torch."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradaccum.errors import GradaccumError, UsageError
from gradaccum.window import Lifecycle, State, Window
from tests import strategies

ROOT = Path(__file__).resolve().parents[1]


class TestWindow:
    @given(size=strategies.steps)
    def test_a_new_window_is_empty(self, size: int) -> None:
        """A new window has no microsteps, takes ``size`` and divides by ``size``."""
        window = Window(size)
        assert (window.done, window.size, window.divisor) == (0, size, size)
        assert window.by_items is False
        assert window.in_block is False
        assert window.losses == []
        assert window.items == []
        assert not window.is_open

    @given(size=strategies.steps, new_size=strategies.steps, done=strategies.steps)
    def test_reset_closes_the_window(self, size: int, new_size: int, done: int) -> None:
        """reset() forgets the window's progress, mode, losses and items; the next
        window takes the new size and divides by it."""
        window = Window(size)
        window.open(by_items=True)
        window.done = done
        window.losses.append("loss")
        window.items.append(3)
        window.reset(new_size)
        assert (window.done, window.size, window.divisor) == (0, new_size, new_size)
        assert window.by_items is False
        assert window.losses == []
        assert window.items == []
        assert not window.is_open

    def test_reset_does_not_clear_the_lists_handed_out(self) -> None:
        """reset() gives the next window new lists: the losses and items of the window
        that closed (handed to the user in its Step) stay as they were."""
        window = Window(2)
        losses, items = window.losses, window.items
        losses.extend(["a", "b"])
        items.extend([1, 2])
        window.reset(2)
        assert losses == ["a", "b"]
        assert items == [1, 2]
        assert window.losses is not losses
        assert window.items is not items

    @given(size=strategies.steps, sized_to=strategies.steps, by_items=st.booleans())
    def test_open_fixes_the_divisor_and_mode(
        self, size: int, sized_to: int, by_items: bool
    ) -> None:
        """The first microstep's open() takes the divisor from the size at that moment
        (which a hand-out may have changed since the reset) and sets the mode."""
        window = Window(size)
        window.size = sized_to
        window.open(by_items)
        assert window.divisor == sized_to
        assert window.by_items is by_items
        window.size = size  # a later change of size does not move the divisor
        assert window.divisor == sized_to

    def test_is_open_with_a_microstep_or_an_open_block(self) -> None:
        """A window is open once a microstep was back-propagated, or while a block is
        open (also the first one's)."""
        window = Window(3)
        assert not window.is_open
        window.in_block = True
        assert window.is_open
        window.in_block = False
        window.done = 1
        assert window.is_open
        window.in_block = True
        assert window.is_open

    @given(size=st.integers(min_value=1, max_value=50))
    def test_next_is_boundary_once_per_window(self, size: int) -> None:
        """Driven through its microsteps, a window says exactly once that the next
        microstep completes it: before its last."""
        window = Window(size)
        seen = []
        for _ in range(size):
            seen.append(window.next_is_boundary)
            window.done += 1
        assert seen == [False] * (size - 1) + [True]
        assert not window.next_is_boundary  # done == size: past the boundary

    def test_a_window_of_one_is_always_at_its_boundary(self) -> None:
        """With steps=1 the first microstep is the boundary."""
        assert Window(1).next_is_boundary

    @given(size=st.integers(min_value=1, max_value=50), data=st.data())
    def test_where_names_the_microstep_due(self, size: int, data: st.DataObject) -> None:
        """where() names the microstep due, counted from 1, and the window's size."""
        window = Window(size)
        window.done = data.draw(st.integers(min_value=0, max_value=size - 1))
        assert window.where() == f"microstep {window.done + 1} of {size}"

    def test_where_example(self) -> None:
        """The message form: the second of four."""
        window = Window(4)
        window.done = 1
        assert window.where() == "microstep 2 of 4"

    def test_no_other_attributes(self) -> None:
        """A window holds only its slots (a typo'd attribute raises, not sticks)."""
        window = Window(2)
        with pytest.raises(AttributeError):
            window.dones = 1  # type: ignore[attr-defined]


class TestLifecycle:
    def test_starts_open(self) -> None:
        """A new lifecycle is open, with no reason, and takes calls."""
        life = Lifecycle()
        assert life.state is State.OPEN
        assert life.reason == ""
        life.check("microstep()")  # does not raise

    def test_closed_refuses_calls(self) -> None:
        """A closed accumulator refuses every call, naming it and saying to build a new
        one."""
        life = Lifecycle()
        life.close()
        assert life.state is State.CLOSED
        with pytest.raises(UsageError) as caught:
            life.check("microstep()")
        assert str(caught.value) == (
            "microstep() was called on a closed Accumulator; create a new one"
        )

    def test_close_reason_is_in_the_refusal(self) -> None:
        """The reason given to close() follows the call in the refusal."""
        life = Lifecycle()
        life.close(" (closed by the Accumulator built after it)")
        with pytest.raises(UsageError, match="closed Accumulator") as caught:
            life.check("epoch()")
        assert str(caught.value) == (
            "epoch() was called on a closed Accumulator (closed by the Accumulator built "
            "after it); create a new one"
        )

    def test_close_is_idempotent_and_keeps_the_first_reason(self) -> None:
        """Closing again changes nothing: the first reason stays."""
        life = Lifecycle()
        life.close(" first")
        life.close(" second")
        life.close()
        assert life.state is State.CLOSED
        assert life.reason == " first"

    def test_broken_refuses_calls_with_the_reason(self) -> None:
        """A broken accumulator refuses calls, saying what broke it and to restart every
        rank from the last checkpoint."""
        life = Lifecycle()
        life.break_("rank 1 failed (boom)")
        assert life.state is State.BROKEN
        with pytest.raises(UsageError) as caught:
            life.check("microstep()")
        assert str(caught.value) == (
            "microstep() was called after rank 1 failed (boom): the ranks' windows no "
            "longer line up, so this accumulator takes no more microsteps; restart every "
            "rank from the last checkpoint"
        )

    def test_close_does_not_mend_a_broken_accumulator(self) -> None:
        """close() after a break leaves it broken, with the break's reason."""
        life = Lifecycle()
        life.break_("rank 0 failed (x)")
        life.close(" later")
        assert life.state is State.BROKEN
        assert life.reason == "rank 0 failed (x)"

    @pytest.mark.parametrize(
        ("state", "expected"),
        [
            (State.OPEN, "step() was refused"),
            (State.CLOSED, "step() was called on a closed Accumulator; create a new one"),
            (State.BROKEN, "step() was called after : the ranks' windows"),
        ],
    )
    def test_refuse_message_is_keyed_by_state(self, state: State, expected: str) -> None:
        """refuse() always raises a UsageError (a RuntimeError and a GradaccumError),
        whose message the state picks."""
        life = Lifecycle()
        life.state = state
        with pytest.raises(UsageError) as caught:
            life.refuse("step()")
        assert str(caught.value).startswith(expected)
        assert isinstance(caught.value, RuntimeError)
        assert isinstance(caught.value, GradaccumError)

    @given(call=st.text(min_size=1, max_size=20), reason=st.text(max_size=20))
    def test_every_refusal_names_the_call(self, call: str, reason: str) -> None:
        """Whatever the call and the reason, a closed or broken lifecycle's refusal
        starts with the call and quotes the reason."""
        for close in (Lifecycle.close, Lifecycle.break_):
            life = Lifecycle()
            close(life, reason)
            with pytest.raises(UsageError) as caught:
                life.check(call)
            assert str(caught.value).startswith(f"{call} was called ")
            assert reason in str(caught.value)
