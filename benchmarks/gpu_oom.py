"""A real CUDA out-of-memory error recovered by ``microbatch="auto"`` (issue 44): the
process's share of the GPU is capped with ``torch.cuda.set_per_process_memory_fraction``
so that the whole batch's window does not fit and a half does; ``acc.step`` must find
that, re-run the window smaller, and equal the run that used the microbatch found from
the start (and the float64 big batch). Prints one JSON line; exits 1 when a check fails,
0 without CUDA (saying so).

    python benchmarks/gpu_oom.py [--rows 8192] [--width 8192]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from typing import Any

import torch
from torch import nn

import gradaccum


def _model(width: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1)
    ).to(device, torch.float64)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).square().mean()


def _window(model: nn.Module, batch: Any, microbatch: int | str) -> tuple[gradaccum.Step, float]:
    acc = gradaccum.Accumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        microbatch=microbatch,  # type: ignore[arg-type]
    )
    torch.cuda.synchronize()
    started = time.perf_counter()
    step = acc.step(batch, _loss)
    torch.cuda.synchronize()
    return step, time.perf_counter() - started


def run(rows: int, width: int) -> dict[str, Any]:
    """The checks, on the current CUDA device."""
    device = torch.device("cuda")
    start = _model(width, device)
    generator = torch.Generator(device).manual_seed(1)
    batch = (
        torch.randn(rows, 256, device=device, dtype=torch.float64, generator=generator),
        torch.randn(rows, 1, device=device, dtype=torch.float64, generator=generator),
    )
    # The whole batch's peak, unlimited: the reference, one float64 big batch.
    reference = copy.deepcopy(start)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    _loss(reference, batch).backward()
    optimizer.step()
    peak = torch.cuda.max_memory_allocated() - base
    del optimizer
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    # Room for 60% of the whole batch's peak above what is held now: half of it fits.
    model = copy.deepcopy(start)
    held = torch.cuda.memory_allocated()
    fraction = (held + 0.6 * peak) / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    tried: list[int] = []

    def watched(model: nn.Module, piece: Any) -> torch.Tensor:
        tried.append(len(piece[0]))
        return _loss(model, piece)

    acc = gradaccum.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), microbatch="auto"
    )
    try:
        found_step = acc.step(batch, watched)
        found = acc.microbatch
        assert found is not None
        fixed = copy.deepcopy(start)
        _, fixed_seconds = _window(fixed, batch, found)
        again = copy.deepcopy(model)
        _, auto_seconds = _window(again, batch, found)  # a found microbatch: no retry
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    pairs = list(zip(model.parameters(), fixed.parameters(), reference.parameters(), strict=True))
    result = {
        "device": torch.cuda.get_device_name(device),
        "rows": rows,
        "width": width,
        "whole_batch_peak_gib": round(peak / 2**30, 3),
        "fraction": round(fraction, 4),
        "tried": tried,
        "microbatch": found,
        "step_microbatch": found_step.microbatch,
        "equal_to_fixed": all(torch.equal(a, b) for a, b, _ in pairs),
        "off_fixed": max((a - b).abs().max().item() for a, b, _ in pairs),
        "off_reference": max((a - c).abs().max().item() for a, _, c in pairs),
        "window_seconds_fixed": round(fixed_seconds, 4),
        "window_seconds_auto_after_probe": round(auto_seconds, 4),
    }
    result["ok"] = bool(
        tried[:1] == [rows]
        and found is not None
        and found < rows
        and result["off_fixed"] < 1e-12
        and result["off_reference"] < 1e-10
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--width", type=int, default=8192)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu_oom.py: no CUDA device, nothing to check")
        return 0
    result = run(args.rows, args.width)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
