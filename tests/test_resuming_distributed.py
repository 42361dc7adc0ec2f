"""Resuming on real gloo ranks: bit for bit at every window boundary of a two-epoch run,
for each kind of loader under DDP, and for torchdata's StatefulDataLoader under
``fully_shard``; and refused on another number of ranks."""

from __future__ import annotations

from typing import Any

import pytest

import gradaccum
from tests import resumes
from tests.distributed import run


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """Every rank's outcomes of `resumes.on_two_ranks` (one launch for this module), given
    a state saved on one process 2 windows into the epoch."""
    alone = resumes.state_at(resumes.Run("dataloader"), 2)
    assert (alone["world_size"], alone["position"]) == (1, 8)
    return run(resumes.on_two_ranks, 2, alone)


def test_resume_at_every_window_boundary_on_two_ranks(two_ranks: list[dict[str, Any]]) -> None:
    """Two ranks, each with its own shard (a DistributedSampler, set to the epoch), dropout
    and its own random state: every checkpoint after a window or an epoch resumes to the
    uninterrupted run's parameters (torch.equal) on both ranks."""
    checkpoints = resumes.CHECKPOINTS
    for outcome in (outcomes["resumed"] for outcomes in two_ranks):
        assert list(outcome) == [*resumes.KINDS, "stateful under fully_shard"]
        for kind, resumed in outcome.items():
            assert list(resumed) == checkpoints, kind
            assert all(resumed.values()), (kind, resumed)


def test_another_world_size_is_refused(two_ranks: list[dict[str, Any]]) -> None:
    """A state saved on 2 DDP ranks, 2 windows into the epoch, is refused by one process,
    and one saved on one process by each of 2 ranks (before, both loaded without a word and
    resumed at the 8th microbatch of another shard); both name the two world sizes and the
    fix, and nothing is loaded."""
    for saved, refusal, after in (outcomes["world size"] for outcomes in two_ranks):
        assert refusal == (
            "the state was saved with world_size=1 (data-parallel ranks) but this "
            "Accumulator has world_size=2: its position counts the microbatches of each "
            "rank's shard and its windows the global batch of 1 rank, which this run would "
            "not continue; resume on 1 rank, as saved, or pass allow_world_size_change=True "
            "to continue on 1, 2 or 4 ranks with steps 4, 2 or 1 (the same global batch)"
        )
        assert after == (0, 0)
        assert (saved["world_size"], saved["position"], saved["global_step"]) == (2, 8, 2)
        fresh = resumes.Run("dataloader").acc
        with pytest.raises(gradaccum.ConfigError) as caught:
            fresh.load_state_dict(saved)
        assert str(caught.value) == (
            "the state was saved with world_size=2 (data-parallel ranks) but this "
            "Accumulator has world_size=1: its position counts the microbatches of each "
            "rank's shard and its windows the global batch of 2 ranks, which this run would "
            "not continue; resume on 2 ranks, as saved, or pass allow_world_size_change=True "
            "to continue on 1, 2, 4 or 8 ranks with steps 8, 4, 2 or 1 (the same global batch)"
        )
        assert (fresh.global_step, fresh.position, fresh.epochs_completed) == (0, 0, 0)
