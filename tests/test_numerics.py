"""The window's update against an independent float64 big-batch reference, and steps=1 bitwise."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import gradaccum
from tests import strategies
from tests.helpers import (
    concat,
    make_batches,
    make_model,
    max_param_diff,
    mean_loss,
    reference_run,
    reference_sgd,
    sgd,
    split_optimizers,
    sum_loss,
    windows_of,
)

TOL = 1e-10


@settings(max_examples=60, deadline=None)
@given(
    steps=strategies.steps,
    n=st.integers(min_value=1, max_value=14),
    size=strategies.batch_size,
    seed=strategies.seeds,
    drop_last=st.booleans(),
)
def test_accumulated_update_equals_big_batch(
    steps: int, n: int, size: int, seed: int, drop_last: bool
) -> None:
    """Equal-sized mean-loss microbatches: each window's update is the big-batch update."""
    if drop_last and n < steps:
        n = steps
    batches = make_batches([size] * n, seed=seed)
    model = make_model(seed)
    expected = reference_sgd(model, windows_of(batches, steps, drop_last), lr=0.1)
    acc = gradaccum.Accumulator(model, sgd(model), steps=steps, drop_last=drop_last)
    for batch in acc.epoch(batches):
        with acc.microstep(mean_loss(model, batch)):
            pass
    assert acc.global_step == gradaccum.total_steps(n, steps, drop_last=drop_last)
    assert max_param_diff(model, expected) < TOL


@settings(max_examples=60, deadline=None)
@given(lengths=strategies.item_counts, steps=strategies.steps, seed=strategies.seeds)
def test_num_items_equals_item_mean_over_the_window(
    lengths: list[int], steps: int, seed: int
) -> None:
    """Summed losses with num_items: the item-mean gradient whatever the lengths."""
    batches = make_batches(lengths, seed=seed)
    model = make_model(seed)
    expected = reference_sgd(model, windows_of(batches, steps, drop_last=False), lr=0.1)
    acc = gradaccum.Accumulator(model, sgd(model), steps=steps, drop_last=False)
    for i, batch in enumerate(acc.epoch(batches)):
        # Alternate ints and device tensors: both are accepted without a host sync.
        items = len(batch[0]) if i % 2 else torch.tensor(len(batch[0]))
        with acc.microstep(sum_loss(model, batch), num_items=items):
            pass
    assert max_param_diff(model, expected) < TOL


def test_the_13_over_4_cadence() -> None:
    """3 optimizer and scheduler steps; the 13th microbatch is never handed out or trained."""
    batches = make_batches([2] * 13)
    model = make_model()
    optimizer = sgd(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    stepped: list[int] = []
    optimizer.register_step_post_hook(lambda *_: stepped.append(1))
    acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=4)
    seen = []
    flags = []
    for batch in acc.epoch(batches):
        seen.append(batch)
        flags.append(acc.sync_gradients)  # before the forward: armed in advance
        with acc.microstep(mean_loss(model, batch)) as step:
            assert step.boundary == acc.sync_gradients
    assert len(seen) == 12
    assert seen[-1] is batches[11]
    assert flags == [False, False, False, True] * 3
    assert (len(stepped), scheduler.last_epoch, acc.global_step) == (3, 3, 3)
    assert optimizer.param_groups[0]["lr"] == 0.1 * 0.5**3
    assert all(p.grad is None for p in model.parameters())  # nothing leaks into the next epoch
    expected = reference_sgd(make_model(), windows_of(batches, 4), lr=0.1)
    assert max_param_diff(model, expected) > 0  # the LR decayed: not the constant-LR reference


