"""Draw what `benchmarks/comm.py --json PATH` measured: docs/images/comm.png.

Three panels, one bar per wrapping and sync policy: collectives per window, MiB handed to
the reductions per window, and the gradient held between microsteps. DDP holds its full
gradient under every policy, which is what it all-reduces once per synced backward (its
MiB per window under "auto"); fully_shard's is measured (``grads held MiB``).

Usage:
    python benchmarks/comm.py --json benchmarks/comm.json
    python benchmarks/plot_comm.py --json benchmarks/comm.json --out docs/images/comm.png
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from matplotlib.figure import Figure


def bars(tables: dict[str, Any]) -> dict[str, list[float]]:
    """Per bar label: collectives, MiB per window, gradient MiB held."""
    ddp, fsdp = tables["DDP"]["rows"], tables["fully_shard"]["rows"]
    full = ddp["auto"][2]  # the whole gradient: one all-reduce round of it per window
    out = {f"DDP\n{policy}": [row[1], row[2], full] for policy, row in ddp.items()}
    out.update({f"fully_shard\n{policy}": [row[1], row[2], row[3]] for policy, row in fsdp.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", default="benchmarks/comm.json", help="what comm.py wrote")
    parser.add_argument("--out", default="docs/images/comm.png", help="the picture to write")
    args = parser.parse_args()
    with open(args.json, encoding="utf-8") as file:
        data = bars(json.load(file))
    labels = list(data)
    colors = ["#4c72b0" if "DDP" in label else "#dd8452" for label in labels]
    titles = ["collectives per window", "MiB reduced per window", "gradient held (MiB)"]
    figure = Figure(figsize=(11, 3.4))
    axes = figure.subplots(1, 3)
    for column, (axis, title) in enumerate(zip(axes, titles, strict=True)):
        values = [data[label][column] for label in labels]
        drawn = axis.bar(labels, values, color=colors)
        axis.bar_label(drawn, labels=[f"{v:.0f}" for v in values], fontsize=8)
        axis.set_title(title, fontsize=10)
        axis.tick_params(axis="x", labelsize=8)
        axis.margins(y=0.15)
    figure.suptitle("2 gloo ranks, 25.2 M-parameter MLP, steps=8 (benchmarks/comm.py)", fontsize=10)
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
