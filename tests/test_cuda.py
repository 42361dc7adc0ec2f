"""On a CUDA GPU: gradaccum trains as the float32 hand loop does, syncs the host nowhere
its options do not ask for (torch's own detector, ``torch.cuda.set_sync_debug_mode``),
peaks at the hand loop's memory, and `gradaccum.testing.CollectiveCounter` counts the
host syncs that detector reports.

Every test needs a GPU and is skipped without one (CI has none); the module imports and
is collected anywhere. The loops are those of benchmarks/gpu.py on a small MLP: fused
AdamW, a LambdaLR, clipping, and a window's losses as means or as sums with
``num_items`` (a Python int, or a 0-dim CUDA tensor).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812  # the usual PyTorch alias

import gradaccum
from gradaccum.testing import CollectiveCounter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"
STEPS = 4
MAX_GRAD_NORM = 0.1  # low enough that every window is clipped
MODES = ("mean", "int", "tensor")  # the loss a mean; a sum with num_items an int; a tensor
SYNC = "synchroniz"  # in every message of torch's sync debug mode

Batch = tuple[torch.Tensor, torch.Tensor, Any]  # inputs, targets, num_items (None: mean)


def _model(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, 1)).to(DEVICE)


def _parts(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    return optimizer, scheduler


def _accumulator(model: nn.Module, steps: int = STEPS, **options: Any) -> gradaccum.Accumulator:
    optimizer, scheduler = _parts(model)
    return gradaccum.Accumulator(
        model, optimizer, scheduler, steps=steps, max_grad_norm=MAX_GRAD_NORM, **options
    )


def _batches(count: int, mode: str, rows: int = 48, vary: bool = True) -> list[Batch]:
    """``count`` microbatches of ``rows`` (to ``rows + 15`` if they ``vary``) rows, made
    on the GPU up front (no copy to the device runs inside the loops), with their
    ``num_items``."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(count):
        size = rows + (int(torch.randint(16, (), generator=generator)) if vary else 0)
        x = torch.randn(size, 32, generator=generator).to(DEVICE)
        y = torch.randn(size, 1, generator=generator).to(DEVICE)
        items = {"mean": None, "int": size, "tensor": torch.tensor(size, device=DEVICE)}[mode]
        batches.append((x, y, items))
    torch.cuda.synchronize()
    return batches


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y, items = batch
    return F.mse_loss(model(x), y, reduction="mean" if items is None else "sum")


def _gradaccum(acc: gradaccum.Accumulator, batches: list[Batch]) -> None:
    for batch in acc.epoch(batches):
        with acc.microstep(_loss(acc.model, batch), num_items=batch[2]):
            pass


class _HandLoop:
    """The hand-written loop gradaccum replaces: the same arithmetic in the same order.

    It keeps each window's detached losses until the window's step, as a loop that logs
    the window's loss does (gradaccum keeps them for `gradaccum.Step`), so that both
    hold the same memory. A mean loss is back-propagated as ``(loss / steps).backward()``,
    as gradaccum does.
    """

    def __init__(self, model: nn.Module, steps: int = STEPS) -> None:
        self.model, self.steps = model, steps
        self.optimizer, self.scheduler = _parts(model)
        self.params = list(model.parameters())

    def run(self, batches: list[Batch]) -> None:
        """Train on ``batches``, one optimizer step per ``steps`` of them."""
        losses: list[torch.Tensor] = []
        items: Any = 0
        for index, batch in enumerate(batches, start=1):
            loss = _loss(self.model, batch)
            if batch[2] is not None:
                loss.backward()  # type: ignore[no-untyped-call]
            else:
                (loss / self.steps).backward()  # type: ignore[no-untyped-call]
            losses.append(loss.detach())
            if batch[2] is not None:
                items = items + batch[2]
            if index % self.steps:
                continue
            if batch[2] is not None:
                # A tensor total's inverse in float64, then float32, as gradaccum scales.
                scale = 1 / items if isinstance(items, int) else (1 / items.double()).float()
                torch._foreach_mul_([p.grad for p in self.params], scale)
            nn.utils.clip_grad_norm_(self.params, MAX_GRAD_NORM)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses, items = [], 0


@contextmanager
def _sync_debug(mode: str) -> Iterator[None]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("steps", [STEPS, 3])
@pytest.mark.parametrize("mode", MODES)
def test_matches_the_float32_hand_loop(mode: str, steps: int) -> None:
    """Three windows with clipping and fused AdamW end in the hand loop's parameters, bit
    for bit: the same kernels run on the same values in the same order. A mean loss is
    divided by ``steps`` by hand, and back-propagated with the ``1 / steps`` that division
    sends into it by gradaccum: the same bits also at ``steps=3``, whose ``1 / 3`` is
    rounded (CUDA divides by a CPU scalar as a multiply by its reciprocal, on both
    sides)."""
    hand, ours = _model(), _model()
    batches = _batches(3 * steps, mode)
    _HandLoop(hand, steps).run(batches)
    acc = _accumulator(ours, steps)
    _gradaccum(acc, batches)
    assert acc.global_step == 3
    for name, p in hand.named_parameters():
        q = ours.get_parameter(name)
        assert torch.equal(p, q), f"{name}: max difference {(p - q).abs().max().item()}"