def test_boundary_body_sees_the_full_window_gradient_clipped() -> None:
    """Clipping happens once, on the window's total gradient, before the body runs."""
    batches = make_batches([3] * 8)
    model = make_model()
    reference = copy.deepcopy(model)
    acc = gradaccum.Accumulator(model, sgd(model), steps=4, max_grad_norm=0.05)
    for index, batch in enumerate(acc.epoch(batches)):
        with acc.microstep(mean_loss(model, batch)) as step:
            if not step.boundary:
                assert step.grad_norm is None
                assert step.loss is None
                continue
            window = batches[index - 3 : index + 1]
            params = list(reference.parameters())
            grads = torch.autograd.grad(mean_loss(reference, concat(window)), params)
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
            assert step.grad_norm is not None
            assert abs(step.grad_norm.item() - norm.item()) < TOL
            assert norm.item() > 0.05  # clipping is active in this test
            clipped = [g * (0.05 / (norm.item() + 1e-6)) for g in grads]
            got = [p.grad for p in model.parameters()]
            assert max((g - c).abs().max().item() for g, c in zip(got, clipped, strict=True)) < TOL
            with torch.no_grad():
                for param, grad in zip(params, clipped, strict=True):
                    param -= 0.1 * grad
    assert max_param_diff(model, reference) < TOL


def test_step_reports_window_loss_lr_and_numbering() -> None:
    """step.loss is the window mean (or item mean), lr the one used, global_step 1-based."""
    batches = make_batches([1, 2, 3, 4, 5, 6])
    model = make_model()
    optimizer = sgd(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=3)
    reports = []
    for batch in acc.epoch(batches):
        loss = sum_loss(model, batch)
        with acc.microstep(loss, num_items=len(batch[0])) as step:
            if step.boundary:
                reports.append((step.global_step, step.loss, step.lr))
    for expected_number, (number, loss, lr) in enumerate(reports, start=1):
        assert loss is not None
        assert not loss.requires_grad
        assert loss.dim() == 0
        assert number == expected_number
        assert lr == 0.1 / number  # the LR this update used, before the scheduler stepped
    assert len(reports) == 2

    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=2)
    losses = [mean_loss(model, b) for b in batches[:2]]
    for loss in losses:
        with acc.microstep(loss) as step:
            pass
    assert step.loss is not None
    assert abs(step.loss.item() - (losses[0].item() + losses[1].item()) / 2) < TOL


def test_items_window_loss_is_the_item_mean() -> None:
    """With num_items, step.loss is summed loss over total items, not a mean of means."""
    batches = make_batches([1, 5])
    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=2)
    sums = [sum_loss(model, b) for b in batches]
    for loss, batch in zip(sums, batches, strict=True):
        with acc.microstep(loss, num_items=len(batch[0])) as step:
            pass
    assert step.loss is not None
    assert abs(step.loss.item() - (sums[0].item() + sums[1].item()) / 6) < TOL


def plain_loop(model, optimizer, scheduler, batches) -> None:
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        mean_loss(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()


def test_steps_1_is_bitwise_the_plain_loop() -> None:
    """Parameters, optimizer state and LR match a plain loop bit for bit (float32, AdamW)."""
    batches = make_batches([4] * 9, dtype=torch.float32)
    runs = []
    for use_acc in (False, True):
        model = make_model(dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=9)
        if use_acc:
            acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=1, max_grad_norm=1.0)
            for batch in acc.epoch(batches):
                with acc.microstep(mean_loss(model, batch)):
                    pass
        else:
            plain_loop(model, optimizer, scheduler, batches)
        runs.append((model, optimizer))
    (plain, plain_opt), (accumulated, acc_opt) = runs
    for p, q in zip(plain.parameters(), accumulated.parameters(), strict=True):
        assert torch.equal(p, q)
    for p, q in zip(plain.parameters(), accumulated.parameters(), strict=True):
        for key, value in plain_opt.state[p].items():
            assert torch.equal(value, acc_opt.state[q][key])
    assert plain_opt.param_groups[0]["lr"] == acc_opt.param_groups[0]["lr"]


