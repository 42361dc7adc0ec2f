"""The epoch plan: which microbatches of an epoch are trained and how they are cut into
windows (integers only, no torch).

Windows of ``steps`` are cut from the epoch's start, and cut again from the next
window's start when ``steps`` changes, a window fails, or a checkpoint resumes, so each
re-plans only the rest of the epoch. The epoch's iterator asks the plan before each
hand-out.
"""

from __future__ import annotations

from gradaccum.errors import ConfigError, UsageError
from gradaccum.order import GlobalOrder, Rescale
from gradaccum.schedule import trained_microbatches

__all__ = ["EpochPlan", "check_epoch_length", "resumes_run"]


class EpochPlan:
    """Where the current epoch stands.

    Attributes:
        drop_last: Each epoch's trailing microbatches that do not fill a window are not
            trained on (else they form one shorter window).
        length: The current epoch's (agreed) length, when it is known; after a load, that
            of the epoch the loaded position lies in, when saved.
        position: Microbatches of the current epoch handed out; after a load, where the
            next epoch resumes.
        closed_at: Microbatches of the current epoch up to the end of the last window that
            closed (applied or skipped): where the next window starts. A window that failed
            does not move it, so its microbatches are not counted as trained.
        cut_at: Where the current cut of the epoch into windows starts: the epoch's (or
            the resumed window's) start, or the window start at the last ``steps`` change.
        trained_end: Where the trained microbatches of a sized epoch end, with the current
            cut; None when the length is unknown.
        pending: The microbatch handed out last has not reached a microstep yet.
        remaining: How many microbatches follow the one handed out last, when known.
        active: An epoch is being iterated.
        resume_at: Where the next epoch resumes (set by a load), or None: from its start;
            kept by an epoch that stopped before its first hand-out (a refused resume).
        drawn: Microbatches of the current epoch drawn from an iterable that restores its
            own position, which its state saves; None for another iterable.
        epochs_completed: Epochs run to their end (set by a load).
        resumes_run: The next epoch is the first of a run resumed past its start (set by a
            load; kept, like ``resume_at``, by an epoch that stopped before its first
            hand-out).
        handed_out: The next epoch resumes a state saved with a microbatch handed out and
            not yet back-propagated (at the top of the loop body; set by a load, kept like
            ``resume_at``): it is drawn again with the trained ones.
        order: The global order of the current epoch's samples over the ranks (between
            epochs: of the last epoch run; after a load on the saved world size, the
            saved one), or None where it is not known.
        by_items: The last window closed passed ``num_items``; None: none closed yet.
        rescale: A state saved on another number of ranks was loaded: what the next epoch
            is checked against before it resumes (kept, like ``resume_at``, until its first
            hand-out).
        refusal: Why a run resumed past its start over the current epoch's iterable (between
            epochs: the last epoch's) would be refused at its first epoch, with the fix
            (`gradaccum.resuming.workers_seed_refusal`), or None: it would not, or no epoch
            began since the accumulator was made or a state was loaded. Set, like
            ``order``, by each `begin` that starts an epoch; cleared by `load`.
    """

    __slots__ = (
        "active",
        "by_items",
        "closed_at",
        "cut_at",
        "drawn",
        "drop_last",
        "epochs_completed",
        "handed_out",
        "length",
        "order",
        "pending",
        "position",
        "refusal",
        "remaining",
        "rescale",
        "resume_at",
        "resumes_run",
        "trained_end",
    )

    def __init__(self, drop_last: bool) -> None:
        self.drop_last = drop_last
        self.length: int | None = None
        self.position = self.closed_at = self.cut_at = 0
        self.resume_at: int | None = None
        self.pending = False
        self.remaining: int | None = None
        self.trained_end: int | None = None
        self.active = False
        self.drawn: int | None = None
        self.epochs_completed = 0
        self.resumes_run = self.handed_out = False
        self.order: GlobalOrder | None = None
        self.by_items: bool | None = None
        self.rescale: Rescale | None = None
        self.refusal: str | None = None

    def begin(
        self,
        length: int | None,
        steps: int,
        *,
        restores_itself: bool = False,
        order: GlobalOrder | None = None,
        refusal: str | None = None,
    ) -> int | None:
        """Start an epoch of ``length`` microbatches (None: unknown); return the loaded
        position it resumes at (the microbatches to skip), or None for a fresh epoch.
        With ``restores_itself`` the iterable resumes there by itself: the microbatches
        drawn from it are counted from there. ``order`` is the epoch's global order, when
        known; ``refusal`` why a run resumed over its iterable would be refused, if so.

        Raises:
            UsageError: Another epoch of this accumulator is being iterated.
            ConfigError: The epoch gives no optimizer step, a loaded position lies in an
                epoch of another length (when saved) or past this one's end, or a state
                loaded from another number of ranks would not continue exactly
                (`Rescale.check`).
        """
        if self.active:
            msg = (
                "acc.epoch() was started while another acc.epoch() of this accumulator is "
                "still being iterated; epochs do not nest: finish the first, break out of "
                "it, or call its close() before starting the next"
            )
            raise UsageError(msg)
        if self.rescale is not None:
            self.rescale.check(order, steps, self.drop_last, restores_itself=restores_itself)
        resume = self.resume_at
        skip = resume or 0
        if length is not None:
            if skip == 0:  # the whole epoch is ahead: the guard applies
                check_epoch_length(length, steps, self.drop_last, discarded=False)
            elif self.length is not None and self.length != length:
                skipped = (
                    "an iterable that skips the trained microbatches itself (Accelerate's "
                    "skip_first_batches: pass the whole epoch's, the accumulator skips), "
                    if length == self.length - skip
                    else ""
                )
                msg = (
                    f"the loaded state resumes at microbatch {skip} of an epoch of "
                    f"{self.length} microbatches (per rank), but this epoch has {length}: "
                    f"{skipped}another batch size, another dataset, or the data sharded over "
                    "another number of processes; resume with the data and batch size the "
                    "state was saved with (a state saved between epochs may change them)"
                )
                raise ConfigError(msg)
            elif skip > length:
                msg = (
                    f"the loaded state resumes at microbatch {skip} of the epoch, past the "
                    f"end of this epoch of {length}; pass the same data"
                )
                raise ConfigError(msg)
        self.length = length
        self.order, self.refusal = order, refusal
        self.position = skip
        if resume is None:
            self.closed_at = 0
        self.cut(steps, self.closed_at)
        self.pending = False
        self.remaining = None
        self.drawn = skip if restores_itself else None
        self.active = True
        return resume

    def end(self, completed: bool) -> None:
        """The epoch's iteration stopped: it ran out (``completed``) or was broken off, in
        which case its position stays for a checkpoint (a microbatch handed out but not
        back-propagated stays uncounted)."""
        self.active = False
        if completed:
            self.epochs_completed += 1
            # (a resume ends with its epoch, also one that had nothing left to hand out)
            self.resume_at = self.drawn = self.rescale = None
            self.resumes_run = self.handed_out = self.pending = False
            self.length = self.trained_end = None
            self.position = self.closed_at = self.cut_at = 0

    def cut(self, steps: int, at: int) -> None:
        """Cut the rest of the epoch into windows of ``steps`` from microbatch ``at``."""
        self.cut_at = at
        if self.length is None:
            self.trained_end = None
        else:
            start = min(at, self.length)
            self.trained_end = start + trained_microbatches(
                self.length - start, steps, self.drop_last
            )

    def recut(self, steps: int) -> None:
        """``steps`` changed between windows, or a window failed: cut the rest of the epoch
        from the next window's start (before a microbatch handed out already, at the top
        of the loop body)."""
        self.cut(steps, self.position - self.pending)
        self._restored_window_ended()

    def hand_out(self, remaining: int | None, steps: int, done: int) -> int:
        """One more microbatch reaches the user, ``done`` microsteps into its window, and
        ``remaining`` follow it, when known; return the size of its window."""
        if self.resumes_run or self.resume_at is not None or self.rescale is not None:
            # The resume is under way (until then a new begin() resumes).
            self.resume_at, self.resumes_run, self.rescale = None, False, None
            self.handed_out = False
        self.position += 1
        self.pending = True
        self.remaining = remaining
        return self.window_size(steps, done)

    def take(self) -> None:
        """Another microbatch of the open window reaches the user: its size is settled."""
        self.position += 1
        self.pending = True

    def window_size(self, steps: int, done: int) -> int:
        """The size of the window that the microbatch handed out last belongs to, ``done``
        microsteps into it: ``steps``, or fewer where the epoch ends before (unless the
        trailing partial window is dropped)."""
        if self.drop_last or self.remaining is None:
            return steps
        return min(steps, done + 1 + self.remaining)

    def next_window_size(self, steps: int) -> int:
        """The size of the window that opens next, with ``steps``: that of the microbatch
        handed out last when it awaits its microstep in the epoch (``steps`` set at the
        top of the loop body), else ``steps``."""
        return self.window_size(steps, 0) if self.active and self.pending else steps

    def dropped(self) -> bool:
        """A window left open at the epoch's end was meant to be dropped (the trailing
        partial window of a ``drop_last`` epoch), rather than left incomplete by the loop."""
        end = self.trained_end
        return self.drop_last and (end is None or self.position > end)

    def draw(self) -> None:
        """One more microbatch was drawn from an iterable that restores its own position."""
        if self.drawn is not None:
            self.drawn += 1

    def checkpoint_position(self, window_done: int) -> int:
        """The position a checkpoint saves: the microbatches trained on, those of an open
        window (``window_done`` > 0) included; a microbatch handed out but not yet
        back-propagated is handed out again after the resume.

        Raises:
            UsageError: The epoch's iterable restores its own position and has handed out
                more: its state, saved now, would not hand those out again.
        """
        position = self.position - self.pending if window_done else self.closed_at
        if self.drawn is not None and self.drawn != position:
            msg = (
                f"the epoch's iterable restores its own position (it has state_dict and "
                f"load_state_dict) and has handed out {self.drawn} microbatches of this "
                f"epoch, but only {position} are trained on: the others were handed out "
                "before their microstep (at the top of the loop body), drawn ahead to find "
                "the epoch's end (drop_last=False without len), or in a window that failed. "
                "Its state would not hand them out again; checkpoint after the `with` block "
                "of a window's last microstep"
            )
            raise UsageError(msg)
        return position

    def refused_resume(self, position: int) -> str | None:
        """Why a run resumed from a checkpoint at ``position`` saved now would be refused at
        its first epoch over an iterable like this epoch's (`refusal`, where the checkpoint
        resumes a run past its start: `resumes_run`), or None."""
        if resumes_run(position, self.epochs_completed, self.pending):
            return self.refusal
        return None

    def checkpoint_length(self, position: int) -> int | None:
        """The epoch length a checkpoint at ``position`` records: this epoch's, where it
        resumes a position (between epochs the next epoch is a fresh one, of any length)."""
        return self.length if position else None

    def close_window(self, by_items: bool) -> None:
        """A window closed (applied or skipped; ``by_items``: it passed ``num_items``): the
        next starts after its microbatches."""
        self.closed_at = self.position - self.pending
        self.by_items = by_items
        self._restored_window_ended()

    def _restored_window_ended(self) -> None:
        # A load at an epoch's start resumes only to carry its open window into the next
        # epoch; once that window closed or failed, the next epoch is a fresh one.
        if self.resume_at == 0:
            self.resume_at = None

    def load(
        self,
        position: int,
        window_done: int,
        *,
        epochs_completed: int = 0,
        length: int | None = None,
        order: GlobalOrder | None = None,
        by_items: bool | None = None,
        handed_out: bool = False,
        rescale: Rescale | None = None,
    ) -> None:
        """Resume at ``position`` of an epoch of ``length`` microbatches (None: not known),
        ``window_done`` microsteps into a window, after ``epochs_completed`` epochs: the next
        epoch skips that many microbatches, and must have that length (a state at an
        epoch's start without an open window resumes nothing: the next epoch is a fresh
        one, of any length). ``order`` and ``by_items`` are as saved; ``handed_out``: saved
        with a microbatch handed out, not back-propagated (at an epoch's first too, where
        the next epoch is otherwise a fresh one); ``rescale``: the state was saved on
        another number of ranks (``position`` counts these ranks' microbatches)."""
        self.epochs_completed = epochs_completed
        self.order, self.by_items, self.rescale = order, by_items, rescale
        self.refusal = None
        self.resumes_run = resumes_run(position, epochs_completed, handed_out)
        self.handed_out = handed_out
        self.length = length
        self.drawn = None
        self.position = position
        self.resume_at = position if position or window_done else None
        self.closed_at = self.cut_at = max(0, position - window_done)  # (outside an epoch: 0)
        self.pending = False
        self.remaining = None


