"""Failures and misuse: nothing half-applied, the next window starts clean, fix-it messages."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import gradaccum
from tests.helpers import make_batches, make_model, max_param_diff, mean_loss, reference_sgd, sgd

TOL = 1e-10


class FailingBackward(torch.autograd.Function):
    """Identity forward whose backward raises: an error during backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise FloatingPointError("backward failed")


def failing_block(acc: gradaccum.Accumulator, loss: torch.Tensor, fail_in_body: bool) -> None:
    with acc.microstep(loss):
        if fail_in_body:
            raise KeyError("user code failed")


def setup(steps: int = 4):
    model = make_model()
    optimizer = sgd(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=steps)
    return model, optimizer, scheduler, acc


@pytest.mark.parametrize("where", ["body", "backward"])
@pytest.mark.parametrize("at", [1, 3])  # mid-window, and the boundary microstep
def test_exception_applies_nothing_and_next_window_is_clean(where: str, at: int) -> None:
    """The failing window is dropped; the next `steps` microsteps form a fresh window."""
    batches = make_batches([2] * 8)
    model, _, scheduler, acc = setup()
    start = copy.deepcopy(model)
    for index, batch in enumerate(batches[:4]):
        loss = mean_loss(model, batch)
        if where == "backward" and index == at:
            loss = FailingBackward.apply(loss)
        if index == at:
            with pytest.raises((FloatingPointError, KeyError)):
                failing_block(acc, loss, fail_in_body=where == "body")
            break
        with acc.microstep(loss):
            pass
    assert acc.global_step == 0
    assert scheduler.last_epoch == 0
    assert all(p.grad is None for p in model.parameters())
    assert max_param_diff(model, start) == 0
    for batch in batches[4:]:
        with acc.microstep(mean_loss(model, batch)):
            pass
    assert acc.global_step == 1
    assert max_param_diff(model, reference_sgd(start, [batches[4:]], lr=0.1)) < TOL


@pytest.mark.parametrize("at", [0, 3])  # the window's first microstep, and its boundary
def test_a_backward_left_in_the_loop_is_named_beside_torch_s_error(at: int) -> None:
    """A hand loop's ``loss.backward()`` kept before the block: the block's backward fails
    in torch (the graph is freed), whose advice is retain_graph=True; the note says to
    remove the call instead. The window is dropped and the next one starts clean."""
    batches = make_batches([2] * 8)
    model, _, _, acc = setup()
    start = copy.deepcopy(model)
    for index, batch in enumerate(batches[: at + 1]):
        loss = mean_loss(model, batch)
        if index < at:
            with acc.microstep(loss):
                pass
            continue
        loss.backward()  # mid-window, it also adds to the window's gradient: warned
        warned = pytest.warns(gradaccum.GradaccumWarning, match="or a backward outside the")
        with (
            warned if at else contextlib.nullcontext(),
            pytest.raises(RuntimeError, match="backward through the graph a second time") as caught,
            acc.microstep(loss),
        ):
            pass
    (note,) = caught.value.__notes__
    assert note.startswith("gradaccum: entering `with acc.microstep(loss):` runs the loss's")
    assert "Remove the loss.backward() (or accelerator.backward(loss)" in note
    assert "retain_graph=True, which would count the microbatch twice" in note
    assert all(p.grad is None for p in model.parameters())
    for batch in batches[4:]:
        with acc.microstep(mean_loss(model, batch)):
            pass
    assert acc.global_step == 1
    assert max_param_diff(model, reference_sgd(start, [batches[4:]], lr=0.1)) < TOL


def test_nested_microstep_is_refused() -> None:
    """A microstep inside another's block is refused; the outer one still completes."""
    model, _, _, acc = setup(steps=1)
    batch = make_batches([2])[0]
    with acc.microstep(mean_loss(model, batch)):
        inner = mean_loss(model, batch)
        with pytest.raises(gradaccum.UsageError, match="leave the first"):
            acc.microstep(inner)
    assert acc.global_step == 1


