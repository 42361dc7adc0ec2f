"""A hypothesis state machine drives random training loops against a model of the contract.

Each epoch's loop body does one drawn action per microbatch it is handed: a plain
microstep (with and without ``num_items``, as an int or a tensor; with faults: an
exception in the block or in the backward, a non-finite loss, a GradScaler overflow, a
NaN only in an added parameter group), a skip (``continue``), ``acc.steps = k`` at the
top of the body or after the block, a checkpoint there (mid-window with
``include_grads``) with or without a resume into a fresh accumulator (with the same or
another ``steps``, ``allow_steps_change``, a version 1 or 2 state), a ``break`` there,
``optimizer.add_param_group``, ``zero_grad()`` inside a window, a window that mixes
``num_items`` with mean losses, or calls that must be refused (a nested epoch, a load
during the epoch, ``state_dict()`` or ``acc.steps`` inside a block, a second accumulator
while a window is open, a load with another ``steps`` or ``drop_last``, a load into a
closed accumulator). The model is trained by one optimizer or by two (the weight's and
the bias's, the second with a scheduler or without; its ``zero_grad()`` wipes only the
bias). Epochs are sized or not, under both ``drop_last`` modes; bare
microsteps, checkpoints, ``steps`` changes and parameter groups also come between epochs.

After every call the accumulator must agree with `tests.contract.Contract`, an
independent float64 model, or refuse the call with a gradaccum error that leaves its
state unchanged. Warnings are checked one by one. ``--hypothesis-show-statistics``
shows how often each seam was reached (the ``event()`` lines).

``--hypothesis-profile=long`` runs many more examples than CI (see tests/conftest.py).
"""

from __future__ import annotations

import functools
import io
import itertools
import math
import warnings
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)
from torch import nn

import gradaccum
from tests.contract import (
    EXTRA_INIT,
    GAMMA,
    GAMMA_BIAS,
    LR,
    LR_BIAS,
    LR_EXTRA,
    MAX_NORM,
    MOMENTUM,
    Contract,
    Micro,
    Saved,
)

TOL = 1e-10
WEIGHT = torch.tensor([[0.3, -0.2, 0.5]], dtype=torch.float64)
BIAS = torch.tensor([0.1], dtype=torch.float64)

# A microbatch's rows and fault: none, an exception in the block or in the backward, a
# NaN loss, or a loss whose scaled gradient overflows (only with a GradScaler). Mostly
# clean.
FAULTS = (None,) * 8 + ("body", "backward", "nan", "overflow")
MICROBATCHES = [(rows, fault) for fault in FAULTS for rows in (1, 2, 3)]
microbatches = st.sampled_from(MICROBATCHES)


@dataclass(frozen=True)
class Action:
    """What the loop body does with a microbatch it was handed.

    ``kind``: "plain", "skip" (``continue``), "steps" (``acc.steps = steps``),
    "checkpoint", "break", "group" (``add_param_group``), "zero_grad", "probe" (calls
    that must be refused) or "mix" (``num_items`` flipped); ``top``: at the top of the
    body, else after the block (a probe: inside it); ``steps``: the new value, or the
    fresh accumulator's (zero_grad: odd for ``set_to_none=True``); ``include_grads``;
    ``resume``: after the checkpoint, break out and resume in a fresh accumulator;
    ``allow``: ``allow_steps_change``; ``flag``: close the old accumulator first
    (checkpoint), ``model.zero_grad()`` (zero_grad), a nested epoch (probe); ``odd``: a
    fresh accumulator with the other ``drop_last`` first, and a load into the closed one.
    """

    kind: str = "plain"
    top: bool = True
    steps: int = 1
    include_grads: bool = False
    resume: bool = False
    allow: bool = False
    flag: bool = False
    odd: bool = False
    version: int = 3  # checkpoint: the state relabelled as an older version (they load alike)

    def __repr__(self) -> str:  # the fields this kind reads and that are not the default
        changed = [
            f"{name}={getattr(self, name)!r}"
            for name in USES.get(self.kind, ())
            if getattr(self, name) != getattr(PLAIN, name)
        ]
        return f"Action({', '.join([repr(self.kind), *changed])})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # hypothesis's repros
        printer.text(repr(self))


