"""`Accumulator.step`: one window from one per-rank batch. The batch is cut into
microbatches (`gradaccum.cutting`), each one's loss comes from the user's ``loss_fn`` and
runs through the block (`gradaccum.block.Microstep`) exactly as ``with acc.microstep(loss):``
does: its backward, the boundary and the step are the block's.

Under ``microbatch="auto"`` (`gradaccum.fitting.Fit`) an out-of-memory error in a forward or
a backward discards the window on every rank (the gradients put back as they were) and
re-runs the same samples with half the microbatch. On several ranks they agree once per
window, after the last microbatch's forward and before its backward, the first that
communicates (the wrappings where an earlier one does are refused up front,
`gradaccum.checks.refuse_auto`): one all-reduce of two integers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradaccum import cutting, fitting, memory
from gradaccum.block import Microstep
from gradaccum.checks import check_num_items
from gradaccum.errors import ConfigError, ConfigTypeError, OutOfMemoryError, UsageError, describe
from gradaccum.step import Step
from gradaccum.window import State

__all__ = ["run"]

LossFn = Callable[[nn.Module, Any], Any]


def run(started: Microstep, model: nn.Module, batch: object, loss_fn: LossFn) -> Step:
    """What `Accumulator.step` does: the window's `Step` (its boundary's)."""
    _check_call(started, loss_fn)
    rows = cutting.rows(batch)
    fit = started.fit
    size = fit.size_for(rows)
    kept = memory.Kept(started.params.now()) if fit.auto else None
    while True:
        done = _attempt(started, model, batch, rows, size, loss_fn, kept is not None)
        if not isinstance(done[0], Step):  # ran out of memory, on this rank or another one
            agreed, rank = done
            number = started.counts.global_step + 1
            started.discard_window()
            kept.restore()  # type: ignore[union-attr]  # (only under "auto" does a try return)
            memory.release()
            if agreed == 0:
                raise _no_row_fits(rank, number)
            fit.shrink(agreed)
            size = agreed
            continue
        step, agreed = done
        fit.fitted(agreed)
        step.microbatch = size
        return step


def _check_call(started: Microstep, loss_fn: object) -> None:
    """Refuse the call before any work: the accumulator takes no calls, a window of the
    ``with`` form is open, ``steps`` is not 1, or ``loss_fn`` is not callable."""
    started.life.check("step()")
    if started.busy:
        started.refuse()
    window = started.window
    if window.is_open:
        msg = (
            f"acc.step() was called inside a window of acc.microstep() ({window.progress()}); "
            "finish that window (its last `with acc.microstep(loss):` block) first: a call "
            "of acc.step() is a whole window"
        )
        raise UsageError(msg)
    steps = started.counts.steps
    if steps != 1:
        msg = (
            f"acc.step() runs one window per call, but the Accumulator has steps={steps} "
            "(microbatches handed out per window); construct it with steps=1 (the default) "
            "and give it microbatch=<rows> or 'auto': the batch passed to acc.step() is the "
            "window, cut into microbatches of that many rows"
        )
        raise UsageError(msg)
    if not callable(loss_fn):
        msg = (
            f"loss_fn must be a callable loss_fn(model, microbatch) returning the "
            f"microbatch's mean loss or a (loss_sum, num_items) pair, got {describe(loss_fn)}"
        )
        raise ConfigTypeError(msg)


def _attempt(
    started: Microstep,
    model: nn.Module,
    batch: object,
    rows: int,
    size: int,
    loss_fn: LossFn,
    retry: bool,
) -> tuple[Step, int] | tuple[int, int | None]:
    """One try at the window with microbatches of ``size`` rows: the boundary's `Step` and
    the microbatch agreed over the ranks; or, after an out-of-memory error here or on
    another rank (only with ``retry``), the size every rank tries next (0: none fits) and the
    rank that ran out. The window is left for the caller to discard then."""
    pieces = cutting.cut(batch, rows, size)
    count = len(pieces)
    started.size_window(count)
    several = started.ranks.count > 1
    agree = retry and several
    spare = memory.out_of_memory if retry else None
    by_items: bool | None = None
    for index, (piece, taken) in enumerate(pieces):
        last = index == count - 1
        try:
            returned = loss_fn(model, piece)
        except BaseException as error:
            if spare is not None and spare(error):
                break
            failed = _fail(started, error)
            if failed is None:
                raise
            raise failed from error
        try:
            loss, items = _loss(returned, index, by_items)
        except BaseException as error:
            failed = _fail(started, error)
            if failed is None:
                raise
            raise failed from error
        by_items = items is not None
        if not by_items and taken * count != rows:
            # Unequal microbatches' means weigh by their rows: the block divides by count.
            loss = loss * (taken * count / rows)
        returned = None
        agreed = size
        if last and agree:
            agreed, rank = _agree(started, size, out_of_memory=False)
            if rank is not None:
                return agreed, rank
        started.hand(loss, items)
        del loss  # (the block holds the graph until its backward frees it)
        try:
            with started.sparing(spare):
                step = started.__enter__()  # the backward; on the last, the boundary
        except BaseException as error:
            if spare is None or not spare(error):
                raise  # the block failed the window
            if last and several:
                failed = _boundary_ran_out(started, size)
                raise failed from error
            break
        started.__exit__(None, None, None)  # on the last microstep, the step
        if last:
            return step, agreed
    # Ran out of memory on this rank.
    if agree:
        return _agree(started, size, out_of_memory=True)
    return size // 2, started.ranks.rank


def _loss(
    returned: object, index: int, by_items: bool | None
) -> tuple[torch.Tensor, int | torch.Tensor | None]:
    """The loss (and item count) that ``loss_fn`` returned for microbatch ``index``,
    checked; ``by_items``: whether the earlier microbatches' returned items (None: first)."""
    items: int | torch.Tensor | None = None
    if isinstance(returned, (tuple, list)) and len(returned) == 2:
        loss, counted = returned
        items = check_num_items(counted)
    else:
        loss = returned
    accepted = (
        "loss_fn(model, microbatch) must return the microbatch's mean loss (a 0-dim tensor "
        "that requires grad) or a (loss_sum, num_items) pair"
    )
    if not isinstance(loss, torch.Tensor):
        msg = f"{accepted}, got {describe(returned)} for microbatch {index + 1}"
        raise ConfigTypeError(msg)
    if loss.dim() != 0 or not loss.requires_grad:
        what = f"shape {tuple(loss.shape)}" if loss.dim() else "a tensor that does not require grad"
        msg = (
            f"{accepted}, got a loss of {what} for microbatch {index + 1}; reduce it with "
            ".mean() (or .sum() with its item count), computed from the model's output "
            "outside torch.no_grad()"
        )
        raise ConfigError(msg)
    if by_items is not None and by_items is not (items is not None):
        forms = ("a (loss_sum, num_items) pair", "a mean loss")
        first, now = forms if by_items else forms[::-1]
        msg = (
            f"loss_fn returned {first} for the first microbatch but {now} for microbatch "
            f"{index + 1}; return the same form for every microbatch"
        )
        raise ConfigError(msg)
    return loss, items


