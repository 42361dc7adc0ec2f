"""Hand out an epoch's microbatches as the epoch plan cuts them into windows, sizing and
arming each window before its microbatches reach the user's forward.

`run` is the generator behind `Accumulator.epoch`. A sized epoch is handed out by one
generator frame, and inside a window (the window's size settled when it opened, the
microbatch handed out last back-propagated) a hand-out is two attribute writes: the cost
of a generator step. An unsized epoch looks ahead (``drop_last=False``) or, on several
ranks, agrees on each window's length first.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any, NoReturn, TypeVar

from gradaccum import resuming
from gradaccum.block import Microstep
from gradaccum.errors import ConfigError, UsageError, warn
from gradaccum.plan import EpochPlan, check_epoch_length
from gradaccum.window import State

__all__ = ["run"]

T = TypeVar("T")
_END: Any = object()  # an iterator ran out


def run(started: Microstep, iterable: Iterable[T]) -> Iterator[T]:
    """The epoch of ``iterable``, for the accumulator whose block is ``started``: planned at
    the first ``next()``, resumed after a load, ended (its open window dropped, the guard
    applied) when it runs out."""
    started.life.check("epoch()")
    plan, window, ranks, counts = started.plan, started.window, started.ranks, started.counts
    n = _length(iterable)
    if n is not None:
        n = ranks.agree(
            n,
            "the ranks' epochs have between {least} and {most} microbatches; every "
            "rank trains on the first {least}",
        )
    restores_itself = resuming.restores_own_position(iterable)
    order = resuming.global_order(iterable, n, ranks.count)
    refusal = resuming.workers_seed_refusal(iterable)
    resume = plan.begin(
        n, counts.steps, restores_itself=restores_itself, order=order, refusal=refusal
    )
    started_at = counts.global_step
    completed = False
    try:
        if window.is_open and resume is None:
            warn(
                f"discarding the {window.done} microsteps of a window left open by the "
                "previous epoch: windows never span epochs"
            )
            started.drop_window()
        iterator = resuming.resumed(
            iterable, resume or 0, resumes_run=plan.resumes_run, handed_out=plan.handed_out
        )
        if restores_itself:
            iterator = _counted(plan, iterator)
        if n is None:
            yield from (_agreed if ranks.count > 1 else _look_ahead)(started, iterator)
        elif plan.position < (plan.trained_end or 0):
            # The sized epoch, inline: one generator frame per hand-out. Inside a window,
            # once the epoch's first hand-out ran the plan's way and while the loop
            # back-propagates what it is handed, the window's size is settled.
            settled = False
            for item in iterator:
                if settled and window.done and not plan.pending:
                    plan.take()
                else:
                    _hand_out(started, n - plan.position - 1)
                    settled = True
                yield item
                if plan.position >= (plan.trained_end or 0):
                    break
            else:
                msg = f"the iterable ended after {plan.position} items; its len() promised {n}"
                raise ConfigError(msg)
        if n is not None and not _quiet_at_end(iterable):
            # Its dropped remainder drawn, and one more, so that what runs at its end
            # (Accelerate's prepared loader advances its epoch there) runs.
            for _ in itertools.islice(iterator, n - plan.position + 1):
                pass
        completed = True
    finally:
        if not completed:
            plan.end(completed=False)
            started.unplanned_window()
    _end(started, guard=n is None and not resume and counts.global_step == started_at)


def _counted(plan: EpochPlan, iterator: Iterator[T]) -> Iterator[T]:
    """``iterator``, counting what is drawn from it in the plan: the position of an
    iterable that restores its own position, which a checkpoint must match."""
    for item in iterator:
        plan.draw()
        yield item


def _look_ahead(started: Microstep, iterator: Iterator[T]) -> Iterator[T]:
    """An unsized epoch on one rank; without ``drop_last`` one item ahead, so that the
    last is known to be last (with it, a trailing window is dropped whatever its size)."""
    if started.options.drop_last:
        for item in iterator:
            _hand_out(started, None)
            yield item
        return
    held = next(iterator, _END)
    while held is not _END:
        following = next(iterator, _END)
        _hand_out(started, None if following is not _END else 0)
        yield held
        held = following


def _agreed(started: Microstep, iterator: Iterator[T]) -> Iterator[T]:
    """An unsized epoch on several ranks: what the open window still needs is drawn
    first, and the ranks agree on how much they drew (one all-reduce per window), so
    that none waits forever; every rank stops where the shortest did. Without
    ``drop_last`` one more is drawn, so that the epoch's last microbatch is known to be
    last before its forward."""
    window, drop_last = started.window, started.options.drop_last
    ready: deque[T] = deque()
    ended = False
    ahead = 0 if drop_last else 1
    while True:
        need = window.size - window.done
        if len(ready) < need + ahead and not ended:
            wanted = need + ahead - len(ready)
            drawn = list(itertools.islice(iterator, wanted))
            count = started.ranks.agree(
                len(drawn),
                "the ranks' iterables ended at different points; every rank stops where "
                "the shortest did",
            )
            ready.extend(drawn[:count])
            ended = count < wanted
        if not ready or (ended and drop_last and len(ready) < need):
            return  # the epoch's end, or a trailing partial window that is dropped
        item = ready.popleft()
        _hand_out(started, len(ready) if ended else None)
        yield item


def _hand_out(started: Microstep, remaining: int | None) -> None:
    """Size the window before a microbatch reaches the user's forward, and arm its sync
    when that changed the size (otherwise the last block's exit armed it already).

    Raises:
        UsageError: On several ranks, the microbatch handed out before was not
            back-propagated (`_skipped`).
    """
    window, plan = started.window, started.plan
    if plan.pending and started.ranks.count > 1 and started.life.state is State.OPEN:
        _skipped(started)  # (a broken accumulator refuses its microsteps already)
    size = plan.hand_out(remaining, started.counts.steps, window.done)
    if size != window.size:
        window.resize(size)
        started.arm()


def _skipped(started: Microstep) -> NoReturn:
    """Refuse, on several ranks, a microbatch that was handed out and not back-propagated:
    this rank's windows would no longer line up with the others' (their all-reduces would
    pair different windows, and the next collective another one). The refusal is this
    rank's failure, which the other ranks name (`gradaccum.block.fail`). On one process the
    window just takes the next microbatch."""
    position, count = started.plan.position, started.ranks.count
    msg = (
        f"the epoch's microbatch {position} (counting from 1) was handed out but not "
        "back-propagated (a `continue`, or an error caught in the loop body, before its `with "
        f"acc.microstep(loss):` block): on {count} ranks every rank back-propagates every "
        "microbatch it is handed, or the ranks' windows no longer line up; to leave a "
        "microbatch out, back-propagate its loss times 0 instead"
    )
    error = UsageError(msg)
    started.fail(error)
    raise error


def _end(started: Microstep, *, guard: bool) -> None:
    """The epoch ran out: drop a window it left open, and apply the guard (``guard``: an
    unsized epoch, run from its start, that closed no window)."""
    plan, window = started.plan, started.window
    position, dropped = plan.position, plan.dropped()
    plan.end(completed=True)
    if window.is_open:
        if not dropped:
            warn(
                f"discarding the {window.done} microsteps of an incomplete window at the "
                "end of the epoch: call acc.microstep() once for every microbatch"
            )
        started.drop_window()
    started.unplanned_window()
    if guard:
        check_epoch_length(
            position,
            started.counts.steps,
            started.options.drop_last,
            discarded=started.ranks.count == 1,
        )


# A DataLoader's iterator does nothing at its end, and torchdata's StatefulDataLoader's state
# is taken as standing in its epoch (docs/semantics.md): their dropped remainder is not loaded.
_QUIET_AT_END = frozenset(
    {
        "torch.utils.data.dataloader.DataLoader",
        "torchdata.stateful_dataloader.stateful_dataloader.StatefulDataLoader",
    }
)


def _quiet_at_end(iterable: object) -> bool:
    """``iterable``'s iteration need not run to its end: a plain or torchdata DataLoader,
    whose iterator runs no code at its end, or a sequence. Another sized iterable, such as
    Accelerate's prepared loader (which advances its epoch, and so its seedable sampler's
    order, after its last batch) or a generator of one's own, is run to its end."""
    kind = type(iterable)
    return f"{kind.__module__}.{kind.__qualname__}" in _QUIET_AT_END or isinstance(
        iterable, Sequence
    )


def _length(iterable: Iterable[Any]) -> int | None:
    if not isinstance(iterable, Sized):
        return None
    try:
        return len(iterable)
    except TypeError:  # a DataLoader over an IterableDataset has __len__ but may raise
        return None
