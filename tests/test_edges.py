"""Edges a careful user reaches beyond the seams: optimizers as they come (a closure
optimizer, groups without "lr", a tensor learning rate), non-finite checks on sparse
gradients, and a GradScaler whose window only overflowed in its norm."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

import gradaccum
from tests.helpers import make_batches, make_model, mean_loss, windows_of

# Optimizers as they come ---------------------------------------------------------


def test_a_closure_optimizer_is_refused_at_construction() -> None:
    """LBFGS needs step(closure): refused before anything changed, naming the optimizer."""
    model = make_model()
    model(torch.ones(2, 5, dtype=torch.float64)).sum().backward()
    grads = [param.grad.clone() for param in model.parameters()]  # type: ignore[union-attr]
    optimizer = torch.optim.LBFGS(model.parameters())
    with pytest.raises(gradaccum.ConfigError, match=r"LBFGS needs step\(closure\)"):
        gradaccum.Accumulator(model, optimizer, steps=2)
    # Nothing half-applied: the gradients were not cleared, and no hook was left behind.
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))  # type: ignore[arg-type]
    assert not optimizer._optimizer_step_pre_hooks


class SignDescent(torch.optim.Optimizer):
    """An optimizer whose groups have a ``step_size`` and no ``"lr"``."""

    def __init__(self, params: Any, step_size: float) -> None:
        super().__init__(params, {"step_size": step_size})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param -= group["step_size"] * param.grad.sign()


def test_an_optimizer_without_lr_steps_and_reports_none() -> None:
    model = make_model()
    twin = copy.deepcopy(model)
    batches = make_batches([3] * 4)
    acc = gradaccum.Accumulator(model, SignDescent(model.parameters(), 0.01), steps=2)
    seen = []
    for batch in acc.epoch(batches):
        with acc.microstep(mean_loss(model, batch)) as step:
            if step.boundary:
                seen.append(step.lr)
    assert seen == [None, None]
    for window in windows_of(batches, 2):  # the reference: sign of the big batch's gradient
        grads = torch.autograd.grad(
            mean_loss(twin, (torch.cat([x for x, _ in window]), torch.cat([y for _, y in window]))),
            list(twin.parameters()),
        )
        with torch.no_grad():
            for param, grad in zip(twin.parameters(), grads, strict=True):
                param -= 0.01 * grad.sign()
    for got, want in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(got, want)


def test_step_lr_is_a_snapshot_of_a_tensor_learning_rate() -> None:
    """A tensor lr is changed in place by the scheduler: step.lr keeps the window's value."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=2)
    steps = []
    for batch in acc.epoch(make_batches([2] * 6)):
        with acc.microstep(mean_loss(model, batch)) as step:
            pass
        if step.boundary:
            steps.append(step)
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)
    lrs = [float(step.lr) for step in steps]  # type: ignore[arg-type]
    assert lrs == pytest.approx([0.01, 0.005, 0.0025], rel=1e-6)
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(0.00125, rel=1e-6)


# Non-finite checks -----------------------------------------------------------------


class Bag(nn.Module):
    """A sparse embedding bag and a dense head: a mixed sparse and dense gradient."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(12, 4, sparse=sparse, dtype=torch.float64)
        self.head = nn.Linear(4, 1, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids)).square().mean()


IDS = [
    torch.tensor(ids) for ids in ([1, 2, 2], [3, 1, 5], [7, 7, 1], [0, 2, 9], [4, 1, 1], [8, 3, 2])
]


@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_on_nonfinite_with_sparse_gradients(on_nonfinite: str, max_grad_norm: float | None) -> None:
    """Sparse and dense gradients, checked (and clipped) by the coalesced values' norm: the
    same updates as the dense model clipped by hand, in float64."""
    model, dense = Bag(sparse=True), Bag(sparse=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = gradaccum.Accumulator(
        model, optimizer, steps=3, max_grad_norm=max_grad_norm, on_nonfinite=on_nonfinite
    )
    norms = []
    for ids in acc.epoch(IDS):
        with acc.microstep(model(ids)) as step:
            if step.boundary:
                norms.append(step.grad_norm)
    params = list(dense.parameters())
    for window in (IDS[:3], IDS[3:]):
        grads = torch.autograd.grad(sum(dense(ids) for ids in window) / 3, params)
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        factor = 1.0 if max_grad_norm is None else min(1.0, max_grad_norm / (norm.item() + 1e-6))
        if max_grad_norm is not None:
            assert norms.pop(0).item() == pytest.approx(norm.item(), rel=1e-12)  # type: ignore[union-attr]
        with torch.no_grad():
            for param, grad in zip(params, grads, strict=True):
                param -= 0.5 * factor * grad
    assert max_grad_norm is None or factor < 1  # the clipping did clip
    for got, want in zip(model.parameters(), dense.parameters(), strict=True):
        assert (got - want).abs().max().item() < 1e-14


@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_a_non_finite_sparse_gradient_is_found(on_nonfinite: str) -> None:
    model = Bag(sparse=True)
    start = [param.detach().clone() for param in model.parameters()]
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.5), steps=2, on_nonfinite=on_nonfinite
    )
    handle = model.embedding.weight.register_hook(lambda grad: grad * math.nan)
    try:
        with acc.microstep(model(IDS[0])):
            pass
        if on_nonfinite == "raise":
            loss = model(IDS[1])
            with pytest.raises(gradaccum.NonFiniteError, match="window 1"), acc.microstep(loss):
                pass
        else:
            with acc.microstep(model(IDS[1])) as step:
                assert step.skipped
            assert acc.skipped_steps == 1
    finally:
        handle.remove()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), start, strict=True))


def test_a_window_whose_norm_alone_overflows_backs_the_scale_off() -> None:
    """Every value finite, the float32 norm inf: skipped, and the scale backs off by the
    backoff factor, as for a window the scaler found inf in (the guide's promise)."""
    weight = nn.Parameter(torch.zeros(1000))
    model = nn.Module()
    model.weight = weight
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD([weight], lr=0.1), steps=2, scaler=scaler, on_nonfinite="skip"
    )
    for _ in range(2):
        with acc.microstep((weight * 1e19).sum()) as step:
            pass
    assert step.skipped
    assert acc.skipped_steps == 1
    assert scaler.get_scale() == 2.0**7
    assert torch.equal(weight.detach(), torch.zeros(1000))
    for _ in range(2):  # a finite window afterwards steps and grows the scale again
        with acc.microstep((weight * 1.0).sum()) as step:
            pass
    assert not step.skipped
    assert scaler.get_scale() == 2.0**8


@pytest.mark.parametrize("steps", [1, 4])
def test_a_compiled_training_step(steps: int) -> None:
    """The forward and the microstep block compiled as one function (``torch.compile`` of
    the training step): bit for bit the hand loop's step compiled the same way."""
    from tests.edges_distributed import compiled_step

    batches = make_batches([2] * 13)
    ours = compiled_step(make_model(), batches, steps=steps, accumulator=True)
    hand = compiled_step(make_model(), batches, steps=steps, accumulator=False)
    assert all(torch.equal(a, b) for a, b in zip(ours["params"], hand["params"], strict=True))
    assert ours["stepped"] == hand["stepped"] == 13 // steps
    assert ours["graphs"] > 0  # compiled, not run eagerly
    assert hand["graphs"] > 0
    assert ours["warnings"] == []