PLAIN = Action()
USES = {  # the fields each kind reads
    "steps": ("top", "steps"),
    "checkpoint": ("top", "steps", "include_grads", "resume", "allow", "flag", "odd", "version"),
    "break": ("top",),
    "zero_grad": ("steps", "flag"),
    "probe": ("top", "flag"),
}
KINDS = ("plain",) * 6 + (
    "skip",
    "steps",
    "checkpoint",
    "checkpoint",
    "break",
    "group",
    "zero_grad",
    "probe",
    "mix",
)


def decode(kind: str, bits: int) -> Action:
    """An action of ``kind`` with its parameters from 10 bits."""
    return Action(
        kind,
        top=not bits & 1,
        steps=1 + (bits >> 1 & 3),
        include_grads=bool(bits & 8),
        resume=bool(bits & 16),
        allow=bool(bits & 32),
        flag=bool(bits & 64),
        odd=bits >> 7 == 3,
        version=(3, 2, 1, 3, 3, 3, 3, 3)[bits >> 7],
    )


@dataclass(frozen=True)
class Turn:
    """A microbatch of an epoch (its rows and fault), and what the loop body does with the
    microbatch handed out in this turn."""

    rows: int
    fault: str | None
    action: Action

    def __repr__(self) -> str:
        return f"Turn({self.rows}, {self.fault!r}, {self.action!r})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # hypothesis's repros
        printer.text(repr(self))


TURNS = len(MICROBATCHES) * len(KINDS) * 1024


def turn(code: int) -> Turn:
    """A turn from one integer: one draw (draws are most of hypothesis's cost here),
    scrambled by a bijection so that hypothesis's preference for small integers favours
    no kind; 0 is still the simplest turn, a clean row and a plain microstep."""
    code, micro = divmod(code * 7919 % TURNS, len(MICROBATCHES))
    bits, kind = divmod(code, len(KINDS))
    return Turn(*MICROBATCHES[micro], decode(KINDS[kind], bits))


class Loop(NamedTuple):
    """How an epoch's loop runs: over a sized iterable or not, with ``num_items`` or not,
    and the ``steps`` set between ``acc.epoch()`` and its first ``next()`` (or None)."""

    sized: bool
    by_items: bool
    steps_first: int | None


turns = st.integers(0, TURNS - 1).map(turn)
loops = st.sampled_from(
    [
        Loop(*options)
        for options in itertools.product(
            (True, False), (False, True), (None, None, None, None, 1, 2, 3, 4)
        )
    ]
)
checkpoints = st.integers(0, 1023).map(lambda bits: decode("checkpoint", bits))


