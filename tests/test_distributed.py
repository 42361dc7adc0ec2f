"""Real gloo ranks: every wrapping against the float64 big-batch reference, and the
collectives each sync policy runs per window, counted at the dispatcher."""

from __future__ import annotations

import copy
import functools
import importlib.util
import itertools
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler

import gradaccum
from gradaccum.testing import LaunchError, check_accumulation, run_ranks
from tests import distributed, loops
from tests.distributed import UNITS, Training, rank_batches, run, train
from tests.helpers import (
    Batch,
    concat,
    make_model,
    mean_loss,
    reference_run,
    reference_sgd,
    shown_output,
    split_optimizers,
    sum_loss,
    torchrun,
    windows_of,
)

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-10
EQUAL = [[2] * 13] * 4  # 13 microbatches of 2 rows on each of up to 4 ranks: 3 windows of 4


def global_windows(
    sizes: list[list[int]],
    world: int,
    steps: int = 4,
    drop_last: bool = True,
    dtype: torch.dtype = torch.float64,
) -> list[list[Batch]]:
    """Window i of the whole job: window i of every rank, as one big batch, in float64 (from
    the ``dtype`` data the ranks drew: randn draws other numbers in float32)."""
    per_rank = [
        windows_of(
            [(x.double(), y.double()) for x, y in rank_batches(r, sizes[r], dtype)],
            steps,
            drop_last,
        )
        for r in range(world)
    ]
    return [list(itertools.chain(*windows)) for windows in zip(*per_rank, strict=True)]


def assert_matches_reference(trainings: list[Training], windows: list[list[Batch]]) -> None:
    expected = list(reference_sgd(make_model(), windows, lr=0.1).parameters())
    for training in trainings:
        assert training.global_step == len(windows)
        for got, want in zip(training.params, expected, strict=True):
            assert (got - want).abs().max().item() < TOL


@functools.cache
def _each_policy(kind: str, world: int) -> dict[str, list[Training]]:
    per_rank = run(distributed.train_each_policy, world, kind, EQUAL)
    return {sync: [rank[sync] for rank in per_rank] for sync in per_rank[0]}


def trained(kind: str, world: int, sync: str) -> list[Training]:
    """Every rank's `Training` of ``kind`` on `EQUAL` under ``sync``: the three policies
    are launched once per wrapping and shared by the tests that read them (a copy each)."""
    return copy.deepcopy(_each_policy(kind, world)[sync])


def per_window(trainings: list[Training], name: str, windows: int) -> set[float]:
    """``c10d::<name>`` ops per window, as the set of what the ranks saw."""
    return {t.collectives.get(f"c10d::{name}", 0) / windows for t in trainings}


@pytest.mark.parametrize(
    ("kind", "world"),
    [
        ("ddp", 2),
        ("ddp_pair", 2),
        ("fsdp1", 2),
        ("fully_shard", 2),
        ("hsdp", 4),
        ("compile_ddp", 2),
        ("ddp_compile", 2),
        ("replicate", 2),
        ("replicate_pair", 2),
        ("replicate_fsdp", 2),
        ("fsdp1_no_shard", 2),
    ],
)
@pytest.mark.parametrize("sync", ["auto", "boundary", "every"])
def test_every_wrapping_equals_the_big_batch_reference(kind: str, world: int, sync: str) -> None:
    """steps=4 over 13 microbatches per rank, different data per rank: within 1e-10."""
    trainings = trained(kind, world, sync)
    assert_matches_reference(trainings, global_windows(EQUAL, world))


@pytest.mark.parametrize("sync", ["auto", "boundary", "every"])
def test_ddp_with_find_unused_parameters_defers_exactly(sync: str) -> None:
    """find_unused_parameters=True with a layer never used: exact, the layer untouched."""
    trainings = trained("ddp_unused", 2, sync)
    untouched = list(distributed.PartlyUsed(make_model()).unused.parameters())
    for training in trainings:
        used, unused = training.params[:-2], training.params[-2:]
        training.params = used
        for got, want in zip(unused, untouched, strict=True):
            assert torch.equal(got, want)
    assert_matches_reference(trainings, global_windows(EQUAL, 2))