def test_parameters_outside_the_model_are_accumulated() -> None:
    """An optimizer that also holds a learnable temperature steps it with the window mean."""
    batches = make_batches([2] * 4)
    model = make_model()
    temperature = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
    optimizer = torch.optim.SGD([*model.parameters(), temperature], lr=0.1)
    acc = gradaccum.Accumulator(model, optimizer, steps=4)
    grads = []
    for batch in acc.epoch(batches):
        loss = mean_loss(model, batch) * temperature
        grads.append(torch.autograd.grad(loss, temperature, retain_graph=True)[0])
        with acc.microstep(loss) as step:
            if step.boundary:
                assert temperature.grad is not None
                assert abs(temperature.grad.item() - torch.stack(grads).mean().item()) < TOL
    assert temperature.grad is None


@settings(max_examples=40, deadline=None)
@given(
    steps=strategies.steps,
    lengths=strategies.item_counts,
    seed=strategies.seeds,
    drop_last=st.booleans(),
    items=st.booleans(),
    clip=st.booleans(),
)
def test_two_optimizers_equal_the_big_batch_reference(
    steps: int, lengths: list[int], seed: int, drop_last: bool, items: bool, clip: bool
) -> None:
    """SGD on the weights and AdamW on the biases, each with its scheduler: every window
    steps both optimizers and both schedulers once, with one clip of the total norm over
    all their parameters, as one float64 big batch per window does."""
    if not items:
        lengths = [lengths[0]] * len(lengths)  # mean mode: equal sizes are the big batch
    if drop_last and len(lengths) < steps:
        steps = len(lengths)
    batches = make_batches(lengths, seed=seed)
    model = make_model(seed)
    max_norm = 0.3 if clip else None
    windows = windows_of(batches, steps, drop_last)
    expected = reference_run(model, windows, split_optimizers, items=items, max_grad_norm=max_norm)
    optimizers, schedulers = split_optimizers(model)
    stepped = [0, 0]
    for index, optimizer in enumerate(optimizers):
        optimizer.register_step_post_hook(
            lambda *_, i=index: stepped.__setitem__(i, stepped[i] + 1)
        )
    acc = gradaccum.Accumulator(
        model, optimizers, schedulers, steps=steps, drop_last=drop_last, max_grad_norm=max_norm
    )
    for batch in acc.epoch(batches):
        loss = sum_loss(model, batch) if items else mean_loss(model, batch)
        with acc.microstep(loss, num_items=len(batch[0]) if items else None) as step:
            if step.boundary:
                assert step.lrs == tuple(o.param_groups[0]["lr"] for o in optimizers)
    assert stepped == [len(windows)] * 2
    assert [s.last_epoch for s in schedulers] == [len(windows)] * 2
    assert acc.global_step == len(windows)
    assert max_param_diff(model, expected) < TOL


def test_steps_1_with_two_optimizers_is_bitwise_the_plain_loop() -> None:
    """steps=1 with two optimizers and clipping: the parameters, both optimizers' states
    and both learning rates match a plain loop (clip_grad_norm_ over model.parameters(),
    then each optimizer and scheduler) bit for bit, in float32."""
    batches = make_batches([4] * 9, dtype=torch.float32)
    runs = []
    for use_acc in (False, True):
        model = make_model(dtype=torch.float32)
        optimizers, schedulers = split_optimizers(model)
        if use_acc:
            acc = gradaccum.Accumulator(model, optimizers, schedulers, steps=1, max_grad_norm=0.5)
            for batch in acc.epoch(batches):
                with acc.microstep(mean_loss(model, batch)):
                    pass
        else:
            for batch in batches:
                for optimizer in optimizers:
                    optimizer.zero_grad(set_to_none=True)
                mean_loss(model, batch).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                for optimizer, scheduler in zip(optimizers, schedulers, strict=True):
                    optimizer.step()
                    scheduler.step()
        runs.append((model, optimizers))
    (plain, plain_opts), (accumulated, acc_opts) = runs
    for p, q in zip(plain.parameters(), accumulated.parameters(), strict=True):
        assert torch.equal(p, q)
    for plain_opt, acc_opt in zip(plain_opts, acc_opts, strict=True):
        plain_params = [p for g in plain_opt.param_groups for p in g["params"]]
        acc_params = [p for g in acc_opt.param_groups for p in g["params"]]
        for p, q in zip(plain_params, acc_params, strict=True):
            for key, value in plain_opt.state[p].items():
                assert torch.equal(value, acc_opt.state[q][key])
        assert plain_opt.param_groups[0]["lr"] == acc_opt.param_groups[0]["lr"]


