"""The ``with acc.microstep(loss):`` block: the backward on entering it, the window's
boundary (normalize, unscale, clip, check) before its body, the step on leaving it, and
what a failure in it leaves behind.

This is the hot path: what is decided per window (its size and last microstep, its mode,
its divisor, whether the strategy needs a look before the backward) is decided when the
window opens, so that a microstep between is a few attribute reads and the backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch
from torch.overrides import has_torch_function_unary

from gradaccum import boundary, checks, faults, hooks
from gradaccum.errors import NonFiniteError, RankFailedError, UsageError, warn
from gradaccum.step import Step
from gradaccum.sync import LocalSync, SyncStrategy, ddp_running_around, several_processes
from gradaccum.window import State

if TYPE_CHECKING:
    from gradaccum.accumulator import Accumulator
    from gradaccum.window import Window

__all__ = [
    "Microstep",
    "check_items",
    "clear_window",
    "driver_of",
    "fail",
    "refuse",
    "refuse_close",
]


def _through_torch(
    roots: tuple[torch.Tensor], gradients: tuple[torch.Tensor], *_: Any, **__: Any
) -> None:
    torch.autograd.backward(roots, gradients)


# What `torch.autograd.backward` calls last, once it has checked its arguments and made the
# gradients it was not given: the engine, with the logging and the context that compiled
# autograd reads (private; where a torch lacks it, `torch.autograd.backward` itself).
_run_backward: Callable[..., Any] = (
    getattr(torch.autograd.graph, "_engine_run_backward", None) or _through_torch
)

# Each wrapper whose sync state an open accumulator sets (`SyncStrategy.wrappers`), and
# that accumulator's block: one sets it at a time (`driver_of`).
_drivers: weakref.WeakKeyDictionary[Any, Microstep] = weakref.WeakKeyDictionary()


def driver_of(strategy: SyncStrategy) -> Accumulator | None:
    """The open accumulator that sets the sync state of one of ``strategy``'s wrappers."""
    for wrapper in strategy.wrappers:
        started = _drivers.get(wrapper)
        if started is not None:
            return started._acc()
    return None