@pytest.mark.parametrize(
    ("kind", "sync", "expected"),
    [
        # DDP: one all-reduce round (one bucket here) per window unless "every".
        ("ddp", "auto", {"allreduce_": 1}),
        ("ddp", "boundary", {"allreduce_": 1}),
        ("ddp", "every", {"allreduce_": 4}),
        # Two DDP modules side by side: each is armed, one all-reduce each per window.
        ("ddp_pair", "auto", {"allreduce_": 2}),
        ("ddp_pair", "every", {"allreduce_": 8}),
        # find_unused_parameters: a synced backward all-reduces the unused-parameter map
        # and two buckets (the unused layer's is reduced too); deferring leaves one per window.
        ("ddp_unused", "auto", {"allreduce_": 3}),
        ("ddp_unused", "every", {"allreduce_": 12}),
        ("compile_ddp", "auto", {"allreduce_": 1}),
        ("ddp_compile", "auto", {"allreduce_": 1}),
        # FSDP1 and fully_shard reduce every microstep unless told "boundary".
        ("fsdp1", "auto", {"_reduce_scatter_base_": 4}),
        ("fsdp1", "boundary", {"_reduce_scatter_base_": 1}),
        ("fully_shard", "auto", {"_reduce_scatter_base_": 4 * UNITS, "allreduce_": 0}),
        ("fully_shard", "boundary", {"_reduce_scatter_base_": UNITS, "allreduce_": 0}),
        ("fully_shard", "every", {"_reduce_scatter_base_": 4 * UNITS, "allreduce_": 0}),
        # The composable replicate() (torchtitan's DDP) is DDP: one round per window.
        ("replicate", "auto", {"allreduce_": 1}),
        ("replicate", "boundary", {"allreduce_": 1}),
        ("replicate", "every", {"allreduce_": 4}),
        ("replicate_pair", "auto", {"allreduce_": 2}),  # each armed alike
        ("replicate_pair", "every", {"allreduce_": 8}),
        # Where nothing is sharded, each rank holds the whole gradient anyway: "auto"
        # defers, as under DDP (FSDP1 NO_SHARD; replicate() on fully_shard's machinery,
        # one all-reduce a unit).
        ("fsdp1_no_shard", "auto", {"allreduce_": 1, "_reduce_scatter_base_": 0}),
        ("fsdp1_no_shard", "every", {"allreduce_": 4}),
        ("replicate_fsdp", "auto", {"allreduce_": UNITS, "_reduce_scatter_base_": 0}),
        ("replicate_fsdp", "boundary", {"allreduce_": UNITS}),
        ("replicate_fsdp", "every", {"allreduce_": 4 * UNITS}),
    ],
)
def test_collectives_per_window(kind: str, sync: str, expected: dict[str, float]) -> None:
    """Counted at the dispatcher on every rank: what each policy costs per window."""
    trainings = trained(kind, 2, sync)
    for name, per in expected.items():
        assert per_window(trainings, name, 3) == {per}, name


def test_hsdp_all_reduces_once_per_window_under_auto() -> None:
    """2x2 mesh: reduce-scatter every microstep, all-reduce across replicas on the boundary."""
    for sync, scatters, reduces in (("auto", 4, 1), ("boundary", 1, 1), ("every", 4, 4)):
        trainings = trained("hsdp", 4, sync)
        assert per_window(trainings, "_reduce_scatter_base_", 3) == {scatters * UNITS}, sync
        assert per_window(trainings, "allreduce_", 3) == {reduces * UNITS}, sync
        assert_matches_reference(trainings, global_windows(EQUAL, 4))


