"""A hypothesis state machine drives random call sequences against a model of the contract.

Rules: microsteps with and without ``num_items``, exceptions in the block and in the
backward, non-finite losses, GradScaler overflows, epochs of random lengths (sized or
not, stopped early or not), checkpoints into a fresh accumulator (mid-window with
``include_grads``), and changes of ``steps``. After every rule the accumulator must
agree with `Contract`, an independent float64 model: its gradients are the analytic
ones of a linear least-squares problem, its optimizer is SGD with momentum written out.

``--hypothesis-profile=long`` runs many more examples than CI (see tests/conftest.py).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from torch import nn

import gradaccum

LR, GAMMA, MOMENTUM, MAX_NORM = 0.1, 0.9, 0.5, 0.5
OVERFLOW = 1e290  # finite, but overflows float64 once scaled by the scaler's 2**100
TOL = 1e-10

# A microbatch's fault: none, an exception in the block or in the backward, a NaN
# loss, or a loss whose scaled gradient overflows (only with a GradScaler).
FAULTS = (None, "body", "backward", "nan", "overflow")
faults = st.sampled_from((None,) * 8 + FAULTS[1:])  # mostly clean microbatches


class BackwardFails(torch.autograd.Function):
    """Identity whose backward raises: an error during ``loss.backward()``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise FloatingPointError("backward failed on purpose")


@dataclass(frozen=True)
class Micro:
    """One microbatch: its rows, whether it passes ``num_items``, and its fault."""

    seed: int
    rows: int
    fault: str | None = None

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.rows, 3, generator=generator, dtype=torch.float64)
        return x, torch.randn(self.rows, 1, generator=generator, dtype=torch.float64)

    def factor(self) -> float:
        return {"nan": math.nan, "overflow": OVERFLOW}.get(self.fault or "", 1.0)


