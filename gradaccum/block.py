"""The ``with acc.microstep(loss):`` block and the window's edges: the backward on
entering it, the boundary (normalize, unscale, clip, check) before its body, the step on
leaving it, and what a failure anywhere in a window leaves behind.

`Microstep` is the accumulator's working state: the facade makes it with the parts it
needs (the optimizers' `Params`, the `Stepper`, the `Ranks`, the `Options`) and it makes
the window's own (`Window`, `Counts`, `EpochPlan`, `GradWatch`, `Lifecycle`, `Arming`,
`Fit`),
which the epoch hand-out (epochs.py) and the checkpoint (checkpoint.py) read through it.
A microstep between a window's first and last is a few attribute reads and the backward
a hand loop runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradaccum import boundary, checks, faults
from gradaccum.arming import Arming
from gradaccum.boundary import Params
from gradaccum.checks import Options
from gradaccum.errors import NonFiniteError, RankFailedError, UsageError, warn
from gradaccum.fitting import Fit
from gradaccum.misuse import GradWatch
from gradaccum.plan import EpochPlan
from gradaccum.ranks import Ranks
from gradaccum.step import Step, at_boundary
from gradaccum.stepping import Stepper
from gradaccum.sync import SyncStrategy
from gradaccum.window import Counts, Lifecycle, State, Window

__all__ = ["Microstep", "check_items", "owners_of"]

# The block of the open accumulator that steps each optimizer, and that sets the sync
# state of each wrapper (`SyncStrategy.wrappers`): one at a time (`owners_of`). Held
# weakly both ways: a block holds its optimizers and model, which may hold the user's
# objects that hold the accumulator (a trainer's hook on the optimizer, the accumulator
# kept as an attribute of the model), so a strong value here would keep them all alive.
_owners: weakref.WeakKeyDictionary[Any, weakref.ref[Microstep]] = weakref.WeakKeyDictionary()
_OPEN = State.OPEN  # (read at every block's exit: a global, not the enum's attribute)


def owners_of(things: Iterable[Any]) -> list[Microstep]:
    """The open accumulators' blocks that own any of ``things`` (optimizers, wrappers),
    each once."""
    found: list[Microstep] = []
    for thing in things:
        owner = _owner(thing)
        if owner is not None and not any(owner is seen for seen in found):
            found.append(owner)
    return found


def _owner(thing: Any) -> Microstep | None:
    held = _owners.get(thing)
    return None if held is None else held()


def _give_back(held: weakref.ref[Microstep], hooks: tuple[RemovableHandle, ...]) -> None:
    """Give back what a block set. The finalizer holds the block weakly, since it holds
    the user's objects; a block that died in a garbage cycle with the accumulator takes
    back only its optimizers' hooks (an optimizer kept alive would otherwise still refuse
    or warn about the steps of the next accumulator over it)."""
    block = held()
    if block is not None:
        block.give_back()
        return
    for hook in hooks:
        hook.remove()


class Microstep:
    """The ``with`` block of a microstep, one per accumulator; see `Accumulator.microstep`.

    It holds the loss from ``microstep()`` until the block is entered (``loss``,
    ``num_items``), and the `Step` its microsteps report (``step``): the window's, made
    when it starts, until the boundary's replaces it for the boundary's block. ``busy``
    refuses a new ``microstep()``: a loss waits for its block, a block is open, or the
    accumulator is closed or broken.
    `release` gives back what the accumulator set (once: when it is closed, taken over,
    or freed unclosed).

    Attributes:
        window, counts, plan, grads, life, arming, stepper, fit: The parts it makes and
            owns.
        params, ranks, options: The parts it was given.
        spare: While `sparing`: which errors of a microstep's backward or boundary leave the
            window to the caller, which re-runs it (`Accumulator.step` after running out of
            memory), instead of failing it.
    """

    __slots__ = (
        "__weakref__",  # (the model's hook holds its listeners weakly: hooks.py)
        "arming",
        "busy",
        "counts",
        "fit",
        "grads",
        "life",
        "loss",
        "num_items",
        "options",
        "params",
        "plan",
        "ranks",
        "release",
        "spare",
        "step",
        "stepper",
        "window",
    )

    def __init__(
        self,
        owner: object,
        model: nn.Module,
        strategy: SyncStrategy,
        steps: int,
        *,
        schedulers: tuple[Any, ...],
        params: Params,
        ranks: Ranks,
        options: Options,
    ) -> None:
        self.params, self.ranks, self.options = params, ranks, options
        self.window = Window(steps)
        self.stepper = Stepper(
            params.optimizers, schedulers, options.scaler, self.window.where_open
        )
        self.counts = Counts(steps)
        self.plan = EpochPlan(options.drop_last)
        self.grads = GradWatch()
        self.life = Lifecycle(stopped=self.stop)
        self.arming = Arming(model, strategy, every=options.sync == "every")
        self.fit = Fit(options.microbatch)
        self.spare: Callable[[BaseException], bool] | None = None
        self.busy = False
        self.loss: torch.Tensor | None = None
        self.num_items: int | torch.Tensor | None = None
        self.step = Step()
        me = weakref.ref(self)
        for thing in (*params.optimizers, *strategy.wrappers):
            _owners[thing] = me
        self.arming.watch(ranks.count, self.forward_failed)
        self.arm()
        # Given back once: by close(), by a newer accumulator taking over, or when the loop
        # drops the accumulator unclosed (this block does not keep it alive), so that a dead
        # accumulator's hooks refuse no later step and DDP is not left deferring.
        self.release = weakref.finalize(owner, _give_back, me, tuple(self.stepper.hooks))
        self.release.atexit = False

    def give_back(self) -> None:
        """Remove what this block set on the user's objects, and its ownership of them."""
        for thing in (*self.stepper.optimizers, *self.arming.strategy.wrappers):
            if _owner(thing) is self:
                del _owners[thing]
        self.stepper.release()
        self.arming.release()

    def stop(self) -> None:
        """The accumulator takes no more microsteps (closed, or broken)."""
        self.busy = True

    def use(self, strategy: SyncStrategy) -> None:
        """Take ``strategy`` in place of the one held: the old one's state is restored."""
        self.arming.strategy.restore()
        for wrapper in strategy.wrappers:
            _owners[wrapper] = weakref.ref(self)
        self.arming.use(strategy)

    def arm(self) -> None:
        """Arm the next backward before its forward (`Arming.arm`); called after a hand-out
        that resized the window, after a block exits and when a window starts."""
        arming = self.arming
        if arming.arms:
            arming.arm(self.window.next_is_boundary)

    def set_steps(self, steps: int, strategy: SyncStrategy | None) -> None:
        """``steps`` changed between windows (``strategy``: the one it needs, if another)."""
        window = self.window
        if window.is_open:
            msg = (
                f"steps was set to {steps} mid-window ({window.progress()}); set it after "
                "the `with` block of the window's last microstep has exited"
            )
            raise UsageError(msg)
        if strategy is not None:
            self.use(strategy)
        self.counts.steps = steps
        self.plan.recut(steps)
        window.reset(self.plan.next_window_size(steps))
        self.arm()

    def size_window(self, size: int) -> None:
        """The window about to open takes ``size`` microsteps (the microbatches
        `Accumulator.step` cut its batch into), armed for the first."""
        self.window.resize(size)
        self.arm()

    def hand(self, loss: torch.Tensor, num_items: int | torch.Tensor | None) -> Microstep:
        """What `Accumulator.microstep` does with a checked ``loss`` and ``num_items``: hold
        them for the block, which is returned."""
        if self.busy:
            self.refuse()
        self.loss, self.num_items, self.busy = loss, num_items, True
        return self

    @contextmanager
    def sparing(self, spare: Callable[[BaseException], bool] | None) -> Iterator[None]:
        """Inside, an error of a microstep's backward or boundary for which ``spare`` holds
        is raised as it is, the window left for the caller to discard and re-run (`spare`)."""
        self.spare = spare
        try:
            yield
        finally:
            self.spare = None

    def forward_failed(self, error: BaseException) -> RankFailedError | None:
        """A forward of the model raised, outside a microstep block (the block's exit sees an
        error raised in it). This rank failed, or its collective did because another rank
        had: then the accumulator is broken, and the `RankFailedError` naming that rank is
        returned, which the model's hook raises from ``error`` (hooks.py; on Python 3.10,
        ``error`` with its message as a note)."""
        if self.window.in_block or self.life.state is not State.OPEN:
            return None
        return self.fail(error, in_collectives=True)

    # The block --------------------------------------------------------------------

    def refuse(self) -> NoReturn:
        """Refuse a ``microstep()`` call while the block is busy: the accumulator is closed
        or broken, a loss was never entered (dropped, so that the corrected loop can run),
        or a block is open."""
        self.life.check("microstep()")
        if self.loss is not None:
            self.loss, self.busy = None, False
            msg = (
                "the previous acc.microstep(...) was never entered, so its loss was not "
                "back-propagated; use it as `with acc.microstep(loss):`"
            )
        else:
            msg = (
                "microstep() was called inside another microstep block; "
                "leave the first `with acc.microstep(...)` block before starting the next"
            )
        raise UsageError(msg)

    def check_closable(self) -> None:
        """Refuse `Accumulator.close` inside a microstep's block: leaving the block still
        needs the accumulator (the boundary's applies the window)."""
        if self.window.in_block:
            msg = (
                "close() was called inside a microstep's `with` block; close the accumulator "
                "after the block has exited (leaving the window's last block applies its update)"
            )
            raise UsageError(msg)

    def __enter__(self) -> Step:
        loss = self.loss
        if loss is None:
            msg = "a microstep block was entered twice; call acc.microstep(loss) for each one"
            raise UsageError(msg)
        self.loss = None
        window, grads, num_items = self.window, self.grads, self.num_items
        window.in_block = True
        plan = self.plan
        if plan.active:  # (a microstep outside the epoch uses no microbatch of it)
            plan.pending = False
        # The window's partial gradient, watched since the last backward (none before a
        # window's first): a version-counter compare, and a look only when it moved.
        param = grads.param
        if param is not None and (
            param.grad is not grads.grad
            or grads.grad._version != grads.version  # type: ignore[union-attr]
            or grads.rest
        ):
            change = grads.change()
            if change is not None:
                self._wiped_or_changed(change)
        try:
            arming = self.arming
            if arming.look:
                actual = arming.strategy.overridden()
                if actual is not None:
                    _warn_overridden(window, arming.strategy, actual)
            if not window.done:
                window.open(num_items is not None)
            # As the hand loop: (loss / divisor).backward() in mean mode (the window's size
            # when it opened), loss.backward() with num_items, through the scaler.
            divisor = window.divisor
            root = loss if num_items is not None or divisor == 1 else loss / divisor
            scaler = self.options.scaler
            (root if scaler is None else scaler.scale(root)).backward()  # type: ignore[no-untyped-call]
            # The value only, not the graph (freed now); `.data` is the loss's detached
            # alias, made without a dispatch.
            window.losses.append(loss.data)
            if num_items is not None:
                window.items.append(num_items)
            if window.done != window.last:
                if param is not None:
                    grads.version = grads.grad._version  # type: ignore[union-attr]
                    if grads.rest:
                        grads.update()
                elif arming.strategy.grads_in_params:
                    grads.start(self.params.first(), self.params.watched())
                return self.step
            self.step = step = self.boundary()
        except BaseException as error:
            window.in_block = False
            self.busy = self.life.state is not _OPEN
            spare = self.spare
            if spare is not None and spare(error):
                raise  # the caller discards the window and re-runs it
            _note_backward_already(error)
            failed = self.fail(error, in_collectives=True)
            if failed is not None:
                raise failed from error
            raise
        return step

    def __exit__(self, _: object, error: BaseException | None, *__: object) -> None:
        window = self.window
        window.in_block = False
        self.busy = self.life.state is not _OPEN
        step = self.step
        if error is not None:
            if step.boundary and self.options.scaler is not None:
                _note_unscaled_already(error)
            self.fail(error)
        elif step.boundary:
            self.apply(step)
        else:
            window.done += 1
            arming = self.arming
            if arming.arms and (window.done == window.last or arming.armed is None):
                arming.arm(window.next_is_boundary)

    # The window's edges -----------------------------------------------------------

    def boundary(self) -> Step:
        """Normalize, unscale, clip and check the window's gradient: the boundary's `Step`,
        what its block sees."""
        window, params, ranks, options = self.window, self.params, self.ranks, self.options
        listed = params.now()
        losses = window.losses
        several = ranks.count > 1
        totals = None
        if window.by_items:
            divisor, totals = boundary.normalize(listed, window, ranks)
            alone = not several
        else:
            divisor = len(losses)
            if window.divisor != window.size:  # an epoch that ended sooner than planned
                boundary.rescale(listed, window)
            alone = options.global_loss and not several  # (else global_loss is the ranks')
            if options.global_loss and several:
                totals = boundary.global_mean(window, ranks)
        step = at_boundary(
            self.counts.global_step + 1, losses, divisor, window.by_items, alone, totals
        )
        stepper = self.stepper
        if options.scaler is not None:
            stepper.unscale()
        norm = None
        if options.max_grad_norm is not None:
            step.grad_norm = norm = boundary.clip(
                self.arming.strategy, params, options.max_grad_norm
            )
        step.lrs = stepper.learning_rates()
        grads = self.grads
        if grads.param is None:  # a window of one microstep, or a wrapping not watched before
            grads.start(params.first(), params.watched())
        if options.check_finite and not boundary.all_finite(listed, norm, ranks):
            if options.on_nonfinite == "raise":
                global_step = step.global_step
                msg = (
                    f"the gradient of window {global_step} (the optimizer step after "
                    f"{global_step - 1}) holds inf or NaN; nothing was applied. Pass "
                    "on_nonfinite='skip' to skip such windows, or find the microbatch "
                    "whose loss is not finite"
                )
                raise NonFiniteError(msg, global_step)
            step.skipped = True
        return step

    def apply(self, step: Step) -> None:
        """Leaving the boundary's block: step (or skip) the window and count it; a failure in
        the stepping counts the window only if the optimizers stepped; a window whose
        gradient was dropped in the block is refused (`_dropped_in_block`)."""
        if not step.skipped and self.grads.dropped():
            self._dropped_in_block(step)
        stepper = self.stepper
        try:
            skipped = stepper.apply(step.skipped)
        except BaseException as failure:
            applied = stepper.applied
            if applied:  # the optimizers stepped: the window counts, though it failed
                stepper.clear()
                self.close_window(skipped=False)
            self.fail(failure, applied=applied)
            raise
        if skipped:
            step.skipped = True
        self.close_window(skipped=skipped)

    def close_window(self, *, skipped: bool) -> None:
        """Count the window that closed (applied or skipped; its gradient is cleared) and
        start the next."""
        self.counts.count(skipped=skipped)
        self.plan.close_window(self.window.by_items)
        self.next_window()

    def next_window(self) -> None:
        """The window closed or was dropped (its gradient cleared): the next one takes
        ``steps`` microsteps, reports the steps completed so far and is armed."""
        self.grads.stop()
        self.window.reset(self.counts.steps)
        self.step = step = Step()
        step.global_step = self.counts.global_step
        if self.arming.arms:
            self.arm()

    def drop_window(self) -> None:
        """Drop the window: clear its gradient and state, so that the next microstep starts
        clean."""
        self.stepper.clear()
        self.next_window()

    def discard_window(self) -> None:
        """Drop the window, on every rank at once, to re-run it: its gradient cleared, its
        state reset, and whatever its forwards prepared in the wrapper forgotten."""
        self.arming.strategy.discard()
        self.drop_window()

    def unplanned_window(self) -> None:
        """Outside an epoch, a window that has not started takes ``steps`` microsteps: a
        trailing window's size, planned for the epoch, does not carry over."""
        if not self.window.is_open:
            self.window.reset(self.counts.steps)
            self.arm()

    def broken(self, reason: str) -> None:
        """On several ranks a rank failed (``reason``): the ranks' windows no longer line
        up, so the accumulator takes no more calls, and where the model's forward runs a
        collective its forwards are refused before it (`Arming.refuse_forwards`); `release`
        lets them run again. A loop that catches the failure and goes on gets this refusal
        instead, and the other ranks name this rank's failure."""
        self.life.break_(reason)
        self.arming.refuse_forwards(reason)

    def fail(
        self, error: BaseException, *, applied: bool = False, in_collectives: bool = False
    ) -> RankFailedError | None:
        """After ``error``: drop the open window (unless it was applied, and so counted);
        under several ranks, say which rank failed.

        A rank that raises records the failure in the process group's store and refuses
        further microsteps: its windows no longer line up with the others'. A rank whose
        forward, backward or boundary (``in_collectives``: where the collectives run) fails
        after another rank recorded a failure gets the `RankFailedError` to raise from
        ``error``, naming that rank and the window each of the two stopped in.
        """
        if not applied:
            self.drop_window()
            self.plan.recut(self.counts.steps)  # the next windows start after the failed one
        ranks = self.ranks
        if ranks.count == 1 or isinstance(error, NonFiniteError):  # every rank raised that
            return None
        number = self.counts.global_step + (not applied)  # the window this rank stopped in
        peer = ranks.first_failure() if in_collectives else None
        if peer is not None:
            self.broken(f"rank {peer.rank} failed ({peer.what})")
            message = _rank_failed(ranks.rank, number, applied, peer)
            return RankFailedError(message, peer.rank, number, applied)
        ranks.record_failure(number, applied, error)
        self.broken(f"this rank failed in window {number} ({type(error).__name__}: {error})")
        return None

    def _wiped_or_changed(self, change: str) -> None:
        """The window's gradient was cleared since its last microstep (refused: the window
        is discarded; this rank's own refusal, not a collective's failure, so never
        `RankFailedError`), or changed in place (warned about)."""
        window = self.window
        if change == "changed":
            warn(
                f"the gradient of this window was changed in place after microstep "
                f"{window.done} of {window.size} (by clip_grad_norm_, say, or a backward "
                "outside the accumulator), so that change applied to a partial sum; pass "
                "max_grad_norm= to the Accumulator, or clip inside the boundary's block (when "
                "step.boundary is True); back-propagate the window's losses through "
                "acc.microstep alone"
            )
            return
        window.in_block = False
        self.busy = self.life.state is not _OPEN
        msg = (
            f"the gradient of this window's first {window.done} microsteps was cleared "
            "since the last one, by optimizer.zero_grad() or model.zero_grad() inside the "
            "window; remove that call: the accumulator clears the gradients after each "
            "window's optimizer step (the window is discarded)"
        )
        error = UsageError(msg)
        self.fail(error)
        raise error

    def _dropped_in_block(self, step: Step) -> None:
        """A watched gradient was dropped in the boundary's block: refused (the window is
        discarded; raises) where every parameter of an optimizer, or of the model, lost its
        gradient, as ``zero_grad()`` leaves them; a gradient set to None by hand, its
        parameter left out of this update, is not refused."""
        if not any(all(p.grad is None for p in params) for params in self.params.watched()):
            return
        msg = (
            f"the gradient of window {step.global_step} was cleared inside its boundary "
            "block, by optimizer.zero_grad() or model.zero_grad(), before the accumulator's "
            "optimizer step, so nothing was applied (the window is discarded); remove that "
            "call: leaving the boundary block steps the optimizer, then clears the gradients"
        )
        error = UsageError(msg)
        self.fail(error)
        raise error