@pytest.mark.parametrize("kind", ["ddp", "fully_shard"])
def test_partial_window_syncs_on_its_last_microstep(kind: str) -> None:
    """drop_last=False: 13 = 4+4+4+1, the last window of one microstep synced and exact."""
    trainings = run(train, 2, kind, EQUAL, sync="boundary", drop_last=False)
    assert_matches_reference(trainings, global_windows(EQUAL, 2, drop_last=False))
    name = "allreduce_" if kind == "ddp" else "_reduce_scatter_base_"
    assert per_window(trainings, name, 4) == {1 if kind == "ddp" else UNITS}


@pytest.mark.parametrize(
    "kind",
    ["ddp", "fsdp1", "fully_shard", "fully_shard_offload", "hsdp", "replicate", "replicate_fsdp"],
)
def test_num_items_is_the_item_mean_over_the_global_window(kind: str) -> None:
    """Different token counts on every rank and microbatch: one scalar all-reduce per window
    (the item total over the ranks that average the gradients). Under CPU offloading the
    parameters and their gradients stay on the CPU, where the item total is applied."""
    world = 4 if kind == "hsdp" else 2
    sizes = [[1 + (3 * i + 5 * r) % 6 for i in range(13)] for r in range(world)]
    trainings = run(train, world, kind, sizes, items=True)
    assert_matches_reference(trainings, global_windows(sizes, world))
    assert all(t.loss_error < TOL for t in trainings)  # step.loss is this rank's item-mean
    gradient = {"ddp": 1, "replicate": 1, "replicate_fsdp": UNITS}.get(kind)
    if gradient is not None:  # the gradient's all-reduces and the items'
        assert per_window(trainings, "allreduce_", 3) == {gradient + 1}


@pytest.mark.parametrize(
    ("kind", "world", "dtype", "tol"),
    [
        ("ddp", 2, torch.float64, TOL),
        # FSDP1 clips with its own clip_grad_norm_, which computes norms in float32 and
        # refuses float64 gradients: checked in float32 against the float64 reference.
        ("fsdp1", 2, torch.float32, 1e-5),
        ("fully_shard", 2, torch.float64, TOL),
        ("hsdp", 4, torch.float64, TOL),
        ("replicate", 2, torch.float64, TOL),
    ],
)
def test_clipping_uses_the_full_norm(kind: str, world: int, dtype: torch.dtype, tol: float) -> None:
    """grad_norm is the whole gradient's norm, a plain 0-dim tensor equal on every rank,
    and clipping by it matches a clipped big-batch reference; under fully_shard and HSDP
    (DTensor gradients) no host synchronization happens in the whole epoch."""
    max_norm = 0.72  # the windows' norms here are about 0.45 to 1.1: some are clipped
    trainings = run(train, world, kind, EQUAL, max_grad_norm=max_norm, dtype=dtype)
    reference = make_model()
    params = list(reference.parameters())
    norms = []
    for window in global_windows(EQUAL, world):
        grads = torch.autograd.grad(mean_loss(reference, concat(window)), params)
        norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        coefficient = min(1.0, max_norm / (norms[-1].item() + 1e-6))
        with torch.no_grad():
            for param, grad in zip(params, grads, strict=True):
                param -= 0.1 * coefficient * grad
    assert min(norms) < max_norm < max(norms)
    for training in trainings:
        if kind in ("fully_shard", "hsdp"):
            assert training.host_syncs == 0
        assert len(training.grad_norms) == 3
        for got, want in zip(training.grad_norms, norms, strict=True):
            assert got.dim() == 0
            assert type(got) is torch.Tensor
            assert abs(got.item() - want.item()) < tol
        for got, want in zip(training.params, reference.parameters(), strict=True):
            assert (got.double() - want).abs().max().item() < tol


