"""gradaccum.testing on 2 real gloo ranks, in one launch shared by these tests: the
equivalence check passes the Accumulator under every wrapping and mode and fails wrong
loops with the message that names what broke; the counters see DDP's reducer, FSDP and
plain torch.distributed calls."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests import loops
from tests.distributed import run

TOL = 1e-10


@functools.cache
def _checks() -> list[dict[str, Any]]:
    return run(loops.checks, 2)


def checked(name: str) -> list[Any]:
    """What each rank found for ``name`` (see `loops.checks`)."""
    return [rank[name] for rank in _checks()]


@pytest.mark.parametrize(
    ("name", "per_window"),
    [
        ("ddp", {"all_reduce": 1}),
        ("ddp_items", {"all_reduce": 2}),  # the bucket, and the window's item count
        ("fully_shard", {"all_gather": 16, "reduce_scatter": 8}),  # 2 units x 4 microsteps
        ("fsdp1", {"all_gather": 4, "reduce_scatter": 4}),
        ("forward_inside", {"all_reduce": 1}),
    ],
)
def test_exact_loops_pass_on_every_rank_alike(name: str, per_window: dict[str, int]) -> None:
    """The Accumulator (mean and item mode, DDP, fully_shard, FSDP1) and a hand loop with
    the forward inside no_sync(): parameters within 1e-10 of the float64 reference after
    every window, 3 optimizer and scheduler steps, and what a window costs."""
    reports = checked(name)
    for report in reports:
        assert report.ok, report
        assert report.max_abs_diff <= TOL
        assert (report.optimizer_steps, report.scheduler_steps, report.expected_steps) == (3, 3, 3)
        assert report.per_window.collectives == per_window
        assert report.per_window.host_syncs == 0
        assert len(report.windows) == 3
    assert repr(reports[0]) == repr(reports[1])  # every rank reports the whole job


def test_the_forward_outside_no_sync_is_caught_by_the_count() -> None:
    """The bug this library was born from: the gradients are exact, so only the count of
    all-reduces per window fails the check, with a message that says so."""
    for report in checked("forward_outside"):
        assert report.max_abs_diff <= TOL
        assert report.optimizer_steps == report.scheduler_steps == 3
        assert report.problems == ["4 all-reduces per window at steps=4, expected 1"]
        assert [window.all_reduces for window in report.windows[1:]] == [4, 4]
        assert repr(report).splitlines()[:2] == [
            "accumulation at steps=4 on 2 ranks (mean mode): FAILED",
            "  4 all-reduces per window at steps=4, expected 1",
        ]


def test_a_scheduler_stepped_every_microbatch_fails_on_its_count_and_parameters() -> None:
    for report in checked("scheduler_every_microbatch"):
        assert report.optimizer_steps == 3
        assert report.scheduler_steps == 12
        assert report.problems[0] == (
            "12 scheduler steps, expected 3 = total_steps(13, 4, 1, drop_last=True)"
        )
        assert report.problems[1].startswith("parameters off the float64 big-batch reference")
        assert report.max_abs_diff > 1e-3


def test_averaging_microbatch_means_fails_the_item_mode() -> None:
    """A loop that averages per-microbatch means, checked against the token mean of
    microbatches of different lengths: the parameters are off, and nothing else."""
    for report in checked("mean_of_means"):
        assert report.mode == "items"
        assert report.max_abs_diff > 1e-3
        assert len(report.problems) == 1
        assert report.problems[0].startswith("parameters off the float64 big-batch reference")


def test_ddp_bucket_counter_counts_each_synced_backward() -> None:
    """The comm-hook fallback: one bucket per window with the forward inside no_sync(),
    one per microstep (3 windows x 4) with it outside."""
    for buckets in checked("buckets"):
        assert buckets == {"forward_outside": 12, "forward_inside": 3}


def test_plain_collectives_count_by_kind() -> None:
    for counted in checked("plain"):
        assert counted == [
            {"all_reduce": 1},
            {"broadcast": 1},
            {"all_gather": 1},
            {"all_gather": 1},
            {"reduce_scatter": 1},
            {"barrier": 1},
        ]
