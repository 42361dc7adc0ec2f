"""acc.step on 2 gloo ranks with an out-of-memory error injected on rank 1 alone: under
DDP every recoverable point of a window is re-run smaller on both ranks, bit for bit the
run with the small microbatch from the start, at one extra all-reduce per try; the last
backward and a microbatch of one row fail on both ranks with errors naming rank 1; the
wrappings whose forward communicates refuse microbatch="auto" up front."""

from __future__ import annotations

import time

import pytest
import torch

from gradaccum.testing import LaunchError, run_ranks
from tests import batchstep_distributed, distributed
from tests.distributed import run
from tests.helpers import POINTS

RECOVERED = [point for point in POINTS if point != "last-backward"]


@pytest.fixture(scope="module")
def recoveries() -> list[dict[str, dict]]:
    """One launch of `batchstep_distributed.recoveries`, shared by the tests below."""
    return run(batchstep_distributed.recoveries, 2)


@pytest.mark.parametrize("mode", ["mean", "items"])
def test_rank_1_s_out_of_memory_is_re_run_smaller_on_both_ranks(
    recoveries: list[dict[str, dict]], mode: str
) -> None:
    """At the first, a middle and the last microbatch's forward, and a non-last backward,
    on rank 1 only: both ranks discard the window and re-run it with 4 rows, so that both
    windows are bit for bit the microbatch=4 run's, on both ranks; acc.microbatch is 4 on
    both. The cost is one scalar all-reduce per try of a window (3 here: 2 tries, then 1),
    nothing else."""
    for ranks in recoveries:
        fixed = ranks[f"{mode}/fixed"]
        for point in RECOVERED:
            got = ranks[f"{mode}/{point}"]
            assert (got["microbatch"], got["used"], got["global_step"]) == (4, [4, 4], 2), point
            assert all(map(torch.equal, got["params"], fixed["params"])), point
            extra = dict(got["collectives"])
            extra["c10d::allreduce_"] -= 3
            assert extra == fixed["collectives"], point
    first, second = recoveries
    assert all(
        map(torch.equal, first[f"{mode}/fixed"]["params"], second[f"{mode}/fixed"]["params"])
    )


def test_fully_shard_with_a_fixed_microbatch_matches_ddp(recoveries: list[dict[str, dict]]) -> None:
    """A fixed microbatch runs under fully_shard (where "auto" is refused): within 1e-12 of
    the DDP run in both modes."""
    for ranks in recoveries:
        for mode in ("mean", "items"):
            sharded, ddp = ranks[f"{mode}/fully_shard"], ranks[f"{mode}/fixed"]
            worst = max(
                (a - b).abs().max().item()
                for a, b in zip(sharded["params"], ddp["params"], strict=True)
            )
            assert worst < 1e-12, mode


def test_the_first_window_probes_to_the_least_that_fits_on_every_rank(
    recoveries: list[dict[str, dict]],
) -> None:
    """Rank 1 runs out of memory above 4 rows: the first window tries 32, 16, 8 and 4 rows
    on both ranks (one all-reduce each, 5 in all with the second window's), and both take 4."""
    for ranks in recoveries:
        probe, fixed = ranks["probe"], ranks["mean/fixed"]
        assert (probe["microbatch"], probe["used"]) == (4, [4, 4])
        assert all(map(torch.equal, probe["params"], fixed["params"]))
        assert (
            probe["collectives"]["c10d::allreduce_"] == fixed["collectives"]["c10d::allreduce_"] + 5
        )


def test_auto_is_refused_where_a_forward_communicates() -> None:
    """fully_shard, FSDP1 and DDP broadcasting a BatchNorm's buffers all-gather or
    broadcast in every forward, sync='every' all-reduces in every backward: "auto" is
    refused on 2 ranks, naming the wrapping and the fix; DDP with broadcast_buffers=False
    is accepted."""
    for messages in run(batchstep_distributed.refusals, 2):
        assert messages.pop("ddp_no_broadcast") == ""
        for name, message in messages.items():
            assert "microbatch='auto' is refused under" in message, name
            assert "on 2 ranks" in message, name
        assert "FullyShardSync" in messages["fully_shard"]
        assert "pass a fixed microbatch=<rows>" in messages["fsdp1"]
        assert "broadcast_buffers=False" in messages["ddp_buffers"]
        assert "pass sync='auto'" in messages["ddp_every"]


def test_what_cannot_be_re_run_fails_on_both_ranks_naming_rank_1() -> None:
    """Microbatches of one row running out on rank 1: OutOfMemoryError on both ranks,
    naming rank 1 and microbatch 1, nothing applied, and the next window trains on both.
    Then rank 1's last backward runs out after rank 0's all-reduce began: rank 1 raises
    OutOfMemoryError (microbatch 8, restart with 4), rank 0 RankFailedError naming it, well
    before the process group's timeout, its parameters unchanged."""
    started = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        run_ranks(batchstep_distributed.unrecoverable, 2, timeout=distributed.PROCESS_GROUP_TIMEOUT)
    assert time.monotonic() - started < distributed.PROCESS_GROUP_TIMEOUT
    assert list(caught.value.failures) == [1]
    failed = caught.value.failures[1]
    assert "rank 1 ran out of memory in the backward of the last microbatch of window 2" in failed
    assert "microbatch=4" in failed
    assert "[rank=1 microbatch=8]" in failed
    outcome = caught.value.results[0]
    message, rank, microbatch, window = outcome["no_row"]
    assert (rank, microbatch, window) == (1, 1, 1)
    assert "rank 1 ran out of memory with microbatches of 1 row" in message
    assert outcome["no_row_unchanged"]
    assert outcome["then"] == 1
    message, rank, window = outcome["failed"]
    assert (rank, window) == (1, 2)
    assert "rank 0 stopped in window 2 because rank 1 failed there first" in message
    assert "OutOfMemoryError: rank 1 ran out of memory in the backward" in message
    assert outcome["unchanged"]
    assert outcome["global_step"] == 1


def test_what_a_flag_all_reduce_costs() -> None:
    """Measures, does not judge: a one-element flag all-reduced and read on the host, as
    Composer does before every FSDP unit's all-gather, takes some microseconds on gloo."""
    costs = run(batchstep_distributed.flag_cost, 2)
    print(f"flag all-reduce on 2 gloo ranks: {max(costs) * 1e6:.0f} us")
    assert all(cost > 0 for cost in costs)