@pytest.mark.parametrize("kind", ["ddp", "replicate"])
def test_ranks_with_different_lengths_agree_and_finish(kind: str) -> None:
    """13 and 9 microbatches: both train on 9 (two windows), with one warning on rank 0."""
    sizes = [[2] * 13, [2] * 9]
    trainings = run(train, 2, kind, sizes)
    assert [len(t.warnings) for t in trainings] == [1, 0]
    assert "between 9 and 13 microbatches" in trainings[0].warnings[0]
    short = [sizes[0][:9], sizes[1]]
    assert_matches_reference(trainings, global_windows(short, 2))


@pytest.mark.parametrize("drop_last", [True, False])
def test_unsized_iterables_agree_window_by_window(drop_last: bool) -> None:
    """Iterators of 13 and 10 microbatches: each window's length is agreed before its
    first forward, so 4+4 (and with drop_last=False a last window of 2) on both ranks."""
    sizes = [[2] * 13, [2] * 10]
    trainings = run(train, 2, "ddp", sizes, unsized=True, drop_last=drop_last)
    assert len(trainings[0].warnings) == 1
    assert "ended at different points" in trainings[0].warnings[0]
    assert trainings[1].warnings == []
    short = [[2] * 10, [2] * 10]
    assert_matches_reference(trainings, global_windows(short, 2, drop_last=drop_last))


def test_a_failing_rank_makes_the_others_fail_not_hang() -> None:
    """Rank 1 raises mid-window; rank 0 errors at its boundary all-reduce well within time."""
    started = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        run_ranks(distributed.fail_mid_window, 2, timeout=distributed.PROCESS_GROUP_TIMEOUT)
    failures = caught.value.failures
    assert "fails on purpose" in failures[1]
    assert "gave no answer" not in failures[0]  # it raised; nobody had to kill it
    assert "backward" in failures[0]  # in the boundary's all-reduce
    assert time.monotonic() - started < distributed.PROCESS_GROUP_TIMEOUT


def test_a_failed_rank_that_carries_on_is_refused_before_its_forwards_collectives() -> None:
    """Under ``fully_shard`` a rank whose block raised, in a loop that catches it and goes
    on, ran its next forward's all-gather against the other rank's backward collectives:
    gloo aborted both processes (SIGABRT), with no message. Its forwards are now refused
    before their collectives, and the other rank's next collective fails with a
    RankFailedError naming rank 1, then its forwards are refused too; both processes end
    their loop."""
    rank0, rank1 = run(distributed.caught_and_carried_on, 2, "fully_shard")
    refused = "UsageError: the model's forward was called after "
    assert rank1[0] == "ValueError: a bad batch"
    assert len(rank1) > 1, rank1
    assert all(seen.startswith(refused + "this rank failed") for seen in rank1[1:]), rank1
    assert len(rank0) > 1, rank0
    assert all(seen.startswith(refused + "rank 1 failed") for seen in rank0[1:]), rank0


def test_a_microbatch_left_out_on_one_rank_is_that_ranks_failure() -> None:
    """Rank 1 leaves a microbatch out of a window (``continue`` before its block): its
    windows stopped lining up with rank 0's, whose all-reduces then paired other windows
    (each rank applied another window 2, no error) until a collective of another size
    aborted gloo. It is refused at the next microbatch's hand-out, as rank 1's failure,
    which rank 0 names."""
    rank0, rank1 = run(distributed.skip_a_microbatch, 2)
    assert rank1.startswith(
        "UsageError: the epoch's microbatch 5 (counting from 1) was handed out but not "
        "back-propagated"
    ), rank1
    assert rank0.startswith(
        "RankFailedError: rank 0 stopped in window 2 because rank 1 failed there first: "
        "UsageError: the epoch's microbatch 5"
    ), rank0


