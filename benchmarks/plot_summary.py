"""Draw the Benchmarks page's opening picture from figures already measured and recorded:
docs/images/summary.png.

Three panels. Time against the hand-written loop: gradaccum / hand per microstep, from
the table of ``benchmarks/overhead.py`` on docs/benchmarks.md, and per window under
``fully_shard``, from the hand-loop rows of ``benchmarks/comm.py`` there. DDP per window
at ``steps=8``: a plain loop's all-reduce on every backward (the ``"every"`` policy)
against gradaccum's ``"auto"``, time and all-reduces, from benchmarks/comm.json. The
gradient ``fully_shard`` holds between microsteps under ``"every"`` (the default) and
``"boundary"``, from the same file. Nothing is measured here.

Usage:
    python benchmarks/plot_summary.py --json benchmarks/comm.json --out docs/images/summary.png
"""

from __future__ import annotations

import argparse
import json

from matplotlib.figure import Figure

# docs/benchmarks.md, "Per-microstep overhead": the median of gradaccum / hand per round.
OVERHEAD = {
    "128\nplain": 0.995,
    "128\nclip": 0.986,
    "256\nplain": 0.993,
    "256\nclip": 0.989,
}
# docs/benchmarks.md, "Communication": gradaccum / hand per window under fully_shard.
HAND_FSDP = {"FSDP2\nauto": 0.915, "FSDP2\nbound.": 0.884}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", default="benchmarks/comm.json", help="what comm.py wrote")
    parser.add_argument("--out", default="docs/images/summary.png", help="the picture to write")
    args = parser.parse_args()
    with open(args.json, encoding="utf-8") as file:
        comm = json.load(file)
    ddp, fsdp = comm["DDP"]["rows"], comm["fully_shard"]["rows"]

    figure = Figure(figsize=(11, 3.4))
    ratio, window, held = figure.subplots(1, 3)

    ratios = {**OVERHEAD, **HAND_FSDP}
    drawn = ratio.bar(list(ratios), list(ratios.values()), color="#4c72b0")
    ratio.bar_label(drawn, labels=[f"{v:.2f}" for v in ratios.values()], fontsize=8)
    ratio.axhline(1.0, color="black", linewidth=0.8)
    ratio.set_ylim(0, 1.25)
    ratio.set_title("time, gradaccum / your hand loop (1 = same)", fontsize=10)
    ratio.set_xlabel("microstep of an MLP (width), window of fully_shard", fontsize=8)

    labels = ["plain loop\n(all-reduce\nevery backward)", "gradaccum\nsync='auto'"]
    times = [ddp["every"][0], ddp["auto"][0]]
    reduces = [ddp["every"][1], ddp["auto"][1]]
    drawn = window.bar(labels, times, color=["#999999", "#4c72b0"])
    window.bar_label(
        drawn,
        labels=[f"{t:.0f} ms, {n} all-reduces" for t, n in zip(times, reduces, strict=True)],
        fontsize=8,
    )
    window.margins(y=0.2)
    window.set_ylabel("ms per window", fontsize=8)
    window.set_title("DDP, one window of 8 microsteps", fontsize=10)

    labels = ["fully_shard\nsync='auto'\n(as a plain loop)", "fully_shard\nsync='boundary'"]
    mib = [fsdp["every"][3], fsdp["boundary"][3]]
    drawn = held.bar(labels, mib, color=["#4c72b0", "#dd8452"])
    held.bar_label(drawn, labels=[f"{m:.0f} MiB" for m in mib], fontsize=8)
    held.margins(y=0.2)
    held.set_title("gradient held between microsteps", fontsize=10)

    for axis in (ratio, window, held):
        axis.tick_params(axis="x", labelsize=8)
    figure.suptitle(
        "2 CPU cores, gloo; 25.2 M-parameter MLP on 2 ranks for DDP and fully_shard", fontsize=10
    )
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
