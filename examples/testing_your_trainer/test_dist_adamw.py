"""A trainer whose optimizer averages the gradients over the ranks inside its own step(),
as nanochat's DistAdamW and DistMuon do (and modded-nanogpt's, and ZeRO-style
optimizers): no DDP around the model, so each rank's backward leaves its own gradient, and
step() reduces it. Its test checks, on 2 gloo ranks, that each window's averaged gradient
and the parameters after it are those of one big float64 batch:

    python -m pytest examples/testing_your_trainer/test_dist_adamw.py
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradaccum.testing import AccumulationReport, check_accumulation

STEPS = 4
Batch = tuple[torch.Tensor, torch.Tensor]


class DistAdamW(torch.optim.Optimizer):
    """nanochat's DistAdamW (nanochat/adamw.py) in its shape, on gloo: no DDP around the
    model; ``step()`` reduce-scatters each parameter's gradient over the ranks (all-reduces
    it whole where the ranks do not divide its first dimension), averages it (gloo has no
    ``ReduceOp.AVG``: summed, then divided by the world size, unless not ``divide``: the
    bug), updates this rank's slice of the parameter with AdamW and all-gathers the
    parameter."""

    def __init__(
        self,
        params: Any,
        lr: float = 6e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        *,
        divide: bool = True,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.divide = divide

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        rank, world = dist.get_rank(), dist.get_world_size()
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.shape[0] % world == 0:
                    size = param.shape[0] // world
                    grad = torch.empty_like(param.grad[:size])
                    dist.reduce_scatter_tensor(grad, param.grad.contiguous())
                    piece = param[rank * size : (rank + 1) * size].clone()
                else:
                    grad, piece = param.grad.clone(), param.clone()
                    dist.all_reduce(grad)
                if self.divide:
                    grad /= world
                state = self.state[param]
                if not state:
                    state.update(t=0, m=torch.zeros_like(grad), v=torch.zeros_like(grad))
                state["t"] += 1
                state["m"].lerp_(grad, 1 - beta1)
                state["v"].lerp_(grad.square(), 1 - beta2)
                denom = (state["v"] / (1 - beta2 ** state["t"])).sqrt() + group["eps"]
                piece.mul_(1 - lr * group["weight_decay"])
                piece.addcdiv_(state["m"] / (1 - beta1 ** state["t"]), denom, value=-lr)
                if piece.shape == param.shape:
                    param.copy_(piece)
                else:
                    dist.all_gather_into_tensor(param, piece)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    inputs, targets = batch
    return (model(inputs) - targets).square().mean()


def rank_batches(rank: int) -> list[Batch]:
    """13 microbatches of 1 to 4 rows, different on every rank: 3 windows and a dropped one."""
    generator = torch.Generator().manual_seed(rank)
    return [
        (
            torch.randn(rows, 5, generator=generator, dtype=torch.float64),
            torch.randn(rows, 1, generator=generator, dtype=torch.float64),
        )
        for rows in (1, 3, 2, 4, 2, 1, 3, 3, 2, 1, 4, 2, 2)
    ]


def train(model: nn.Module, optimizer: Any, scheduler: Any, batches: Sequence[Batch]) -> None:
    """nanochat's inner loop: each microbatch's loss over the accumulation steps,
    back-propagated (no DDP: nothing to sync), then one optimizer step per window."""
    for step in range(len(batches) // STEPS):
        for micro in range(STEPS):
            (loss_fn(model, batches[step * STEPS + micro]) / STEPS).backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)


def check(divide: bool = True) -> AccumulationReport:
    """The loop on 2 gloo ranks with `DistAdamW` (with ``divide`` False, the bug)."""
    return check_accumulation(
        make_model,
        functools.partial(DistAdamW, divide=divide),
        train,
        [rank_batches(0), rank_batches(1)],
        loss_fn,
        steps=STEPS,
    )


def test_the_averaged_gradient_is_the_big_batch_s() -> None:
    report = check()
    assert report.ok, str(report)
