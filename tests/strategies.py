"""Hypothesis strategies shared by the property tests."""

from __future__ import annotations

from hypothesis import strategies as st

steps = st.integers(min_value=1, max_value=6)
n_batches = st.integers(min_value=0, max_value=10_000)
seeds = st.integers(min_value=0, max_value=2**16)
batch_size = st.integers(min_value=1, max_value=4)
# Lengths of a microbatch in items (tokens), for the num_items mode.
item_counts = st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=12)
fractions = st.floats(min_value=1e-6, max_value=1.0, exclude_max=True)
