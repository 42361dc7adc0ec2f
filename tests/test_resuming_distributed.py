"""Resuming on real gloo ranks: bit for bit at every window boundary of a two-epoch run,
for each kind of loader under DDP, and for torchdata's StatefulDataLoader under
``fully_shard``, all in one launch."""

from __future__ import annotations

from tests import resumes
from tests.distributed import run


def test_resume_at_every_window_boundary_on_two_ranks() -> None:
    """Two ranks, each with its own shard (a DistributedSampler, set to the epoch), dropout
    and its own random state: every checkpoint after a window or an epoch resumes to the
    uninterrupted run's parameters (torch.equal) on both ranks."""
    checkpoints = ["step 1", "step 2", "step 3", "epoch 1", "step 4", "step 5", "step 6", "epoch 2"]
    for outcome in run(resumes.resumed_everywhere_on_ranks, 2):
        assert list(outcome) == [*resumes.KINDS, "stateful under fully_shard"]
        for kind, resumed in outcome.items():
            assert list(resumed) == checkpoints, kind
            assert all(resumed.values()), (kind, resumed)