def test_step_reports_the_windows_items_and_on_one_process_its_global_loss() -> None:
    """``step.num_items`` is the window's item total as passed (an int, or a tensor when a
    tensor was passed), None in mean mode; on one process ``step.global_loss`` is
    ``step.loss`` (in mean mode when ``global_loss=True``, else None); both are None off
    the boundary."""
    batches = make_batches([1, 5, 2, 3])
    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=2)
    reports = []
    for index, batch in enumerate(acc.epoch(batches)):
        items = len(batch[0]) if index < 2 else torch.tensor(len(batch[0]))
        with acc.microstep(sum_loss(model, batch), num_items=items) as step:
            if not step.boundary:
                assert (step.num_items, step.global_loss) == (None, None)
                continue
            reports.append((step.num_items, step.global_loss, step.loss))
    (first, global_first, loss_first), (second, global_second, loss_second) = reports
    assert first == 6
    assert isinstance(second, torch.Tensor)
    assert int(second) == 5
    assert global_first is loss_first
    assert global_second is loss_second

    for asked in (False, True):
        acc = gradaccum.Accumulator(model, sgd(model), steps=1, global_loss=asked)
        with acc.microstep(mean_loss(model, batches[0])) as step:
            assert step.num_items is None
            # Mean mode reports it only when asked, on one process as on several.
            assert step.global_loss is (step.loss if asked else None)
        acc.close()


def step_by_hand(optimizer, scaler) -> None:
    """The hand loop's boundary: step (through the scaler), then clear the gradients."""
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)


def hand_scaled_loop(model, optimizer, scaler, batches, steps: int) -> None:
    """The hand loop as it is written: ``(loss / steps).backward()``, through the scaler."""
    for index, batch in enumerate(batches):
        scaled = mean_loss(model, batch) / steps
        (scaled if scaler is None else scaler.scale(scaled)).backward()
        if index % steps == steps - 1:
            step_by_hand(optimizer, scaler)