@pytest.mark.parametrize(("kind", "sync"), [("ddp", "auto"), ("fully_shard", "boundary")])
def test_an_unclosed_accumulator_cannot_stop_the_next_from_reducing(kind: str, sync: str) -> None:
    """The first accumulator leaves the model deferring; the second still reduces once per
    window, and both epochs train exactly."""
    outcomes = run(distributed.after_an_unclosed_accumulator, 2, kind, sync)
    windows = global_windows([[2] * 8] * 2, 2)
    name, per = ("allreduce_", 1) if kind == "ddp" else ("_reduce_scatter_base_", UNITS)
    expected = list(reference_sgd(make_model(), windows * 2, lr=0.1).parameters())
    for collectives, params in outcomes:
        assert collectives.get(f"c10d::{name}", 0) == per * len(windows)
        for got, want in zip(params, expected, strict=True):
            assert (got - want).abs().max().item() < TOL


def test_no_sync_keeps_the_gradient_local() -> None:
    """``gradaccum.no_sync(model)`` around a forward and backward: no all-reduce inside it
    (the composable replicate() and replicate on fully_shard's machinery included), the
    wrapper's all-reduces outside it."""
    reduces = {"ddp": 1, "replicate": 1, "replicate_fsdp": UNITS, "fsdp1_no_shard": 1}
    for rank in run(distributed.no_sync_counted, 2, list(reduces)):
        for kind, (inside, outside) in rank.items():
            assert inside.get("c10d::allreduce_", 0) == 0, kind
            assert outside.get("c10d::allreduce_", 0) == reduces[kind], kind


def test_an_unknown_set_requires_gradient_sync_is_refused_on_several_ranks() -> None:
    """A module with a ``set_requires_gradient_sync()`` that gradaccum does not know (it
    once took such a model for unwrapped: synced every microstep, ``num_items`` per rank)
    is refused on 2 ranks, naming it and the fix; on one process it is local."""
    for error in run(distributed.unknown_gradient_sync, 2):
        assert error.startswith("model contains a OwnGradientSync, which has a ")
        assert "gradaccum.register_sync_strategy()" in error
    model = distributed.OwnGradientSync(make_model())
    with gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2) as acc:
        assert type(acc._block.arming.strategy).__name__ == "LocalSync"


@pytest.mark.parametrize("dropped", [False, True], ids=["closed", "dropped"])
@pytest.mark.parametrize("kind", ["ddp", "fully_shard", "replicate"])
def test_flags_are_restored_on_close(kind: str, dropped: bool) -> None:
    """Deferring sets the module's flags; close() and no_sync() put back what they found.
    So does dropping the accumulator unclosed mid-window (a trainer function that broke
    out of its loop), which once left DDP deferring: a plain loop after it never
    all-reduced, and the ranks drifted apart."""
    first, deferring, closed, inside, after = run(distributed.restore_flags, 2, kind, dropped)[0]
    assert closed == after == first
    assert deferring != first
    assert inside != first


def _big_batch_losses(windows: list[list[Batch]]) -> list[float]:
    """The loss of each global window as one big batch (the mean over its rows), before
    its SGD step, as `reference_sgd` trains."""
    model = make_model()
    losses = []
    for window in windows:
        loss = mean_loss(model, concat(window))
        losses.append(loss.item())
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= 0.1 * param.grad
    return losses


ITEM_SIZES = [[1 + (3 * i + 5 * r) % 6 for i in range(13)] for r in range(2)]


@pytest.mark.parametrize(("items", "asked"), [(True, False), (False, True)])
def test_global_loss_is_the_big_batch_loss_on_every_rank(items: bool, asked: bool) -> None:
    """``step.global_loss`` is the whole job's window loss, the same on both ranks: in item
    mode the summed losses over every rank's items (different counts per rank), free: the
    same 2 all-reduces per window
    as the gradient and the item total; in mean mode, asked for, the ranks' mean, at one
    scalar all-reduce per window more than without it. No host sync either way."""
    sizes = ITEM_SIZES if items else EQUAL
    want = _big_batch_losses(global_windows(sizes, 2))
    ranks = run(distributed.global_losses, 2, sizes, items, asked, None)
    for rank in ranks:
        assert rank["read"] == pytest.approx(want, abs=TOL)
        assert rank["host_syncs"] == 0
    assert ranks[0]["read"] == ranks[1]["read"]
    baseline = run(distributed.global_losses, 2, sizes, items, False, 1)  # read on rank 1 only
    reduces = {rank["collectives"]["c10d::allreduce_"] / 3 for rank in ranks}
    assert reduces == {2}
    assert {rank["collectives"]["c10d::allreduce_"] / 3 for rank in baseline} == {2 if items else 1}
    assert baseline[0]["read"] == []
    assert baseline[1]["read"] == (pytest.approx(want, abs=TOL) if items else [None] * 3)


