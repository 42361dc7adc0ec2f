"""`Accumulator`: the facade that turns N microbatches into one optimizer step.

It validates its arguments, makes the block (`gradaccum.block.Microstep`) with the parts
it needs (the optimizers' parameters, the ranks, the options), and delegates: the block
makes and owns the window's own parts, the epoch hand-out (epochs.py) and the checkpoint
(checkpoint.py) work on them. See CONTRIBUTING.md, "Inside the accumulator".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from typing_extensions import Self

from gradaccum import batchstep, block, boundary, checkpoint, checks, epochs
from gradaccum.checks import NonFinitePolicy
from gradaccum.errors import ConfigTypeError, UsageError, describe, warn
from gradaccum.fitting import MicrobatchOption
from gradaccum.ranks import Ranks
from gradaccum.schedule import check_steps
from gradaccum.step import Step
from gradaccum.sync import SyncPolicy, SyncStrategy, strategy_for
from gradaccum.window import Window

__all__ = ["Accumulator", "Step"]

T = TypeVar("T")


class Accumulator:
    """Accumulate gradients over ``steps`` microbatches and step once per window.

    Args:
        model: The module whose forward produces the losses.
        optimizer: An optimizer, or a sequence of them (a Muon + AdamW split), each on
            its own share of the model's parameters; one window steps every one of them
            once, in the order given. The accumulator owns their ``step()`` and
            ``zero_grad()`` from now on, and clears any gradient it finds. Accelerate's
            prepared optimizer is unwrapped: gradaccum steps the optimizer it wraps.
        scheduler: Optional LR scheduler, stepped once per applied window: with one
            optimizer, a scheduler or None; with several, None or a sequence with one
            entry per optimizer, in their order (a scheduler on that optimizer, or None).
            Accelerate's prepared scheduler is unwrapped, so it steps once per window
            on any number of processes.
        steps: Microbatches per optimizer step (``1``: no accumulation).
        max_grad_norm: Clip the window's gradient to this total norm at the boundary,
            one norm over every optimizer's parameters (``math.inf`` reports the norm
            without clipping).
        scaler: An enabled ``torch.amp.GradScaler``: every microstep's loss is scaled,
            and the gradient is unscaled, clipped, stepped and the scale updated once
            per window (each optimizer unscaled and stepped, the scale updated once). A
            disabled scaler is the same as none. With several optimizers the window's
            gradient is checked for inf/NaN at the boundary (one host sync), so that
            either every optimizer steps or none does.
        drop_last: In `epoch`, skip each epoch's trailing microbatches that do not fill
            a window; when False they form one shorter window, scaled by its length.
        sync: When a wrapped model communicates gradients. ``"auto"`` defers to the
            boundary where that costs no memory (DDP; HSDP's all-reduce) and reduces
            every microstep where deferring would hold unsharded gradients (FSDP1,
            ``fully_shard``); ``"boundary"`` always defers; ``"every"`` never does. An
            unwrapped module never communicates, so all three agree.
        on_nonfinite: What a window whose gradient holds inf/NaN does at its boundary:
            ``None`` (no check, no cost, as plain PyTorch), ``"raise"`` `NonFiniteError`
            naming the window, or ``"skip"`` the whole window (every optimizer and
            scheduler). A check costs one host sync per window, and one scalar
            all-reduce when several ranks hold the gradients, so that every rank decides
            the same. With a GradScaler, which skips overflowing windows by design, only
            ``None`` and ``"skip"`` apply.
        global_loss: In mean mode, report `Step.global_loss`: each window's loss is
            all-reduced at its boundary (one scalar all-reduce per window under several
            ranks; nothing on one process). With ``num_items`` it is free and always
            reported.
        microbatch: How `step` cuts a batch: rows per microbatch (an int), ``"auto"`` (the
            largest that fits, found by halving on out-of-memory errors, which re-run the
            window smaller), or None (the whole batch at once). ``"auto"`` on several
            ranks costs one all-reduce of two integers per window, and is refused where a
            microstep other than the window's last backward communicates (FSDP,
            ``fully_shard``, DDP broadcasting buffers, ``sync="every"``).

    Raises:
        UsageError: An optimizer is owned by another open accumulator whose window is
            open (one between windows is closed, with a warning, and this one takes over).
        ConfigTypeError: An argument has the wrong type.
        ConfigError: An argument has a value outside what is accepted, the model has no
            trainable parameter, an optimizer holds none of them, two optimizers share
            a parameter, the schedulers do not line up with the optimizers, or the
            model's wrapping cannot be accumulated over as it is (DDP modules side by
            side over different process groups, a ``fully_shard`` divide factor other
            than its ranks).

    Attributes:
        model: The model, as given.
        optimizer: The optimizer argument, as given (one, or the sequence).
        scheduler: The scheduler argument, as given.
        optimizers: The optimizers the accumulator steps, in order (Accelerate's
            prepared ones unwrapped).
        schedulers: Their schedulers, one entry per optimizer (None where it has none).

    Examples:
        >>> model = torch.nn.Linear(3, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> acc = Accumulator(model, optimizer, steps=2)
        >>> for x in acc.epoch(torch.randn(5, 3)):   # 2 windows; the 5th row is dropped
        ...     loss = model(x).square().mean()
        ...     with acc.microstep(loss) as step:
        ...         pass
        >>> acc.global_step
        2
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        scheduler: Any = None,
        *,
        steps: int = 1,
        max_grad_norm: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
        drop_last: bool = True,
        sync: SyncPolicy = "auto",
        on_nonfinite: NonFinitePolicy | None = None,
        global_loss: bool = False,
        microbatch: MicrobatchOption = None,
    ) -> None:
        scaler = checks.check_scaler(scaler)
        parts = checks.check_parts(model, optimizer, scheduler, scaler)
        steps = check_steps(steps)
        self._options = checks.check_options(
            max_grad_norm=max_grad_norm,
            scaler=scaler,
            drop_last=drop_last,
            sync=sync,
            on_nonfinite=on_nonfinite,
            global_loss=global_loss,
            optimizers=len(parts.optimizers),
            microbatch=microbatch,
        )
        self.model = model
        strategy = self._strategy_for(steps)
        if self._options.microbatch == "auto":
            checks.refuse_auto(strategy, _world(strategy), self._options.sync)
        previous = block.owners_of(parts.optimizers)
        for owner in previous:
            _refuse_open_window(owner.window, "optimizer", "optimizer")
        for owner in block.owners_of(strategy.wrappers):
            if not any(owner is seen for seen in previous):
                _refuse_open_window(
                    owner.window, "model's gradient sync (its DDP or FSDP)", "model"
                )
                previous.append(owner)
        # Everything is validated: from here on the accumulator changes state.
        _take_over(previous)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.optimizers, self.schedulers = parts.optimizers, parts.schedulers
        for each in parts.optimizers:
            each.zero_grad(set_to_none=True)
        self._block = block.Microstep(
            self,
            model,
            strategy,
            steps,
            schedulers=parts.schedulers,
            params=boundary.Params(parts.optimizers, model),
            ranks=Ranks(strategy.group, parts.params[0].device),
            options=self._options,
        )

    def _strategy_for(self, steps: int) -> SyncStrategy:
        # With steps=1 every microstep is a boundary, nothing is ever deferred, unless
        # `step` cuts its batch into microbatches.
        every = steps == 1 and self._options.microbatch is None
        return strategy_for(self.model, "every" if every else self._options.sync)

    # Properties -------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """Microbatches per optimizer step; settable between windows.

        A new value applies from the next window on, also in the middle of an epoch
        (whose remaining microbatches are then cut into windows of the new size), and
        also at the top of the loop body, after the next window's first microbatch was
        handed out: a warm-up of accumulation, e.g.
        ``acc.steps = steps_at_epoch(schedule, epoch)``. Setting the value it has changes
        nothing, mid-window too.

        Raises:
            ConfigTypeError, ConfigError: The value is not a positive int.
            UsageError: A window is open (and the value is another), or the accumulator
                is closed.
            ConfigError: The wrapping cannot be accumulated over with the value (a
                strategy made for it refused it; nothing has changed).
        """
        return self._block.counts.steps

    @steps.setter
    def steps(self, value: int) -> None:
        steps = check_steps(value)
        started = self._block
        started.life.check("steps was set; it")
        now = started.counts.steps
        if steps == now:  # (a loop that sets it at every microbatch, unchanged)
            return
        strategy = None
        if (steps == 1) is not (now == 1) and not started.window.is_open:
            # The policy becomes, or stops being, "every": may refuse, changing nothing.
            strategy = self._strategy_for(steps)
        started.set_steps(steps, strategy)

    @property
    def microbatch(self) -> int | None:
        """The rows per microbatch that `step` cuts batches into: the fixed one, the one
        ``microbatch="auto"`` found (None before its first window), or None for the
        whole batch. Saved in `state_dict`."""
        return self._block.fit.microbatch

    @property
    def global_step(self) -> int:
        """Windows completed: optimizer steps taken, plus the skipped ones."""
        return self._block.counts.global_step

    @property
    def skipped_steps(self) -> int:
        """Windows completed without an optimizer step: their gradient held inf/NaN (under
        ``on_nonfinite="skip"``, or found by the GradScaler)."""
        return self._block.counts.skipped

    @property
    def position(self) -> int:
        """Microbatches of the current epoch handed out by `epoch`; after `load_state_dict`,
        the microbatches the next `epoch` skips because they were trained on already."""
        return self._block.plan.position

    @property
    def epochs_completed(self) -> int:
        """Epochs that `epoch` ran to their end, saved in `state_dict`: the epoch to resume
        is ``epochs_completed``, also when a checkpoint fell on an epoch's last window."""
        return self._block.plan.epochs_completed

    @property
    def sync_gradients(self) -> bool:
        """True from before the window's last microbatch is handed out until its block exits."""
        return self._block.window.next_is_boundary

    # Microsteps -------------------------------------------------------------------

    def microstep(
        self, loss: torch.Tensor, num_items: int | torch.Tensor | None = None
    ) -> block.Microstep:
        """Back-propagate one microbatch's loss on entering the returned ``with`` block.

        Args:
            loss: The microbatch's 0-dim loss: its mean, or its sum with ``num_items``.
            num_items: With a summed ``loss``, the items (tokens) it sums over; the
                window's gradient is divided by the window's total items: an int (NumPy's
                too) or a 0-dim tensor, read without host synchronization.

        Returns:
            A context manager whose ``__enter__`` runs the backward and returns the
            `Step`; leaving the window's last block applies the update.

        Raises:
            UsageError: The accumulator is closed, a microstep block is already open,
                this window mixes ``num_items`` with plain mean losses, or the window's
                gradient was cleared by a ``zero_grad()`` since its last microstep.
            ConfigTypeError: ``loss`` or ``num_items`` has the wrong type.
            ConfigError: ``loss`` is not a 0-dim tensor that requires grad, or
                ``num_items`` is a negative int or a tensor that is not 0-dim (a
                tensor's value is not read, to avoid a host sync).
        """
        started = self._block
        # One cheap condition each on the hot path; messages are built on failure.
        if started.busy:
            started.refuse()
        try:  # (free when it holds; a non-tensor fails on the attribute)
            usable = loss.ndim == 0 and loss.requires_grad
        except AttributeError:
            usable = False
        if not usable:
            checks.refuse_loss(loss)
        window = started.window
        if (num_items is not None or window.by_items) and not (
            type(num_items) is int and num_items >= 0 and (window.by_items or not window.done)
        ):  # (an int count in an item window needs no more)
            num_items = block.check_items(window, num_items)
        started.loss, started.num_items, started.busy = loss, num_items, True
        return started

    def step(self, batch: Any, loss_fn: Callable[[nn.Module, Any], Any]) -> Step:
        """One window from one per-rank batch: cut it into microbatches, back-propagate each
        one's loss and step once.

        The batch (a tensor, or dicts, lists, tuples and dataclasses of tensors) is cut
        along dim 0 into microbatches of `microbatch` rows, the last one shorter where they
        do not divide it; other leaves go to every microbatch as they are. Each one's loss
        is ``loss_fn(model, microbatch)``: its mean loss, or a ``(loss_sum, num_items)``
        pair. Each runs the microstep of ``with acc.microstep(loss):`` and the last one the
        boundary and the step, so every option applies as there. Mean losses of unequal
        microbatches are weighed by their rows: the update is the batch's mean-loss
        gradient whatever the cut.

        With ``microbatch="auto"`` an out-of-memory error in any forward or backward of the
        window, on any rank, discards the window's gradient on every rank and re-runs the
        same samples with half the microbatch, which is kept for later windows; the result
        is that of the run that used the smaller microbatch from the start.

        Args:
            batch: This rank's batch: the window.
            loss_fn: ``loss_fn(model, microbatch)``, returning the microbatch's 0-dim mean
                loss, or a ``(loss_sum, num_items)`` pair.

        Returns:
            The window's `Step` (its boundary's, after the step): ``step.microbatch`` is
            the microbatch it ran with.

        Raises:
            ConfigError: The batch's tensors disagree on dim 0 (or it has none, or no
                rows), or ``loss_fn`` returned a loss that is not 0-dim or does not require
                grad, or mixed the two forms.
            ConfigTypeError: ``loss_fn`` is not callable, or returned neither a tensor nor
                a pair.
            UsageError: A window of `microstep` is open, ``steps`` is not 1, or the
                accumulator is closed.
            OutOfMemoryError: Under ``"auto"``, a microbatch of one row ran out of memory
                (on every rank, naming the rank), or the window's last backward did on
                this rank once the other ranks' all-reduce had started (they raise
                `RankFailedError` naming it). Nothing was applied.

        Examples:
            >>> model = torch.nn.Linear(3, 1)
            >>> acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1),
            ...                   microbatch=2)
            >>> step = acc.step(torch.randn(5, 3), lambda m, x: m(x).square().mean())
            >>> step.microbatch, acc.global_step
            (2, 1)
        """
        return batchstep.run(self._block, self.model, batch, loss_fn)

    # Epochs -----------------------------------------------------------------------

    def epoch(self, iterable: Iterable[T]) -> Iterator[T]:
        """Hand out the microbatches of one epoch, arming each window's boundary in advance.

        Windows never span epochs. With ``drop_last`` (the default) an epoch of known
        length yields ``steps_per_epoch(n, steps) * steps`` microbatches; for an
        iterable without ``len`` the trailing partial window's gradient is discarded.
        With ``drop_last=False`` the trailing microbatches form one shorter window.
        After `load_state_dict` the first epoch resumes after the microbatches already
        trained, and cuts the rest into windows with the saved ``steps``. An iterable that
        restores its own position (``state_dict`` and ``load_state_dict``, as torchdata's
        ``StatefulDataLoader``, and Accelerate's prepared one) resumes by its loaded state
        instead. A ``DataLoader`` over a map-style dataset skips by its batch sampler's
        indices, loading no skipped sample; from any other the trained ones are drawn, dropped.

        The epoch is planned when its iteration starts (the first ``next()``), with the
        ``steps`` set by then, and re-planned from each window's start after a change.
        When the model's gradients are averaged over several ranks, the ranks agree on
        the epoch's length first (one all-reduce) and all train on the shortest; an
        iterable without ``len`` is drawn a window at a time and each window's length
        agreed (one all-reduce per window), so no rank waits on a collective that
        another never calls. Unequal lengths warn once, on rank 0.

        Raises:
            ConfigTypeError: ``iterable`` is not iterable.
            ConfigError: The epoch has too few microbatches for one optimizer step (for
                an iterable without ``len`` this is known only at its end), a loaded
                position lies in an epoch of another length or past its end, an iterable
                that restores its own position stands elsewhere in its epoch, or, in the
                first epoch after a load, a ``DataLoader`` with persistent workers draws
                its order from the generator of its workers' seed, or a state loaded from
                another number of ranks would not be continued exactly (another or an
                unknown global order, batch size, or windows cut otherwise at the epoch's
                end: see `load_state_dict`); raised by the first ``next()``, before
                anything is drawn.
            UsageError: The accumulator is closed, or another of its epochs is still
                being iterated (raised by the first ``next()``).
        """
        self._block.life.check("epoch()")
        if not (isinstance(iterable, Iterable) or hasattr(type(iterable), "__getitem__")):
            msg = f"iterable must be an iterable of microbatches, got {describe(iterable)}"
            raise ConfigTypeError(msg)
        return epochs.run(self._block, iterable)

    # Checkpoints ------------------------------------------------------------------

    def state_dict(self, *, include_grads: bool = False) -> dict[str, Any]:
        """The accumulator's state, to save beside the model's, optimizer's and scheduler's.

        Accepted between windows, also at the top of the loop body (a microbatch handed
        out but not back-propagated is handed out again after the resume), and with
        ``include_grads`` after any microstep's block.

        Args:
            include_grads: Also save an open window: its gradients so far (this rank's:
                under DDP every rank saves its own state) and its losses and item
                counts, so that `load_state_dict` resumes mid-window exactly. Only where
                the partial gradient is ``param.grad`` (a plain module, DDP).

        Returns:
            ``steps``, the ``position`` in the current epoch (microbatches trained on),
            ``global_step``, ``skipped_steps``, ``epochs_completed``, the policy
            (``drop_last``, ``sync``), the data-parallel ``world_size`` and, with a
            position in a sized epoch, that epoch's ``epoch_length`` (else None);
            with ``include_grads`` and an open window, also ``window``. See
            `gradaccum.record.StateDict`.

        Raises:
            UsageError: A window is open without ``include_grads``, a microstep block is
                open, the wrapping keeps the partial gradient outside ``param.grad``, or the
                epoch's iterable restores its own position and has handed out microbatches
                not trained on (at the top of the loop body).

        Warns:
            GradaccumWarning: A run resumed from this state would be refused at its first
                epoch by an iterable like this epoch's (a DataLoader with persistent
                workers whose order is drawn from the generator of their seed).
        """
        return checkpoint.save(self._block, include_grads)

    def load_state_dict(
        self,
        state: Mapping[str, Any],
        *,
        allow_steps_change: bool = False,
        allow_world_size_change: bool = False,
    ) -> None:
        """Resume from `state_dict`: restores ``global_step``, ``epochs_completed`` and
        where the epoch was.

        The next `epoch` skips the ``position`` microbatches already trained on, so pass
        the same data in the same order (an iterable that restores its own position: with
        its state saved at the same point), and cuts the rest into windows of ``steps``. A
        state with a ``window`` restores its gradients: the next microstep continues
        that window. A state saved on another number of data-parallel ranks is refused
        here; one whose position lies in an epoch of another length is refused when the
        next epoch begins (a state saved between epochs resumes no position, and the next
        epoch may have any length).

        With ``allow_world_size_change``, a state saved on ``W`` ranks with ``steps`` loads
        on ``W'`` ranks where this accumulator's ``steps`` keeps the global window
        (``W' * steps' == W * steps``: `gradaccum.steps_for`), and the next epoch resumes at
        the same sample of the epoch's global order, every later window covering the
        samples it covered in the run on ``W`` ranks (equal up to the order of summation).
        That needs the order: a ``DataLoader`` over a ``DistributedSampler`` (with
        ``set_epoch``), or an iterable with a ``global_order()`` method returning a
        `gradaccum.GlobalOrder`. What cannot be continued exactly is refused: here, a
        state saved mid-window or mid-epoch without a known order, or whose position falls
        inside a microbatch of these ranks; when the next epoch begins, another order or
        batch size, or windows that the epoch's end cuts otherwise (the sampler pads or
        cuts the order to a multiple of the ranks).

        Args:
            state: From `state_dict`.
            allow_steps_change: Load a state saved with another ``steps`` and keep this
                accumulator's from the next window on; only between windows (no saved
                ``window``).
            allow_world_size_change: Load a state saved on another number of data-parallel
                ranks, keeping the global batch (see above).

        Raises:
            ConfigTypeError: ``state`` is not such a mapping, or an ``allow_`` argument is
                not a bool.
            ConfigError: ``state`` was saved on another number of data-parallel ranks
                (unless allowed, where it can be continued exactly), with another
                ``drop_last``, with another ``steps`` (unless allowed, between windows), or
                its window does not fit this optimizer's parameters.
            UsageError: The accumulator is closed, a window is open in it, or one of its
                epochs is being iterated.
        """
        checkpoint.load(self._block, state, allow_steps_change, allow_world_size_change)

    # Lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Remove the optimizers' hooks and the model's, and restore any sync state set on
        the model: it is as it was. Refused (`UsageError`) inside a microstep's block."""
        started = self._block
        started.check_closable()
        started.life.close()
        started.release()  # (once: a later call gives back nothing)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        names = ", ".join(type(optimizer).__name__ for optimizer in self.optimizers)
        several = f"optimizers=({names}), " if len(self.optimizers) > 1 else ""
        window, counts = self._block.window, self._block.counts
        return (
            f"Accumulator({several}steps={counts.steps}, global_step={counts.global_step}, "
            f"window={window.done}/{window.size})"
        )


