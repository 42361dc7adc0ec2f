"""The step arithmetic: properties that pin it, and its refusals of bad input."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import gradaccum
from tests import strategies


@given(n=strategies.n_batches, steps=strategies.steps)
def test_steps_per_epoch_brackets_the_epoch(n: int, steps: int) -> None:
    """Whole windows fit in the epoch and one more would not."""
    per_epoch = gradaccum.steps_per_epoch(n, steps)
    assert per_epoch * steps <= n < (per_epoch + 1) * steps


@given(
    n=strategies.n_batches,
    steps=strategies.steps,
    epochs=st.integers(min_value=0, max_value=50),
)
def test_total_steps_counts_whole_and_partial_windows(n: int, steps: int, epochs: int) -> None:
    """drop_last adds per-epoch floors; keeping the remainder adds per-epoch ceilings."""
    assert gradaccum.total_steps(n, steps, epochs) == epochs * (n // steps)
    kept = gradaccum.total_steps(n, steps, epochs, drop_last=False)
    assert kept == epochs * math.ceil(n / steps)
    assert kept - gradaccum.total_steps(n, steps, epochs) == epochs * (n % steps != 0)


@given(freq=st.integers(min_value=1, max_value=10_000), per_epoch=strategies.n_batches)
def test_interval_int_is_itself(freq: int, per_epoch: int) -> None:
    """An int frequency is a number of optimizer steps, whatever the epoch length."""
    assert gradaccum.interval(freq, per_epoch) == freq


@given(freq=strategies.fractions, per_epoch=strategies.n_batches)
def test_interval_fraction_of_an_epoch(freq: float, per_epoch: int) -> None:
    """A fraction of an epoch rounds to the nearest step, never below one."""
    every = gradaccum.interval(freq, per_epoch)
    assert every == max(1, round(freq * per_epoch))
    assert every >= 1
    assert every <= max(1, per_epoch)


def test_the_13_over_4_cadence() -> None:
    """13 microbatches with steps=4: 3 optimizer steps, 4 when the remainder is kept."""
    assert gradaccum.steps_per_epoch(13, 4) == 3
    assert gradaccum.total_steps(13, 4) == 3
    assert gradaccum.total_steps(13, 4, drop_last=False) == 4


@pytest.mark.parametrize(
    ("call", "error", "fragments"),
    [
        (lambda: gradaccum.steps_per_epoch(13, 0), gradaccum.ConfigError, ["steps", "0"]),
        (lambda: gradaccum.steps_per_epoch(13, -1), gradaccum.ConfigError, ["steps", "-1"]),
        (lambda: gradaccum.steps_per_epoch(13, True), TypeError, ["True (bool)"]),
        (lambda: gradaccum.steps_per_epoch(13, 1.5), TypeError, ["1.5 (float)"]),
        (lambda: gradaccum.steps_per_epoch(13, "4"), TypeError, ["'4' (str)"]),
        (lambda: gradaccum.steps_per_epoch(13, None), TypeError, ["None (NoneType)"]),
        (lambda: gradaccum.steps_per_epoch(13.0, 4), TypeError, ["n_batches", "13.0"]),
        (lambda: gradaccum.steps_per_epoch("13", 4), TypeError, ["n_batches", "'13'"]),
        (lambda: gradaccum.steps_per_epoch(True, 4), TypeError, ["n_batches", "True"]),
        (lambda: gradaccum.steps_per_epoch(-1, 4), ValueError, ["n_batches", "-1"]),
        (lambda: gradaccum.total_steps(13, 4, epochs=-1), ValueError, ["epochs", "-1"]),
        (lambda: gradaccum.total_steps(13, 4, drop_last="no"), TypeError, ["drop_last"]),
        (lambda: gradaccum.interval(0, 10), ValueError, ["freq", "0"]),
        (lambda: gradaccum.interval(1.5, 10), ValueError, ["freq", "1.5", "pass an int"]),
        (lambda: gradaccum.interval(0.0, 10), ValueError, ["freq", "0.0"]),
        (lambda: gradaccum.interval(math.nan, 10), ValueError, ["freq", "nan"]),
        (lambda: gradaccum.interval("0.5", 10), TypeError, ["freq", "'0.5' (str)"]),
        (lambda: gradaccum.interval(0.5, 10.0), TypeError, ["steps_per_epoch", "10.0"]),
    ],
)
def test_bad_arguments_are_named(call, error, fragments) -> None:
    """Each refusal names the argument and quotes the value; each is a GradaccumError."""
    with pytest.raises(error) as caught:
        call()
    assert isinstance(caught.value, gradaccum.GradaccumError)
    for fragment in fragments:
        assert fragment in str(caught.value)


class TestStepsFor:
    @given(
        micro_batch=st.integers(1, 64),
        world_size=st.integers(1, 64),
        steps=st.integers(1, 64),
    )
    def test_the_steps_that_keep_the_global_batch(
        self, micro_batch: int, world_size: int, steps: int
    ) -> None:
        """steps_for returns the steps whose windows hold global_batch samples."""
        global_batch = micro_batch * world_size * steps
        assert gradaccum.steps_for(global_batch, micro_batch, world_size) == steps

    def test_a_global_batch_the_ranks_cannot_keep_is_refused_with_where_it_is_kept(self) -> None:
        """256 samples of 8 are 32 microbatches: not on 3 ranks; the message names the
        numbers of ranks (and steps) that keep it."""
        with pytest.raises(gradaccum.ConfigError) as caught:
            gradaccum.steps_for(256, 8, 3)
        assert str(caught.value) == (
            "global_batch=256 is not a multiple of micro_batch * world_size = 8 * 3 = 24; "
            "with micro_batch=8 it is kept on 1, 2, 4, 8, 16 or 32 ranks with steps 32, 16, "
            "8, 4, 2 or 1"
        )

    def test_a_global_batch_of_one_microbatch_is_kept_on_one_rank(self) -> None:
        """8 samples of 8: one microbatch, kept on 1 rank only (singular)."""
        with pytest.raises(gradaccum.ConfigError) as caught:
            gradaccum.steps_for(8, 8, 2)
        assert str(caught.value) == (
            "global_batch=8 is not a multiple of micro_batch * world_size = 8 * 2 = 16; "
            "with micro_batch=8 it is kept on 1 rank with steps 1"
        )

    def test_a_micro_batch_that_does_not_divide_is_refused(self) -> None:
        with pytest.raises(gradaccum.ConfigError) as caught:
            gradaccum.steps_for(100, 8, 1)
        assert str(caught.value) == (
            "global_batch=100 is not a multiple of micro_batch * world_size = 8 * 1 = 8; "
            "pass a micro_batch that divides 100"
        )

    @pytest.mark.parametrize("bad", [0, -1, True, 2.0, "8"])
    def test_bad_arguments_are_refused_by_name(self, bad: object) -> None:
        for name, args in (
            ("global_batch", (bad, 8, 2)),
            ("micro_batch", (256, bad, 2)),
            ("world_size", (256, 8, bad)),
        ):
            with pytest.raises(gradaccum.GradaccumError, match=name):
                gradaccum.steps_for(*args)  # type: ignore[arg-type]


def test_numpy_numbers_are_taken_and_ints_come_back() -> None:
    """A NumPy count (from a config or a collate function) is taken like an int by every
    helper, and what comes back is a plain int (``json.dumps`` refused the NumPy int
    ``total_steps`` returned for a NumPy ``epochs``; ``interval`` refused NumPy numbers)."""
    import numpy as np

    found = [
        gradaccum.total_steps(np.int64(13), 4, np.int64(2)),
        gradaccum.steps_per_epoch(np.int64(13), 4),
        gradaccum.interval(np.int64(50), np.int64(1000)),
        gradaccum.interval(np.float32(0.25), 1000),
    ]
    assert found == [6, 3, 50, 250]
    assert all(type(value) is int for value in found)
