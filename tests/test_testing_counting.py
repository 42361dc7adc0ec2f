"""gradaccum.testing's counters on one process: host syncs (what would stall a device,
not reads of CPU values), windows closed by the optimizers or by hand, pausing, the
arithmetic of `Counts`, and every collective op by a kind's name (the collectives
themselves are counted on real ranks in test_testing_distributed.py)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import gradaccum
from gradaccum.testing import CollectiveCounter, Counts, DDPBucketCounter
from gradaccum.testing.counting import KINDS, in_words, kind_named, kind_of, usual
from tests import loops
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
    counter = CollectiveCounter()
    with counter:
        # A model's output: a device run holds it on the device.
        value = make_model()(torch.ones(1, 5, dtype=torch.float64)).sum().detach()
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
    assert str(Counts({"all_reduce": 1, "reduce": 2})) == "1 all-reduce + 2 reduce, 0 host syncs"
    assert str(Counts()) == "no collective, 0 host syncs"
    # Those of them outside any backward add and subtract alike, and are not compared.
    logged = Counts({"all_reduce": 2}, 0, {"all_reduce": 1})
    assert (logged + logged).outside_backward == {"all_reduce": 2}
    assert (logged - Counts({"all_reduce": 1})).outside_backward == {"all_reduce": 1}
    assert (logged - logged).outside_backward == {}
    assert logged == Counts({"all_reduce": 2})
    assert usual([logged, logged, Counts({"all_reduce": 1})]).outside_backward == {"all_reduce": 1}
    # So do the backward passes that ran each kind.
    synced = Counts({"all_reduce": 4}, 0, {}, {"all_reduce": 4})
    assert (synced + synced).backwards == {"all_reduce": 8}
    assert (synced - Counts({"all_reduce": 1}, 0, {}, {"all_reduce": 1})).backwards == {
        "all_reduce": 3
    }
    assert synced == Counts({"all_reduce": 4})
    assert usual([synced, Counts({"all_reduce": 1})]).backwards == {}  # (a tie: the later's)
    assert usual([synced, synced, Counts({"all_reduce": 1})]).backwards == {"all_reduce": 4}


def test_every_collective_op_counts_as_a_kind_with_a_name() -> None:
    """Each ``c10d::`` and ``_c10d_functional::`` op this torch registers counts as one of
    the kinds, none under its raw op name (``reduce_``, ``alltoall_base_``)."""
    ops = [
        name.partition("::")[2]
        for name in torch._C._dispatch_get_all_op_names()
        if name.partition("::")[0] in ("c10d", "_c10d_functional")
    ]
    collectives = [op for op in ops if op not in ("wait_tensor", "check_for_nan")]
    collectives = [op for op in collectives if op != "_wrap_tensor_autograd"]
    assert len(collectives) > 30
    assert {op: kind_of(op) for op in collectives if kind_of(op) not in KINDS} == {}
    assert kind_of("c10d::reduce_") == "reduce"
    assert kind_of("c10d::alltoall_base_") == "all_to_all"
    assert kind_of("c10d::_allgather_base_") == "all_gather"
    assert kind_of("_c10d_functional::reduce_scatter_tensor_coalesced") == "reduce_scatter"


def test_every_name_a_count_is_printed_by_means_its_kind() -> None:
    """``in_words`` names each kind so that `kind_named` reads it back, in the singular
    and the plural: what ``expect_collectives`` accepts is what a report prints."""
    for kind in KINDS:
        for n in (1, 2):
            assert kind_named(in_words(n, kind).split(" ", 1)[1]) == kind
        assert kind_named(kind) == kind
    assert in_words(2, "reduce") == "2 reduce"
    assert in_words(2, "all_reduce") == "2 all-reduces"
    assert kind_named("allreduce") is None


def test_host_syncs_are_reads_of_what_would_live_on_the_device() -> None:
    """Counted: reads of a parameter, a loss, a gradient, Adam's moments, a CPU tensor a
    loss was added into, a view of it. Not counted: Adam's CPU step counter and a tensor
    built on the host from Python values (a device run keeps both on the CPU)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    weight = model[0].weight
    with CollectiveCounter() as counter:
        loss = mean_loss(model, make_batches([2])[0])
        loss.backward()
        optimizer.step()
        total = torch.zeros(2)
        total[0] += loss.detach()
        device = [
            weight[0, 0].item(),
            loss.item(),
            float(weight.grad.norm()),
            bool(optimizer.state[weight]["exp_avg"].abs().max() > 0),
            total.sum().item(),
            total[0].item(),
        ]
        assert counter.host_syncs == len(device)
        host = [
            optimizer.state[weight]["step"].item(),
            torch.tensor(3.0).item(),
            int(total.shape[0]),
        ]
    assert counter.host_syncs == len(device)
    assert host == [1.0, 3.0, 2]


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda params: torch.optim.AdamW(params, lr=1e-2),
        lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
        lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
        lambda params: torch.optim.Adam(params, lr=1e-2),
        lambda params: torch.optim.NAdam(params, lr=1e-2),
        loops.adamw,
    ],
    ids=["adamw", "adamw_foreach", "adamw_fused", "adam", "nadam", "nanogpt_adamw"],
)
def test_adam_s_step_counters_are_no_host_sync(make_optimizer: Any) -> None:
    """Non-capturable Adam and AdamW read each parameter's CPU step counter with
    ``.item()`` every step; a loop that logs nothing has 0 host syncs per window, and one
    that reads its loss once per window, 1."""
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    with CollectiveCounter(optimizer) as counter:
        for logs in (False, True):
            for window in range(2):
                for batch in make_batches([2] * 2, seed=window):
                    loss = mean_loss(model, batch) / 2
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if logs:
                    loss.item()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    assert [window.host_syncs for window in counter.windows] == [0, 0, 1, 1]


def test_a_window_closes_once_every_optimizer_has_stepped() -> None:
    """Given several optimizers, a window ends when the last of them has stepped, in any
    order: the host sync between the two steps belongs to the window."""
    model = make_model()
    optimizers = loops.split_optimizers(model.parameters())
    with CollectiveCounter(optimizers) as counter:
        for order in ([0, 1], [1, 0]):
            mean_loss(model, make_batches([2])[0]).backward()
            optimizers[order[0]].step()
            model[0].weight.sum().item()
            optimizers[order[1]].step()
            model.zero_grad()
    assert counter.windows == [Counts({}, 1), Counts({}, 1)]
    assert not any(optimizer._optimizer_step_post_hooks for optimizer in optimizers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_syncs_agree_with_cuda_s_sync_debug_mode() -> None:
    """On a GPU, the counter counts exactly the syncs torch's own detector warns about:
    an AdamW loop reading its loss each microstep (one per read), its step counters and
    a host-built tensor read too (neither syncs the GPU)."""
    device = torch.device("cuda")
    model = make_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = [(x.to(device), y.to(device)) for x, y in make_batches([2] * 4)]
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with CollectiveCounter(optimizer) as counter:
                for index, batch in enumerate(batches):
                    loss = mean_loss(model, batch) / 2
                    loss.backward()
                    loss.item()
                    if index % 2:
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                        optimizer.state[model[0].weight]["step"].item()
                        torch.tensor(2.0).item()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    synced = [w for w in caught if "synchronizing" in str(w.message)]
    assert counter.host_syncs == len(synced) == 4
    assert [window.host_syncs for window in counter.windows] == [2, 2]


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
