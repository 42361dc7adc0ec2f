"""Checkpoints: resuming at a window boundary is bit for bit; misuse is refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gradaccum
from tests.helpers import load_checkpoint, make_batches, make_model, mean_loss, save_checkpoint

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
    """The saved state names what a resume needs."""
    parts = build()
    train(parts, epochs=1, stop_after=2)
    assert parts[3].state_dict() == {
        "version": 4,
        "steps": 4,
        "position": 8,
        "global_step": 2,
        "skipped_steps": 0,
        "epochs_completed": 0,
        "drop_last": True,
        "sync": "auto",
    }


def test_mid_window_checkpoint_is_refused() -> None:
    """state_dict() mid-window, or inside the boundary block, says when to call it."""
    model, _, _, acc = build()
    batch = BATCHES[0]
    with acc.microstep(mean_loss(model, batch)):
        pass
    with pytest.raises(gradaccum.UsageError, match=r"mid-window \(1 of 4.*has exited"):
        acc.state_dict()
    for _ in range(3):
        with acc.microstep(mean_loss(model, batch)) as step:
            if step.boundary:
                with pytest.raises(gradaccum.UsageError, match="mid-window"):
                    acc.state_dict()
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
    """A position beyond the epoch means other data: refused at acc.epoch()."""
    parts = build()
    train(parts, epochs=1, stop_after=3)
    state = parts[3].state_dict() | {"position": 12}
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