def test_global_loss_read_on_one_rank_only_does_not_hang() -> None:
    """Reading ``step.global_loss`` on rank 0 only (a rank-0 logger) launches nothing: the
    other rank never meets a collective it does not call, in either mode."""
    for items, sizes in ((True, ITEM_SIZES), (False, EQUAL)):
        ranks = run(distributed.global_losses, 2, sizes, items, True, 0)
        assert len(ranks[0]["read"]) == 3
        assert ranks[1]["read"] == []


def _example_reference(world: int, epochs: int, steps: int = 4) -> list[str]:
    """What examples/distributed.py logs, computed on one process without gradaccum: each
    window is one big batch of every rank's microbatches of that window (in the order the
    ranks' DistributedSamplers give them), its loss the mean over all its rows."""
    spec = importlib.util.spec_from_file_location("example", ROOT / "examples" / "distributed.py")
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    data, batch = example.dataset(512), 8
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per_rank = len(data) // world // batch  # the microbatches of each rank's epoch
    horizon = gradaccum.total_steps(per_rank, steps, epochs)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=horizon)
    logs, done = [], 0
    for epoch in range(epochs):
        orders = []
        for rank in range(world):
            sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        rows = steps * batch
        for window in range(per_rank // steps):
            indices = [i for order in orders for i in order[window * rows : (window + 1) * rows]]
            x, y = data[indices]
            loss = (model(x) - y).square().mean()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            done += 1
            if done % 4 == 0:
                logs.append(
                    f"epoch {epoch} step {done}/{horizon} loss {loss:.5f} grad norm {norm:.5f}"
                )
    return logs


LOG = re.compile(r"epoch (\d+) step (\d+/\d+) loss (\S+) grad norm (\S+)")


@pytest.mark.parametrize(
    ("wrapping", "nproc"), [("ddp", 2), ("fsdp1", 2), ("fully_shard", 2), ("hsdp", 4)]
)
def test_the_distributed_example_logs_the_big_batch_loss(wrapping: str, nproc: int) -> None:
    """examples/distributed.py, launched as its docstring says under DDP (the other
    wrappings run its main() on the launcher's ranks; 4 microbatches a window by default),
    trains the steps it should and logs the whole job's window loss and the gradient norm
    of the big batch of every rank's window. Logging rank 0's own `step.loss`, or
    averaging the ranks' without weighing them by their items, does not match."""
    if wrapping == "ddp":  # as its docstring says, whole
        result = torchrun(ROOT / "examples" / "distributed.py", nproc, "--wrap", wrapping)
        assert result.returncode == 0, result.stderr[-3000:]
        printed = result.stdout
    else:  # its main() on the launcher's ranks, which torch was imported into once
        printed = run(distributed.example_main, nproc, "distributed.py", "--wrap", wrapping)[0]
    *lines, last = printed.splitlines()
    windows = 512 // nproc // 8 // 4
    assert last == f"{2 * windows} optimizer steps on {nproc} ranks ({wrapping})"
    expected = _example_reference(nproc, epochs=2)
    assert len(lines) == len(expected) == 2 * windows // 4
    assert_same_log(lines, expected)
    if nproc == 2:  # what the Distributed page shows it prints, to its 5 digits
        *shown, shown_last = shown_output("distributed.md", "## Run the example").splitlines()
        assert shown_last == "16 optimizer steps on 2 ranks (ddp)"
        assert_same_log(lines, shown)


def assert_same_log(lines: list[str], expected: list[str]) -> None:
    """The example's log lines are ``expected``'s: the same epochs and steps, and losses
    and gradient norms within their printed 5 digits."""
    assert len(lines) == len(expected), (lines, expected)
    for got, want in zip(map(LOG.fullmatch, lines), map(LOG.fullmatch, expected), strict=True):
        assert got is not None
        assert want is not None
        (*at, loss, norm), (*want_at, want_loss, want_norm) = got.groups(), want.groups()
        assert at == want_at
        assert float(loss) == pytest.approx(float(want_loss), abs=2e-5), (lines, expected)
        assert float(norm) == pytest.approx(float(want_norm), abs=2e-5), (lines, expected)


def test_a_divide_factor_equal_to_the_ranks_is_exact() -> None:
    """fully_shard whose units divide by the world size through set_gradient_divide_factor
    (FSDP's own average, so not refused) trains by items exactly as the float64 big batch,
    on 2 ranks with different data."""
    report = check_accumulation(
        make_model,
        loops.sgd,
        functools.partial(loops.accumulator_loop, by_items=True),
        [loops.rank_batches(0), loops.rank_batches(1)],
        sum_loss,
        steps=loops.STEPS,
        num_items=loops.items,
        wrap=distributed.fully_shard_averaging_by_its_factor,
    )
    assert report.ok, report


# FSDP1 (with use_orig_params, so that its parameters can be split) clips in float32 only:
# see test_clipping_uses_the_full_norm.
SPLIT_WORLDS: dict[int, dict[str, dict[str, Any]]] = {
    2: {
        "ddp": {},
        "fsdp1_orig": {"dtype": torch.float32},
        "fully_shard": {},
        "compile_ddp": {},
        "ddp_compile": {},
    },
    4: {"hsdp": {}},
}
SPLIT_OPTIONS = {"max_grad_norm": 0.3, "sync": "auto"}


@functools.cache
def _split(world: int, items: bool) -> dict[str, tuple[Training, Training]]:
    sizes = [[1 + (3 * i + 5 * r) % 6 for i in range(13)] for r in range(world)] if items else EQUAL
    per_rank = run(
        distributed.train_split_and_single,
        world,
        SPLIT_WORLDS[world],
        sizes,
        items=items,
        **SPLIT_OPTIONS,
    )
    return {kind: tuple(rank[kind] for rank in per_rank) for kind in SPLIT_WORLDS[world]}  # type: ignore[misc]


@pytest.mark.parametrize("items", [False, True], ids=["mean", "items"])
@pytest.mark.parametrize(
    ("kind", "world"), [(kind, world) for world, kinds in SPLIT_WORLDS.items() for kind in kinds]
)
def test_two_optimizers_on_every_wrapping_equal_the_big_batch_reference(
    kind: str, world: int, items: bool
) -> None:
    """SGD on the weights and AdamW on the biases, each with a scheduler, one clip of the
    total norm over both: every wrapping matches one float64 big batch per window (the
    mean of every rank's microbatches, or the item mean), and runs the same collectives
    per window as with one optimizer."""
    sizes = [[1 + (3 * i + 5 * r) % 6 for i in range(13)] for r in range(world)] if items else EQUAL
    dtype = SPLIT_WORLDS[world][kind].get("dtype", torch.float64)
    windows = global_windows(sizes, world, dtype=dtype)
    expected = list(
        reference_run(
            make_model(), windows, split_optimizers, items=items, max_grad_norm=0.3
        ).parameters()
    )
    tol = TOL if dtype == torch.float64 else 1e-5
    for rank_runs in _split(world, items)[kind]:
        split, single = rank_runs
        assert split.global_step == len(windows)
        for got, want in zip(split.params, expected, strict=True):
            assert (got - want).abs().max().item() < tol
        assert split.collectives == single.collectives
        assert split.host_syncs == single.host_syncs
