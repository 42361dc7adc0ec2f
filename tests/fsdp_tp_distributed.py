"""What the gloo ranks of tests/test_fsdp_tp.py run: ``fully_shard`` on the data-parallel
dim of a (dp=2, tp=2) mesh, over a model whose Linear pair is tensor-parallel."""

from __future__ import annotations

import itertools
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradaccum
from gradaccum.sync import full_tensor, strategy_for
from gradaccum.testing import CollectiveCounter
from tests.helpers import Batch

DP, TP = 2, 2
WIDTH, OUT = 8, 2  # the hidden width, split over the TP ranks, and the outputs per row


def make_model() -> nn.Module:
    """The float64 model every rank starts from, and the reference trains."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, WIDTH), nn.Tanh(), nn.Linear(WIDTH, OUT)).double()


def make_batches(dp: int, sizes: list[int]) -> list[Batch]:
    """Data-parallel rank ``dp``'s microbatches: the same on both of its TP ranks."""
    generator = torch.Generator().manual_seed(500 + dp)
    return [
        (
            torch.randn(size, 5, generator=generator, dtype=torch.float64),
            torch.randn(size, OUT, generator=generator, dtype=torch.float64),
        )
        for size in sizes
    ]


def squared_error(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The summed squared error of every output of the batch (its items: rows x OUT)."""
    inputs, targets = batch
    return (model(inputs) - targets).square().sum()


class GroupCounter(CollectiveCounter):  # type: ignore[misc]
    """`CollectiveCounter` that also counts each collective by the ranks of its group."""

    def __init__(self) -> None:
        super().__init__()
        self.by_group: Counter[tuple[str, tuple[int, ...]]] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Sequence[type], args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        if func.namespace in ("c10d", "_c10d_functional"):
            names = [argument.name for argument in func._schema.arguments]
            for name, value in zip(names, args, strict=False):
                if name == "process_group":
                    group = dist.ProcessGroup.unbox(value)
                elif name == "group_name":
                    group = dist.distributed_c10d._resolve_process_group(value)
                else:
                    continue
                op = func.name().split("::")[-1]
                self.by_group[op, tuple(dist.get_process_group_ranks(group))] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@dataclass
class Run:
    """What one rank saw in one epoch."""

    kind: str
    group: list[int]  # the strategy's data-parallel ranks
    params: list[torch.Tensor]  # whole, in the model's order
    global_step: int
    losses: list[torch.Tensor]  # step.loss of each window
    by_group: dict[tuple[str, tuple[int, ...]], int]  # over the counted windows
    agreement: dict[tuple[str, tuple[int, ...]], int]  # the epoch's length agreement
    host_syncs: int


def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
    """Column- then row-wise TP over ``mesh["tp"]``, then fully_shard over ``mesh["dp"]``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (model[0], model[2]):  # type: ignore[index]
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


SPLIT_LRS, SPLIT_MAX_NORM = {"weight": 0.1, "bias": 0.05}, 0.4


def split(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Two optimizers: SGD at ``SPLIT_LRS["weight"]`` on the weights, at ``["bias"]`` on
    the biases."""
    return [
        torch.optim.SGD([p for n, p in model.named_parameters() if n.endswith(kind)], lr=lr)
        for kind, lr in SPLIT_LRS.items()
    ]


def train(
    mesh: Any,
    sizes: list[int],
    *,
    items: bool,
    sync: gradaccum.SyncPolicy,
    steps: int,
    several: bool = False,
) -> Run:
    """One epoch of the design-card loop on this data-parallel rank's data; the collectives
    of every window counted, and apart from them those of the epoch's length agreement.
    With ``several``, the two optimizers of `split` and one clip of the total norm."""
    model = parallelize(make_model(), mesh)
    strategy = strategy_for(model, sync)
    acc = gradaccum.Accumulator(
        model,
        split(model) if several else torch.optim.SGD(model.parameters(), lr=0.1),
        steps=steps,
        sync=sync,
        max_grad_norm=SPLIT_MAX_NORM if several else None,
    )
    counter, agreement = GroupCounter(), GroupCounter()
    losses = []
    epoch = iter(acc.epoch(make_batches(mesh.get_local_rank("dp"), sizes)))
    with agreement:
        first = next(epoch)
    with counter:
        for batch in itertools.chain([first], epoch):
            loss = squared_error(model, batch)
            n = batch[0].shape[0] * OUT
            block = acc.microstep(loss, num_items=n) if items else acc.microstep(loss / n)
            with block as step:
                if step.boundary:
                    assert step.loss is not None
                    losses.append(step.loss.clone())
    acc.close()
    assert strategy.group is not None
    return Run(
        kind=strategy.kind,
        group=dist.get_process_group_ranks(strategy.group),
        params=[full_tensor(p).detach().clone() for p in model.parameters()],
        global_step=acc.global_step,
        losses=losses,
        by_group=dict(counter.by_group),
        agreement=dict(agreement.by_group),
        host_syncs=counter.host_syncs,
    )


def classify_hsdp_and_fsdp(rank: int, world: int) -> list[tuple[str, list[int]]]:
    """The kind and data-parallel ranks detected for plain HSDP (a 2 x 2 (replicate, shard)
    mesh) and plain fully_shard over the whole world."""
    from gradaccum.verify import wrapper

    found = []
    for path in ("HSDP", "fully_shard"):
        strategy = strategy_for(wrapper(path, torch.device("cpu"))(make_model()))
        assert strategy.group is not None
        found.append((strategy.kind, dist.get_process_group_ranks(strategy.group)))
    return found


def scenario(
    rank: int, world: int, sizes: dict[str, list[list[int]]], steps: int
) -> dict[str, Any]:
    """Every case of tests/test_fsdp_tp.py in one launch of DP x TP ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore", "FSDP2-wrapped module", UserWarning)  # a TP output view
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    runs = {
        f"{mode}/{sync}": train(
            mesh, sizes[mode][dp], items=mode == "items", sync=sync, steps=steps
        )
        for mode in ("mean", "items")
        for sync in ("auto", "boundary", "every")
    }
    for mode in ("mean", "items"):
        runs[f"split/{mode}"] = train(
            mesh, sizes[mode][dp], items=mode == "items", sync="auto", steps=steps, several=True
        )
    return {
        "runs": runs,
        "ranks": {
            "dp": dist.get_process_group_ranks(mesh["dp"].get_group()),
            "tp": dist.get_process_group_ranks(mesh["tp"].get_group()),
        },
        "plain": classify_hsdp_and_fsdp(rank, world),
    }