def check_items(window: Window, num_items: object) -> int | torch.Tensor | None:
    """Refuse a bad ``num_items``, or a window that mixes it with mean losses; return it
    as the window keeps it (`checks.check_num_items`)."""
    kept = None if num_items is None else checks.check_num_items(num_items)
    by_items = kept is not None
    if window.done and by_items is not window.by_items:
        msg = (
            f"microstep {window.done + 1} of this window "
            f"{'passes' if by_items else 'omits'} num_items but the window's first "
            f"microstep did {'not' if by_items else 'so'}; pass num_items on every "
            "microstep of a window or on none"
        )
        raise UsageError(msg)
    return kept


def _rank_failed(me: int, window: int, applied: bool, peer: faults.Failure) -> str:
    """What `RankFailedError` says: the window each of the two ranks stopped in, whether
    it applied it, the windows this rank applied that the failed one did not, the fix."""
    where = "there first" if peer.window == window else f"first, in window {peer.window}"
    first, last = peer.window + peer.applied, window - (not applied)  # applied here only
    ahead = ""
    if last >= first:
        windows = f"window {first}" if last == first else f"windows {first} to {last}"
        ahead = f", so rank {me} applied {windows} that rank {peer.rank} did not"
    return (
        f"rank {me} stopped in window {window} because rank {peer.rank} failed {where}: "
        f"{peer.what}; rank {peer.rank} {'applied' if peer.applied else 'did not apply'} "
        f"window {peer.window}, rank {me} {'applied' if applied else 'did not apply'} "
        f"window {window}{ahead}. Restart every rank from the last checkpoint"
    )


