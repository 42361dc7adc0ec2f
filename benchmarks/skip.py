"""What a resume costs before it trains: the samples loaded and the time to the first
trained microbatch, skipping at the index level against drawing and dropping.

    python benchmarks/skip.py
    python benchmarks/skip.py --samples 1000000 --batch 8 --position 124992
    python benchmarks/skip.py --cost-only

What is measured:
    An accumulator (``steps=4``) loads a state saved at microbatch ``--position`` of an
    epoch, and its next ``acc.epoch(...)`` resumes there, over a DataLoader (batches of
    ``--batch``, shuffled, no workers) on a map-style dataset that counts its
    ``__getitem__`` calls. Two iterables over the same loader are resumed:

    * ``index``: the DataLoader itself. The accumulator skips by its batch sampler's
      indices: the skipped batches' indices are drawn, no skipped sample is loaded.
    * ``draw``: a generator over the same DataLoader (what any iterable that is neither a
      DataLoader nor restores its own position gets, and what a DataLoader got before):
      every skipped batch is loaded and collated, then dropped.

    For each: the samples loaded when the first trained microbatch reaches the loop, the
    wall time from the resumed epoch's start to then (``time.perf_counter``), and the
    samples loaded over the whole resumed epoch. Each case runs ``--repeats`` times; the
    report is the median time. Two cases by default: the issue's (batches of 8, resuming
    at microbatch 40 of 48: 320 samples trained already) and the last window of an epoch
    of a million samples.

    Then the cost of the skip itself, per skipped batch: the time to the first trained
    microbatch of the ``index`` resume at microbatch 125,000 of an epoch of 1,000,072
    samples, less the same resume at microbatch 8 (the same loader, the same shuffled
    order drawn), over the 124,992 batches more that it skips; the least of
    ``--repeats`` pairs of runs (the least is what load on a shared machine cannot
    inflate), with ``shuffle=True`` (a RandomSampler) and with a DistributedSampler.
    ``--cost-only`` prints this alone.

How to read it:
    ``index`` loads exactly the samples it trains on; ``draw`` loads ``position * batch``
    more. The ratio column is ``draw / index``, for the samples and the time. The script
    only reports; it never fails on timings (exit status 0).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import gradaccum

STEPS = 4


class Counting(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``n`` samples (a row of 16 features and a target), counting the ones loaded."""

    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=generator)
        self.y = torch.randn(n, 1, generator=generator)
        self.loaded = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loaded += 1
        return self.x[index] * 2.0, self.y[index]


def batches_of(loader: Iterable[Any]) -> Iterator[Any]:
    yield from loader


def resume(data: Counting, batch: int, position: int, kind: str) -> tuple[int, float, int]:
    """Samples loaded at the first trained microbatch, seconds to it, and samples loaded
    over the resumed epoch."""
    model = torch.nn.Linear(16, 1)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=STEPS)
    state = acc.state_dict()
    acc.load_state_dict(dict(state, position=position, global_step=position // STEPS))
    loader = DataLoader(data, batch_size=batch, shuffle=True, generator=torch.Generator())
    data.loaded = 0
    start = time.perf_counter()
    epoch = acc.epoch(loader if kind == "index" else batches_of(loader))
    x, y = next(epoch)
    seconds = time.perf_counter() - start
    first = data.loaded
    with acc.microstep(torch.nn.functional.mse_loss(model(x), y)):
        pass
    for x, y in epoch:
        with acc.microstep(torch.nn.functional.mse_loss(model(x), y)):
            pass
    acc.close()
    return first, seconds, data.loaded


def report(samples: int, batch: int, position: int, repeats: int) -> None:
    data = Counting(samples)
    batches = samples // batch + (samples % batch > 0)
    print(
        f"\n{samples} samples in {batches} batches of {batch}, resumed at microbatch "
        f"{position} ({position * batch} samples trained already), steps={STEPS}"
    )
    print(f"{'':>6} {'loaded at 1st':>14} {'ms to 1st':>10} {'loaded in epoch':>16}")
    rows = {}
    for kind in ("index", "draw"):
        runs = [resume(data, batch, position, kind) for _ in range(repeats)]
        first, total = runs[0][0], runs[0][2]
        seconds = statistics.median(run[1] for run in runs)
        rows[kind] = (first, seconds, total)
        print(f"{kind:>6} {first:>14} {seconds * 1e3:>10.2f} {total:>16}")
    (first_i, sec_i, total_i), (first_d, sec_d, total_d) = rows["index"], rows["draw"]
    print(
        f"{'ratio':>6} {first_d / first_i:>14.1f} {sec_d / sec_i:>10.1f} "
        f"{total_d / total_i:>16.1f}   (draw / index)"
    )


def skip_cost(repeats: int, batches: int = 125_000, batch: int = 8) -> None:
    """Microseconds per skipped batch of the index-level skip (see the module's docstring),
    for a shuffled loader (a RandomSampler, whose indices come from a generator) and one with
    a DistributedSampler (a list of indices)."""
    data = Counting((batches + STEPS * 2) * batch + 8)  # an epoch that goes on after it
    near, far = STEPS * 2, batches
    print(
        f"\nthe skip itself: resumed at microbatch {far} against {near} of {len(data)} samples "
        f"in batches of {batch}, the least of {repeats}"
    )
    for sampler in ("RandomSampler", "DistributedSampler"):
        runs = [
            (resume_first(data, batch, far, sampler), resume_first(data, batch, near, sampler))
            for _ in range(repeats)
        ]
        extra = min(far_s for far_s, _ in runs) - min(near_s for _, near_s in runs)
        print(
            f"{sampler:>18}: +{extra * 1e3:.1f} ms for {far - near} batches more, "
            f"{extra / (far - near) * 1e6:.3f} us per skipped batch"
        )


def resume_first(data: Counting, batch: int, position: int, sampler: str) -> float:
    """Seconds from the resumed epoch's start to its first trained microbatch (index)."""
    model = torch.nn.Linear(16, 1)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=STEPS)
    acc.load_state_dict(dict(acc.state_dict(), position=position, global_step=position // STEPS))
    if sampler == "RandomSampler":
        loader = DataLoader(data, batch_size=batch, shuffle=True, generator=torch.Generator())
    else:
        order = DistributedSampler(data, num_replicas=1, rank=0)
        loader = DataLoader(data, batch_size=batch, sampler=order)
    start = time.perf_counter()
    next(iter(acc.epoch(loader)))
    seconds = time.perf_counter() - start
    acc.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, help="one case of this many samples")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--position", type=int, help="the microbatch the resume starts at")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cost-only", action="store_true", help="only the skip's own cost")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.cost_only:
        skip_cost(max(args.repeats, 7))
        return
    if args.samples is not None:
        batches = args.samples // args.batch
        position = args.position if args.position is not None else batches - batches % STEPS - STEPS
        report(args.samples, args.batch, position, args.repeats)
        return
    report(48 * 8, 8, 40, args.repeats)  # the case
    report(1_000_000, 8, 125_000 - STEPS * 2, args.repeats)  # the last two windows of a million
    skip_cost(max(args.repeats, 7))


if __name__ == "__main__":
    main()
