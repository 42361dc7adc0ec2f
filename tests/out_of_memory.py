"""Run in a process of its own by tests/test_memory.py (`on_a_rank`: a rank of the suite's
launcher, forked from a process that imported torch once): one window of acc.step with
microbatch="auto" under an address-space limit (RLIMIT_AS) that the whole batch's
activations do not fit in and half of them do, so that the CPU allocator really fails
("can't allocate memory"); then, without the limit, the run with the microbatch found
from the start and a float64 big batch. Returns what it found (printed as JSON from the
command line).

Also ``python -m tests.out_of_memory BUDGET``. BUDGET: the limit above the process's size after
setup, in activations of the whole batch's hidden layer (3: the whole batch's forward and
backward need about 4, half of it 2).
"""

from __future__ import annotations

import copy
import json
import re
import resource
import sys
from typing import Any

import torch
from torch import nn

import gradaccum

ROWS, WIDTH = 2048, 2048


def _size() -> int:
    """The process's virtual memory now, in bytes (what RLIMIT_AS limits)."""
    status = open("/proc/self/status").read()  # noqa: SIM115 (read at once)
    return int(re.search(r"VmSize:\s+(\d+)", status).group(1)) * 1024  # type: ignore[union-attr]


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).square().mean()


def main(budget: float) -> dict[str, Any]:
    torch.set_num_threads(1)  # (no thread arenas reserving address space)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1)).double()
    start = copy.deepcopy(model)
    batch = (torch.randn(ROWS, 64, dtype=torch.float64), torch.randn(ROWS, 1, dtype=torch.float64))
    tried: list[int] = []

    def watched(model: nn.Module, piece: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tried.append(len(piece[0]))
        return loss_fn(model, piece)

    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), microbatch="auto"
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _size() + int(budget * ROWS * WIDTH * 8)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        step = acc.step(batch, watched)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    found = acc.microbatch
    fixed = copy.deepcopy(start)
    gradaccum.Accumulator(
        fixed, torch.optim.SGD(fixed.parameters(), lr=0.1), microbatch=found
    ).step(batch, loss_fn)
    reference = copy.deepcopy(start)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss_fn(reference, batch).backward()
    optimizer.step()
    pairs = list(zip(model.parameters(), fixed.parameters(), reference.parameters(), strict=True))
    return {
        "tried": tried,
        "microbatch": found,
        "step_microbatch": step.microbatch,
        "equal_to_fixed": all(torch.equal(got, want) for got, want, _ in pairs),
        "off_reference": max((got - want).abs().max().item() for got, _, want in pairs),
    }


def on_a_rank(rank: int, world: int, budget: float) -> dict[str, Any]:
    """`main` on a rank of `gradaccum.testing.run_ranks` (a process of its own)."""
    return main(budget)


if __name__ == "__main__":
    print(json.dumps(main(float(sys.argv[1]))))
