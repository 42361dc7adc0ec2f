"""Wrapping detection through torch.compile, gradaccum.no_sync, and refusal of real wrappers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gradaccum
from gradaccum.sync import LocalSync, strategy_for, unwrap
from tests.helpers import make_batches, make_model, mean_loss


def test_compile_wrappers_are_seen_through() -> None:
    """torch.compile(model) unwraps to the module; detection compiles nothing."""
    model = make_model()
    compiled = torch.compile(model)
    assert unwrap(compiled) is model
    assert isinstance(strategy_for(compiled), LocalSync)


def test_no_sync_on_a_plain_module_accumulates_normally() -> None:
    """No communication to skip: gradients accumulate exactly as without the block."""
    model, twin = make_model(), make_model()
    batches = make_batches([2, 2])
    with gradaccum.no_sync(model):
        mean_loss(model, batches[0]).backward()
    mean_loss(model, batches[1]).backward()
    for batch in batches:
        mean_loss(twin, batch).backward()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[None]:
    """A real one-rank gloo group, so real DDP and fully_shard modules can be built."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("process_group")
def test_ddp_and_fully_shard_are_refused_until_supported() -> None:
    """DDP, compile(DDP) and fully_shard models are refused by name at construction."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(make_model())
    sharded = make_model()
    fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
    for model, name in (
        (ddp, "DistributedDataParallel"),
        (torch.compile(ddp), "DistributedDataParallel"),
        (sharded, "FSDPSequential"),
    ):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(gradaccum.ConfigTypeError, match=f"{name}.*unwrapped modules only"):
            gradaccum.Accumulator(model, optimizer)
        with pytest.raises(gradaccum.ConfigTypeError, match=name):
            gradaccum.no_sync(model).__enter__()
