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
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from gradaccum import block, resuming
from gradaccum.errors import ConfigError, UsageError, warn
from gradaccum.plan import check_epoch_length
from gradaccum.window import State

if TYPE_CHECKING:
    from gradaccum.accumulator import Accumulator

__all__ = ["run", "unplanned_window"]

T = TypeVar("T")
_END: Any = object()  # an iterator ran out


def run(acc: Accumulator, iterable: Iterable[T]) -> Iterator[T]:
    """The epoch of ``iterable``: planned at the first ``next()``, resumed after a load,
    ended (its open window dropped, the guard applied) when it runs out."""
    acc._life.check("epoch()")
    plan, window, ranks = acc._plan, acc._window, acc._ranks
    n = _length(iterable)
    if n is not None:
        n = ranks.agree(
            n,
            "the ranks' epochs have between {least} and {most} microbatches; every "
            "rank trains on the first {least}",
        )
    restores_itself = resuming.restores_own_position(iterable)
    order = resuming.global_order(iterable, n, ranks.count)
    resume = plan.begin(n, acc._steps, restores_itself=restores_itself, order=order)
    started_at = acc._global_step
    completed = False
    try:
        if window.is_open and resume is None:
            warn(
                f"discarding the {window.done} microsteps of a window left open by the "
                "previous epoch: windows never span epochs"
            )
            block.clear_window(acc)
        iterator = resuming.resumed(
            iterable, resume or 0, resumes_run=plan.resumes_run, handed_out=plan.handed_out
        )
        if restores_itself:
            iterator = _counted(acc, iterator)
        if n is None:
            yield from (_agreed if ranks.count > 1 else _look_ahead)(acc, iterator)
        elif plan.position < (plan.trained_end or 0):
            # The sized epoch, inline: one generator frame per hand-out. Inside a window,
            # once the epoch's first hand-out ran the plan's way and while the loop
            # back-propagates what it is handed, the window's size is settled.
            settled = False
            for item in iterator:
                if settled and window.done and not plan.pending:
                    plan.position += 1
                    plan.pending = True
                else:
                    _hand_out(acc, n - plan.position - 1)
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
            unplanned_window(acc)
    _end(acc, guard=n is None and not resume and acc._global_step == started_at)


def _counted(acc: Accumulator, iterator: Iterator[T]) -> Iterator[T]:
    """``iterator``, counting what is drawn from it in the plan: the position of an
    iterable that restores its own position, which a checkpoint must match."""
    for item in iterator:
        acc._plan.draw()
        yield item


def _look_ahead(acc: Accumulator, iterator: Iterator[T]) -> Iterator[T]:
    """An unsized epoch on one rank; without ``drop_last`` one item ahead, so that the
    last is known to be last (with it, a trailing window is dropped whatever its size)."""
    if acc._options.drop_last:
        for item in iterator:
            _hand_out(acc, None)
            yield item
        return
    held = next(iterator, _END)
    while held is not _END:
        following = next(iterator, _END)
        _hand_out(acc, None if following is not _END else 0)
        yield held
        held = following


def _agreed(acc: Accumulator, iterator: Iterator[T]) -> Iterator[T]:
    """An unsized epoch on several ranks: what the open window still needs is drawn
    first, and the ranks agree on how much they drew (one all-reduce per window), so
    that none waits forever; every rank stops where the shortest did. Without
    ``drop_last`` one more is drawn, so that the epoch's last microbatch is known to be
    last before its forward."""
    window, drop_last = acc._window, acc._options.drop_last
    ready: deque[T] = deque()
    ended = False
    ahead = 0 if drop_last else 1
    while True:
        need = window.size - window.done
        if len(ready) < need + ahead and not ended:
            wanted = need + ahead - len(ready)
            drawn = list(itertools.islice(iterator, wanted))
            count = acc._ranks.agree(
                len(drawn),
                "the ranks' iterables ended at different points; every rank stops where "
                "the shortest did",
            )
            ready.extend(drawn[:count])
            ended = count < wanted
        if not ready or (ended and drop_last and len(ready) < need):
            return  # the epoch's end, or a trailing partial window that is dropped
        item = ready.popleft()
        _hand_out(acc, len(ready) if ended else None)
        yield item


def _hand_out(acc: Accumulator, remaining: int | None) -> None:
    """Size the window before a microbatch reaches the user's forward, and arm its sync
    when that changed the size (otherwise the last block's exit armed it already).

    Raises:
        UsageError: On several ranks, the microbatch handed out before was not
            back-propagated (`_skipped`).
    """
    window, plan = acc._window, acc._plan
    if plan.pending and acc._ranks.count > 1 and acc._life.state is State.OPEN:
        _skipped(acc)  # (a broken accumulator refuses its microsteps already)
    size = plan.hand_out(remaining, acc._steps, window.done)
    if size != window.size:
        window.resize(size)
        acc._block.arm()


def _skipped(acc: Accumulator) -> NoReturn:
    """Refuse, on several ranks, a microbatch that was handed out and not back-propagated:
    this rank's windows would no longer line up with the others' (their all-reduces would
    pair different windows, and the next collective another one). The refusal is this
    rank's failure, which the other ranks name (`gradaccum.block.fail`). On one process the
    window just takes the next microbatch."""
    position, count = acc._plan.position, acc._ranks.count
    msg = (
        f"the epoch's microbatch {position} (counting from 1) was handed out but not "
        "back-propagated (a `continue`, or an error caught in the loop body, before its `with "
        f"acc.microstep(loss):` block): on {count} ranks every rank back-propagates every "
        "microbatch it is handed, or the ranks' windows no longer line up; to leave a "
        "microbatch out, back-propagate its loss times 0 instead"
    )
    error = UsageError(msg)
    block.fail(acc, error)
    raise error


def _end(acc: Accumulator, *, guard: bool) -> None:
    """The epoch ran out: drop a window it left open, and apply the guard (``guard``: an
    unsized epoch, run from its start, that closed no window)."""
    plan, window = acc._plan, acc._window
    position, dropped = plan.position, plan.dropped()
    plan.end(completed=True)
    if window.is_open:
        if not dropped:
            warn(
                f"discarding the {window.done} microsteps of an incomplete window at the "
                "end of the epoch: call acc.microstep() once for every microbatch"
            )
        block.clear_window(acc)
    unplanned_window(acc)
    if guard:
        check_epoch_length(
            position, acc._steps, acc._options.drop_last, discarded=acc._ranks.count == 1
        )


def unplanned_window(acc: Accumulator) -> None:
    """Outside an epoch, a window that has not started takes ``steps`` microsteps: a
    trailing window's size, planned for the epoch, does not carry over."""
    if not acc._window.is_open:
        acc._window.reset(acc._steps)
        acc._block.arm()


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