def assert_same_bits(runs: list[tuple[torch.nn.Module, torch.optim.Optimizer]]) -> None:
    """The hand loop's run and the accumulator's (in that order) hold the same parameters
    and SGD momentum, bit for bit."""
    (hand, hand_opt), (accumulated, acc_opt) = runs
    for p, q in zip(hand.parameters(), accumulated.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(
            hand_opt.state[p]["momentum_buffer"], acc_opt.state[q]["momentum_buffer"]
        )


def assert_bitwise_the_hand_loop(
    batches, dtype: torch.dtype, init_scale: float | None, steps: int, *, items: bool
) -> None:
    """The accumulator's parameters and momentum equal the hand loop's bit for bit, with
    mean losses (`hand_scaled_loop`) or summed ones with ``num_items`` (`hand_items_loop`)."""
    runs = []
    for use_acc in (False, True):
        model = make_model(dtype=dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = None if init_scale is None else torch.amp.GradScaler("cpu", init_scale=init_scale)
        if use_acc:
            acc = gradaccum.Accumulator(model, optimizer, steps=steps, scaler=scaler)
            for batch in acc.epoch(batches):
                loss = (sum_loss if items else mean_loss)(model, batch)
                with acc.microstep(loss, len(batch[0]) if items else None):
                    pass
        else:
            (hand_items_loop if items else hand_scaled_loop)(
                model, optimizer, scaler, batches, steps
            )
        runs.append((model, optimizer))
    assert_same_bits(runs)


@pytest.mark.parametrize("steps", [3, 4])
@pytest.mark.parametrize(
    ("dtype", "init_scale"),
    [
        (torch.float32, None),
        (torch.float64, None),
        (torch.bfloat16, None),
        (torch.float32, 2.0**8),
        (torch.float32, 1000.0),  # a scale that is not a power of two
    ],
)
def test_mean_mode_is_bitwise_the_hand_loops_division(
    steps: int, dtype: torch.dtype, init_scale: float | None
) -> None:
    """A mean-mode microstep back-propagates ``loss`` with the gradient ``1 / steps`` that
    ``(loss / steps).backward()`` sends into it: the parameters and the optimizer's state
    match that hand loop bit for bit, in each dtype, with and without a GradScaler, at a
    ``steps`` that is a power of two and one that is not."""
    batches = make_batches([3] * (steps * 3), dtype=dtype)
    assert_bitwise_the_hand_loop(batches, dtype, init_scale, steps, items=False)


def microstep_ops(
    acc: gradaccum.Accumulator, loss: torch.Tensor, num_items: int | None = None
) -> list[str]:
    """The aten ops that entering and leaving one microstep block runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list[str] = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Recorder(), acc.microstep(loss, num_items):
        pass
    return ops


def hand_ops(model: torch.nn.Module, loss_of: Any, batch: Any, root_of: Any) -> list[str]:
    """The aten ops that the hand loop's backward, ``root_of(loss).backward()``, runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list[str] = []
    loss = loss_of(model, batch)

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Recorder():
        root_of(loss).backward()
    return ops


@pytest.mark.parametrize("items", [False, True], ids=["mean", "num_items"])
def test_a_microstep_runs_the_hand_loops_backward_op_for_op(items: bool) -> None:
    """Inside a window a microstep runs exactly the ops of the hand loop's backward,
    ``(loss / steps).backward()`` (``loss.backward()`` with ``num_items``): no kept
    gradient and no private entry into the autograd engine, then the loss's value kept
    (``detach``, for ``step.loss``); at the boundary those ops come first."""
    steps = 4
    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=steps)
    loss_of = sum_loss if items else mean_loss
    for index, batch in enumerate(make_batches([3] * 8)):
        twin = copy.deepcopy(model)
        for mine, theirs in zip(twin.parameters(), model.parameters(), strict=True):
            mine.grad = None if theirs.grad is None else theirs.grad.clone()
        hand = hand_ops(twin, loss_of, batch, (lambda x: x) if items else (lambda x: x / steps))
        loss = loss_of(model, batch)
        microstep = microstep_ops(acc, loss, len(batch[0]) if items else None)
        expected = [*hand, "detach"]
        if index % steps == steps - 1:
            assert microstep[: len(expected)] == expected
        else:
            assert microstep == expected


def test_a_loss_that_is_not_a_plain_real_tensor_is_divided_as_before() -> None:
    """A complex loss is refused by torch's backward, as in the hand loop; a tensor
    subclass's loss is divided by ``steps`` (its gradient is its own type)."""
    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=2)
    loss = torch.complex(
        mean_loss(model, make_batches([2])[0]), torch.tensor(0.0, dtype=torch.float64)
    )
    with pytest.raises(RuntimeError, match="real scalar outputs"), acc.microstep(loss):
        pass
    # Mid-window too, where the window's kept gradient (a real one) would start it.
    with acc.microstep(mean_loss(model, make_batches([2], seed=5)[0])):
        pass
    with pytest.raises(RuntimeError, match="real scalar outputs"), acc.microstep(loss):
        pass

    divided: list[str] = []

    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            divided.append(getattr(func, "__name__", ""))
            return super().__torch_function__(func, types, args, kwargs or {})

    for batch in make_batches([2, 2], seed=3):
        with acc.microstep(mean_loss(model, batch).as_subclass(Logged)):
            pass
    assert divided.count("__truediv__") + divided.count("div") >= 2
    assert acc.global_step == 1


