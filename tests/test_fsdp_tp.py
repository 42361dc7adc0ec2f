"""FSDP with tensor parallelism on 4 gloo ranks: ``fully_shard`` on the data-parallel dim of
a (dp=2, tp=2) mesh is detected from FSDP's own mesh information, its item totals are summed
over the data-parallel ranks only, and every policy matches a float64 big-batch reference.

The two TP ranks of a data-parallel rank see the same data, so an item total summed over
the whole world is exactly twice the data-parallel one, and the gradient's factors cancel:
the collectives, counted by the ranks of their process group, are what shows where the
items were summed. ``step.loss`` (this rank's window: its summed losses over its items) is
checked against the reference too. All cases share one launch of 4 ranks.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import gradaccum
from gradaccum.sync import strategy_for
from tests import fsdp_tp_distributed as tp
from tests.distributed import run
from tests.helpers import Batch

WORLD, STEPS, WINDOWS = tp.DP * tp.TP, 4, 3
TOL = 1e-10
UNITS = 2  # fully_shard units with parameters: the two Linear layers
SIZES = {
    "mean": [[2] * STEPS * WINDOWS] * tp.DP,  # equal microbatches: their mean is the batch's
    "items": [[1 + (3 * i + 5 * dp) % 6 for i in range(STEPS * WINDOWS)] for dp in range(tp.DP)],
}
CASES = [f"{mode}/{sync}" for mode in ("mean", "items") for sync in ("auto", "boundary", "every")]


@functools.cache
def _launched() -> list[dict[str, Any]]:
    return run(tp.scenario, WORLD, SIZES, STEPS)


@pytest.fixture
def ranks() -> list[dict[str, Any]]:
    """Every rank's results of the one launch."""
    return _launched()


def reference(mode: str) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Plain float64 SGD, one step per window on every data-parallel rank's window as one
    big batch (the mean over its items); and per window, each data-parallel rank's own
    window loss at the window's start, as ``step.loss`` reports it."""
    model = tp.make_model()
    params = list(model.parameters())
    data = [tp.make_batches(dp, SIZES[mode][dp]) for dp in range(tp.DP)]
    losses = []
    for w in range(WINDOWS):
        windows: list[list[Batch]] = [batches[w * STEPS : (w + 1) * STEPS] for batches in data]
        with torch.no_grad():
            losses.append([own_loss(model, window, mode) for window in windows])
        big = [batch for window in windows for batch in window]
        items = sum(x.shape[0] * tp.OUT for x, _ in big)
        loss = sum(tp.squared_error(model, batch) for batch in big) / items
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for param, grad in zip(params, grads, strict=True):
                param -= 0.1 * grad
    return [p.detach() for p in params], losses


def own_loss(model: torch.nn.Module, window: list[Batch], mode: str) -> torch.Tensor:
    """A rank's window loss: its microbatch means averaged, or its summed losses over its
    items."""
    sums = [tp.squared_error(model, batch) for batch in window]
    counts = [x.shape[0] * tp.OUT for x, _ in window]
    if mode == "mean":
        return sum(s / n for s, n in zip(sums, counts, strict=True)) / len(window)  # type: ignore[return-value]
    return sum(sums) / sum(counts)  # type: ignore[return-value]


def test_fsdp_on_the_dp_dim_of_a_tp_mesh_is_detected_as_such(ranks: list[dict[str, Any]]) -> None:
    """Classified from FSDP's mesh information: fully_shard with TP, whose data-parallel
    ranks are the dp dim's group, not the whole (dp, tp) mesh that the parameters are on
    (which made it look like HSDP over all 4 ranks)."""
    for rank in ranks:
        for case in CASES:
            run_ = rank["runs"][case]
            assert run_.kind == "fully_shard + TP", case
            assert run_.group == rank["ranks"]["dp"], case
            assert len(run_.group) == tp.DP


def test_plain_hsdp_and_fully_shard_are_still_classified_as_before(
    ranks: list[dict[str, Any]],
) -> None:
    """HSDP on a 2 x 2 (replicate, shard) mesh: HSDP over all 4 ranks; fully_shard on a
    1-D mesh of the 4: fully_shard over all 4."""
    for rank in ranks:
        assert rank["plain"] == [("HSDP", [0, 1, 2, 3]), ("fully_shard", [0, 1, 2, 3])]


