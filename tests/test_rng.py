"""The random state (gradaccum/rng.py): captured and restored as one value, through a
checkpoint file, and refused whole when it cannot be restored."""

from __future__ import annotations

import io
import random
from typing import Any

import numpy
import pytest
import torch

import gradaccum
from gradaccum import rng


def draws() -> tuple[Any, ...]:
    """One draw from each global generator a training loop may use."""
    return (
        torch.rand(3).tolist(),
        random.random(),
        numpy.random.rand(),
        torch.nn.functional.dropout(torch.ones(8), 0.5).tolist(),
    )


class TestRandomState:
    def test_restoring_repeats_the_draws(self) -> None:
        """After set_random_state, torch's, Python's and NumPy's generators draw what they
        drew after random_state."""
        state = gradaccum.random_state()
        first = draws()
        assert draws() != first
        gradaccum.set_random_state(state)
        assert draws() == first

    def test_it_survives_a_checkpoint_file_read_with_weights_only(self) -> None:
        """torch.save, then torch.load(weights_only=True) (torch's default): every part is
        a plain value or a tensor."""
        state = gradaccum.random_state()
        first = draws()
        buffer = io.BytesIO()
        torch.save({"random": state}, buffer)
        loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)["random"]
        gradaccum.set_random_state(loaded)
        assert draws() == first

    def test_the_parts(self) -> None:
        """Python's, torch's and (installed here) NumPy's state; CUDA's where it is."""
        expected = {"python", "torch", "numpy"} | ({"cuda"} if torch.cuda.is_available() else set())
        assert set(gradaccum.random_state()) == expected


class TestSetRandomState:
    def test_a_state_that_fails_part_way_is_put_back(self) -> None:
        """A torch state of the wrong size passes the type check but fails in torch, after
        Python's was restored: Python's is put back, and the error names the state."""
        before = gradaccum.random_state()
        expected = draws()
        other_python = random.getstate()  # after the draws: not before's
        bad = dict(before, python=other_python, torch=torch.zeros(3, dtype=torch.uint8))
        gradaccum.set_random_state(before)
        with pytest.raises(gradaccum.ConfigError, match="not a random state from"):
            gradaccum.set_random_state(bad)
        assert draws() == expected

    def test_a_numpy_state_without_numpy_is_refused(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without NumPy a state holding its part is refused before anything is restored."""
        state = gradaccum.random_state()
        monkeypatch.setattr(rng, "_numpy", lambda: None)
        with pytest.raises(gradaccum.ConfigError) as caught:
            gradaccum.set_random_state(state)
        assert str(caught.value) == (
            "state['numpy'] holds NumPy's random state, but NumPy is not installed; install "
            "it, or drop state['numpy'] to resume without it"
        )
        del state["numpy"]
        gradaccum.set_random_state(state)  # without its part, the rest is restored