def _world(strategy: SyncStrategy) -> int:
    """How many ranks ``strategy``'s process group holds (1 without one)."""
    group = strategy.group
    return 1 if group is None else torch.distributed.get_world_size(group)


def _refuse_open_window(window: Window, what: str, other: str) -> None:
    """Refuse to take ``what`` over from an accumulator whose ``window`` is open (or pass
    another ``other``).

    Raises:
        UsageError: Taking over would lose that window.
    """
    if window.is_open:
        msg = (
            f"the {what} is owned by another open Accumulator, whose window is open "
            f"({window.where()}); finish that window and close() it, or pass "
            f"another {other}"
        )
        raise UsageError(msg)


def _take_over(previous: list[block.Microstep]) -> None:
    """Close the accumulators whose optimizers, or whose model's gradient sync, a newer
    one takes, and say so: one accumulator at a time steps an optimizer and sets a
    wrapper's sync (two at once over one DDP model would each arm it for their own
    windows, and the ranks drift apart)."""
    for owner in previous:
        owner.life.close(" (a newer Accumulator took over its optimizer or its model)")
        owner.release()
        warn(
            "this Accumulator closed the previous Accumulator on the same optimizer or the "
            "same DDP or FSDP model (it was between windows), and steps the optimizer and "
            "sets the model's gradient sync from now on; close() an accumulator when you "
            "are done with it (for two models trained in turn, such as a GAN's, wrap each "
            "in its own DDP)"
        )