@pytest.mark.parametrize("case", CASES)
def test_every_policy_matches_the_big_batch_reference(
    ranks: list[dict[str, Any]], case: str
) -> None:
    """Mean and item mode under each policy: the whole parameters on every rank, and each
    rank's step.loss, match the float64 reference; no host sync in the whole epoch."""
    mode = case.split("/")[0]
    params, losses = reference(mode)
    for number, rank in enumerate(ranks):
        run_ = rank["runs"][case]
        dp = rank["ranks"]["dp"].index(number)  # its coordinate on the dp dim
        assert run_.global_step == WINDOWS
        for got, want in zip(run_.params, params, strict=True):
            assert (got - want).abs().max().item() < TOL
        assert len(run_.losses) == WINDOWS
        for got, want in zip(run_.losses, losses, strict=True):
            assert abs(got.item() - want[dp].item()) < TOL
        assert run_.host_syncs == 0


@pytest.mark.parametrize("case", CASES)
def test_items_are_summed_over_the_data_parallel_ranks_only(
    ranks: list[dict[str, Any]], case: str
) -> None:
    """Per window, counted by process group: the item total is one all-reduce over the
    data-parallel ranks (none in mean mode), the reduce-scatters run over them as the
    policy says, the TP collectives over the TP ranks, and nothing over all 4 ranks. The
    epoch's length agreement is one all-reduce over the data-parallel ranks."""
    mode, sync = case.split("/")
    scatters = (1 if sync == "boundary" else STEPS) * UNITS
    for rank in ranks:
        counts = rank["runs"][case].by_group
        dp, tp_ranks = tuple(rank["ranks"]["dp"]), tuple(rank["ranks"]["tp"])
        per_window = {
            op: n / WINDOWS
            for (op, group), n in counts.items()
            if group == dp and op in ("allreduce_", "_reduce_scatter_base_")
        }
        assert per_window == {
            "_reduce_scatter_base_": scatters,
            **({"allreduce_": 1} if mode == "items" else {}),
        }
        assert not [key for key in counts if len(key[1]) == WORLD]
        assert any(group == tp_ranks for _, group in counts)  # the model is tensor-parallel
        assert rank["runs"][case].agreement == {("allreduce_", dp): 1}


@pytest.mark.usefixtures("process_group")
def test_modules_sharded_over_different_meshes_are_refused() -> None:
    """One layer fully_shard on a 1-D mesh, the other HSDP on a 2-D one: no one rank group
    sums the items for both, so the accumulator is refused up front, naming both meshes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tp.make_model()
    fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)))
    hsdp = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    fully_shard(model[2], mesh=hsdp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(gradaccum.ConfigError, match=r"different meshes .*DeviceMesh"):
        gradaccum.Accumulator(model, optimizer, steps=2)


@pytest.mark.usefixtures("process_group")
def test_replicate_is_classified_from_its_mesh_information() -> None:
    """torch's FSDP-based replicate() has a replicate dim and no shard dim: "replicate"."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    assert strategy_for(replicate(tp.make_model())).kind == "replicate"  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["mean", "items"])
def test_two_optimizers_match_the_reference_with_one_clip_of_the_whole_norm(
    ranks: list[dict[str, Any]], mode: str
) -> None:
    """Two optimizers (the weights' and the biases', at other learning rates) under FSDP +
    TP, clipped once by the norm of the whole gradient over both (DTensors over the dp
    and tp dims): the float64 reference, clipped by the same norm (which clips some
    windows)."""
    model = tp.make_model()
    named = list(model.named_parameters())
    data = [tp.make_batches(dp, SIZES[mode][dp]) for dp in range(tp.DP)]
    clipped = []
    for w in range(WINDOWS):
        big = [batch for batches in data for batch in batches[w * STEPS : (w + 1) * STEPS]]
        if mode == "mean":
            loss = sum(tp.squared_error(model, b) / (b[0].shape[0] * tp.OUT) for b in big) / len(
                big
            )
        else:
            loss = sum(tp.squared_error(model, b) for b in big) / sum(
                b[0].shape[0] * tp.OUT for b in big
            )
        grads = torch.autograd.grad(loss, [p for _, p in named])
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
        coefficient = min(1.0, tp.SPLIT_MAX_NORM / (norm + 1e-6))
        clipped.append(coefficient < 1)
        with torch.no_grad():
            for (name, param), grad in zip(named, grads, strict=True):
                param -= tp.SPLIT_LRS[name.rpartition(".")[2]] * coefficient * grad
    assert any(clipped)
    for rank in ranks:
        run_ = rank["runs"][f"split/{mode}"]
        assert run_.global_step == WINDOWS
        for got, (_, want) in zip(run_.params, named, strict=True):
            assert (got - want).abs().max().item() < TOL