def test_optimizer_step_inside_a_window_is_refused() -> None:
    """optimizer.step() by hand mid-window or in the boundary body raises before it steps."""
    model, optimizer, _, acc = setup(steps=2)
    batches = make_batches([2] * 2)
    start = copy.deepcopy(model)
    with acc.microstep(mean_loss(model, batches[0])):
        pass
    with pytest.raises(gradaccum.UsageError, match=r"microstep 2 of 2.*remove the call"):
        optimizer.step()
    with acc.microstep(mean_loss(model, batches[1])) as step:
        assert step.boundary
        with pytest.raises(gradaccum.UsageError, match="inside an accumulation window"):
            optimizer.step()
        assert max_param_diff(model, start) == 0
    assert acc.global_step == 1
    assert max_param_diff(model, reference_sgd(start, [batches], lr=0.1)) < TOL


def test_mixing_num_items_and_means_in_a_window_is_refused() -> None:
    """num_items on some microsteps of a window and not others: refused, both directions."""
    model, _, _, acc = setup(steps=3)
    batch = make_batches([2])[0]
    with acc.microstep(mean_loss(model, batch)):
        pass
    with pytest.raises(gradaccum.UsageError, match="num_items on every microstep"):
        acc.microstep(mean_loss(model, batch), num_items=2)
    model, _, _, acc = setup(steps=3)
    with acc.microstep(mean_loss(model, batch), num_items=2):
        pass
    with pytest.raises(gradaccum.UsageError, match="omits num_items"):
        acc.microstep(mean_loss(model, batch))


def test_zero_items_in_a_window_is_refused() -> None:
    """A window whose int item counts sum to 0 cannot be normalized: refused, discarded."""
    model, _, _, acc = setup(steps=2)
    batch = make_batches([2])[0]
    with acc.microstep(mean_loss(model, batch) * 0, num_items=0):
        pass
    with pytest.raises(gradaccum.ConfigError, match="summing to 0"):
        acc.microstep(mean_loss(model, batch) * 0, num_items=0).__enter__()
    assert acc.global_step == 0
    assert all(p.grad is None for p in model.parameters())


def test_closed_accumulator_refuses_and_releases_the_optimizer() -> None:
    """After close(), microstep/epoch are refused and the optimizer is the user's again."""
    model, optimizer, _, acc = setup(steps=2)
    batch = make_batches([2])[0]
    with acc, acc.microstep(mean_loss(model, batch)):
        pass
    with pytest.raises(gradaccum.UsageError, match="closed"):
        acc.microstep(mean_loss(model, batch))
    with pytest.raises(gradaccum.UsageError, match="closed"):
        acc.epoch([batch])
    optimizer.step()  # no longer refused: the hook is gone
    acc.close()  # idempotent
    assert "global_step=0" in repr(acc)


@pytest.mark.parametrize("at", [0, 1])  # a microstep inside the window, and the boundary
def test_close_inside_a_block_is_refused_and_the_window_goes_on(at: int) -> None:
    """An early stop written as ``acc.close()`` inside a microstep's block: refused (leaving
    the block still needs the accumulator; it failed inside gradaccum, or re-set DDP's flag
    after close restored it), and nothing is changed: the window completes, applies as a
    plain loop's does, and close() after the block releases everything."""
    model, optimizer, _, acc = setup(steps=2)
    batches = make_batches([2] * 2)
    expected = reference_sgd(make_model(), [batches], lr=0.1)
    for index, batch in enumerate(acc.epoch(batches)):
        with acc.microstep(mean_loss(model, batch)):
            if index == at:
                with pytest.raises(gradaccum.UsageError, match="inside a microstep's"):
                    acc.close()
    assert acc.global_step == 1
    assert max_param_diff(model, expected) < TOL
    acc.close()
    optimizer.step()  # the hook is gone


def test_microstep_never_entered_is_refused() -> None:
    """acc.microstep(loss) without `with` would silently skip the backward: refused."""
    model, _, _, acc = setup(steps=2)
    batch = make_batches([2])[0]
    acc.microstep(mean_loss(model, batch))
    with pytest.raises(gradaccum.UsageError, match="never entered"):
        acc.microstep(mean_loss(model, batch))
    assert all(p.grad is None for p in model.parameters())  # no backward ran
    block = acc.microstep(mean_loss(model, batch))  # the corrected loop runs on
    with block:
        pass
    with pytest.raises(gradaccum.UsageError, match="entered twice"), block:
        pass
    assert repr(acc) == "Accumulator(steps=2, global_step=0, window=1/2)"