class Microstep:
    """The ``with`` block of a microstep, one per accumulator; see `Accumulator.microstep`.

    It holds the loss from ``microstep()`` until the block is entered, and the boundary's
    `Step` until it exits; ``idle`` is what every other microstep of the window reports.
    It holds its accumulator weakly (`acc`), so that an accumulator its loop dropped
    without `Accumulator.close` (a trainer function that returned, or broke out of its
    loop) is freed at once, and gives back its hooks and sync state (`release`).
    ``busy`` refuses a new ``microstep()`` (a loss waits for its block, a block is open, or
    the accumulator is closed or broken: ``stopped``). The other attributes are what the
    hot path reads, each decided once: the accumulator's parts and options (when made),
    what the strategy asks (when the accumulator takes it: `use`, which keeps it as
    ``strategy``), what the strategy was last armed with (``armed``), and the gradients a
    backward starts from (`backward`): made once on the loss's device (``seed_device``,
    its ``get_device()``, read when a window opens), a mean-mode loss's (``unit``, for the
    divisor ``unit_divisor``) and the ones torch makes for any other (``one``), and the
    one this window's microsteps start from past its first (``seed``, for a loss of dtype
    ``seed_dtype``; None until the window's first microstep has chosen it).
    """

    __slots__ = (
        "__weakref__",  # (the model's hook holds its listeners weakly: hooks.py)
        "_acc",
        "armed",
        "arms",
        "busy",
        "every",
        "finite",
        "global_mean",
        "grads",
        "idle",
        "look",
        "loss",
        "max_grad_norm",
        "mean_alone",
        "num_items",
        "one",
        "one_for",
        "one_rank",
        "params",
        "plan",
        "raises",
        "ranks",
        "refusing",
        "scaler",
        "seed",
        "seed_device",
        "seed_dtype",
        "step",
        "stepper",
        "stopped",
        "strategy",
        "unit",
        "unit_divisor",
        "unit_for",
        "watch",
        "watching",
        "window",
    )

    def __init__(self, acc: Accumulator) -> None:
        self._acc = cast("Callable[[], Accumulator]", weakref.ref(acc))
        self.strategy: SyncStrategy = LocalSync()
        self.watching: hooks.Watch | None = None
        self.refusing: hooks.Refusal | None = None
        self.window, self.plan, self.grads = acc._window, acc._plan, acc._grads
        self.params, self.stepper, self.ranks = acc._params, acc._stepper, acc._ranks
        options = acc._options
        self.scaler, self.max_grad_norm = options.scaler, options.max_grad_norm
        self.finite = options.check_finite
        self.raises = options.on_nonfinite == "raise"
        self.every = options.sync == "every"
        self.one_rank = self.ranks.count == 1
        # In mean mode the window's loss is all-reduced for step.global_loss (opt-in), and
        # on one process step.global_loss is step.loss (``mean_alone``).
        self.global_mean = options.global_loss and not self.one_rank
        self.mean_alone = options.global_loss and self.one_rank
        self.watch = self.look = self.arms = False
        self.armed: bool | None = None
        self.busy = self.stopped = False
        self.loss: torch.Tensor | None = None
        self.num_items: int | torch.Tensor | None = None
        self.step: Step | None = None
        self.idle = Step()
        self.unit: torch.Tensor | None = None
        self.unit_divisor = 0
        self.one: torch.Tensor | None = None
        self.seed: torch.Tensor | None = None
        self.seed_dtype: torch.dtype | None = None
        self.one_for: torch.dtype | None = None  # the loss's dtype ``one`` is the seed of
        self.unit_for: torch.dtype | None = None  # ``unit``'s (the loss's it was made for)
        self.seed_device = -2  # (no device: the first window reads the loss's)

    @property
    def acc(self) -> Accumulator:
        """The accumulator (alive while its block is used: it holds the block)."""
        return self._acc()

    def stop(self) -> None:
        """The accumulator takes no more microsteps (closed, or broken)."""
        self.busy = self.stopped = True

    def use(self, strategy: SyncStrategy) -> None:
        """The accumulator takes ``strategy``; what it asks of the hot path is decided once,
        here."""
        self.strategy, self.armed = strategy, None
        for wrapper in strategy.wrappers:
            _drivers[wrapper] = self
        self.arms = type(strategy).arm is not LocalSync.arm  # a local module has nothing to arm
        self.watch = strategy.grads_in_params
        self.look = type(strategy).overridden is not SyncStrategy.overridden

    def arm(self) -> None:
        """Arm the next backward before its forward: sync if the next microstep is the
        boundary or the policy is "every"; the strategy is called only on a change, or
        after each microstep while it could not arm as asked (``armed`` None)."""
        if not self.arms:
            return
        sync = self.window.next_is_boundary or self.every
        if sync is not self.armed:
            self.armed = None if self.strategy.arm(sync) is False else sync

    def watch_model(self) -> None:
        """Put the hook on the model (``watching``), only where something listens
        (hooks.py): a strategy that sees each forward, a forward's collective failing
        under several ranks, and the first forward of a model taken for unwrapped on
        several processes."""
        acc = self.acc
        strategy = self.strategy
        sees = type(strategy).forward_done is not SyncStrategy.forward_done
        guards = acc._ranks.count > 1 and strategy.forward_communicates
        unwrapped = (
            type(strategy) is LocalSync
            and several_processes()
            and not isinstance(acc.model, torch.jit.ScriptModule)  # (which takes no hook)
        )
        if not (sees or guards or unwrapped):
            return
        self.watching = hooks.watch(
            acc.model,
            done=self.forward_done if sees else self.first_forward if unwrapped else None,
            failed=self.forward_failed if guards else None,
        )

    def forward_done(self) -> None:
        """After each forward of the model, for a strategy that sees each one
        (`SyncStrategy.forward_done`)."""
        self.strategy.forward_done()

    def first_forward(self) -> None:
        """After the first forward under grad mode (a training forward, not an evaluation's)
        of a model taken for unwrapped on several processes, and then no more (the hook is
        taken off): refuse one that ran inside the forward of a DDP built around it since,
        whose all-reduce the accumulator cannot defer."""
        if not torch.is_grad_enabled():
            return
        acc = self.acc
        self.unwatch()
        ddp = ddp_running_around(acc.model)
        if ddp is not None:
            msg = (
                f"the model's forward runs inside a {type(ddp).__name__} built around it "
                "after the Accumulator, which took the model for an unwrapped one: DDP would "
                "all-reduce on every microbatch, and the ranks would not agree on the "
                "epoch's length or the item totals. Build the Accumulator on the wrapped "
                "model: after model = DistributedDataParallel(model), or on what "
                "accelerator.prepare(model, ...) returns"
            )
            raise UsageError(msg)

    def unwatch(self) -> None:
        """Take the hook's listeners off the model."""
        watching, self.watching = self.watching, None
        if watching is not None:
            watching.remove()

    def release(self) -> None:
        """Give back what the accumulator set on the model: its sync state and its hooks."""
        for wrapper in self.strategy.wrappers:
            if _drivers.get(wrapper) is self:
                del _drivers[wrapper]
        self.strategy.restore()
        self.unwatch()
        refusing, self.refusing = self.refusing, None
        if refusing is not None:
            refusing.remove()

    def broken(self, reason: str) -> None:
        """On several ranks a rank failed (``reason``): the ranks' windows no longer line
        up, so the accumulator takes no more calls, and where the model's forward runs a
        collective its forwards are refused before it, since it would pair with another
        window's on the other ranks (gloo then aborts every process, with no message);
        `release` lets them run again. A loop that catches the failure and goes on gets
        this refusal instead, and the other ranks name this rank's failure."""
        self.acc._life.break_(reason)
        if self.refusing is not None or not self.strategy.forward_communicates:
            return
        msg = (
            f"the model's forward was called after {reason}: its collectives would pair "
            "with other ones on the other ranks, so gradaccum refuses it; restart every "
            "rank from the last checkpoint"
        )
        self.refusing = hooks.Refusal(self.acc.model, msg)

    def forward_failed(self, error: BaseException) -> None:
        """A forward of the model raised, outside a microstep block (the block's exit sees an
        error raised in it). This rank failed, or its collective did because another rank
        had: ``model(x)`` runs outside any gradaccum call, so the error cannot be replaced
        by a `RankFailedError` there; it gets that error's message as a note instead, and
        the accumulator is broken with it."""
        acc = self.acc
        if self.window.in_block or acc._life.state is not State.OPEN:
            return
        failed = fail(acc, error, in_collectives=True)
        if failed is not None:
            faults.add_note(error, f"gradaccum.RankFailedError: {failed}")

    def backward(self, loss: torch.Tensor, num_items: int | torch.Tensor | None) -> None:
        """Back-propagate ``loss`` where the window's ``seed`` does not fit it: the window's
        first microstep (which opens the window and chooses the seed), a loss of another
        dtype, a tensor subclass, or a ``__torch_function__`` mode.

        A mean-mode loss back-propagates as ``(loss / divisor).backward()`` would: ``loss``
        from ``unit``, the gradient that the division sends into ``loss``, ``1 / divisor``
        computed by the same division in the loss's dtype on its device, so that the
        gradients are the same bit for bit without the division's two ops (its forward and
        its backward) and torch's ``ones_like`` on every microstep. The unit is made for a
        plain floating-point tensor (a subclass, such as a DTensor, takes its own gradient,
        and a complex loss is refused by torch) and, with a scaler, a divisor that is a
        power of two (the scaler's backward multiplies by its scale, and ``scale * (1 /
        divisor)`` equals ``scale / divisor`` exactly only then); elsewhere the loss is
        divided. Any other loss (``num_items``, ``steps=1``, a divided one) starts from the
        ones that ``backward()`` makes, ``one``, which the first such backward makes once.
        Both are kept until the divisor, the dtype or the device changes (the device is read
        as a window opens), or something writes to them in place (a hook of the loss's that
        changes its gradient in place: ``_version`` tells). Where ``loss`` itself started
        from a kept gradient, that gradient is the window's ``seed`` from then on
        (`__enter__`).

        A kept gradient goes to the engine as ``torch.autograd.backward`` hands it on once it
        has checked its arguments; a subclass or a mode goes through ``root.backward()``,
        which its ``__torch_function__`` sees.
        """
        divisor, scaler = self.window.divisor, self.scaler
        plain = type(loss) is torch.Tensor
        dtype = loss.dtype
        root, unit = loss, None
        if num_items is None and divisor != 1:
            unit = self.unit
            if not (
                unit is not None
                and plain
                and self.unit_divisor == divisor
                and unit.dtype is dtype
                and not unit._version
            ):
                if (
                    plain
                    and dtype.is_floating_point
                    and (scaler is None or not divisor & (divisor - 1))
                ):
                    unit = torch.ones((), dtype=dtype, device=loss.device) / divisor
                    self.unit, self.unit_divisor, self.unit_for = unit, divisor, dtype
                else:
                    unit, root = None, loss / divisor
        divided = root is not loss
        if scaler is not None:
            root = scaler.scale(root)
        seed = unit
        if seed is None:
            one = self.one
            if one is not None and one.dtype is root.dtype and not one._version:
                seed = one
        direct = type(root) is torch.Tensor and not has_torch_function_unary(root)
        if seed is not None and direct:
            _run_backward(
                (root,), (seed,), False, False, (), allow_unreachable=True, accumulate_grad=True
            )
        else:
            if seed is None and type(root) is torch.Tensor and root.dtype.is_floating_point:
                # What this backward() makes on its own, kept for the next ones (the
                # seed of ``loss``'s dtype below, unless root is ``loss`` divided).
                self.one = seed = torch.ones((), dtype=root.dtype, device=root.device)
                self.one_for = None
            root.backward(unit)  # type: ignore[no-untyped-call]
        if plain and direct and not divided and seed is not None:
            self.seed, self.seed_dtype = seed, dtype
            if seed is self.one:
                self.one_for = dtype

    def open(self, loss: torch.Tensor, by_items: bool) -> torch.Tensor | None:
        """The window's first microstep fixes its mode and divisor; return the seed its
        microsteps start from, kept from an earlier window of the same kind (the unit of
        the same divisor, or the ones) on the loss's device, or None (`backward` chooses)."""
        window = self.window
        window.open(by_items)
        device = loss.get_device()  # (-1 on the CPU)
        if device != self.seed_device:  # (the kept gradients are made on the loss's device)
            self.unit = self.one = self.one_for = None
            self.unit_divisor, self.seed_device = 0, device
        if by_items or window.divisor == 1:
            self.seed, self.seed_dtype = self.one, self.one_for
        elif self.unit_divisor == window.divisor:
            self.seed, self.seed_dtype = self.unit, self.unit_for
        else:
            self.seed = None
        return self.seed

    def __enter__(self) -> Step:
        loss = self.loss
        if loss is None:
            msg = "a microstep block was entered twice; call acc.microstep(loss) for each one"
            raise UsageError(msg)
        self.loss = None
        window, grads, num_items = self.window, self.grads, self.num_items
        window.in_block = True
        if self.plan.active:  # (a microstep outside the epoch uses no microbatch of it)
            self.plan.pending = False
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
                _wiped_or_changed(self, change)
        try:
            if self.look:
                actual = self.strategy.overridden()
                if actual is not None:
                    _warn_overridden(self.acc, actual)
            seed = self.seed if window.done else self.open(loss, num_items is not None)
            if (
                seed is not None
                and type(loss) is torch.Tensor
                and loss.dtype is self.seed_dtype
                and not seed._version
                and not has_torch_function_unary(loss)
            ):
                # What root.backward(seed) runs once it has checked its arguments.
                scaler = self.scaler
                _run_backward(
                    (loss if scaler is None else scaler.scale(loss),),
                    (seed,),
                    False,
                    False,
                    (),
                    allow_unreachable=True,
                    accumulate_grad=True,
                )
            else:
                self.backward(loss, num_items)
            # The value only, not the graph (freed now); `.data` is the loss's detached
            # alias, made without a dispatch (`detach()` costs half again as much).
            window.losses.append(loss.data)
            if num_items is not None:
                window.items.append(num_items)
            if window.done != window.last:
                if param is not None:
                    grads.version = grads.grad._version  # type: ignore[union-attr]
                    if grads.rest:
                        grads.update()
                elif self.watch:
                    grads.start(self.params.first, self.params.watched())
                return self.idle
            self.step = step = self.boundary()
        except BaseException as error:
            window.in_block = False
            self.busy = self.stopped
            _note_backward_already(error)
            failed = fail(self.acc, error, in_collectives=True)
            if failed is not None:
                raise failed from error
            raise
        return step

    def __exit__(self, _: object, error: BaseException | None, *__: object) -> None:
        window = self.window
        window.in_block = False
        self.busy = self.stopped
        step = self.step
        if step is None and error is None:
            window.done += 1
            if self.arms and (window.done == window.last or self.armed is None):
                self.arm()
            return
        self.step = None
        if error is not None:
            if step is not None and self.scaler is not None:
                _note_unscaled_already(error)
            fail(self.acc, error)
        elif step is not None:
            self.apply(step)

    def boundary(self) -> Step:
        """Normalize, unscale, clip and check the window's gradient: the boundary's `Step`,
        what its block sees. Only the fields that differ from `Step`'s defaults are set."""
        window, params, ranks = self.window, self.params, self.ranks
        listed = params.now()
        losses = window.losses
        step = Step()
        step.boundary = True
        step.global_step = self._acc()._global_step + 1
        step._losses = losses
        if window.by_items:
            step._divisor, step._global = boundary.normalize(params, window, ranks)
            step._by_items = True
            step._alone = self.one_rank
        else:
            step._divisor = len(losses)
            if window.divisor != window.size:  # an epoch that ended sooner than planned
                boundary.rescale(params, window)
            if self.global_mean:
                step._global = boundary.global_mean(window, ranks)
            if not self.mean_alone:  # (step.global_loss is None, or the ranks' mean)
                step._alone = False
        stepper = self.stepper
        if self.scaler is not None:
            stepper.unscale()
        norm = None
        if self.max_grad_norm is not None:
            step.grad_norm = norm = boundary.clip(self.strategy, params, self.max_grad_norm)
        step.lrs = stepper.learning_rates()
        grads = self.grads
        if grads.param is None:  # a window of one microstep, or a wrapping not watched before
            grads.start(params.first, params.watched())
        if self.finite and not boundary.all_finite(listed, norm, ranks):
            if self.raises:
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
        acc = self._acc()
        if not step.skipped and self.grads.dropped():
            _dropped_in_block(acc, step)
        stepper = self.stepper
        try:
            skipped = stepper.apply(step.skipped)
        except BaseException as failure:
            applied = stepper.applied
            if applied:  # the optimizers stepped: the window counts, though it failed
                stepper.clear()
                self.close_window(acc, skipped=False)
            fail(acc, failure, applied=applied)
            raise
        if skipped:
            step.skipped = True
        self.close_window(acc, skipped=skipped)

    def close_window(self, acc: Accumulator, *, skipped: bool) -> None:
        """Count the window that closed (applied or skipped; its gradient is cleared) and
        start the next."""
        if skipped:
            acc._skipped += 1
        acc._global_step += 1
        self.plan.close_window(self.window.by_items)
        self.next_window(acc)

    def next_window(self, acc: Accumulator) -> None:
        """The window closed or was dropped (its gradient cleared): the next one takes
        ``steps`` microsteps, reports the steps completed so far, chooses its own seed and
        is armed."""
        self.grads.stop()
        self.window.reset(acc._steps)
        self.idle = idle = Step()
        idle.global_step = acc._global_step
        self.seed = None
        if self.arms:
            self.arm()