class BackwardFails(torch.autograd.Function):
    """Identity whose backward raises: an error during ``loss.backward()``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise FloatingPointError("backward failed on purpose")


def state_of(acc: gradaccum.Accumulator, params: list[torch.Tensor]) -> tuple[Any, ...]:
    """What a refused call must leave as it was: the public state and the gradients."""
    grads = [None if p.grad is None else repr(p.grad.tolist()) for p in params]  # NaN == NaN
    return repr(acc), acc.global_step, acc.skipped_steps, acc.position, acc.steps, grads


def break_off(epoch: Iterator[Micro]) -> None:
    """``break``: the loop leaves the epoch, and its generator is closed."""
    assert isinstance(epoch, Generator)
    epoch.close()


class AccumulatorMachine(RuleBasedStateMachine):
    """Random training loops against `Contract`."""

    def __init__(self) -> None:
        super().__init__()
        self.seed = 0
        self.last_epoch: tuple[list[Micro], bool, bool] | None = None
        self.extra: torch.Tensor | None = None

    # Set-up -----------------------------------------------------------------------

    @initialize(
        steps=st.integers(1, 4),
        drop_last=st.booleans(),
        scaler=st.booleans(),
        on_nonfinite=st.sampled_from([None, "raise", "skip"]),
        clip=st.booleans(),
        optimizers=st.sampled_from(["one", "two", "two, the second unscheduled"]),
    )
    def build(
        self,
        steps: int,
        drop_last: bool,
        scaler: bool,
        on_nonfinite: str | None,
        clip: bool,
        optimizers: str,
    ) -> None:
        """A float64 linear model, SGD with momentum and StepLR on all of it, or (Muon +
        AdamW-style) one SGD with its StepLR on the weight and another on the bias with
        its own StepLR or none; maybe a GradScaler."""
        if scaler and on_nonfinite == "raise":
            on_nonfinite = "skip"  # refused together: see the bad-input catalog
        self.model = nn.Linear(3, 1, dtype=torch.float64)
        with torch.no_grad():  # (torch.manual_seed costs a millisecond per example)
            self.model.weight.copy_(WEIGHT)
            self.model.bias.copy_(BIAS)
        split = optimizers != "one"
        if split:
            weight = torch.optim.SGD([self.model.weight], lr=LR, momentum=MOMENTUM)
            bias = torch.optim.SGD([self.model.bias], lr=LR_BIAS, momentum=MOMENTUM)
            self.optimizers = [weight, bias]
            self.schedulers: list[Any] = [
                torch.optim.lr_scheduler.StepLR(weight, 1, gamma=GAMMA),
                None
                if optimizers.endswith("unscheduled")
                else torch.optim.lr_scheduler.StepLR(bias, 1, gamma=GAMMA_BIAS),
            ]
        else:
            whole = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
            self.optimizers = [whole]
            self.schedulers = [torch.optim.lr_scheduler.StepLR(whole, 1, gamma=GAMMA)]
        self.optimizer_steps = [0] * len(self.optimizers)
        for index, optimizer in enumerate(self.optimizers):
            optimizer.register_step_post_hook(functools.partial(self._count_step, index))
        self.scaler = (
            torch.amp.GradScaler("cpu", init_scale=2.0**100, growth_interval=10**9)
            if scaler
            else None
        )
        self.options: dict[str, Any] = {
            "scaler": self.scaler,
            "on_nonfinite": on_nonfinite,
            "max_grad_norm": MAX_NORM if clip else None,
        }
        self.acc = self.new_acc(steps, drop_last)
        params = {"weight": self.model.weight, "bias": self.model.bias}
        self.contract = Contract(
            steps,
            drop_last,
            scaler,
            on_nonfinite,
            clip,
            {name: p.detach().clone() for name, p in params.items()},
            split=split,
            bias_scheduled=self.schedulers[-1] is not None,
        )
        event(f"optimizers: {optimizers}")

    def _count_step(self, index: int, *_: object) -> None:
        self.optimizer_steps[index] += 1

    def new_acc(self, steps: int, drop_last: bool | None = None) -> gradaccum.Accumulator:
        if drop_last is None:
            drop_last = self.contract.drop_last
        several = len(self.optimizers) > 1
        return gradaccum.Accumulator(
            self.model,
            self.optimizers if several else self.optimizers[0],
            self.schedulers if several else self.schedulers[0],
            steps=steps,
            drop_last=drop_last,
            **self.options,
        )

    def params(self) -> list[torch.Tensor]:
        return [p for o in self.optimizers for group in o.param_groups for p in group["params"]]

    # Checks -----------------------------------------------------------------------

    @contextmanager
    def warnings_checked(self) -> Iterator[None]:
        """The GradaccumWarnings raised in the block are the contract's, in order."""
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", gradaccum.GradaccumWarning)
            yield
        got = [str(w.message) for w in seen if issubclass(w.category, gradaccum.GradaccumWarning)]
        want, self.contract.warnings = self.contract.warnings, []
        assert len(got) == len(want), (got, want)
        for message, fragment in zip(got, want, strict=True):
            assert fragment in message, (message, fragment)
            event(f"warned: {fragment[:45]}...")

    def refused(
        self,
        error: type[Exception],
        fragment: str,
        call: Callable[[], object],
        acc: gradaccum.Accumulator | None = None,
    ) -> None:
        """``call`` raises ``error`` (message with ``fragment``) and changes nothing."""
        acc = self.acc if acc is None else acc
        before = state_of(acc, self.params())
        with pytest.raises(error, match=fragment):
            call()
        assert state_of(acc, self.params()) == before

    def check_window(self) -> None:
        """Where the window and the epoch stand (repr, position, global_step)."""
        contract = self.contract
        assert f"window={len(contract.window)}/{contract.size})" in repr(self.acc)
        assert self.acc.global_step == contract.windows
        assert self.acc.position == contract.handed

    # One microstep, as a user's loop runs it -----------------------------------------

    def loss_of(self, micro: Micro, by_items: bool) -> torch.Tensor:
        x, y = micro.data()
        prediction = self.model(x)
        if self.extra is not None:
            prediction = prediction + self.extra * x[:, :1]
        loss = (prediction - y).square()
        loss = loss.sum() if by_items else loss.mean()
        if micro.fault == "nan" and self.extra is not None and micro.seed % 3 == 0:
            # NaN only in the added group's gradient (the loss's value is NaN too).
            loss = loss + (self.extra - self.extra.detach()) * math.nan
            event("NaN only in the added group's gradient")
        elif micro.fault in ("nan", "overflow"):
            loss = loss * micro.factor()
        if micro.fault == "backward":
            loss = BackwardFails.apply(loss)
        return loss

    def microstep(self, micro: Micro, by_items: bool, probe: bool = False) -> None:
        """Run ``micro`` through ``acc.microstep``; check what escapes and update the
        contract (``probe``: also calls that a block refuses, from inside it)."""
        contract = self.contract
        num_items = micro.rows if micro.seed % 2 else torch.tensor(micro.rows)
        if contract.window and contract.window[0][1] is not by_items:
            loss = self.loss_of(micro, by_items)
            self.refused(
                gradaccum.UsageError,
                "on every microstep of a window",
                lambda: self.acc.microstep(loss, num_items if by_items else None),
            )
            event("refused: num_items mixed in a window (then retried)")
            by_items = contract.window[0][1]
        block = self.acc.microstep(self.loss_of(micro, by_items), num_items if by_items else None)
        contract.enter()
        if contract.wiped:
            with pytest.raises(gradaccum.UsageError, match="zero_grad"):
                block.__enter__()
            contract.fail()
            event("refused: a microstep after zero_grad() in the window")
            return
        boundary = len(contract.window) == contract.size - 1
        contract.window.append((micro, by_items))
        if micro.fault == "backward":
            with pytest.raises(FloatingPointError, match="on purpose"):
                block.__enter__()
            contract.fail()
            return
        if boundary and contract.on_nonfinite == "raise" and contract.faulty():
            with pytest.raises(gradaccum.NonFiniteError, match=f"window {contract.windows + 1}"):
                block.__enter__()
            contract.fail()
            event("window raised NonFiniteError")
            return
        if micro.fault == "body":
            with pytest.raises(KeyError), block:
                raise KeyError("the block failed on purpose")
            contract.fail()
            return
        lrs = [contract.lrs["weight"]] + ([contract.lrs["bias"]] if contract.split else [])
        outcome = contract.boundary() if boundary else None
        if outcome:
            mode = f"num_items {type(num_items).__name__}" if by_items else "mean"
            event(f"window {outcome} ({mode})")
        with block as step:
            assert step.boundary is boundary
            if probe:
                self.refused(
                    gradaccum.UsageError,
                    "after the `with` block",
                    lambda: self.acc.state_dict(include_grads=True),
                )
                other = contract.steps + 1  # (the value it has is a no-op)
                self.refused(
                    gradaccum.UsageError, "mid-window", lambda: setattr(self.acc, "steps", other)
                )
                event(f"refused: state_dict and steps inside a {'boundary ' * boundary}block")
            if boundary:
                assert step.global_step == contract.windows
                assert math.isclose(float(step.lr or 0.0), lrs[0], rel_tol=1e-15)
                assert len(step.lrs) == len(lrs)
                for got, want in zip(step.lrs, lrs, strict=True):
                    assert math.isclose(float(got or 0.0), want, rel_tol=1e-15)
                if contract.on_nonfinite == "skip":
                    assert step.skipped is (outcome == "skipped")
        if boundary:
            assert step.skipped is (outcome == "skipped")

    def next_micro(self, rows: int, fault: str | None) -> Micro:
        self.seed += 1
        if fault in ("nan", "overflow") and not self.contract.scaler:
            # Without a scaler an overflow is just a NaN; with no check either, it would
            # stick in the parameters (as in plain PyTorch), so none is drawn.
            fault = "nan" if self.contract.on_nonfinite else None
        return Micro(self.seed, rows, fault)

    # Calls between windows ---------------------------------------------------------

    def set_steps(self, steps: int, where: str) -> None:
        """``acc.steps = steps``: accepted between windows, refused mid-window unless it is
        the value it has (a no-op)."""
        if self.contract.window and steps != self.contract.steps:
            self.refused(
                gradaccum.UsageError, "mid-window", lambda: setattr(self.acc, "steps", steps)
            )
            event("refused: steps set mid-window")
            return
        self.acc.steps = steps
        self.contract.set_steps(steps)
        event(f"steps set {where}")
        self.check_window()

    def add_group(self, where: str) -> None:
        """``optimizer.add_param_group`` with a scalar that enters the loss, between windows."""
        if self.extra is not None or self.contract.window:
            return
        self.extra = torch.tensor(EXTRA_INIT, dtype=torch.float64, requires_grad=True)
        self.optimizers[-1].add_param_group({"params": [self.extra], "lr": LR_EXTRA})
        self.contract.add_extra()
        event(f"param group added {where}")

    def checkpoint(self, include_grads: bool, where: str) -> tuple[dict[str, Any], Saved] | None:
        """``state_dict()`` as the contract says, through bytes; None when refused."""
        contract = self.contract
        saved = contract.state_dict(include_grads)
        if saved is None:
            self.refused(
                gradaccum.UsageError,
                "include_grads=True",
                lambda: self.acc.state_dict(include_grads=include_grads),
            )
            event("refused: state_dict mid-window without include_grads")
            return None
        before = state_of(self.acc, self.params())
        state = self.acc.state_dict(include_grads=include_grads)
        assert state_of(self.acc, self.params()) == before
        fields = (
            "version",
            "steps",
            "position",
            "global_step",
            "skipped_steps",
            "epochs_completed",
            "drop_last",
            "world_size",
            "handed_out",
        )
        assert tuple(state[name] for name in fields) == (
            8,
            saved.steps,
            saved.position,
            saved.global_step,
            saved.skipped_steps,
            saved.epochs_completed,
            contract.drop_last,
            1,
            saved.handed_out,
        )
        if saved.position == 0:  # no position to resume: no epoch length to match
            assert state["epoch_length"] is None
        window = state.get("window")
        assert (None if window is None else (window["microsteps"], window["size"])) == saved.window
        event(f"checkpoint {where} ({'mid-window' if saved.window else 'between windows'})")
        if window is None:  # plain values: a copy stands for the bytes (torch.load is slow)
            return dict(state), saved
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return torch.load(io.BytesIO(buffer.getvalue())), saved

    def resume(self, state: dict[str, Any], saved: Saved, how: Action) -> None:
        """Hand the optimizer to a fresh accumulator (``how.steps``) and load ``state``."""
        contract, old = self.contract, self.acc
        if how.flag:
            old.close()
        elif contract.window:
            self.refused(gradaccum.UsageError, "owned by", lambda: self.new_acc(how.steps))
            event("refused: a fresh accumulator while the owner's window is open")
            old.close()
        else:
            contract.warnings.append("closed the previous Accumulator")
        if how.odd:
            other = self.new_acc(how.steps, not contract.drop_last)
            self.refused(
                gradaccum.ConfigError,
                "saved with drop_last=",
                lambda: other.load_state_dict(state),
                acc=other,
            )
            event("refused: load with another drop_last")
            other.close()
        if how.version < 3 and (how.version == 2 or saved.skipped_steps == 0):
            state = {**state, "version": how.version}  # version 1 has no skipped_steps
            if how.version == 1:
                del state["skipped_steps"]
            event(f"resumed from a version {how.version} state")
        steps = how.steps
        fresh = self.new_acc(steps)
        if not contract.accepts(saved, steps, how.allow):
            self.refused(
                gradaccum.ConfigError,
                f"saved with steps={saved.steps}",
                lambda: fresh.load_state_dict(state, allow_steps_change=how.allow),
                acc=fresh,
            )
            event("refused: load with another steps")
            fresh.close()
            steps = saved.steps
            fresh = self.new_acc(steps)
        fresh.load_state_dict(state, allow_steps_change=how.allow)
        self.acc = fresh
        if how.odd:
            self.refused(
                gradaccum.UsageError,
                "closed Accumulator",
                lambda: old.load_state_dict(state),
                acc=old,
            )
            event("refused: load_state_dict on the closed accumulator")
        contract.load(saved, steps)
        event(
            f"resumed {'mid-window' if saved.window else 'between windows'}"
            f"{' with another steps' if steps != saved.steps else ''}"
        )
        self.check_window()

    # Epochs -----------------------------------------------------------------------

    def run_epoch(
        self,
        micros: list[Micro],
        sized: bool,
        by_items: bool,
        body: list[Action],
        steps_first: int | None,
    ) -> None:
        """Iterate ``acc.epoch`` over ``micros``, the loop body doing ``body``'s actions;
        after a resume in a fresh accumulator, the same data again."""
        event(f"epoch {'sized' if sized else 'unsized'}, drop_last={self.contract.drop_last}")
        todo = list(body)
        while True:
            epoch = self.acc.epoch(micros if sized else iter(micros))
            if steps_first is not None:  # the epoch is planned at its first next()
                self.set_steps(steps_first, "between acc.epoch() and its first next()")
                steps_first = None
            if not self.iterate(epoch, micros, sized, by_items, todo):
                return

    def iterate(
        self,
        epoch: Iterator[Micro],
        micros: list[Micro],
        sized: bool,
        by_items: bool,
        todo: list[Action],
    ) -> bool:
        """One accumulator's part of the epoch; return whether it resumed in a fresh one."""
        contract = self.contract
        refusal = contract.begin(len(micros) if sized else None, len(micros))
        if refusal is not None:
            self.refused(gradaccum.ConfigError, refusal, lambda: next(epoch))
            event("refused: sized epoch at its first next() (the guard)")
            return False
        self.last_epoch = (micros, sized, by_items)
        if contract.handed:
            event("epoch resumed past its start")
        while True:
            index = contract.hand_out()
            if index is None:
                guard, fate = contract.end()
                event(f"epoch end: {fate}")
                if guard:
                    with pytest.raises(gradaccum.ConfigError, match="gradient was discarded"):
                        next(epoch)
                    event("refused: unsized epoch at its end (the guard)")
                else:
                    with pytest.raises(StopIteration):
                        next(epoch)
                return False
            micro = next(epoch)
            assert micro is micros[index]
            self.check_window()
            action = todo.pop(0) if todo else PLAIN
            if action.kind == "skip":
                event("loop: continue without a microstep")
                continue
            if action.top and action.kind in ("break", "steps", "checkpoint"):
                resumed = self.between_windows(action, epoch, "at the top of the body")
                if resumed is not None:
                    return resumed
            self.at_top(action, micro)
            probe = action.kind == "probe" and not action.top
            self.microstep(micro, by_items ^ (action.kind == "mix"), probe)
            self.check_window()
            if not action.top and action.kind in ("break", "steps", "checkpoint"):
                resumed = self.between_windows(action, epoch, "after a block")
                if resumed is not None:
                    return resumed

    def between_windows(self, action: Action, epoch: Iterator[Micro], where: str) -> bool | None:
        """A break, ``steps`` change or checkpoint at ``where``: None to go on with the
        loop, else whether the epoch goes on in a fresh accumulator."""
        contract = self.contract
        state = "mid-window" if contract.window else "between windows"
        if action.kind == "steps":
            self.set_steps(action.steps, f"{where} ({state})")
            return None
        if action.kind == "break":
            break_off(epoch)
            contract.break_off()
            event(f"loop: break {where} ({state})")
            return False
        checkpoint = self.checkpoint(action.include_grads, where)
        if checkpoint is None or not action.resume:
            return None
        break_off(epoch)
        contract.break_off()
        self.resume(*checkpoint, action)
        return True

    def at_top(self, action: Action, micro: Micro) -> None:
        """The top of the loop body: a parameter group, a zero_grad() or a refused call."""
        contract = self.contract
        if action.kind == "group":
            self.add_group("at the top of the body")
        elif action.kind == "zero_grad":
            owner = self.model if action.flag else self.optimizers[-1]  # (only the bias's)
            owner.zero_grad(set_to_none=action.steps % 2 == 1)
            contract.wiped = bool(contract.window)
        elif action.kind == "probe" and not action.top:
            pass  # inside the block
        elif action.kind == "probe" and action.flag:
            nested = self.acc.epoch([micro])
            self.refused(gradaccum.UsageError, "do not nest", lambda: next(nested))
            event("refused: a nested epoch")
        elif action.kind == "probe":
            state = self.acc.state_dict(include_grads=True)
            self.refused(
                gradaccum.UsageError,
                "load before the epoch loop",
                lambda: self.acc.load_state_dict(state),
            )
            event("refused: load_state_dict during the epoch")

    # Rules ------------------------------------------------------------------------

    @rule(batch=microbatches, by_items=st.booleans())
    def bare_microstep(self, batch: tuple[int, str | None], by_items: bool) -> None:
        """A microstep outside `acc.epoch`."""
        with self.warnings_checked():
            self.microstep(self.next_micro(*batch), by_items)

    @rule(batches=st.lists(turns, max_size=8), loop=loops)
    def epoch(self, batches: list[Turn], loop: Loop) -> None:
        """An epoch of ``batches`` (rows, fault, and what the loop body does with the
        microbatch handed out in that turn), run as ``loop`` says; after a load
        mid-epoch, the data of the epoch saved (``batches`` gives only the actions),
        which the accumulator resumes where the checkpoint was taken."""
        body = [batch.action for batch in batches]
        sized, by_items = loop.sized, loop.by_items
        if self.contract.resume_at:
            assert self.last_epoch is not None
            micros, sized, by_items = self.last_epoch
        else:
            micros = [self.next_micro(batch.rows, batch.fault) for batch in batches]
        with self.warnings_checked():
            self.run_epoch(micros, sized, by_items, body, loop.steps_first)

    @rule(how=checkpoints)
    def checkpoint_between_epochs(self, how: Action) -> None:
        """state_dict → bytes → a fresh accumulator (maybe with another steps) → load."""
        with self.warnings_checked():
            checkpoint = self.checkpoint(how.include_grads, "outside an epoch")
            if checkpoint is not None:
                self.resume(*checkpoint, how)

    @rule(steps=st.integers(1, 4))
    def set_steps_between_epochs(self, steps: int) -> None:
        """``acc.steps = k`` outside an epoch; refused mid-window."""
        with self.warnings_checked():
            self.set_steps(steps, "outside an epoch")

    @rule()
    def add_param_group(self) -> None:
        """``optimizer.add_param_group`` outside an epoch, between windows (once)."""
        self.add_group("outside an epoch")

    # Invariants -------------------------------------------------------------------

    @invariant()
    def agrees_with_the_contract(self) -> None:
        """Counts, steps, window, position, parameters and learning rates match."""
        contract = self.contract
        self.check_window()
        assert self.acc.skipped_steps == contract.skipped
        assert self.acc.epochs_completed == contract.epochs
        applied = contract.windows - contract.skipped
        assert self.optimizer_steps == [applied] * len(self.optimizers)
        for scheduler in self.schedulers:
            assert scheduler is None or scheduler.last_epoch == applied
        assert self.acc.steps == contract.steps
        if not contract.window:
            assert all(p.grad is None for p in self.params())
        params = [self.model.weight, self.model.bias]
        if self.extra is not None:
            params.append(self.extra)
        for got, want in zip(params, contract.params.values(), strict=True):
            error = max(map(abs, (got.detach() - want).flatten().tolist()))
            assert error < TOL, (got, want)
        groups = [group for optimizer in self.optimizers for group in optimizer.param_groups]
        names = ["weight", "bias"] if contract.split else ["weight"]
        for group, name in zip(
            groups, [*names, *(["extra"] if self.extra is not None else [])], strict=True
        ):
            assert math.isclose(group["lr"], contract.lrs[name], rel_tol=1e-14)


