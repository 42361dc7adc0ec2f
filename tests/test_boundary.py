"""The boundary's parameters (boundary.Params): worked out once, again when the groups
change, and a group added between windows is normalized, clipped and checked."""

from __future__ import annotations

import math

import torch

import gradaccum
from gradaccum.boundary import Params
from tests.helpers import make_batches, make_model, sum_loss


def test_the_parameters_are_worked_out_again_when_the_groups_change() -> None:
    """The list is the same object while nothing changes (no work per boundary), and a
    new one after ``add_param_group`` or a new group list (``load_state_dict``); the
    model's order comes first, a parameter outside the model last."""
    model = make_model()
    optimizer = torch.optim.SGD(list(model.parameters())[::-1], lr=0.1)
    params = Params((optimizer,), model)
    first = params.now()
    assert params.now() is first
    assert params.ordered() == list(model.parameters())
    extra = torch.nn.Parameter(torch.zeros(()))
    optimizer.add_param_group({"params": [extra]})
    grown = params.now()
    assert grown is not first
    assert grown[-1] is extra
    assert params.ordered() == [*model.parameters(), extra]
    optimizer.load_state_dict(optimizer.state_dict())  # a new list of groups
    assert params.now() is not grown
    assert params.now() == grown


def test_the_gradients_are_grouped_by_device_and_dtype() -> None:
    """Each kind of parameter its own group; those without a gradient left out."""
    model = make_model()
    half = torch.nn.Parameter(torch.zeros(3, dtype=torch.float32))
    optimizer = torch.optim.SGD([*model.parameters(), half], lr=0.1)
    params = Params((optimizer,), model)
    params.now()
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    kinds = {
        (str(device), dtype): len(grads) for device, dtype, grads, *_ in params.grads_by_kind()
    }
    assert kinds == {("cpu", torch.float64): 4, ("cpu", torch.float32): 0}


def test_a_group_added_between_windows_is_normalized_clipped_and_checked() -> None:
    """A learnable scale added with ``add_param_group`` after the first window: its
    gradient in the next window is divided by the window's items and clipped with the
    others by one total norm; a NaN in it alone skips the window."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: only the gradients matter
    acc = gradaccum.Accumulator(model, optimizer, steps=2, max_grad_norm=1e-3, on_nonfinite="skip")
    batches = make_batches([3, 5, 2, 4, 1, 6])
    for batch in batches[:2]:
        with acc.microstep(sum_loss(model, batch), num_items=len(batch[0])):
            pass
    scale = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
    optimizer.add_param_group({"params": [scale], "lr": 0.0})
    window = batches[2:4]
    losses = [scale * sum_loss(model, batch) for batch in window]
    total = sum(losses) / sum(len(batch[0]) for batch in window)
    grads = torch.autograd.grad(total, [*model.parameters(), scale], retain_graph=True)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    for loss, batch in zip(losses, window, strict=True):
        with acc.microstep(loss, num_items=len(batch[0])) as step:
            if step.boundary:
                assert step.grad_norm is not None
                assert math.isclose(step.grad_norm.item(), norm.item(), rel_tol=1e-12)
                assert scale.grad is not None
                clipped = grads[-1] * (1e-3 / (norm + 1e-6))
                assert math.isclose(scale.grad.item(), clipped.item(), rel_tol=1e-9)
    poisoned = [scale * sum_loss(model, batch) for batch in batches[4:]]
    poisoned[0] = poisoned[0] + (scale - scale.detach()) * math.nan  # NaN in scale's only
    for loss, batch in zip(poisoned, batches[4:], strict=True):
        with acc.microstep(loss, num_items=len(batch[0])) as step:
            pass
    assert step.skipped
    assert acc.skipped_steps == 1


def test_a_model_converted_between_windows_is_normalized_in_its_new_dtype() -> None:
    """``model.double()`` between windows converts the parameters in place (the same
    objects in the same groups): the next window's item total is divided in float64, so
    the float32 model turned float64 matches its float64 big-batch reference to rounding,
    as an accumulator built after the conversion does, bit for bit."""

    def train(rebuild: bool) -> torch.nn.Module:
        model = make_model(dtype=torch.float32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = gradaccum.Accumulator(model, optimizer, steps=2)
        for index, batch in enumerate(make_batches([3, 5, 7, 2], dtype=torch.float32)):
            if index == 2:
                model.double()
                if rebuild:
                    acc.close()
                    acc = gradaccum.Accumulator(model, optimizer, steps=2)
            inputs, targets = (tensor.to(next(model.parameters()).dtype) for tensor in batch)
            loss = sum_loss(model, (inputs, targets))
            with acc.microstep(loss, num_items=torch.tensor(len(inputs))):
                pass
        acc.close()
        return model

    kept, rebuilt = train(rebuild=False), train(rebuild=True)
    pairs = zip(kept.parameters(), rebuilt.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    # The reference: the first window as trained, then one float64 big batch.
    model = make_model(dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, optimizer, steps=2)
    batches = make_batches([3, 5, 7, 2], dtype=torch.float32)
    for batch in batches[:2]:
        with acc.microstep(sum_loss(model, batch), num_items=len(batch[0])):
            pass
    acc.close()
    model.double()
    inputs, targets = (torch.cat([b[i] for b in batches[2:]]).double() for i in (0, 1))
    mean = sum_loss(model, (inputs, targets)) / len(inputs)
    grads = torch.autograd.grad(mean, [*model.parameters()])
    with torch.no_grad():
        for param, grad in zip(model.parameters(), grads, strict=True):
            param -= 0.1 * grad
    pairs = zip(kept.parameters(), model.parameters(), strict=True)
    gap = max((a - b).abs().max().item() for a, b in pairs)
    assert gap < 1e-15
