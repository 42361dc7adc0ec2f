"""No host-device synchronization on any microstep unless the user asked for one."""

from __future__ import annotations

import pytest
import torch

import gradaccum
from gradaccum.testing import CollectiveCounter
from tests.helpers import make_batches, make_model, mean_loss, sum_loss


def test_counter_sees_host_syncs() -> None:
    """The counter is live: .item(), bool() and float() on a model's output each count
    once."""
    counter = CollectiveCounter()
    with counter:
        value = make_model()(torch.ones(1, 5, dtype=torch.float64)).sum().detach()
        value.item()
        bool(value > 1)
        float(value)
        value * 3  # no sync
    assert counter.host_syncs == 3


def test_microsteps_never_sync_the_host() -> None:
    """Clipping, a scheduler, tensor num_items and the boundary: zero host syncs.

    SGD, because the optimizer's own step may read CPU step counters (Adam on CPU does).
    """
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4)
    acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=3, max_grad_norm=0.1)
    counter = CollectiveCounter()
    boundaries = 0
    for batch in acc.epoch(make_batches([1, 2, 3, 4, 5, 6])):
        loss = sum_loss(model, batch)
        with counter, acc.microstep(loss, num_items=torch.tensor(len(batch[0]))) as step:
            boundaries += step.boundary
    with counter, acc.microstep(mean_loss(model, make_batches([2])[0])):
        pass
    assert boundaries == 2
    assert counter.host_syncs == 0


def test_scaler_is_the_documented_exception() -> None:
    """A GradScaler needs the host at the boundary, once: its own found-inf read, as in
    the hand loop's ``scaler.step(optimizer)``; whether it skipped is seen without a read
    of gradaccum's. Never off the boundary."""
    model = make_model(dtype=torch.float32)
    scaler = torch.amp.GradScaler("cpu")
    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2, scaler=scaler
    )
    batches = make_batches([2, 2], dtype=torch.float32)
    counter = CollectiveCounter()
    with counter, acc.microstep(mean_loss(model, batches[0])):
        pass
    assert counter.host_syncs == 0
    with counter, acc.microstep(mean_loss(model, batches[1])):
        pass
    assert counter.host_syncs == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_sync_under_cuda_sync_debug_mode() -> None:
    """On a GPU, torch's own detector raises on any synchronizing call in the microsteps."""
    device = torch.device("cuda")
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, optimizer, steps=2, max_grad_norm=1.0)
    batches = [(x.to(device), y.to(device)) for x, y in make_batches([2] * 4)]
    items = [torch.tensor(2, device=device) for _ in batches]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch, count in zip(batches, items, strict=True):
            loss = sum_loss(model, batch)
            with acc.microstep(loss, num_items=count):
                pass
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert acc.global_step == 2
