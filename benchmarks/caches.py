"""What gradaccum's kept state saves on a small transformer, in instructions.

What is measured:
    A 24-layer transformer encoder (d_model 64, 4 heads, 290 parameter tensors, 1.0 M
    parameters; batches of 8 sequences of 32 tokens, AdamW), one process, one thread.
    Each count runs in its own process under callgrind, around the counted part only
    (`benchmarks/instructions.py`'s client requests):

    * ``window``: a hand loop's window of 4 microsteps (forward, ``(loss / 4).backward()``)
      and its boundary (``optimizer.step()``, ``zero_grad()``): what everything below is
      measured against;
    * ``divided`` and ``engine``: one microstep back-propagated the public way, ``(loss /
      4).backward()``, and the way earlier releases did, from a kept ``1 / 4`` handed to
      torch's private ``torch.autograd.graph._engine_run_backward``: their difference is
      what the kept gradient saved;
    * ``holds`` and ``rebuild``: the boundary's parameter list (`gradaccum.boundary.Params`)
      read while it holds (every group's list compared by identity), and worked out again
      (the list, the model's order, the lists a wipe is watched on): their difference is
      what keeping it saves per window.

    Each count is the median of ``--layouts`` heap layouts, as in instructions.py.

How to read it:
    A kept value earns its place when what it saves is at least 0.5% of the realistic
    window or microstep it lives in (the bar issue 40 set); the script prints each share.

Usage:
    python benchmarks/caches.py [--layouts 3]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import tempfile
from pathlib import Path

import instructions
import torch
from torch import nn

STEPS = 4
REPEATS = 20  # reads of the parameter list counted, per count


class Encoder(nn.Module):
    """A token embedding, a 24-layer transformer encoder and a vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(256, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, 24, enable_nested_tensor=False)
        self.head = nn.Linear(64, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.layers(self.embed(tokens)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def child(variant: str, library: str) -> None:
    from gradaccum.boundary import Params

    markers = ctypes.CDLL(library)
    torch.set_num_threads(1)
    model = Encoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 256, (8, 32), generator=generator) for _ in range(2 * STEPS)]
    unit = torch.ones(()) / STEPS
    params = Params((optimizer,), model)

    def microstep(batch: torch.Tensor) -> None:
        loss = model(batch)
        if variant == "engine":
            torch.autograd.graph._engine_run_backward(
                (loss,), (unit,), False, False, (), allow_unreachable=True, accumulate_grad=True
            )
        else:
            (loss / STEPS).backward()

    def run(batches: list[torch.Tensor]) -> None:
        if variant == "holds":
            for _ in range(REPEATS):
                params.now()
        elif variant == "rebuild":
            for _ in range(REPEATS):
                params._work_out()  # (this measurement only: what a miss costs)
        elif variant == "window":
            for batch in batches:
                microstep(batch)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            microstep(batches[0])

    run(tokens[:STEPS])  # the warm-up: the optimizer's state, the autograd graph's buffers
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    gc.disable()
    markers.gradaccum_start()
    run(tokens[STEPS:])
    markers.gradaccum_stop()
    gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    script = Path(__file__)
    counts: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as directory:
        library = instructions.build_markers(Path(directory))
        for variant in ("window", "divided", "engine", "holds", "rebuild"):
            per = REPEATS if variant in ("holds", "rebuild") else 1
            counts[variant] = statistics.median(
                instructions.callgrind(script, [variant, str(library)], per, layout)
                for layout in range(args.layouts)
            )
    tensors = sum(1 for _ in Encoder().parameters())
    window, microstep = counts["window"], counts["divided"]
    saved_engine = counts["divided"] - counts["engine"]
    saved_list = counts["rebuild"] - counts["holds"]
    print(f"torch {torch.__version__}; a 24-layer encoder, {tensors} parameter tensors")
    print(f"hand window ({STEPS} microsteps and the step)  {window:>14,.0f} instructions")
    print(f"one microstep, (loss / {STEPS}).backward()      {microstep:>14,.0f}")
    print(f"one microstep, kept 1/{STEPS} to the engine     {counts['engine']:>14,.0f}")
    print(
        f"  the kept gradient saves {saved_engine:,.0f} a microstep: "
        f"{saved_engine / microstep:.3%} of it (bar: 0.5%)"
    )
    print(f"parameter list read while it holds     {counts['holds']:>14,.0f}")
    print(f"parameter list worked out again        {counts['rebuild']:>14,.0f}")
    print(
        f"  keeping it saves {saved_list:,.0f} a window: {saved_list / window:.3%} of it "
        f"here (bar: 0.5%); per tensor, {saved_list / tensors:,.0f} against the check's "
        f"{counts['holds'] / tensors:,.0f}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
