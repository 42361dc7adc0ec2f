"""gradaccum.testing.strategies: epochs and their expected windows agree with the step
arithmetic, and a trainer's cadence (here the Accumulator's) can be property-tested
against them."""

from __future__ import annotations

import importlib
import sys

import pytest
from hypothesis import given, settings

import gradaccum
from gradaccum.testing import strategies
from tests.helpers import make_batches, make_model, mean_loss, sgd


@given(epoch=strategies.epochs())
def test_an_epoch_s_windows_are_what_total_steps_counts(epoch: strategies.Epoch) -> None:
    """Consecutive windows from the first microbatch, of ``steps`` each but a shorter
    last one without drop_last; one per optimizer step; items summed per window."""
    assert len(epoch.items) == epoch.n_batches <= 32
    assert 1 <= epoch.steps <= 8
    assert all(1 <= rows <= 4 for rows in epoch.sizes)
    assert len(epoch.windows) == epoch.optimizer_steps
    assert epoch.optimizer_steps == gradaccum.total_steps(
        epoch.n_batches, epoch.steps, 1, epoch.drop_last
    )
    flat = [index for window in epoch.windows for index in window]
    assert flat == list(range(epoch.trained))
    assert all(len(window) == epoch.steps for window in epoch.windows[:-1])
    if epoch.drop_last:
        assert epoch.trained == epoch.n_batches // epoch.steps * epoch.steps
    else:
        assert epoch.trained == epoch.n_batches
    assert epoch.window_items == [sum(epoch.items[i] for i in w) for w in epoch.windows]


@settings(max_examples=25, deadline=None)
@given(epoch=strategies.epochs(max_batches=12, max_steps=5))
def test_the_accumulator_s_cadence_property_tested(epoch: strategies.Epoch) -> None:
    """What a trainer's own property test looks like: the Accumulator's boundaries fall
    at the ends of the expected windows, one optimizer step each (or, for an epoch that
    gives none, the guard refuses it)."""
    model = make_model()
    acc = gradaccum.Accumulator(model, sgd(model), steps=epoch.steps, drop_last=epoch.drop_last)
    batches = make_batches(list(epoch.sizes))
    if epoch.optimizer_steps == 0:
        with pytest.raises(gradaccum.ConfigError, match="gives no optimizer step"):
            next(iter(acc.epoch(batches)))
        return
    ends = []
    for index, batch in enumerate(acc.epoch(batches)):
        with acc.microstep(mean_loss(model, batch)) as step:
            if step.boundary:
                ends.append(index)
    assert ends == [window[-1] for window in epoch.windows]
    assert acc.global_step == epoch.optimizer_steps


@given(steps=strategies.steps(3), length=strategies.epoch_lengths(5))
def test_steps_and_lengths_stay_in_bounds(steps: int, length: int) -> None:
    assert 1 <= steps <= 3
    assert 0 <= length <= 5


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: strategies.steps(0), "max_value must be a positive int, got 0"),
        (lambda: strategies.epoch_lengths(-1), "max_value must be a non-negative int, got -1"),
        (lambda: strategies.item_counts(max_items=0), "max_items must be a positive int, got 0"),
        (lambda: strategies.item_counts(max_batches=0), "max_batches must be a positive int"),
        (lambda: strategies.epochs(max_batches=-1), "max_batches must be a non-negative int"),
        (lambda: strategies.epochs(max_steps=0), "max_steps must be a positive int, got 0"),
        (lambda: strategies.epochs(max_items=0), "max_items must be a positive int, got 0"),
    ],
)
def test_bounds_that_allow_nothing_are_refused(call: object, message: str) -> None:
    with pytest.raises(gradaccum.ConfigError, match=message.replace("(", r"\(")):
        call()  # type: ignore[operator]


def test_item_counts_draw_per_microbatch_lengths() -> None:
    @given(counts=strategies.item_counts(max_batches=3, max_items=2))
    def check(counts: list[int]) -> None:
        assert 1 <= len(counts) <= 3
        assert all(1 <= n <= 2 for n in counts)

    check()


def test_without_hypothesis_the_import_names_the_testing_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where hypothesis cannot be imported, the strategies module says which extra
    installs what it needs (imported afresh in this process, ``sys.modules`` put back
    after; that ``gradaccum.testing`` itself does not import hypothesis, a fresh process
    shows in tests/test_public_api.py)."""
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # what such an environment sees
    monkeypatch.delitem(sys.modules, "gradaccum.testing.strategies")
    with pytest.raises(ImportError) as raised:
        importlib.import_module("gradaccum.testing.strategies")
    assert raised.value.name == "hypothesis"
    assert str(raised.value) == (
        "gradaccum.testing.strategies needs hypothesis, which the testing extra installs: "
        "pip install gradaccum[testing]"
    )
    assert sys.modules["gradaccum.testing"].strategies is strategies