def _note_backward_already(error: BaseException) -> None:
    """A ``loss.backward()`` of the hand loop, kept before the block (or Accelerate's
    ``accelerator.backward(loss)``), freed the graph, so the block's backward fails in torch
    ("backward through the graph a second time"), whose advice, ``retain_graph=True``,
    would count the microbatch twice. Say what to remove beside torch's message."""
    if isinstance(error, RuntimeError) and "backward through the graph a second time" in str(error):
        faults.add_note(
            error,
            "gradaccum: entering `with acc.microstep(loss):` runs the loss's backward; "
            "this loss was back-propagated already. Remove the loss.backward() (or "
            "accelerator.backward(loss), scaler.scale(loss).backward()) left in the loop, "
            "rather than passing retain_graph=True, which would count the microbatch twice",
        )


def _note_unscaled_already(error: BaseException) -> None:
    """The AMP recipe's ``scaler.unscale_(optimizer)``, kept in the boundary's block before
    a clip of the user's own, fails in torch ("already been called"): the accumulator
    unscaled the window's gradient before the block. Say so beside torch's message."""
    if isinstance(error, RuntimeError) and "unscale_() has already been called" in str(error):
        faults.add_note(
            error,
            "gradaccum: the Accumulator's scaler unscales the window's gradient before "
            "the boundary's block runs, so the gradient there is unscaled already; remove "
            "the scaler.unscale_(optimizer) call (clip in the block, or pass max_grad_norm=)",
        )


