"""What an accumulator sets on the user's model: its wrapper's sync state, armed before
each microstep's forward, the hook that hears its forwards, and the refusal of forwards
after a rank failed. Everything here is given back by `Arming.release`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gradaccum import hooks
from gradaccum.errors import UsageError
from gradaccum.sync import LocalSync, SyncStrategy, ddp_running_around, several_processes

__all__ = ["Arming"]


class Arming:
    """The model's sync state and hooks, for one accumulator.

    Attributes:
        model: The model, as given.
        strategy: How the model's wrapping communicates (`gradaccum.sync`).
        every: The policy is ``"every"``: every microstep syncs.
        arms: The strategy has something to arm (a wrapped model).
        armed: What the strategy was last armed with; None until armed, or while it could
            not arm as asked (then it is asked again after each microstep).
        look: The strategy can tell that its sync was changed behind the accumulator's back
            (`SyncStrategy.overridden`).
    """

    __slots__ = (
        "__weakref__",  # (the model's hook holds its listeners weakly: hooks.py)
        "armed",
        "arms",
        "every",
        "look",
        "model",
        "refusing",
        "strategy",
        "watching",
    )

    def __init__(self, model: nn.Module, strategy: SyncStrategy, every: bool) -> None:
        self.model = model
        self.every = every
        self.armed: bool | None = None
        self.watching: hooks.Watch | None = None
        self.refusing: hooks.Refusal | None = None
        self.use(strategy)

    def use(self, strategy: SyncStrategy) -> None:
        """Take ``strategy`` (after restoring the one held before, if any)."""
        self.strategy: SyncStrategy = strategy
        self.armed = None
        self.arms = type(strategy).arm is not LocalSync.arm  # a local module has nothing to arm
        self.look = type(strategy).overridden is not SyncStrategy.overridden

    def arm(self, boundary: bool) -> None:
        """Arm the next backward before its forward: sync if it completes the window
        (``boundary``) or the policy is "every"; the strategy is called only on a change."""
        sync = boundary or self.every
        if sync is not self.armed:
            self.armed = None if self.strategy.arm(sync) is False else sync

    def watch(self, ranks: int, failed: Callable[[BaseException], BaseException | None]) -> None:
        """Put the hook on the model, only where something listens (hooks.py): a strategy
        that sees each forward (`forward_done`), a forward's collective failing under
        several ``ranks`` (``failed``), and the first forward of a model taken for
        unwrapped on several processes (`first_forward`)."""
        strategy = self.strategy
        sees = type(strategy).forward_done is not SyncStrategy.forward_done
        guards = ranks > 1 and strategy.forward_communicates
        unwrapped = (
            type(strategy) is LocalSync
            and several_processes()
            and not isinstance(self.model, torch.jit.ScriptModule)  # (which takes no hook)
        )
        if sees or guards or unwrapped:
            self.watching = hooks.watch(
                self.model,
                done=self.forward_done if sees else self.first_forward if unwrapped else None,
                failed=failed if guards else None,
            )

    def forward_done(self) -> None:
        """After each forward of the model, for a strategy that sees each one."""
        self.strategy.forward_done()

    def first_forward(self) -> None:
        """After the first training forward of a model taken for unwrapped on several
        processes (then the hook is taken off): refuse one that ran inside the forward of
        a DDP built around it since, whose all-reduce the accumulator cannot defer."""
        if not torch.is_grad_enabled():
            return
        self.unwatch()
        ddp = ddp_running_around(self.model)
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

    def refuse_forwards(self, reason: str) -> None:
        """A rank failed (``reason``): where the model's forward runs a collective, refuse
        it before it runs, since it would pair with another window's on the other ranks
        (gloo then aborts every process, with no message)."""
        if self.refusing is not None or not self.strategy.forward_communicates:
            return
        msg = (
            f"the model's forward was called after {reason}: its collectives would pair "
            "with other ones on the other ranks, so gradaccum refuses it; restart every "
            "rank from the last checkpoint"
        )
        self.refusing = hooks.Refusal(self.model, msg)

    def unwatch(self) -> None:
        """Take the hook's listeners off the model."""
        watching, self.watching = self.watching, None
        if watching is not None:
            watching.remove()

    def release(self) -> None:
        """Give back the wrapper's sync state and the hooks: the model is as it was."""
        self.strategy.restore()
        self.unwatch()
        refusing, self.refusing = self.refusing, None
        if refusing is not None:
            refusing.remove()
