"""The epoch plan (gradaccum/plan.py): which microbatches of an epoch are trained and how
they are cut into windows, checked against an independent brute-force cut of the epoch.

`Driver` drives an `EpochPlan` exactly as the accumulator does (a hand-out, then the
window sized by the plan; a window closes after ``size`` microsteps; ``steps`` changes
between windows, or at the top of the loop body after the next window's first hand-out),
so the plan is tested without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaccum.errors import ConfigError, UsageError
from gradaccum.plan import EpochPlan, check_epoch_length
from gradaccum.schedule import total_steps, trained_microbatches
from tests import strategies

ROOT = Path(__file__).resolve().parents[1]

# {window boundary: (new steps, set at the top of the loop body)}; boundary b is after the
# b-th window of the epoch closed. "Top" changes come after the next window's first
# microbatch was handed out; the others right after the window closed.
changes = st.dictionaries(
    st.integers(min_value=0, max_value=12),
    st.tuples(strategies.steps, st.booleans()),
    max_size=4,
)
lengths = st.integers(min_value=0, max_value=40)


@dataclass
class Driver:
    """An `EpochPlan` driven the way the accumulator drives it, recording the windows.

    Attributes:
        offset: Windows that closed before this driver's first (a resumed run), so that
            ``changes`` keep their boundaries.
        hook: Called with ``(driver, where)`` at each checkpointable point: ``"top"`` (the
            top of the loop body, a window's first microbatch handed out), ``"between"``
            (a window just closed) and ``"mid"`` (after a microstep of an open window).
    """

    steps: int
    drop_last: bool
    changes: Mapping[int, tuple[int, bool]] = field(default_factory=dict)
    offset: int = 0
    hook: Callable[[Driver, str], None] | None = None
    plan: EpochPlan = field(init=False)
    done: int = 0
    size: int = 0
    windows: list[tuple[int, int]] = field(default_factory=list)  # (start, size), closed
    applied: dict[int, int] = field(default_factory=dict)  # {boundary: steps} changes made
    left_open: int = 0  # microsteps of a window open when the epoch ended
    dropped: bool = False  # ... which the plan meant to drop

    def __post_init__(self) -> None:
        self.plan = EpochPlan(self.drop_last)
        self.size = self.steps

    @property
    def boundary(self) -> int:
        return self.offset + len(self.windows)

    def set_steps(self, steps: int) -> None:
        """``acc.steps = steps`` (between windows)."""
        assert self.done == 0
        self.steps = steps
        self.plan.recut(steps)
        self.size = self.plan.window_size(steps, 0) if self.plan.pending else steps
        self.applied[self.boundary] = steps

    def hand_out(self, remaining: int | None) -> None:
        self.size = self.plan.hand_out(remaining, self.steps, self.done)

    def microstep(self) -> None:
        """One microstep's block entered and exited; the window closes after ``size``."""
        self.plan.pending = False
        self.done += 1
        if self.done < self.size:
            self._at("mid")
            return
        self.plan.close_window(False)
        self.windows.append((self.plan.closed_at - self.size, self.size))
        self.done, self.size = 0, self.steps
        change = self.changes.get(self.boundary)
        if change is not None and not change[1]:
            self.set_steps(change[0])
        self._at("between")

    def loop_body(self, remaining: int | None) -> None:
        self.hand_out(remaining)
        if self.done == 0:
            self._at("top")
            change = self.changes.get(self.boundary)
            if change is not None and change[1]:
                self.set_steps(change[0])
        self.microstep()

    def sized_epoch(self, n: int) -> None:
        plan = self.plan
        plan.begin(n, self.steps)
        while plan.position < (plan.trained_end or 0):
            self.loop_body(n - plan.position - 1)
        self._end()

    def unsized_epoch(self, n: int) -> None:
        """One rank, one item of look-ahead: only the last item's ``remaining`` is known."""
        skip = self.plan.begin(None, self.steps) or 0
        for item in range(skip, n):
            self.loop_body(0 if item == n - 1 else None)
        self._end()

    def _end(self) -> None:
        self.dropped = self.plan.dropped()
        self.plan.end(completed=True)
        self.left_open = self.done
        self.done, self.size = 0, self.steps

    def _at(self, where: str) -> None:
        if self.hook is not None:
            self.hook(self, where)


def brute_force(
    n: int, steps: int, changes: Mapping[int, int], drop_last: bool
) -> list[tuple[int, int]]:
    """The windows (start, size) of an epoch of ``n``: each window takes the steps in force
    when it starts (a change at boundary b applies from the b-th window on); a trailing
    window shorter than that is kept, or dropped with ``drop_last``."""
    windows: list[tuple[int, int]] = []
    start = 0
    while start < n:
        steps = changes.get(len(windows), steps)
        size = min(steps, n - start)
        if size < steps and drop_last:
            break
        windows.append((start, size))
        start += size
    return windows


class TestBruteForce:
    """The oracle itself, on examples worked by hand."""

    @pytest.mark.parametrize(
        ("n", "steps", "changes", "drop_last", "expected"),
        [
            (13, 4, {}, True, [(0, 4), (4, 4), (8, 4)]),
            (13, 4, {}, False, [(0, 4), (4, 4), (8, 4), (12, 1)]),
            (13, 4, {1: 2}, True, [(0, 4), (4, 2), (6, 2), (8, 2), (10, 2)]),
            (13, 4, {1: 2}, False, [(0, 4), (4, 2), (6, 2), (8, 2), (10, 2), (12, 1)]),
            (9, 2, {2: 6}, True, [(0, 2), (2, 2)]),
            (9, 2, {2: 6}, False, [(0, 2), (2, 2), (4, 5)]),
            (3, 4, {}, True, []),
            (0, 4, {}, False, []),
        ],
    )
    def test_examples(self, n, steps, changes, drop_last, expected) -> None:
        """Windows of the steps in force from each change; drop_last drops the tail."""
        assert brute_force(n, steps, changes, drop_last) == expected


class TestEpochPlanCut:
    @settings(max_examples=800)
    @given(
        n=lengths,
        steps=strategies.steps,
        drop_last=st.booleans(),
        changes=changes,
    )
    def test_sized_epoch_matches_the_brute_force_cut(
        self, n: int, steps: int, drop_last: bool, changes: dict[int, tuple[int, bool]]
    ) -> None:
        """A sized epoch, with steps changed at random window boundaries (between
        windows or at the top of the loop body), is cut into the windows of the brute
        force and trains exactly their microbatches; any window left open at its end is
        one the plan meant to drop (drop_last), never an incomplete one."""
        if not brute_force(n, steps, {}, drop_last):
            with pytest.raises(ConfigError):
                EpochPlan(drop_last).begin(n, steps)
            return
        driver = Driver(steps, drop_last, changes)
        driver.sized_epoch(n)
        assert driver.windows == brute_force(n, steps, driver.applied, drop_last)
        trained = sum(size for _, size in driver.windows)
        assert trained == n or drop_last
        if driver.left_open:
            assert drop_last
            assert driver.dropped
            assert driver.left_open == 1  # only a top change can leave a window to drop

    @settings(max_examples=300)
    @given(
        n=st.integers(min_value=0, max_value=2_000),
        steps=st.integers(min_value=1, max_value=64),
        drop_last=st.booleans(),
    )
    def test_without_a_change_the_arithmetic_holds(
        self, n: int, steps: int, drop_last: bool
    ) -> None:
        """With no steps change a sized epoch makes total_steps(n, steps, 1, drop_last)
        windows and trains trained_microbatches(n, steps, drop_last) microbatches: the
        plan and the step arithmetic agree."""
        if trained_microbatches(n, steps, drop_last) == 0:
            with pytest.raises(ConfigError):
                EpochPlan(drop_last).begin(n, steps)
            return
        driver = Driver(steps, drop_last)
        driver.sized_epoch(n)
        assert len(driver.windows) == total_steps(n, steps, 1, drop_last)
        assert sum(size for _, size in driver.windows) == trained_microbatches(n, steps, drop_last)
        assert driver.left_open == 0

    @settings(max_examples=400)
    @given(
        n=st.integers(min_value=1, max_value=40),
        steps=strategies.steps,
        drop_last=st.booleans(),
        changes=changes,
    )
    def test_unsized_epoch_matches_the_brute_force_cut(
        self, n: int, steps: int, drop_last: bool, changes: dict[int, tuple[int, bool]]
    ) -> None:
        """An unsized epoch on one rank (only the last item known to be last) is cut like
        the brute force; every item is handed out, and under drop_last a trailing partial
        window is left open for the plan to drop; without it the last window ends at the
        last item."""
        driver = Driver(steps, drop_last, changes)
        driver.unsized_epoch(n)
        windows = brute_force(n, steps, driver.applied, drop_last)
        assert driver.windows == windows
        trained = sum(size for _, size in windows)
        assert driver.left_open == n - trained
        if driver.left_open:
            assert drop_last
            assert driver.dropped

    def test_steps_change_at_the_top_of_the_loop_cuts_from_the_handed_out_microbatch(
        self,
    ) -> None:
        """steps set at the top of the loop body, after the next window's first
        microbatch was handed out, cuts the rest of the epoch from that microbatch."""
        driver = Driver(4, drop_last=False, changes={1: (3, True)})
        driver.sized_epoch(13)
        assert driver.windows == [(0, 4), (4, 3), (7, 3), (10, 3)]

    def test_a_top_change_past_the_epoch_drops_the_handed_out_microbatch(self) -> None:
        """Under drop_last, steps raised at the top of the loop body past what is left
        ends the hand-outs; the handed-out microbatch's window is one to drop."""
        driver = Driver(2, drop_last=True, changes={2: (8, True)})
        driver.sized_epoch(7)
        assert driver.windows == [(0, 2), (2, 2)]
        assert driver.left_open == 1
        assert driver.dropped


class TestEpochPlanWindowSize:
    @given(steps=strategies.steps, done=st.integers(0, 5), remaining=st.integers(0, 20))
    def test_sized_by_what_is_left(self, steps: int, done: int, remaining: int) -> None:
        """Without drop_last a window is ``steps``, or what is left of the epoch (the
        microsteps done, the one handed out, and those that follow) when that is less."""
        plan = EpochPlan(drop_last=False)
        size = plan.hand_out(remaining, steps, done)
        assert size == plan.window_size(steps, done)
        assert plan.window_size(steps, done) == min(steps, done + 1 + remaining)

    @given(steps=strategies.steps, done=st.integers(0, 5), remaining=st.integers(0, 20))
    def test_drop_last_windows_are_whole(self, steps: int, done: int, remaining: int) -> None:
        """Under drop_last a window is always ``steps``: a shorter tail is dropped."""
        plan = EpochPlan(drop_last=True)
        size = plan.hand_out(remaining, steps, done)
        assert size == plan.window_size(steps, done)
        assert plan.window_size(steps, done) == steps

    @given(steps=strategies.steps, done=st.integers(0, 5), drop_last=st.booleans())
    def test_unknown_remainder_gives_steps(self, steps: int, done: int, drop_last: bool) -> None:
        """When what follows is unknown the window is ``steps``."""
        plan = EpochPlan(drop_last)
        size = plan.hand_out(None, steps, done)
        assert size == plan.window_size(steps, done)
        assert plan.window_size(steps, done) == steps


class TestEpochPlanTrainedEnd:
    def test_unknown_length(self) -> None:
        """An unsized epoch has no planned end."""
        plan = EpochPlan(drop_last=True)
        plan.begin(None, 4)
        assert plan.trained_end is None

    @given(n=st.integers(1, 60), steps=strategies.steps, cut=st.integers(0, 80))
    def test_from_the_cut(self, n: int, steps: int, cut: int) -> None:
        """The trained microbatches end at the cut plus the whole windows (drop_last) or
        all the microbatches after it, never past the epoch."""
        for drop_last in (False, True):
            plan = EpochPlan(drop_last)
            plan.length = n
            plan.cut(steps, cut)
            start = min(cut, n)
            expected = start + ((n - start) // steps * steps if drop_last else n - start)
            assert plan.trained_end == expected
            assert plan.trained_end <= n


class TestEpochPlanDropped:
    def test_without_drop_last_nothing_is_dropped(self) -> None:
        """Without drop_last a window left open at the end is never meant to be dropped."""
        plan = EpochPlan(drop_last=False)
        plan.begin(None, 4)
        plan.hand_out(None, 4, 0)
        assert not plan.dropped()

    def test_unsized_drop_last_drops_the_tail(self) -> None:
        """An unsized drop_last epoch drops whatever window is left open at its end."""
        plan = EpochPlan(drop_last=True)
        plan.begin(None, 4)
        plan.hand_out(0, 4, 0)
        assert plan.dropped()

    def test_sized_drop_last_drops_only_past_the_trained_end(self) -> None:
        """A sized drop_last epoch drops a window left open only past its trained end;
        one open before it was left incomplete by the loop."""
        plan = EpochPlan(drop_last=True)
        plan.begin(10, 4)
        for _ in range(7):
            plan.hand_out(None, 4, 0)
        assert not plan.dropped()  # 7 of the 8 trained: the loop stopped early
        plan.hand_out(None, 4, 0)
        assert not plan.dropped()  # 8: the end of the trained microbatches
        plan.hand_out(None, 4, 0)
        assert plan.dropped()  # 9: past it (after a steps change at the top)


class TestEpochPlanCheckpointPosition:
    def test_at_the_top_of_the_loop_body_the_pending_microbatch_is_not_counted(self) -> None:
        """At the top of the loop body, between windows, a checkpoint saves the end of
        the last window: the handed-out microbatch is handed out again after a resume."""
        driver = Driver(3, drop_last=False)
        seen: list[tuple[int, int]] = []

        def hook(driver: Driver, where: str) -> None:
            if where == "top":
                seen.append((driver.plan.position, driver.plan.checkpoint_position(0)))

        driver.hook = hook
        driver.sized_epoch(10)
        assert seen == [(1, 0), (4, 3), (7, 6), (10, 9)]

    def test_mid_window_counts_what_was_back_propagated(self) -> None:
        """With an open window (include_grads) the position is the microbatches through
        the last back-propagated one: a pending microbatch is not counted."""
        plan = EpochPlan(drop_last=False)
        plan.begin(10, 4)
        plan.hand_out(9, 4, 0)
        plan.pending = False  # its microstep
        plan.hand_out(8, 4, 0)
        plan.pending = False
        assert plan.checkpoint_position(2) == 2
        plan.hand_out(7, 4, 0)  # the top of the loop body, pending
        assert plan.checkpoint_position(2) == 2

    def test_a_failed_window_is_not_counted(self) -> None:
        """A window that failed (discarded: close_window not called) does not move the
        position: a checkpoint saves the end of the last window that closed."""
        driver = Driver(3, drop_last=False)
        plan = driver.plan
        plan.begin(10, 3)
        for _ in range(3):
            driver.loop_body(10 - plan.position - 1)
        assert plan.checkpoint_position(0) == 3
        driver.hand_out(10 - plan.position - 1)
        plan.pending = False  # the microstep's block raised after entering
        driver.done, driver.size = 0, driver.steps  # the window is discarded
        assert plan.position == 4
        assert plan.checkpoint_position(0) == 3
        driver.hand_out(10 - plan.position - 1)  # the next window, top of the loop body
        assert plan.checkpoint_position(0) == 3

    @given(
        n=st.integers(min_value=1, max_value=30),
        steps=strategies.steps,
        drop_last=st.booleans(),
    )
    def test_between_windows_it_is_the_last_window_end(
        self, n: int, steps: int, drop_last: bool
    ) -> None:
        """After each window closes, the checkpoint position is its end."""
        if drop_last and n < steps:
            return
        ends: list[int] = []

        def hook(driver: Driver, where: str) -> None:
            if where == "between":
                ends.append(driver.plan.checkpoint_position(0))

        driver = Driver(steps, drop_last, hook=hook)
        driver.sized_epoch(n)
        assert ends == [start + size for start, size in driver.windows]


class TestEpochPlanResume:
    @settings(max_examples=400)
    @given(
        n=st.integers(min_value=1, max_value=30),
        steps=strategies.steps,
        drop_last=st.booleans(),
        changes=changes,
    )
    def test_resume_anywhere_continues_the_same_cut(
        self, n: int, steps: int, drop_last: bool, changes: dict[int, tuple[int, bool]]
    ) -> None:
        """A checkpoint taken at any window boundary (between windows or at the top of
        the loop body) or after any microstep of an open window, loaded into a fresh plan
        with the steps in force, resumes with the same remaining windows as the
        uninterrupted epoch (the loop replaying its later steps changes)."""
        if drop_last and n < steps:
            return
        saves: list[tuple[str, int, int, int, int, int]] = []

        def hook(driver: Driver, where: str) -> None:
            position = driver.plan.checkpoint_position(driver.done)
            saves.append((where, driver.boundary, position, driver.steps, driver.done, driver.size))

        uninterrupted = Driver(steps, drop_last, changes, hook=hook)
        uninterrupted.sized_epoch(n)
        for where, boundary, position, saved_steps, done, size in saves:
            replay = {
                b: change
                for b, change in changes.items()
                if b > boundary or (b == boundary and change[1] and where != "mid")
            }
            resumed = Driver(saved_steps, drop_last, replay, offset=boundary)
            resumed.plan.load(position, done)
            resumed.done, resumed.size = done, size  # the restored window
            resumed.sized_epoch(n)
            assert resumed.windows == uninterrupted.windows[boundary:], (where, boundary)
            assert resumed.left_open == uninterrupted.left_open

    def test_load_then_begin_skips_the_position(self) -> None:
        """After load(position, 0) the next epoch skips ``position`` microbatches and
        cuts the rest from there; the one after that starts from 0."""
        plan = EpochPlan(drop_last=True)
        plan.load(5, 0)
        assert plan.begin(13, 4) == 5
        assert (plan.position, plan.closed_at, plan.cut_at) == (5, 5, 5)
        assert plan.trained_end == 13
        plan.end(completed=True)
        assert plan.begin(13, 4) is None  # a fresh epoch
        assert plan.trained_end == 12

    def test_load_mid_window_cuts_from_the_window_start(self) -> None:
        """load(position, done) resumes at ``position`` inside a window that started
        ``done`` microbatches earlier: the cut starts there."""
        plan = EpochPlan(drop_last=True)
        plan.load(6, 2)
        assert plan.begin(13, 4) == 6
        assert (plan.position, plan.closed_at, plan.cut_at) == (6, 4, 4)
        assert plan.checkpoint_position(2) == 6
        assert plan.checkpoint_position(0) == 4

    @given(position=st.integers(0, 40), n=st.integers(0, 40), steps=strategies.steps)
    def test_resume_past_the_end_is_refused(self, position: int, n: int, steps: int) -> None:
        """A loaded position past the epoch's end is refused, naming both; up to the end
        it is accepted (without the guard, which the saved run passed)."""
        plan = EpochPlan(drop_last=True)
        plan.load(position, 0)
        if position > n:
            with pytest.raises(ConfigError) as caught:
                plan.begin(n, steps)
            assert str(caught.value) == (
                f"the loaded state resumes at microbatch {position} of the epoch, past the "
                f"end of this epoch of {n}; pass the same data"
            )
            assert not plan.active
        elif position > 0:
            assert plan.begin(n, steps) == position

    def test_unsized_resume_is_not_checked(self) -> None:
        """An unsized epoch cannot check a loaded position against its length."""
        plan = EpochPlan(drop_last=False)
        plan.load(99, 0)
        assert plan.begin(None, 4) == 99

    @given(
        position=st.integers(1, 40),
        saved=st.integers(1, 40),
        n=st.integers(0, 40),
        done=st.integers(0, 3),
        steps=strategies.steps,
    )
    def test_a_position_in_an_epoch_of_another_length_is_refused(
        self, position: int, saved: int, n: int, done: int, steps: int
    ) -> None:
        """A loaded position saved in an epoch of ``saved`` microbatches resumes only an
        epoch of that length: another is refused, naming both, before anything starts
        (and the loaded state stays for a retry with the right data)."""
        if position > saved or done > position:
            return
        plan = EpochPlan(drop_last=True)
        plan.load(position, done, length=saved)
        if n == saved:
            assert plan.begin(n, steps) == position
            return
        with pytest.raises(ConfigError) as caught:
            plan.begin(n, steps)
        skipped = (  # short by the trained microbatches: an iterable that skipped them
            "an iterable that skips the trained microbatches itself (Accelerate's "
            "skip_first_batches: pass the whole epoch's, the accumulator skips), "
            if n == saved - position
            else ""
        )
        assert str(caught.value) == (
            f"the loaded state resumes at microbatch {position} of an epoch of {saved} "
            f"microbatches (per rank), but this epoch has {n}: {skipped}another batch "
            "size, another dataset, or the data sharded over another number of processes; "
            "resume with the data and batch size the state was saved with (a state saved "
            "between epochs may change them)"
        )
        assert not plan.active
        assert (plan.resume_at, plan.length, plan.checkpoint_length(position)) == (
            position,
            saved,
            saved,
        )
        assert plan.begin(saved, steps) == position

    @given(saved=st.none() | st.integers(1, 40), n=st.integers(1, 40))
    def test_between_epochs_any_length_begins(self, saved: int | None, n: int) -> None:
        """A state saved between epochs (position 0) resumes no position: the next epoch is
        a fresh one, of any length (only the guard applies)."""
        plan = EpochPlan(drop_last=False)
        plan.load(0, 0, epochs_completed=3, length=saved)
        assert plan.begin(n, 4) is None
        assert plan.length == n

    def test_the_length_a_checkpoint_records(self) -> None:
        """A checkpoint records the epoch's length with a position to resume, not at the
        epoch's start (nothing trained yet) nor between epochs, nor an unknown one."""
        plan = EpochPlan(drop_last=True)
        plan.begin(13, 4)
        assert plan.checkpoint_length(0) is None
        plan.hand_out(12, 4, 0)
        assert plan.checkpoint_length(1) == 13
        plan.end(completed=True)
        assert plan.checkpoint_length(0) is None
        plan.begin(None, 4)
        plan.hand_out(None, 4, 0)
        assert plan.checkpoint_length(1) is None

    @pytest.mark.parametrize(
        ("position", "epochs_completed", "resumes"),
        [(0, 0, False), (4, 0, True), (0, 1, True), (4, 2, True)],
    )
    def test_a_resumed_run_until_its_first_hand_out(
        self, position: int, epochs_completed: int, resumes: bool
    ) -> None:
        """A load past the run's start makes the next epoch the first of a resumed run,
        through epochs stopped before their first hand-out, until that hand-out; a fresh
        plan resumes nothing."""
        assert not EpochPlan(drop_last=True).resumes_run
        plan = EpochPlan(drop_last=True)
        plan.load(position, 0, epochs_completed=epochs_completed)
        assert plan.resumes_run is resumes
        plan.begin(13, 4)
        plan.end(completed=False)
        assert plan.resumes_run is resumes
        plan.begin(13, 4)
        plan.hand_out(12, 4, 0)
        assert not plan.resumes_run

    def test_a_checkpoint_says_the_refusal_of_the_run_it_resumes(self) -> None:
        """A checkpoint that resumes a run past its start (a position, an epoch completed, or
        a microbatch handed out) says the refusal of the epoch's iterable (that of the last
        epoch, between epochs), which each begin() sets; one at the run's start, or after a
        load before an epoch began (its iterable not seen yet), says none."""
        plan = EpochPlan(drop_last=True)
        plan.begin(13, 4, refusal="refused")
        assert plan.refused_resume(0) is None  # the epoch's start: a fresh run
        plan.hand_out(12, 4, 0)
        assert plan.refused_resume(0) == "refused"  # at the top of the loop body
        plan.pending = False  # its microstep
        assert (plan.refused_resume(0), plan.refused_resume(1)) == (None, "refused")
        plan.end(completed=True)
        assert plan.refused_resume(0) == "refused"  # between epochs
        plan.begin(13, 4)
        assert plan.refused_resume(0) is None  # an iterable refused by none
        plan.end(completed=False)
        plan.begin(13, 4, refusal="refused")
        plan.end(completed=False)
        plan.load(4, 0, epochs_completed=1)
        assert plan.refused_resume(4) is None


class TestEpochPlanBegin:
    def test_refuses_nesting(self) -> None:
        """A second begin() while an epoch is being iterated is a UsageError; the first
        epoch is untouched."""
        plan = EpochPlan(drop_last=False)
        plan.begin(10, 4)
        plan.hand_out(8, 4, 0)
        with pytest.raises(UsageError) as caught:
            plan.begin(10, 4)
        assert str(caught.value) == (
            "acc.epoch() was started while another acc.epoch() of this accumulator is "
            "still being iterated; epochs do not nest: finish the first, break out of it, "
            "or call its close() before starting the next"
        )
        assert (plan.active, plan.position, plan.length) == (True, 1, 10)

    def test_a_resume_stopped_before_its_first_hand_out_is_kept(self) -> None:
        """An epoch that stops before handing anything out (a refused resume) leaves the
        loaded position for the next begin(); one hand-out ends the resume."""
        plan = EpochPlan(drop_last=True)
        plan.load(4, 0)
        assert plan.begin(13, 4) == 4
        plan.end(completed=False)
        assert plan.begin(13, 4) == 4
        plan.hand_out(8, 4, 0)
        plan.end(completed=False)
        assert plan.begin(13, 4) is None

    def test_a_load_at_position_0_is_a_resume(self) -> None:
        """load(0, done) (a window saved outside an epoch) resumes: begin() returns 0, not
        None, so the restored window is kept rather than discarded as a stale one."""
        plan = EpochPlan(drop_last=False)
        plan.load(0, 1)
        assert plan.begin(10, 4) == 0

    def test_a_break_keeps_the_pending_microbatch_uncounted(self) -> None:
        """A break at the top of the loop body ends the epoch with the microbatch handed
        out but not back-propagated: a checkpoint still does not count it."""
        plan = EpochPlan(drop_last=True)
        plan.begin(10, 2)
        plan.hand_out(8, 2, 0)
        plan.pending = False  # its microstep
        plan.hand_out(7, 2, 1)  # the top of the next loop body
        plan.end(completed=False)
        assert plan.checkpoint_position(window_done=1) == 1

    def test_after_end_a_new_epoch_begins(self) -> None:
        """Once the epoch ended, run out or broken off, the next begins from 0."""
        plan = EpochPlan(drop_last=False)
        plan.begin(10, 4)
        plan.end(completed=False)
        assert plan.begin(10, 4) is None
        assert plan.position == 0

    def test_broken_off_epoch_keeps_its_position(self) -> None:
        """end(completed=False) keeps the position and the last window's end for a
        checkpoint; end(completed=True) starts the next epoch afresh."""
        driver = Driver(2, drop_last=False)
        plan = driver.plan
        plan.begin(10, 2)
        for _ in range(3):
            driver.loop_body(10 - plan.position - 1)
        plan.end(completed=False)
        assert not plan.active
        assert not plan.pending
        assert (plan.position, plan.checkpoint_position(0), plan.length) == (3, 2, 10)
        plan.end(completed=True)
        assert (plan.position, plan.checkpoint_position(0), plan.length) == (0, 0, None)

    def test_the_guard_runs_on_a_fresh_epoch(self) -> None:
        """begin() refuses an epoch that gives no optimizer step, before anything starts."""
        plan = EpochPlan(drop_last=True)
        with pytest.raises(ConfigError, match="gives no optimizer step"):
            plan.begin(3, 4)
        assert not plan.active


class TestCheckEpochLength:
    @given(n=st.integers(0, 100), steps=st.integers(1, 20), drop_last=st.booleans())
    def test_refuses_exactly_the_epochs_without_a_step(
        self, n: int, steps: int, drop_last: bool
    ) -> None:
        """The guard refuses an epoch iff no window of it is trained."""
        refused = not brute_force(n, steps, {}, drop_last)
        if refused:
            with pytest.raises(ConfigError):
                check_epoch_length(n, steps, drop_last, discarded=False)
        else:
            check_epoch_length(n, steps, drop_last, discarded=False)

    @pytest.mark.parametrize("drop_last", [False, True])
    def test_empty(self, drop_last: bool) -> None:
        """An empty epoch says so, whatever drop_last, and what one needs."""
        with pytest.raises(ConfigError) as caught:
            check_epoch_length(0, 4, drop_last, discarded=False)
        least = "steps=4 microbatches (drop_last=True)" if drop_last else "one microbatch"
        assert str(caught.value) == (
            "the epoch's iterable is empty: it gives no optimizer step; pass one with at "
            f"least {least}"
        )

    def test_too_short_for_a_window(self) -> None:
        """An epoch shorter than a window under drop_last names its length, steps, and
        both fixes."""
        with pytest.raises(ConfigError) as caught:
            check_epoch_length(3, 4, True, discarded=False)
        assert str(caught.value) == (
            "the iterable's epoch of 3 microbatches gives no optimizer step with steps=4 "
            "and drop_last=True; lower steps to at most 3, or pass drop_last=False"
        )

    @pytest.mark.parametrize("n", [0, 3])
    def test_discarded_says_so(self, n: int) -> None:
        """After the fact (an unsized epoch) the message adds that the gradient was
        discarded."""
        with pytest.raises(ConfigError) as caught:
            check_epoch_length(n, 4, True, discarded=True)
        assert str(caught.value).endswith(" (its gradient was discarded)")


class TestEpochsCompleted:
    def test_counts_the_epochs_run_to_their_end(self) -> None:
        """An epoch that ran out counts; one broken off does not, nor a resumed one before
        its end; a load sets the count."""
        plan = EpochPlan(drop_last=True)
        plan.begin(8, 4)
        plan.end(completed=True)
        plan.begin(8, 4)
        plan.hand_out(7, 4, 0)
        plan.end(completed=False)
        assert plan.epochs_completed == 1
        plan.load(4, 0, epochs_completed=5)
        assert plan.epochs_completed == 5
        plan.begin(8, 4)
        assert plan.epochs_completed == 5
        plan.end(completed=True)
        assert plan.epochs_completed == 6


class Drawing(Driver):
    """A `Driver` whose epoch comes from an iterable that restores its own position: each
    microbatch is drawn from it right before it is handed out."""

    def hand_out(self, remaining: int | None) -> None:
        self.plan.draw()
        super().hand_out(remaining)

    def sized_epoch(self, n: int) -> None:
        plan = self.plan
        plan.begin(n, self.steps, restores_itself=True)
        while plan.position < (plan.trained_end or 0):
            self.loop_body(n - plan.position - 1)
        self._end()


class TestDrawn:
    @settings(max_examples=300)
    @given(n=lengths, steps=strategies.steps, changes=changes, drop_last=st.booleans())
    def test_a_checkpoint_stands_where_the_iterable_does(
        self, n: int, steps: int, changes: dict[int, tuple[int, bool]], drop_last: bool
    ) -> None:
        """Between windows and mid-window, what a checkpoint saves is what was drawn from an
        iterable that restores its own position; at the top of the loop body one more was
        drawn, and the checkpoint is refused."""
        if n == 0 or (drop_last and n < steps):
            return  # refused by the guard
        seen: list[tuple[str, int | None, int]] = []

        def hook(driver: Driver, where: str) -> None:
            drawn = driver.plan.drawn
            assert drawn is not None
            try:
                seen.append((where, driver.plan.checkpoint_position(driver.done), drawn))
            except UsageError:
                seen.append((where, None, drawn))

        Drawing(steps, drop_last, changes, hook=hook).sized_epoch(n)
        for where, position, drawn in seen:
            assert position == (None if where == "top" else drawn), (where, position, drawn)

    def test_counts_from_the_resumed_position(self) -> None:
        """A resumed epoch of an iterable that restores itself counts from the loaded
        position; another iterable counts nothing; the count ends with the epoch."""
        plan = EpochPlan(drop_last=True)
        plan.load(4, 0)
        plan.begin(13, 4, restores_itself=True)
        assert plan.drawn == 4
        plan.draw()
        assert plan.drawn == 5
        plan.end(completed=True)
        assert plan.drawn is None
        plan.begin(13, 4)
        plan.draw()
        assert plan.drawn is None
        assert plan.checkpoint_position(0) == 0

    def test_the_refusal_names_both_counts(self) -> None:
        """The refusal says how many were drawn and how many are trained on."""
        plan = EpochPlan(drop_last=True)
        plan.begin(13, 4, restores_itself=True)
        for _ in range(5):
            plan.draw()
            plan.hand_out(None, 4, 0)
            plan.pending = False
        plan.closed_at = 4
        with pytest.raises(UsageError) as caught:
            plan.checkpoint_position(0)
        assert "has handed out 5 microbatches of this epoch, but only 4 are trained on" in str(
            caught.value
        )
