"""gradaccum.testing's counters on one process: host syncs, windows closed by the
optimizer or by hand, pausing, and the arithmetic of `Counts` (the collectives
themselves are counted on real ranks in test_testing_distributed.py)."""

from __future__ import annotations

import pytest
import torch

import gradaccum
from gradaccum.testing import CollectiveCounter, Counts, DDPBucketCounter
from gradaccum.testing.counting import usual
from tests.helpers import make_batches, make_model, mean_loss, sgd


def test_each_optimizer_step_closes_a_window() -> None:
    """Given the optimizer, the counter splits any loop into windows at its steps: here
    a read of each window's loss (one host sync) on the window's last microstep."""
    model = make_model()
    optimizer = sgd(model)
    acc = gradaccum.Accumulator(model, optimizer, steps=2)
    counter = CollectiveCounter(optimizer)
    with counter:
        for batch in acc.epoch(make_batches([2] * 5)):
            with acc.microstep(mean_loss(model, batch)) as step:
                if step.boundary:
                    step.loss.item()
    assert counter.windows == [Counts({}, 1), Counts({}, 1)]
    assert counter.per_window == Counts({}, 1)
    assert counter.counts == Counts({}, 2)
    assert not optimizer._optimizer_step_post_hooks  # the counter's hook left with it


def test_windows_closed_by_hand_and_a_pause() -> None:
    """end_window() closes a window by hand; what runs while paused is not counted."""
    value = torch.tensor(3.0)
    counter = CollectiveCounter()
    with counter:
        value.item()
        assert counter.open_window == Counts({}, 1)
        assert counter.end_window() == Counts({}, 1)
        with counter.paused():
            value.item()
        bool(value > 1)
    with counter:  # entered again, it counts on
        float(value)
    assert counter.open_window == Counts({}, 2)
    assert counter.host_syncs == 3
    assert counter.windows == [Counts({}, 1)]


def test_counts_add_subtract_and_read_in_words() -> None:
    ddp = Counts({"all_reduce": 4, "broadcast": 2}, 1)
    assert ddp.all_reduces == 4
    assert ddp.broadcasts == 2
    assert ddp.reduce_scatters == ddp.all_gathers == 0
    assert ddp - Counts({"all_reduce": 4}) == Counts({"broadcast": 2}, 1)
    assert ddp + Counts({"barrier": 1}) == Counts(
        {"all_reduce": 4, "barrier": 1, "broadcast": 2}, 1
    )
    assert str(ddp) == "4 all-reduces + 2 broadcasts, 1 host sync"
    assert str(Counts({"all_gather": 1, "barrier": 2})) == "1 all-gather + 2 barrier, 0 host syncs"
    assert str(Counts()) == "no collective, 0 host syncs"


def test_per_window_is_what_most_windows_ran() -> None:
    """The first window's one-time work is left out; the later windows win a tie."""
    windows = [Counts({"all_reduce": 2, "broadcast": 2}), Counts({"all_reduce": 1})] * 2
    assert usual(windows) == Counts({"all_reduce": 1})
    assert usual(windows[:1] + [Counts({"all_reduce": 1})] * 2) == Counts({"all_reduce": 1})
    assert usual([]) == Counts()


def test_bad_input_is_refused() -> None:
    with pytest.raises(gradaccum.ConfigTypeError, match=r"optimizer must be a torch.optim"):
        CollectiveCounter("sgd")  # type: ignore[arg-type]
    with pytest.raises(gradaccum.ConfigTypeError, match=r"model must be a DistributedDataParallel"):
        DDPBucketCounter(make_model())
