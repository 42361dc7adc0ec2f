"""Hypothesis strategies shared by the property tests: gradaccum.testing's, and the
project's own seeds, batch sizes and fractions."""

from __future__ import annotations

from hypothesis import strategies as st

from gradaccum.testing import strategies as cadence

steps = cadence.steps(max_value=6)
n_batches = cadence.epoch_lengths(max_value=10_000)
# Lengths of a microbatch in items (tokens), for the num_items mode.
item_counts = cadence.item_counts(max_batches=12, max_items=6)
seeds = st.integers(min_value=0, max_value=2**16)
batch_size = st.integers(min_value=1, max_value=4)
fractions = st.floats(min_value=1e-6, max_value=1.0, exclude_max=True)