def hand_items_loop(model, optimizer, scaler, batches, steps: int) -> None:
    """The hand loop of summed losses: ``loss.backward()`` (torch makes its ones), through the
    scaler, the window's gradient divided by its items at the boundary."""
    items = 0
    for index, batch in enumerate(batches):
        loss = sum_loss(model, batch)
        (loss if scaler is None else scaler.scale(loss)).backward()
        items += len(batch[0])
        if index % steps == steps - 1:
            grads = [p.grad for p in model.parameters()]
            # As the accumulator multiplies: a low-precision gradient by a float32 factor.
            wide = grads[0].dtype in (torch.float32, torch.float64)
            torch._foreach_mul_(grads, 1 / items if wide else torch.tensor(1 / items))
            items = 0
            step_by_hand(optimizer, scaler)


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize(
    ("dtype", "init_scale"),
    [(torch.float32, None), (torch.float64, None), (torch.bfloat16, None), (torch.float32, 2.0**8)],
)
def test_item_mode_is_bitwise_the_hand_loops_backward(
    steps: int, dtype: torch.dtype, init_scale: float | None
) -> None:
    """A ``num_items`` microstep (and every microstep at ``steps=1``) starts the backward
    from ones it made once, where ``loss.backward()`` makes them on every call: the
    parameters and the optimizer's state match that hand loop bit for bit, in each dtype,
    with and without a GradScaler."""
    batches = make_batches([3, 5, 2] * 3, dtype=dtype)
    assert_bitwise_the_hand_loop(batches, dtype, init_scale, steps, items=True)