def refuse(acc: Accumulator) -> NoReturn:
    """Refuse a ``microstep()`` call while the block is busy: the accumulator is closed or
    broken, a loss was never entered (dropped, so that the corrected loop can run), or
    a block is open."""
    acc._life.check("microstep()")
    started = acc._block
    if started.loss is not None:
        started.loss, started.busy = None, started.stopped
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


def refuse_close(window: Window) -> None:
    """Refuse `Accumulator.close` inside a microstep's block: leaving the block still needs
    the accumulator (the boundary's applies the window)."""
    if window.in_block:
        msg = (
            "close() was called inside a microstep's `with` block; close the accumulator "
            "after the block has exited (leaving the window's last block applies its update)"
        )
        raise UsageError(msg)


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


def clear_window(acc: Accumulator) -> None:
    """Drop the window: clear its gradient and state, so that the next microstep starts
    clean."""
    acc._stepper.clear()
    acc._block.next_window(acc)


def fail(
    acc: Accumulator, error: BaseException, *, applied: bool = False, in_collectives: bool = False
) -> RankFailedError | None:
    """After ``error``: drop the open window (unless it was applied, and so counted); under
    several ranks, say which rank failed.

    A rank that raises records the failure in the process group's store and refuses
    further microsteps: its windows no longer line up with the others'. A rank whose
    forward, backward or boundary (``in_collectives``: where the collectives run) fails
    after another rank recorded a failure gets the `RankFailedError` to raise from
    ``error``, naming that rank and the window each of the two stopped in.
    """
    if not applied:
        clear_window(acc)
        acc._plan.recut(acc._steps)  # the next windows start after the failed microbatch
    ranks = acc._ranks
    if ranks.count == 1 or isinstance(error, NonFiniteError):  # every rank raised that
        return None
    number = acc._global_step + (not applied)  # the window this rank stopped in
    peer = ranks.first_failure() if in_collectives else None
    if peer is not None:
        acc._block.broken(f"rank {peer.rank} failed ({peer.what})")
        message = _rank_failed(ranks.rank, number, applied, peer)
        return RankFailedError(message, peer.rank, number, applied)
    ranks.record_failure(number, applied, error)
    acc._block.broken(f"this rank failed in window {number} ({type(error).__name__}: {error})")
    return None


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


