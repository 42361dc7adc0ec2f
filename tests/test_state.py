"""Checkpoints: resuming at a window boundary is bit for bit; misuse is refused."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import gradaccum
from tests.helpers import (
    load_checkpoint,
    load_parts,
    make_batches,
    make_model,
    mean_loss,
    save_checkpoint,
    save_parts,
)

BATCHES = make_batches([3] * 13, dtype=torch.float32)


def build(steps: int = 4):
    model = make_model(dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=6)
    return (
        model,
        optimizer,
        scheduler,
        gradaccum.Accumulator(model, optimizer, scheduler, steps=steps, max_grad_norm=1.0),
    )


def train(parts, epochs: int, stop_after: int | None = None) -> None:
    model, _, _, acc = parts
    for _ in range(epochs):
        for batch in acc.epoch(BATCHES):
            with acc.microstep(mean_loss(model, batch)):
                pass
            if acc.global_step == stop_after:
                return


def save(parts) -> bytes:
    return save_checkpoint(parts)


def load(blob: bytes):
    return load_checkpoint(build(), blob)


def assert_same_run(a, b) -> None:
    (model_a, opt_a, _, acc_a), (model_b, opt_b, _, acc_b) = a, b
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(p, q)
        for key, value in opt_a.state[p].items():
            assert torch.equal(value, opt_b.state[q][key])
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
    assert acc_a.global_step == acc_b.global_step


@pytest.mark.parametrize("stop_after", [3, 2, 5])  # last window of epoch 1, mid-epoch, epoch 2
def test_resume_at_a_window_boundary_is_bit_for_bit(stop_after: int) -> None:
    """Stop after a window, save everything, resume in fresh objects: the same run."""
    uninterrupted = build()
    train(uninterrupted, epochs=2)
    first = build()
    train(first, epochs=2, stop_after=stop_after)
    resumed = load(save(first))
    assert resumed[3].state_dict()["position"] == first[3].state_dict()["position"]
    model, _, _, acc = resumed
    for batch in acc.epoch(BATCHES):  # finishes the interrupted epoch from its position
        with acc.microstep(mean_loss(model, batch)):
            pass
    train(resumed, epochs=1 if stop_after <= 3 else 0)
    assert_same_run(uninterrupted, resumed)


def test_state_holds_steps_position_global_step_and_policy() -> None:
    """The saved state names what a resume needs, and what it must match: the
    data-parallel world size and the length of the epoch its position lies in (None
    between epochs, where no position is resumed), and acc.step's microbatch (None: not
    set)."""
    parts = build()
    train(parts, epochs=1, stop_after=2)
    assert parts[3].state_dict() == {
        "version": 8,
        "steps": 4,
        "position": 8,
        "global_step": 2,
        "skipped_steps": 0,
        "epochs_completed": 0,
        "drop_last": True,
        "sync": "auto",
        "world_size": 1,
        "epoch_length": 13,
        # a list of batches: no global order known
        "global_order": {"data": None, "epoch": None, "samples": None, "batch_size": None},
        "global_position": None,
        "by_items": False,
        "handed_out": False,  # saved after a block: no microbatch awaits its microstep
        "microbatch": None,
    }
    train(parts, epochs=1)
    assert parts[3].state_dict()["position"] == 0
    assert (parts[3].state_dict()["world_size"], parts[3].state_dict()["epoch_length"]) == (1, None)


def test_a_version_5_state_resumes_as_before() -> None:
    """A state saved by the gradaccum of version 5 (no global order, position or mode)
    loads and resumes the uninterrupted run bit for bit."""
    uninterrupted = build()
    train(uninterrupted, epochs=2)
    first = build()
    train(first, epochs=2, stop_after=2)
    state = first[3].state_dict()
    old = {
        key: value
        for key, value in state.items()
        if key not in ("global_order", "global_position", "by_items")
    }
    resumed = build()
    resumed[0].load_state_dict(first[0].state_dict())
    resumed[1].load_state_dict(first[1].state_dict())
    resumed[2].load_state_dict(first[2].state_dict())
    resumed[3].load_state_dict(dict(old, version=5))
    assert (resumed[3].global_step, resumed[3].position) == (2, 8)
    train(resumed, epochs=2 - resumed[3].epochs_completed)
    assert_same_run(uninterrupted, resumed)


def test_mid_window_checkpoint_is_refused() -> None:
    """state_dict() mid-window, or inside the boundary block, says when to call it."""
    model, _, _, acc = build()
    batch = BATCHES[0]
    with acc.microstep(mean_loss(model, batch)):
        pass
    with pytest.raises(gradaccum.UsageError, match=r"mid-window \(1 of 4.*has exited"):
        acc.state_dict()
    for index in range(3):
        # inside a block its microstep counts: its backward ran on entering
        refused = pytest.raises(gradaccum.UsageError, match=rf"mid-window \({index + 2} of 4")
        with acc.microstep(mean_loss(model, batch)) as step, refused:
            acc.state_dict()
    assert step.boundary
    assert acc.state_dict()["global_step"] == 1


def test_resume_with_other_steps_or_policy_is_refused() -> None:
    """A state saved with steps=4 does not load into steps=2, nor drop_last into keep-last."""
    parts = build()
    state = parts[3].state_dict()
    _, _, _, other = build(steps=2)
    with pytest.raises(gradaccum.ConfigError, match=r"saved with steps=4.*steps=2.*steps=4"):
        other.load_state_dict(state)
    model = make_model()
    keep = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), steps=4, drop_last=False
    )
    with pytest.raises(gradaccum.ConfigError, match="drop_last=True"):
        keep.load_state_dict(state)
    assert other.global_step == 0


@pytest.mark.parametrize(
    "state",
    [
        None,
        {"steps": 4},
        {"version": 1, "steps": 0, "position": 0, "global_step": 0},
        {"version": 1, "steps": 4, "position": -1, "global_step": 0},
    ],
)
def test_malformed_state_is_refused(state: Any) -> None:
    """Anything but a state from state_dict() is refused by name, and nothing is loaded."""
    _, _, _, acc = build()
    with pytest.raises(gradaccum.GradaccumError, match="state"):
        acc.load_state_dict(state)
    assert acc.global_step == 0


def test_load_into_an_open_window_is_refused() -> None:
    """Loading into an accumulator mid-window would mix two runs: refused."""
    model, _, _, acc = build()
    state = acc.state_dict()
    with acc.microstep(mean_loss(model, BATCHES[0])):
        pass
    with pytest.raises(gradaccum.UsageError, match="mid-window"):
        acc.load_state_dict(state)


def test_resume_position_past_the_epoch_is_refused() -> None:
    """A position beyond the epoch means other data: refused at acc.epoch() (a state that
    records its epoch's length refuses another length first: tests/test_resuming.py)."""
    parts = build()
    train(parts, epochs=1, stop_after=3)
    state = parts[3].state_dict() | {"position": 12, "epoch_length": None}
    _, _, _, acc = build()
    acc.load_state_dict(state)
    with pytest.raises(gradaccum.ConfigError, match=r"microbatch 12.*past the end of .* of 8"):
        next(acc.epoch(BATCHES[:8]))


def test_resume_past_an_unsized_epoch_is_refused() -> None:
    """Without len the shortfall shows while skipping: refused, naming both counts."""
    parts = build()
    train(parts, epochs=1, stop_after=3)
    _, _, _, acc = build()
    acc.load_state_dict(parts[3].state_dict())
    with pytest.raises(gradaccum.ConfigError, match=r"microbatch 12.*ended after 5"):
        next(acc.epoch(iter(BATCHES[:5])))


def test_epochs_completed_counts_the_epochs_run_to_their_end() -> None:
    """acc.epochs_completed counts each epoch whose loop ran out, not one broken off; it is
    saved and loaded, so the resumed loop knows its epoch (a state of version 3 has none)."""
    parts = build()
    acc = parts[3]
    assert acc.epochs_completed == 0
    train(parts, epochs=2)
    assert acc.epochs_completed == 2
    train(parts, epochs=1, stop_after=acc.global_step + 1)  # broken off after a window
    assert acc.epochs_completed == 2
    state = acc.state_dict()
    assert (state["epochs_completed"], state["position"]) == (2, 4)
    resumed = load(save(parts))
    assert resumed[3].epochs_completed == 2
    old = dict(state, version=3)
    del old["epochs_completed"]
    resumed[3].load_state_dict(old)
    assert resumed[3].epochs_completed == 0


def test_a_checkpoint_on_an_epochs_last_window_resumes_that_epoch() -> None:
    """After the last window of an epoch, before its loop ran out, the epoch is not yet
    completed: the resumed loop restarts that epoch, which ends at once and counts."""
    parts = build()
    train(parts, epochs=1, stop_after=3)  # the 3rd and last window of the first epoch
    assert (parts[3].epochs_completed, parts[3].position) == (0, 12)
    resumed = load(save(parts))
    acc = resumed[3]
    for _ in range(acc.epochs_completed, 1):
        for batch in acc.epoch(BATCHES):
            raise AssertionError(f"the epoch handed out {batch} after its last window")
    assert (acc.epochs_completed, acc.position, acc.global_step) == (1, 0, 3)
    train(resumed, epochs=1)
    uninterrupted = build()
    train(uninterrupted, epochs=2)
    assert_same_run(uninterrupted, resumed)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_torch_distributed_checkpoint_saves_the_accumulator_as_a_stateful(tmp_path) -> None:
    """The accumulator is a ``Stateful`` of torch.distributed.checkpoint: saved in one dict
    with the model's, optimizer's and scheduler's state and loaded back in place, the
    resumed run is the uninterrupted one, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    def build_for_dcp():
        model = make_model(dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=6)
        acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=4, max_grad_norm=1.0)
        # get_state_dict steps a fresh optimizer once (zero gradients, lr 0) to create its
        # state: a step that changes nothing, so the accumulator does not warn about it.
        with warnings.catch_warnings():
            warnings.simplefilter("error", gradaccum.GradaccumWarning)
            get_state_dict(model, optimizer)
        return model, optimizer, scheduler, acc

    def checkpoint(parts) -> dict[str, Any]:
        model, optimizer, scheduler, acc = parts
        model_state, optimizer_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optimizer_state, "sched": scheduler, "acc": acc}

    uninterrupted = build_for_dcp()
    train(uninterrupted, epochs=2)
    first = build_for_dcp()
    assert isinstance(first[3], Stateful)
    train(first, epochs=2, stop_after=5)
    dcp.save(checkpoint(first), checkpoint_id=tmp_path)
    resumed = build_for_dcp()
    state = checkpoint(resumed)
    dcp.load(state, checkpoint_id=tmp_path)  # loads "sched" and "acc" through load_state_dict
    set_state_dict(
        resumed[0], resumed[1], model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    model, _, _, acc = resumed
    assert acc.state_dict() == first[3].state_dict()
    for _ in range(acc.epochs_completed, 2):
        for batch in acc.epoch(BATCHES):
            with acc.microstep(mean_loss(model, batch)):
                pass
    assert_same_run(uninterrupted, resumed)


def build_split(steps: int = 4) -> tuple[Any, ...]:
    """A Muon + AdamW-shaped split (SGD with momentum on the weights, AdamW on the biases),
    each with its scheduler, under one accumulator."""
    from tests.helpers import split_optimizers

    model = make_model(dtype=torch.float32)
    optimizers, schedulers = split_optimizers(model)
    acc = gradaccum.Accumulator(model, optimizers, schedulers, steps=steps, max_grad_norm=1.0)
    return model, optimizers, schedulers, acc


@pytest.mark.parametrize("stop_at", [8, 6])  # after window 2; mid-window 2 of 4 of window 2
def test_two_optimizers_resume_bit_for_bit(stop_at: int) -> None:
    """Both optimizers' states, both schedulers and a mid-window gradient over both
    (``include_grads``) resume the uninterrupted run bit for bit."""
    uninterrupted = build_split()
    train(uninterrupted, epochs=2)
    first = build_split()
    model, _, _, acc = first
    for index, batch in enumerate(acc.epoch(BATCHES)):
        with acc.microstep(mean_loss(model, batch)):
            pass
        if index + 1 == stop_at:
            break
    state = acc.state_dict(include_grads=stop_at % 4 != 0)
    assert ("window" in state) is (stop_at % 4 != 0)
    resumed = load_parts(build_split(), save_parts(first, include_grads=stop_at % 4 != 0)[0])
    model, _, _, acc = resumed
    for batch in acc.epoch(BATCHES):
        with acc.microstep(mean_loss(model, batch)):
            pass
    train(resumed, epochs=1)
    (model_a, opts_a, scheds_a, acc_a), (model_b, opts_b, scheds_b, acc_b) = (
        uninterrupted,
        resumed,
    )
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(p, q)
    for opt_a, opt_b in zip(opts_a, opts_b, strict=True):
        assert str(opt_a.state_dict()) == str(opt_b.state_dict())
    assert [s.last_epoch for s in scheds_a] == [s.last_epoch for s in scheds_b] == [6, 6]
    assert acc_a.global_step == acc_b.global_step == 6


def test_a_two_optimizer_window_does_not_load_into_one_optimizer() -> None:
    """A mid-window state saved over two optimizers holds every parameter's gradient: an
    accumulator over only one of them is told the window does not fit."""
    parts = build_split()
    model, optimizers, _, acc = parts
    with acc.microstep(mean_loss(model, BATCHES[0])):
        pass
    state = acc.state_dict(include_grads=True)
    acc.close()
    single = gradaccum.Accumulator(model, optimizers[0], steps=4)
    with pytest.raises(gradaccum.ConfigError, match="does not fit"):
        single.load_state_dict(state)
