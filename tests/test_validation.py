"""Bad input is refused before any work, naming the argument, the value and the fix."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import gradaccum
from tests.helpers import make_batches, make_model, mean_loss, sum_loss

MODEL = make_model()
OPTIMIZER = torch.optim.SGD(MODEL.parameters(), lr=0.1)
OTHER = torch.optim.SGD(make_model().parameters(), lr=0.1)

CONSTRUCTION: list[tuple[dict[str, Any], type[Exception], list[str]]] = [
    ({"steps": 0}, ValueError, ["steps", "got 0", "pass 1 for no accumulation"]),
    ({"steps": -1}, ValueError, ["steps", "got -1"]),
    ({"steps": 1.5}, TypeError, ["steps", "1.5 (float)"]),
    ({"steps": True}, TypeError, ["steps", "True (bool)"]),
    ({"steps": "4"}, TypeError, ["steps", "'4' (str)"]),
    ({"steps": None}, TypeError, ["steps", "None (NoneType)"]),
    ({"max_grad_norm": -1.0}, ValueError, ["max_grad_norm", "-1.0", "None for no clipping"]),
    ({"max_grad_norm": 0}, ValueError, ["max_grad_norm", "got 0"]),
    ({"max_grad_norm": math.nan}, ValueError, ["max_grad_norm", "nan"]),
    ({"max_grad_norm": "1"}, TypeError, ["max_grad_norm", "'1' (str)"]),
    ({"max_grad_norm": True}, TypeError, ["max_grad_norm", "True (bool)"]),
    ({"sync": "sometimes"}, ValueError, ["sync", "'sometimes'", "'auto', 'boundary', 'every'"]),
    ({"sync": None}, TypeError, ["sync", "None (NoneType)"]),
    ({"drop_last": "yes"}, TypeError, ["drop_last", "'yes' (str)"]),
    ({"scaler": object()}, TypeError, ["scaler", "GradScaler"]),
    ({"model": "model"}, TypeError, ["model", "'model' (str)", "torch.nn.Module"]),
    ({"optimizer": "sgd"}, TypeError, ["optimizer", "'sgd' (str)"]),
    ({"scheduler": object()}, TypeError, ["scheduler", "step()"]),
    (
        {"scheduler": torch.optim.lr_scheduler.StepLR(OTHER, 1)},
        ValueError,
        ["scheduler", "another optimizer", "create the scheduler on the optimizer"],
    ),
    (
        {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(OPTIMIZER)},
        TypeError,
        ["ReduceLROnPlateau", "scheduler=None"],
    ),
]


@pytest.mark.parametrize(("override", "error", "fragments"), CONSTRUCTION)
def test_construction_refuses_bad_arguments_before_any_work(
    override: dict[str, Any], error: type[Exception], fragments: list[str]
) -> None:
    """Each bad argument raises its builtin and GradaccumError; no state is touched."""
    MODEL.zero_grad(set_to_none=True)
    mean_loss(MODEL, make_batches([2])[0]).backward()
    grads = [p.grad.clone() for p in MODEL.parameters()]
    arguments: dict[str, Any] = {"model": MODEL, "optimizer": OPTIMIZER} | override
    with pytest.raises(error) as caught:
        gradaccum.Accumulator(**arguments)
    assert isinstance(caught.value, gradaccum.GradaccumError)
    for fragment in fragments:
        assert fragment in str(caught.value)
    for param, grad in zip(MODEL.parameters(), grads, strict=True):
        assert torch.equal(param.grad, grad)
    OPTIMIZER.step()  # still the user's: no hook was left behind


def test_accepted_settings() -> None:
    """The legitimate edges are accepted: ints for max_grad_norm, inf to only measure."""
    for max_grad_norm in (1, 0.5, math.inf, None):
        gradaccum.Accumulator(MODEL, OPTIMIZER, max_grad_norm=max_grad_norm).close()
    for sync in ("auto", "boundary", "every"):
        gradaccum.Accumulator(MODEL, OPTIMIZER, sync=sync).close()


LOSS = mean_loss(MODEL, make_batches([2])[0])
MICROSTEP: list[tuple[Any, Any, type[Exception], list[str]]] = [
    (0.5, None, TypeError, ["loss", "0.5 (float)"]),
    (LOSS.expand(3), None, ValueError, ["loss", "0-dim", "(3,)", ".mean()"]),
    (LOSS.detach(), None, ValueError, ["loss does not require grad", "torch.no_grad()"]),
    (LOSS, -1, ValueError, ["num_items", "-1"]),
    (LOSS, 1.5, TypeError, ["num_items", "1.5 (float)"]),
    (LOSS, True, TypeError, ["num_items", "True (bool)"]),
    (LOSS, torch.ones(2), ValueError, ["num_items", "0-dim", "(2,)"]),
]


@pytest.mark.parametrize(("loss", "num_items", "error", "fragments"), MICROSTEP)
def test_microstep_refuses_bad_arguments_before_backward(
    loss: Any, num_items: Any, error: type[Exception], fragments: list[str]
) -> None:
    """A bad loss or num_items is refused at the call; no backward runs."""
    acc = gradaccum.Accumulator(MODEL, OPTIMIZER, steps=2)
    with pytest.raises(error) as caught:
        acc.microstep(loss, num_items)
    assert isinstance(caught.value, gradaccum.GradaccumError)
    for fragment in fragments:
        assert fragment in str(caught.value)
    assert all(p.grad is None for p in MODEL.parameters())
    acc.close()


def test_numpy_integers_are_ints() -> None:
    """A NumPy integer (a count from a collate function) is taken as the int it holds, for
    ``num_items`` and for ``steps``: the same run as with ints, and what is reported is
    an int; NumPy's bool is refused as a bool is."""
    import numpy

    runs = []
    for integer in (int, numpy.int64, numpy.int32):
        model = make_model()
        acc = gradaccum.Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=0.1), steps=integer(2)
        )
        for batch in acc.epoch(make_batches([2, 3, 1, 2])):
            with acc.microstep(sum_loss(model, batch), num_items=integer(len(batch[0]))) as step:
                pass
        assert (type(acc.steps), type(step.num_items), step.num_items) == (int, int, 3)
        runs.append([p.detach().clone() for p in model.parameters()])
        acc.close()
    for run in runs[1:]:
        assert all(torch.equal(p, q) for p, q in zip(run, runs[0], strict=True))
    acc = gradaccum.Accumulator(MODEL, OPTIMIZER, steps=2)
    with pytest.raises(TypeError, match="num_items must be a non-negative int"):
        acc.microstep(LOSS, numpy.bool_(True))
    acc.close()
