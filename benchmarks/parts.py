"""What two of gradaccum's hot-path features cost per microstep, in instructions, against
the room that 1.02 of the hand loop leaves over the floor.

What is measured:
    For each one-process cell of `benchmarks/instructions.py` (or those asked for), the
    instructions per microstep of the hand loop, the floor and gradaccum, as there, and
    of gradaccum twice more with one feature taken away:

    * ``no watch``: the ``zero_grad`` watch off (`gradaccum.misuse.GradWatch`: the version
      compare before each backward, the read after it, the watch's start per window);
    * ``no hand-out``: the microsteps run over the list itself instead of ``acc.epoch``
      (the epoch's generator, its plan and its sizing of each window).

    The three gradaccum counts run the same loop (`instructions.gradaccum_block`), so that
    they differ by the feature only.

    A feature's cost is gradaccum's count less the count without it. The room is what
    the target leaves gradaccum over the floor: ``1.02 * hand - floor``. What these two
    features cost, with the rest of gradaccum's own work over the floor, is what a
    library with the same features must fit into that room.

How it is measured:
    As `benchmarks/instructions.py` (callgrind, one process per count, the timed block
    only), each count the median of ``--layouts`` heap layouts (3: the environment
    padded by 0, 1 and 2 kB), because a difference of two counts is as noisy as both
    (about 1,000 instructions a microstep for one layout); needs valgrind and a C
    compiler, not run in CI. Taking a feature away is done on the accumulator's private
    parts, for this measurement only.

Usage:
    python benchmarks/parts.py [--width 4 128] [--mode plain items ...]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import instructions
import torch

VARIANTS = ("hand", "floor", "gradaccum", "no watch", "no hand-out")


def child(variant: str, width: int, mode: str, microsteps: int, library: str) -> None:
    if variant in ("hand", "floor"):
        instructions.child(variant, width, mode, "process", microsteps, library)
        return
    markers = ctypes.CDLL(library)
    torch.set_num_threads(1)
    parts = instructions.build(width, mode, "process")
    batches = instructions.make_batches(microsteps)
    acc = instructions.accumulator(parts, mode, instructions.STEPS)
    if variant == "no watch":  # (the watch never starts: its reads are skipped)
        from gradaccum.misuse import GradWatch

        GradWatch.start = lambda self, *_: None  # type: ignore[method-assign]
    epoch: Any = acc.epoch if variant != "no hand-out" else (lambda data: data)
    instructions.timed(
        markers, lambda data: instructions.gradaccum_block(acc, mode, data, epoch), batches
    )


def count(
    variant: str, width: int, mode: str, microsteps: int, library: Path, layouts: int
) -> float:
    """The median over ``layouts`` heap layouts (`instructions.callgrind`) of one count."""
    child_args = [variant, str(width), mode, str(microsteps), str(library)]
    script = Path(__file__)
    return statistics.median(
        instructions.callgrind(script, child_args, microsteps, layout) for layout in range(layouts)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, nargs="+", default=[4, 128])
    parser.add_argument("--mode", nargs="+", choices=instructions.MODES, default=["plain", "items"])
    parser.add_argument("--microsteps", type=int, default=80)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--layouts", type=int, default=3, help="heap layouts each count is the median of (3)"
    )
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, width, mode, microsteps, library = args.child
        child(variant, int(width), mode, int(microsteps), library)
        return
    cells = [(width, mode) for width in args.width for mode in args.mode]
    with tempfile.TemporaryDirectory() as directory:
        library = instructions.build_markers(Path(directory))
        print(
            f"torch {torch.__version__}; instructions per microstep, one process, steps=4; "
            f"each count the median of {args.layouts} heap layouts"
        )
        print(
            f"{'width':>5} {'mode':7} {'room':>7} {'over floor':>10} {'watch':>7} "
            f"{'hand-out':>8} {'the rest':>8}"
        )
        with ThreadPoolExecutor(args.jobs) as pool:
            counts = {
                (cell, variant): pool.submit(
                    count, variant, *cell, args.microsteps, library, args.layouts
                )
                for cell in cells
                for variant in VARIANTS
            }
            for cell in cells:
                got = {variant: counts[cell, variant].result() for variant in VARIANTS}
                room = instructions.TARGET * got["hand"] - got["floor"]
                over = got["gradaccum"] - got["floor"]
                watch = got["gradaccum"] - got["no watch"]
                hand_out = got["gradaccum"] - got["no hand-out"]
                print(
                    f"{cell[0]:>5} {cell[1]:7} {room:>7,.0f} {over:>10,.0f} {watch:>7,.0f} "
                    f"{hand_out:>8,.0f} {over - watch - hand_out:>8,.0f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