# A few thousand sequences in CI, the "long" profile's count when it asks for more: run
# in chunks, each its own test (a few seconds on an idle machine, far inside the suite's
# per-test time limit even on a loaded one), so the budget is a count of sequences, never
# a time. The first chunk is small, for the quick tier (tests/tiers.py); the others take
# CHUNK each, the last what is left. Each chunk is a search of its own, from its own
# random seed.
EXAMPLES = max(3_000, settings.default.max_examples)
FIRST = 30
CHUNK = 330
SIZES = [FIRST] + [
    min(CHUNK, EXAMPLES - FIRST - start) for start in range(0, EXAMPLES - FIRST, CHUNK)
]
CHUNKS = len(SIZES)


def machine_settings(examples: int) -> settings:
    """The settings of a chunk of ``examples`` sequences of up to 30 calls."""
    return settings(
        max_examples=examples,
        stateful_step_count=30,
        suppress_health_check=[HealthCheck.too_slow],
        deadline=None,
    )


# Every GradaccumWarning is checked against the contract (`warnings_checked`).
pytestmark = pytest.mark.filterwarnings("error::gradaccum.GradaccumWarning")


def chunk_of_sequences(index: int) -> type:
    """The test class that runs the ``index``-th chunk's ``SIZES[index]`` sequences: after
    every call the accumulator agrees with the float64 contract or refuses the call
    unchanged. (A class of the machine's own TestCase, for
    ``--hypothesis-show-statistics``.)"""
    chunk = {"settings": machine_settings(SIZES[index])}
    return type(f"TestChunk{index}", (AccumulatorMachine.TestCase,), chunk)


for _index in range(CHUNKS):
    globals()[f"TestChunk{_index}"] = chunk_of_sequences(_index)


def test_the_sequences_add_up_to_the_budget() -> None:
    """The chunks run 3,000 sequences in the default profile, all of a larger one's."""
    chunks = [globals()[name] for name in globals() if name.startswith("TestChunk")]
    assert [chunk.settings.max_examples for chunk in chunks] == SIZES
    assert sum(SIZES) == EXAMPLES >= 3_000
    assert max(SIZES) == CHUNK
    assert min(SIZES) > 0