def resumes_run(position: int, epochs_completed: int, handed_out: bool) -> bool:
    """A state saved at ``position`` after ``epochs_completed`` epochs (``handed_out``: with a
    microbatch handed out, not back-propagated) resumes a run past its start, where its
    first epoch refuses what only a run from the start may do
    (`gradaccum.resuming.check_workers_seed`)."""
    return bool(position or epochs_completed or handed_out)


def check_epoch_length(n: int, steps: int, drop_last: bool, *, discarded: bool) -> None:
    """The guard: an epoch of ``n`` microbatches that gives no optimizer step is refused.

    Raises:
        ConfigError: No window fits (``discarded``: its gradient was already discarded).
    """
    if trained_microbatches(n, steps, drop_last) > 0:
        return
    if n == 0:
        least = f"steps={steps} microbatches (drop_last=True)" if drop_last else "one microbatch"
        msg = (
            "the epoch's iterable is empty: it gives no optimizer step; pass one with at "
            f"least {least}"
        )
    else:
        msg = (
            f"the iterable's epoch of {n} microbatches gives no optimizer step with "
            f"steps={steps} and drop_last=True; lower steps to at most {n}, or pass "
            "drop_last=False"
        )
    if discarded:
        msg += " (its gradient was discarded)"
    raise ConfigError(msg)