def _warn_overridden(window: Window, strategy: SyncStrategy, actual: bool) -> None:
    """This backward will communicate otherwise than was armed: DDP's forward saw another
    flag (it ran ahead of its block, or inside a ``no_sync()`` of the user's own), or
    someone else turned the wrapper's sync off or on since it was armed."""
    will = "reduce" if actual else "not reduce"
    lost = (
        ", so this window's gradient is not reduced over the ranks and its update is "
        "wrong (under DDP the ranks' parameters drift apart)"
        if not actual and window.next_is_boundary
        else ""
    )
    if strategy.decides_in_forward:
        ahead = (
            "(ahead of its block, or inside a no_sync() of your own, such as the one "
            "Accelerate's accelerator.accumulate() enters)"
        )
        # DDP records what its last forward prepared; a forward around DDP's (the module
        # inside it called directly) records nothing, and its backward all-reduces nothing.
        around = (
            "did not run through DDP's forward at all (model.module(x), or a method of the "
            "inner module), which DDP never sees: then DDP shows an earlier forward's "
            "record, and no backward of such a forward all-reduces, the window's last "
            "neither, so the ranks' parameters drift apart"
        )
        if actual:
            cause = (
                f"the forward of {window.where()} ran while DDP was set to all-reduce "
                f"{ahead}, or {around}"
            )
        else:
            # DDP records its last forward only: one under no_grad (an evaluation) after
            # the loss's records no all-reduce, whatever the loss's forward prepared.
            cause = (
                "the forward DDP ran last prepared no all-reduce: either the forward of "
                f"{window.where()} ran while DDP was set to defer {ahead}{lost}, or it "
                f"{around}, or a forward under no_grad (an evaluation) ran between it and "
                "its block, which DDP records in its place, and nothing is wrong"
            )
        lost = ""
        fix = (
            "run each microbatch's forward through the DDP model itself, model(x), right "
            "before its `with acc.microstep(loss):` block, outside any no_sync(), and "
            "evaluations before it or after the block: the accumulator sets DDP's flag "
            "itself"
        )
    else:
        cause = (
            f"the sync state of {type(strategy).__name__} was changed since the accumulator "
            "armed it (by a no_sync() or set_requires_gradient_sync() of your own?)"
        )
        fix = "remove that call: the accumulator sets the wrapper's sync for every microstep"
    warn(
        f"the backward of {window.where()} will {will} the gradient, which is not "
        f"what the accumulator armed: {cause}{lost}; {fix}"
    )