def _agree(started: Microstep, size: int, *, out_of_memory: bool) -> tuple[int, int | None]:
    """The ranks' agreement on the window: one all-reduce of two integers (the next size,
    the least rank that ran out of memory). A failure in it (another rank raised) fails
    the window, naming that rank."""
    ranks = started.ranks
    try:
        least = ranks.least(fitting.proposal(size, out_of_memory, ranks.rank))
    except BaseException as error:
        failed = _fail(started, error)
        if failed is None:
            raise
        raise failed from error
    return fitting.agreed(least)


def _fail(started: Microstep, error: BaseException) -> BaseException | None:
    """After ``error`` outside the block (the user's ``loss_fn``, a bad return, the
    agreement): fail the window as the block does, unless it is failed already; the
    `RankFailedError` to raise instead when another rank failed first."""
    if started.life.state is not State.OPEN:
        return None  # (the model's forward hook failed it, and raised what names the rank)
    return started.fail(error, in_collectives=True)


def _boundary_ran_out(started: Microstep, size: int) -> BaseException:
    """The last microbatch's backward ran out of memory on this rank, where the other ranks
    have started its gradient all-reduce: the window cannot be re-run. Fail it (recorded,
    so that the other ranks name this one) and return the error to raise."""
    ranks = started.ranks
    number = started.counts.global_step + 1
    smaller = max(1, size // 2)
    msg = (
        f"rank {ranks.rank} ran out of memory in the backward of the last microbatch of "
        f"window {number} (microbatches of {size} rows), whose gradient all-reduce the "
        "other ranks had started, so the window cannot be re-run smaller; nothing was "
        "applied on any rank. Restart every rank from the last checkpoint with "
        f"microbatch={smaller}: the window's last backward needs more memory than the "
        "others (its all-reduce buffers), so a microbatch below the largest that fits the "
        "others avoids it"
    )
    error = OutOfMemoryError(msg, ranks.rank, size, number)
    failed = started.fail(error, in_collectives=True)
    return error if failed is None else failed


def _no_row_fits(rank: int | None, number: int) -> OutOfMemoryError:
    """Every rank's error when microbatches of one row ran out of memory on ``rank``."""
    rank = 0 if rank is None else rank
    msg = (
        f"rank {rank} ran out of memory with microbatches of 1 row in window {number} "
        "(acc.step with microbatch='auto'): no microbatch fits. The window was discarded "
        "on every rank and nothing was applied; free memory on that rank's device (a "
        "smaller model or sequence length, activation checkpointing, mixed precision, an "
        "optimizer with less state, or more ranks sharding the model)"
    )
    return OutOfMemoryError(msg, rank, 1, number)
