"""Hypothesis strategies for accumulation cadences, and the windows each must train.

This is the one part of gradaccum that imports hypothesis (``pip install
gradaccum[testing]``); ``import gradaccum`` and ``import gradaccum.testing`` do not.

Examples:
    >>> from hypothesis import given
    >>> @given(epoch=epochs())
    ... def test_cadence(epoch):
    ...     assert len(epoch.windows) == epoch.optimizer_steps
    ...     assert all(len(window) <= epoch.steps for window in epoch.windows)
    >>> test_cadence()
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    from hypothesis import strategies as st
except ImportError as error:
    msg = (
        "gradaccum.testing.strategies needs hypothesis, which the testing extra installs: "
        "pip install gradaccum[testing]"
    )
    raise ImportError(msg, name="hypothesis") from error

from gradaccum.schedule import check_count, check_positive, total_steps
from gradaccum.testing.equivalence import expected_windows

__all__ = ["Epoch", "epoch_lengths", "epochs", "item_counts", "steps"]


def steps(max_value: int = 8) -> st.SearchStrategy[int]:
    """``steps`` settings: ints from 1 to ``max_value``."""
    return st.integers(min_value=1, max_value=check_positive(max_value, "max_value"))


def epoch_lengths(max_value: int = 64) -> st.SearchStrategy[int]:
    """Epoch lengths in microbatches, from 0 (an empty loader) to ``max_value``."""
    return st.integers(min_value=0, max_value=check_count(max_value, "max_value"))


def item_counts(max_batches: int = 12, max_items: int = 6) -> st.SearchStrategy[list[int]]:
    """The items (tokens) of each microbatch of an epoch: 1 to ``max_batches``
    microbatches of 1 to ``max_items`` items each."""
    return st.lists(
        st.integers(min_value=1, max_value=check_positive(max_items, "max_items")),
        min_size=1,
        max_size=check_positive(max_batches, "max_batches"),
    )


@dataclass(frozen=True)
class Epoch:
    """One epoch's cadence, and what a trainer must do with it.

    Attributes:
        steps: Microbatches per window.
        drop_last: Whether the trailing partial window is dropped.
        sizes: Each microbatch's rows (batch size), variable.
        items: Each microbatch's items (tokens), for the ``num_items`` mode.
    """

    steps: int
    drop_last: bool
    sizes: tuple[int, ...]
    items: tuple[int, ...]

    @property
    def n_batches(self) -> int:
        """Microbatches in the epoch."""
        return len(self.sizes)

    @property
    def windows(self) -> list[range]:
        """The microbatch indices of each window, as `expected_windows` cuts them."""
        return expected_windows(self.n_batches, self.steps, self.drop_last)

    @property
    def optimizer_steps(self) -> int:
        """``total_steps(n_batches, steps, 1, drop_last)``: one per window."""
        return total_steps(self.n_batches, self.steps, 1, self.drop_last)

    @property
    def trained(self) -> int:
        """Microbatches some window trains on; the rest are dropped."""
        return sum(len(window) for window in self.windows)

    @property
    def window_items(self) -> list[int]:
        """Each window's total items: what its summed loss is divided by."""
        return [sum(self.items[i] for i in window) for window in self.windows]


def epochs(
    max_batches: int = 32, max_steps: int = 8, max_items: int = 16
) -> st.SearchStrategy[Epoch]:
    """Epochs of 0 to ``max_batches`` microbatches (shorter than a window too) with
    ``steps`` from 1 to ``max_steps``, either ``drop_last``, 1 to 4 rows and 1 to
    ``max_items`` items per microbatch."""
    check_count(max_batches, "max_batches")
    check_positive(max_steps, "max_steps")
    check_positive(max_items, "max_items")

    @st.composite
    def draw(draw: st.DrawFn) -> Epoch:
        n = draw(epoch_lengths(max_batches))
        return Epoch(
            steps=draw(steps(max_steps)),
            drop_last=draw(st.booleans()),
            sizes=tuple(draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))),
            items=tuple(draw(st.lists(st.integers(1, max_items), min_size=n, max_size=n))),
        )

    return draw()