@pytest.mark.parametrize("items", [False, True])
def test_a_hook_that_changes_the_losss_gradient_in_place_changes_its_microstep_only(
    items: bool,
) -> None:
    """A hook on the loss that scales its gradient in place (``grad.mul_(3)``) scales that
    microstep's, bit for bit as in the hand loop: the gradient a backward starts from is
    kept between microsteps, and made again after such a write instead of compounding it."""
    steps = 4
    batches = make_batches([3, 2, 4, 3] * 2)
    runs = []
    for use_acc in (False, True):
        model = make_model()
        optimizer = sgd(model)
        acc = gradaccum.Accumulator(model, optimizer, steps=steps) if use_acc else None
        for index, batch in enumerate(batches):
            loss = (sum_loss if items else mean_loss)(model, batch)
            loss.register_hook(lambda grad: grad.mul_(3))
            count = len(batch[0]) if items else None
            if acc is not None:
                with acc.microstep(loss, count):
                    pass
                continue
            (loss if items else loss / steps).backward()
            if index % steps == steps - 1:
                if items:
                    torch._foreach_mul_([p.grad for p in model.parameters()], 1 / 12)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        runs.append(model)
    for p, q in zip(runs[0].parameters(), runs[1].parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_torch_function_mode_sees_each_microsteps_backward() -> None:
    """Under a ``__torch_function__`` mode a microstep back-propagates through
    ``Tensor.backward``, which the mode sees (and may change), as the hand loop's: the
    engine is started directly only where ``Tensor.backward`` would start it."""
    from torch.overrides import TorchFunctionMode

    seen: list[str] = []

    class Seen(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=2)
    batches = make_batches([3] * 4)
    for items in (False, True):
        for batch in batches[:2]:
            loss = (sum_loss if items else mean_loss)(model, batch)
            with Seen(), acc.microstep(loss, len(batch[0]) if items else None):
                pass
        assert seen.count("backward") == 2
        seen.clear()
    assert acc.global_step == 2


class _Marked(torch.Tensor):
    """A loss subclass that its ``__torch_function__`` lets through unchanged."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return super().__torch_function__(func, types, args, kwargs or {})


_TURNS = (None, "float32", "subclass", "mode", "hook")
# (steps, items, what each microstep of the window is turned into: a loss of another
# dtype, a tensor subclass, a ``__torch_function__`` mode, a hook that writes to the
# loss's gradient in place, or nothing)
_windows = st.lists(
    st.integers(1, 5).flatmap(
        lambda steps: st.tuples(
            st.just(steps),
            st.booleans(),
            st.lists(st.sampled_from(_TURNS), min_size=steps, max_size=steps),
        )
    ),
    min_size=1,
    max_size=6,
)
_ONE_AT_1 = [None, "float32", None, None]  # the window's microstep at index 1 turned


@settings(max_examples=40, deadline=None)
@given(windows=_windows, seed=strategies.seeds)
@example(
    windows=[
        (4, False, [None] * 4),
        (4, True, _ONE_AT_1),
        (3, False, [None, "subclass", None]),
        (3, True, [None] * 3),
        (4, False, [None, "mode", None, None]),
        (3, False, _ONE_AT_1[:3]),
        (4, True, [None, "mode", None, None]),
        (4, False, [None, None, "hook", None]),
    ],
    seed=0,
)
def test_each_window_chooses_the_gradient_its_microsteps_start_from(
    windows: list[tuple[int, bool, list[str | None]]], seed: int
) -> None:
    """The gradient a window's microsteps start from is chosen when the window opens, and
    any microstep it does not fit back-propagates as the hand loop's: windows of mean and
    summed losses in any order, each with its own ``steps`` (another divisor), and on any
    microstep a loss of another dtype, a tensor subclass, a ``__torch_function__`` mode or
    a hook that scales the loss's gradient in place; the parameters and the momentum equal
    the hand loop's bit for bit."""
    from torch.overrides import TorchFunctionMode

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 5, (sum(steps for steps, _, _ in windows),), generator=generator)
    batches = make_batches(sizes.tolist(), seed=seed)
    runs = []
    for use_acc in (False, True):
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        acc = gradaccum.Accumulator(model, optimizer) if use_acc else None
        drawn = iter(batches)
        for steps, items, turns in windows:
            if acc is not None:
                acc.steps = steps
            total = 0
            for turned in turns:
                inputs, targets = next(drawn)
                loss = (sum_loss if items else mean_loss)(model, (inputs, targets))
                if turned == "float32":
                    loss = loss.float()
                elif turned == "subclass":
                    loss = loss.as_subclass(_Marked)
                elif turned == "hook":
                    loss.register_hook(lambda gradient: gradient.mul_(3))
                mode = Passing() if turned == "mode" else contextlib.nullcontext()
                with mode:
                    if acc is not None:
                        with acc.microstep(loss, len(inputs) if items else None):
                            pass
                    else:
                        (loss if items else loss / steps).backward()
                total += len(inputs)
            if acc is None:
                if items:
                    torch._foreach_mul_([p.grad for p in model.parameters()], 1 / total)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        runs.append((model, optimizer))
    assert_same_bits(runs)


def test_the_kept_losses_are_values_without_a_graph() -> None:
    """What a window keeps of each loss is its value (``step.loss`` is their mean), not
    its graph: no kept loss requires grad or has a ``grad_fn``."""
    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=3)
    losses = []
    for batch in acc.epoch(make_batches([2, 3, 4])):
        loss = mean_loss(model, batch)
        losses.append(loss.item())
        with acc.microstep(loss) as step:
            if step.boundary:
                kept = list(step._losses)
                reported = step.loss
    assert [value.item() for value in kept] == losses
    assert not any(value.requires_grad or value.grad_fn is not None for value in kept)
    assert reported.item() == pytest.approx(sum(losses) / 3, rel=1e-15)