@dataclass
class Contract:
    """What the accumulator must have done: a float64 model of the documented contract."""

    steps: int
    drop_last: bool
    scaler: bool
    on_nonfinite: str | None
    clip: bool
    weight: torch.Tensor
    bias: torch.Tensor
    momentum: list[torch.Tensor] | None = None
    lr: float = LR
    windows: int = 0
    skipped: int = 0
    position: int = 0
    resume_at: int = 0
    window: list[tuple[Micro, bool]] = field(default_factory=list)  # (microbatch, by_items)
    size: int = 0

    def __post_init__(self) -> None:
        self.size = self.steps

    def discard(self) -> None:
        self.window = []
        self.size = self.steps

    def grads(self, micro: Micro, by_items: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """d loss / d (weight, bias), by hand: the mean (or the sum, with num_items)."""
        x, y = micro.data()
        residual = x @ self.weight.T + self.bias - y
        scale = 2.0 * micro.factor() / (1 if by_items else micro.rows)
        return scale * residual.T @ x, scale * residual.sum(0)

    def faulty(self) -> bool:
        """The open window's gradient is not finite (once unscaled)."""
        return any(micro.fault in ("nan", "overflow") for micro, _ in self.window)

    def boundary(self) -> str:
        """Close the window; return whether it was "applied" or "skipped"."""
        parts = [self.grads(micro, by_items) for micro, by_items in self.window]
        weight = sum(g[0] for g in parts)
        bias = sum(g[1] for g in parts)
        if self.window[0][1]:
            divisor = sum(micro.rows for micro, _ in self.window)
        else:
            divisor = len(self.window)
        grads = [weight / divisor, bias / divisor]
        faulty = self.faulty()
        self.discard()
        if faulty:
            self.windows += 1
            self.skipped += 1
            return "skipped"
        if self.clip:
            norm = torch.cat([g.flatten() for g in grads]).norm()
            coef = min(1.0, MAX_NORM / (norm.item() + 1e-6))
            grads = [g * coef for g in grads]
        if self.momentum is None:
            self.momentum = [g.clone() for g in grads]
        else:
            self.momentum = [MOMENTUM * m + g for m, g in zip(self.momentum, grads, strict=True)]
        self.weight = self.weight - self.lr * self.momentum[0]
        self.bias = self.bias - self.lr * self.momentum[1]
        self.lr *= GAMMA
        self.windows += 1
        return "applied"


class AccumulatorMachine(RuleBasedStateMachine):
    """Random call sequences against `Contract`."""

    def __init__(self) -> None:
        super().__init__()
        self.seed = 0
        self.last_epoch: tuple[list[Micro], bool, bool] | None = None

    # Set-up -----------------------------------------------------------------------

    @initialize(
        steps=st.integers(1, 4),
        drop_last=st.booleans(),
        scaler=st.booleans(),
        on_nonfinite=st.sampled_from([None, "raise", "skip"]),
        clip=st.booleans(),
    )
    def build(
        self, steps: int, drop_last: bool, scaler: bool, on_nonfinite: str | None, clip: bool
    ) -> None:
        if scaler and on_nonfinite == "raise":
            on_nonfinite = "skip"  # refused together: see the bad-input catalog
        torch.manual_seed(0)
        self.model = nn.Linear(3, 1).double()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, 1, gamma=GAMMA)
        self.optimizer_steps = 0
        self.optimizer.register_step_post_hook(self._count_step)
        self.scaler = (
            torch.amp.GradScaler("cpu", init_scale=2.0**100, growth_interval=10**9)
            if scaler
            else None
        )
        self.options: dict[str, Any] = {
            "drop_last": drop_last,
            "scaler": self.scaler,
            "on_nonfinite": on_nonfinite,
            "max_grad_norm": MAX_NORM if clip else None,
        }
        self.acc = gradaccum.Accumulator(
            self.model, self.optimizer, self.scheduler, steps=steps, **self.options
        )
        self.contract = Contract(
            steps,
            drop_last,
            scaler,
            on_nonfinite,
            clip,
            self.model.weight.detach().clone(),
            self.model.bias.detach().clone(),
        )

    def _count_step(self, *_: object) -> None:
        self.optimizer_steps += 1

    # One microstep, as a user's loop runs it -----------------------------------------

    def microstep(self, micro: Micro, by_items: bool) -> None:
        """Run ``micro`` through ``acc.microstep``; check what escapes and update the contract."""
        contract = self.contract
        x, y = micro.data()
        loss = (self.model(x) - y).square()
        loss = loss.sum() if by_items else loss.mean()
        loss = loss * micro.factor()
        if micro.fault == "backward":
            loss = BackwardFails.apply(loss)
        num_items = micro.rows if micro.seed % 2 else torch.tensor(micro.rows)
        if contract.window and contract.window[0][1] is not by_items:
            with pytest.raises(gradaccum.UsageError, match="on every microstep of a window"):
                self.acc.microstep(loss, num_items if by_items else None)
            return
        boundary = len(contract.window) == contract.size - 1
        block = self.acc.microstep(loss, num_items if by_items else None)
        contract.window.append((micro, by_items))
        if micro.fault == "backward":
            with pytest.raises(FloatingPointError, match="on purpose"):
                block.__enter__()
            contract.discard()
            return
        if boundary and contract.on_nonfinite == "raise" and contract.faulty():
            with pytest.raises(gradaccum.NonFiniteError, match=f"window {contract.windows + 1}"):
                block.__enter__()
            contract.discard()
            event("window raised NonFiniteError")
            return
        if micro.fault == "body":
            with pytest.raises(KeyError), block:
                raise KeyError("the block failed on purpose")
            contract.discard()
            return
        outcome = contract.boundary() if boundary else None
        if outcome:
            event(f"window {outcome}{' by items' if by_items else ''}")
        with block as step:
            assert step.boundary is boundary
            if boundary and contract.on_nonfinite == "skip":
                assert step.skipped is (outcome == "skipped")
        if boundary:
            assert step.skipped is (outcome == "skipped")
            assert step.global_step == contract.windows

    # Rules ------------------------------------------------------------------------

    def next_micro(self, rows: int, fault: str | None) -> Micro:
        self.seed += 1
        if fault in ("nan", "overflow") and not self.contract.scaler:
            # Without a scaler an overflow is just a NaN; with no check either, it would
            # stick in the parameters (as in plain PyTorch), so none is drawn.
            fault = "nan" if self.contract.on_nonfinite else None
        return Micro(self.seed, rows, fault)

    @rule(rows=st.integers(1, 3), by_items=st.booleans(), fault=faults)
    def bare_microstep(self, rows: int, by_items: bool, fault: str | None) -> None:
        """A microstep outside `acc.epoch`."""
        self.microstep(self.next_micro(rows, fault), by_items)

    @precondition(lambda self: self.contract.resume_at == 0)
    @rule(
        plan=st.lists(st.tuples(st.integers(1, 3), faults), max_size=9),
        sized=st.booleans(),
        by_items=st.booleans(),
        stop=st.integers(0, 10),
    )
    def epoch(
        self, plan: list[tuple[int, str | None]], sized: bool, by_items: bool, stop: int
    ) -> None:
        """An epoch of random length, possibly stopped early after a microstep."""
        micros = [self.next_micro(rows, fault) for rows, fault in plan]
        self.last_epoch = (micros, sized, by_items)
        self.run_epoch(micros, sized, by_items, stop)

    @precondition(lambda self: self.contract.resume_at > 0)
    @rule(stop=st.integers(0, 10))
    def resume_epoch(self, stop: int) -> None:
        """After a load mid-epoch: the same epoch again; the accumulator skips what was done."""
        assert self.last_epoch is not None
        micros, sized, by_items = self.last_epoch
        self.run_epoch(micros, sized, by_items, stop)

    def run_epoch(self, micros: list[Micro], sized: bool, by_items: bool, stop: int) -> None:
        contract = self.contract
        n, steps = len(micros), contract.steps
        too_short = n == 0 or (contract.drop_last and n < steps)
        planned = n // steps * steps if contract.drop_last else n
        if sized and (too_short or contract.resume_at > planned):
            with pytest.raises(gradaccum.ConfigError, match=r"optimizer step|past the"):
                self.acc.epoch(micros)
            return
        if contract.window and contract.resume_at == 0:
            contract.discard()  # windows never span epochs
        skip, contract.resume_at = contract.resume_at, 0
        end = planned if sized else n
        stopped = False
        try:
            handed = 0
            for handed, micro in enumerate(self.acc.epoch(micros if sized else iter(micros)), 1):
                seen = skip + handed
                assert micro is micros[seen - 1]
                if skip and handed == 1:
                    event("resumed mid-epoch")
                contract.position = seen
                if not contract.drop_last:
                    remaining = n - seen if sized or seen == n else None
                    if not contract.window and remaining is not None:
                        contract.size = min(steps, remaining + 1)
                    if remaining == 0:
                        contract.size = len(contract.window) + 1
                self.microstep(micro, by_items)
                if handed == stop:
                    stopped = True
                    break
            assert stopped or skip + handed == end
        except gradaccum.ConfigError:  # an unsized epoch too short, known at its end
            assert not sized
            assert too_short
            assert not stopped
            contract.discard()
            contract.position = 0
            return
        assert not (too_short and not stopped), "the guard did not fire"
        if not stopped:
            contract.position = 0
            contract.discard()

    @rule(include_grads=st.booleans(), steps=st.integers(1, 4), allow=st.booleans())
    def checkpoint(self, include_grads: bool, steps: int, allow: bool) -> None:
        """state_dict → bytes → a fresh accumulator (maybe with another steps) → load."""
        contract = self.contract
        if contract.window and not include_grads:
            with pytest.raises(gradaccum.UsageError, match="include_grads=True"):
                self.acc.state_dict()
            return
        buffer = io.BytesIO()
        torch.save(self.acc.state_dict(include_grads=include_grads), buffer)
        state = torch.load(io.BytesIO(buffer.getvalue()))
        self.acc.close()
        fresh = gradaccum.Accumulator(
            self.model, self.optimizer, self.scheduler, steps=steps, **self.options
        )
        if steps != contract.steps:
            if allow and contract.position == 0 and not contract.window:
                fresh.load_state_dict(state, allow_steps_change=True)
                self.acc = fresh
                contract.steps = contract.size = steps
                return
            with pytest.raises(gradaccum.ConfigError, match=f"saved with steps={contract.steps}"):
                fresh.load_state_dict(state, allow_steps_change=allow)
            fresh.close()
            fresh = gradaccum.Accumulator(
                self.model, self.optimizer, self.scheduler, steps=contract.steps, **self.options
            )
        fresh.load_state_dict(state)
        self.acc = fresh
        contract.resume_at = contract.position
        event(f"resumed {'mid-window' if contract.window else 'between windows'}")

    @rule(steps=st.integers(1, 4))
    def set_steps(self, steps: int) -> None:
        """``acc.steps = k`` between windows; refused mid-window."""
        contract = self.contract
        if contract.window:
            with pytest.raises(gradaccum.UsageError, match="mid-window"):
                self.acc.steps = steps
            return
        self.acc.steps = steps
        contract.steps = contract.size = steps

    # Invariants -------------------------------------------------------------------

    @invariant()
    def agrees_with_the_contract(self) -> None:
        contract = self.contract
        assert self.acc.global_step == contract.windows
        assert self.acc.skipped_steps == contract.skipped
        assert self.optimizer_steps == contract.windows - contract.skipped
        assert self.scheduler.last_epoch == contract.windows - contract.skipped
        assert self.acc.steps == contract.steps
        assert f"window={len(contract.window)}/{contract.size}" in repr(self.acc)
        if not contract.window:
            assert all(p.grad is None for p in self.model.parameters())
        for got, want in ((self.model.weight, contract.weight), (self.model.bias, contract.bias)):
            assert (got.detach() - want).abs().max().item() < TOL
        assert math.isclose(self.optimizer.param_groups[0]["lr"], contract.lr, rel_tol=1e-15)


# A few thousand sequences in CI; the "long" profile's count when it asks for more.
EXAMPLES = max(3_000, settings.default.max_examples)
AccumulatorMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=30,
    suppress_health_check=[HealthCheck.too_slow],
    deadline=None,
)


# Warnings other than the documented discards (misuse warnings on a correct loop) fail it.
pytestmark = [
    pytest.mark.filterwarnings("error::gradaccum.GradaccumWarning"),
    pytest.mark.filterwarnings("ignore:discarding the:gradaccum.GradaccumWarning"),
]
TestAccumulatorMachine = AccumulatorMachine.TestCase
