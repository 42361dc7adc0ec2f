"""Every warning gradaccum emits points at the user's line (``warning.filename``), whatever
the depth of gradaccum and torch frames between the user's call and the warning.

The warnings of several ranks (unequal lengths, a DDP forward run for another
microstep) are checked the same way on real ranks in tests/test_reliability_distributed.py.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import gradaccum
from tests.helpers import make_batches, make_model, mean_loss, sgd

BATCHES = make_batches([2] * 8)


def build(steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer, gradaccum.Accumulator]:
    model = make_model()
    optimizer = sgd(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    return model, optimizer, gradaccum.Accumulator(model, optimizer, scheduler, steps=steps)


def microstep(acc: gradaccum.Accumulator, model: nn.Module, index: int) -> None:
    with acc.microstep(mean_loss(model, BATCHES[index])):
        pass


def window_left_open_by_an_epoch() -> None:
    model, _, acc = build()
    for index, _batch in enumerate(acc.epoch(BATCHES[:3])):
        microstep(acc, model, index)
        break
    for _batch in acc.epoch(BATCHES[:2]):  # the user's line: this for statement
        break


def incomplete_window_at_the_end_of_an_epoch() -> None:
    model, _, acc = build()
    for index, _batch in enumerate(acc.epoch(BATCHES[:4])):  # the user's line
        if index != 1:
            microstep(acc, model, index)


def scheduler_stepped_by_hand() -> None:
    model, _, acc = build(steps=1)
    microstep(acc, model, 0)
    assert acc.scheduler is not None
    acc.scheduler.step()
    with acc.microstep(mean_loss(model, BATCHES[1])):  # the user's line: leaving this block
        pass


def optimizer_stepped_between_windows() -> None:
    _, optimizer, _ = build()
    optimizer.step()  # the user's line


def clipping_a_partial_window() -> None:
    model, _, acc = build()
    microstep(acc, model, 0)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with acc.microstep(mean_loss(model, BATCHES[1])):  # the user's line: found here
        pass


def a_second_accumulator_takes_over() -> None:
    model, optimizer, _ = build()
    gradaccum.Accumulator(model, optimizer, steps=2)  # the user's line


class UnknownWrapper(nn.Module):
    """A wrapper gradaccum does not know, with a no_sync() of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 1)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield


def a_resumed_persistent_loader_without_a_generator() -> None:
    _, _, acc = build()
    acc.load_state_dict(dict(acc.state_dict(), epochs_completed=1))
    data = TensorDataset(*BATCHES[0])
    order = RandomSampler(data, generator=torch.Generator())
    loader = DataLoader(data, sampler=order, num_workers=2, persistent_workers=True)
    for _batch in acc.epoch(loader):  # the user's line: this for statement
        break


def a_state_whose_resume_is_refused() -> None:
    _, _, acc = build()
    data = TensorDataset(*BATCHES[0])
    loader = DataLoader(data, shuffle=True, num_workers=2, persistent_workers=True)
    for _batch in acc.epoch(loader):
        acc.state_dict()  # the user's line: at the top of the loop body, handed out
        break


def an_unknown_wrapper() -> None:
    model = UnknownWrapper()
    gradaccum.Accumulator(model, sgd(model), steps=2)  # the user's line


CASES: list[tuple[Callable[[], None], str]] = [
    (window_left_open_by_an_epoch, "left open by the previous epoch"),
    (incomplete_window_at_the_end_of_an_epoch, "incomplete window at the end"),
    (scheduler_stepped_by_hand, "the scheduler was stepped outside"),
    (optimizer_stepped_between_windows, "optimizer.step() was called between windows"),
    (clipping_a_partial_window, "changed in place after microstep 1 of 2"),
    (a_second_accumulator_takes_over, "closed the previous Accumulator"),
    (an_unknown_wrapper, "which gradaccum does not know"),
    (a_resumed_persistent_loader_without_a_generator, "persistent_workers=True and no generator"),
    (a_state_whose_resume_is_refused, "a run resumed from this state is refused"),
]


@pytest.mark.parametrize(("user_code", "message"), CASES, ids=[c[0].__name__ for c in CASES])
def test_warning_points_at_the_users_line(user_code: Callable[[], None], message: str) -> None:
    """The warning is raised, once, with the user's file as its filename."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gradaccum.GradaccumWarning)
        user_code()
    ours = [w for w in caught if issubclass(w.category, gradaccum.GradaccumWarning)]
    assert [message in str(w.message) for w in ours] == [True], [str(w.message) for w in ours]
    assert ours[0].filename == __file__