@pytest.mark.parametrize("mode", MODES)
def test_no_host_sync_off_the_boundary(mode: str) -> None:
    """Sync debug mode "error" raises on the first synchronizing call: the hand-out, the
    forward and the microstep of every non-boundary microbatch run under it."""
    model = _model()
    acc = _accumulator(model)
    batches = _batches(2 * STEPS, mode)
    with _sync_debug("error"):
        for index, batch in enumerate(acc.epoch(batches)):
            loss = _loss(model, batch)
            if index % STEPS == STEPS - 1:
                torch.cuda.set_sync_debug_mode("default")
                with acc.microstep(loss, num_items=batch[2]):
                    pass
                torch.cuda.set_sync_debug_mode("error")
            else:
                with acc.microstep(loss, num_items=batch[2]):
                    pass
    assert acc.global_step == 2


@pytest.mark.parametrize("mode", MODES)
def test_no_host_sync_at_the_boundary_either(mode: str) -> None:
    """With clipping, fused AdamW and a scheduler nothing needs the host at the boundary
    either: the whole loop, the first optimizer step included, runs under "error"."""
    acc = _accumulator(_model())
    batches = _batches(2 * STEPS, mode)
    with _sync_debug("error"):
        _gradaccum(acc, batches)
    assert acc.global_step == 2


def test_a_finite_check_syncs_once_per_boundary() -> None:
    """``on_nonfinite="skip"`` asks for one sync per window, at the boundary, and sync
    debug mode "warn" reports exactly that one: the detector is live."""
    model = _model()
    acc = _accumulator(model, on_nonfinite="skip")
    batches = _batches(2 * STEPS, "int")
    per_microstep = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _sync_debug("warn"):
            for batch in acc.epoch(batches):
                seen = len(caught)
                with acc.microstep(_loss(model, batch), num_items=batch[2]):
                    pass
                per_microstep.append(sum(SYNC in str(w.message) for w in caught[seen:]))
    assert per_microstep == [0, 0, 0, 1] * 2
    assert acc.skipped_steps == 0


@pytest.mark.parametrize("mode", ["mean", "int"])
def test_peak_memory_is_the_hand_loop_s(mode: str) -> None:
    """A window's peak of allocated memory is the hand loop's, to the byte: gradaccum
    holds nothing on the GPU beyond what the loop holds (each window's losses: `_HandLoop`).

    The activations dominate (2 MiB each, all of one size, so that the allocator's
    cache hands out the same blocks on both sides whatever it holds).
    """
    hand, ours = _model(width=1024), _model(width=1024)
    batches = _batches(STEPS, mode, rows=512, vary=False)
    loop, acc = _HandLoop(hand), _accumulator(ours)
    runs = {"hand": lambda: loop.run(batches), "gradaccum": lambda: _gradaccum(acc, batches)}
    peaks: dict[str, list[int]] = {"hand": [], "gradaccum": []}
    starts: dict[str, list[int]] = {"hand": [], "gradaccum": []}
    requested: dict[str, list[int]] = {"hand": [], "gradaccum": []}
    for window in range(3):  # the first creates AdamW's state and warms the allocator
        for side, run in runs.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            run()
            torch.cuda.synchronize()
            if window:
                starts[side].append(start)
                peaks[side].append(torch.cuda.max_memory_allocated())
                requested[side].append(torch.cuda.memory_stats()["requested_bytes.all.peak"])
    assert starts["gradaccum"] == starts["hand"]
    assert peaks["gradaccum"] == peaks["hand"]
    assert requested["gradaccum"] == requested["hand"]


def test_counter_counts_what_sync_debug_mode_reports() -> None:
    """A loop that reads ``step.loss.item()`` at each boundary syncs once per window:
    `CollectiveCounter` counts what torch's sync debug mode reports, window by window."""
    model = _model()
    acc = _accumulator(model)
    batches = _batches(3 * STEPS, "int")
    logged = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _sync_debug("warn"), CollectiveCounter(acc.optimizers) as counter:
            for batch in acc.epoch(batches):
                with acc.microstep(_loss(model, batch), num_items=batch[2]) as step:
                    if step.boundary:
                        assert step.loss is not None
                        logged.append(step.loss.item())
    synced = [w for w in caught if SYNC in str(w.message)]
    assert len(logged) == 3
    assert counter.host_syncs == len(synced) == 3
    assert [window.host_syncs for window in counter.windows] == [1, 1, 1]