def _wiped_or_changed(block: Microstep, change: str) -> None:
    """The window's gradient was cleared since its last microstep (refused: the window is
    discarded; this rank's own refusal, not a collective's failure, so never
    `RankFailedError`), or changed in place (warned about)."""
    window = block.window
    if change == "changed":
        warn(
            f"the gradient of this window was changed in place after microstep {window.done} "
            f"of {window.size} (by clip_grad_norm_, say, or a backward outside the "
            "accumulator), so that change applied to a partial sum; pass max_grad_norm= to "
            "the Accumulator, or clip inside the boundary's block (when step.boundary is "
            "True); back-propagate the window's losses through acc.microstep alone"
        )
        return
    window.in_block = False
    block.busy = block.stopped
    msg = (
        f"the gradient of this window's first {window.done} microsteps was cleared "
        "since the last one, by optimizer.zero_grad() or model.zero_grad() inside the "
        "window; remove that call: the accumulator clears the gradients after each "
        "window's optimizer step (the window is discarded)"
    )
    error = UsageError(msg)
    fail(block.acc, error)
    raise error


def _dropped_in_block(acc: Accumulator, step: Step) -> None:
    """A watched gradient was dropped in the boundary's block: refused (the window is
    discarded; raises) where every parameter of an optimizer, or of the model, lost its
    gradient, as ``zero_grad()`` leaves them; a gradient set to None by hand, its
    parameter left out of this update, is not refused."""
    if not any(all(p.grad is None for p in params) for params in acc._params.watched()):
        return
    msg = (
        f"the gradient of window {step.global_step} was cleared inside its boundary block, "
        "by optimizer.zero_grad() or model.zero_grad(), before the accumulator's optimizer "
        "step, so nothing was applied (the window is discarded); remove that call: leaving "
        "the boundary block steps the optimizer, then clears the gradients"
    )
    error = UsageError(msg)
    fail(acc, error)
    raise error


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


def _warn_overridden(acc: Accumulator, actual: bool) -> None:
    """This backward will communicate otherwise than was armed: DDP's forward saw another
    flag (it ran ahead of its block, or inside a ``no_sync()`` of the user's own), or
    someone else turned the wrapper's sync off or on since it was armed."""
    window, strategy = acc._window, acc._block.strategy
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
