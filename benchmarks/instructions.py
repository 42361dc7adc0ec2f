"""Instructions per microstep: gradaccum against the hand-written loop and the floor.

What is measured:
    Machine instructions (valgrind's callgrind) per microstep of one block of
    ``--microsteps`` microbatches (80, steps=4), after an untimed warm-up block, for three
    loops that do the same training on a 2-layer MLP (``--width`` 4 and 128, batches of 32
    rows, SGD with momentum, a LambdaLR):

    * ``hand``: what a careful user writes: forward, ``(loss / steps).backward()`` (a
      summed loss with ``num_items``, divided at the boundary by the window's items), and
      on every 4th microbatch the mode's boundary work, ``optimizer.step()``,
      ``scheduler.step()``, ``zero_grad(set_to_none=True)``; under DDP the flag
      ``require_backward_grad_sync`` set before each forward;
    * ``floor``: `benchmarks/floor.py`, a minimal accumulator with gradaccum's hot-path
      semantics (the loss scaled, the detached loss kept, windows counted, the DDP flag
      armed before the forward) and nothing else;
    * ``gradaccum``: ``for x, y in acc.epoch(data): loss = ...; with acc.microstep(loss):``.

    Modes: ``plain``; ``clip`` (``max_grad_norm=1.0``); ``items`` (summed losses with
    ``num_items``); ``skip`` (``on_nonfinite="skip"``: by hand, the total norm read on the
    host before stepping); ``scaler`` (an enabled ``GradScaler``). Setups: one process,
    and DDP on one gloo rank; there the accumulator's several-ranks path is what is
    measured, as on many ranks: the ``always_call`` forward hook that names a failed rank
    is installed where the model's forward runs a collective
    (`SyncStrategy.forward_communicates`: DDP broadcasting buffers, FSDP), which this
    MLP's does not, so it has no hook, as on many ranks.

How it is measured:
    Each (setup, width, mode, loop) runs in its own process under
    ``valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no``; the process
    turns instrumentation and collection on and off around the timed block with
    callgrind's client requests (a small C library compiled here, from
    ``valgrind/callgrind.h``), so start-up and the warm-up are not counted. Garbage
    collection is off in the block and ``PYTHONHASHSEED=0``: the count is the same from
    run to run, whatever else the machine does, for the same layout of the heap when the
    timed block starts; that layout follows everything that ran before it, down to the
    size of the environment, and moves the count by up to about 0.6% (the C allocator's
    work, an eighth of the count, and more), so each count is the median over
    ``--layouts`` layouts (3: the environment padded by 0, 1 and 2 kB), and the ratio's
    range over them is printed beside it. Needs valgrind and its header (Debian:
    ``apt-get install valgrind``) and a C compiler; not run in CI. A full table takes
    about an hour on two cores.

How to read it:
    ``ratio`` is gradaccum's instructions per microstep over the hand loop's; the target
    is at most 1.03 in every cell, and ``floor`` shows how low a library can go.
    gradaccum back-propagates as the hand loop does (``(loss / steps).backward()``), so
    the ratio is its bookkeeping, like for like.

    ``--tensors 5000`` measures the boundary instead: a model of 5,000 parameter tensors
    (each 16 values), ``steps=1`` so that every microstep is a window, and the ratio is
    then the window's cost over the hand loop's (the target, in every mode and with
    ``--mode clip`` above all: at most 1.001, the boundary O(1) in Python per tensor beyond
    the optimizer's own work).

Usage:
    python benchmarks/instructions.py [--width 4 128] [--mode plain clip ...]
        [--setup process ddp] [--microsteps 80] [--json PATH] [--tensors N]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
STEPS, BATCH, LR = 4, 32, 0.01
MODES = ("plain", "clip", "items", "skip", "scaler")
SETUPS = ("process", "ddp")
LOOPS = ("hand", "floor", "gradaccum")
TARGET = 1.03  # like for like: gradaccum back-propagates as the hand loop does
TENSORS_TARGET = 1.001  # the boundary at --tensors N: at most 0.1% over the hand loop
MARKERS = r"""
#include <valgrind/callgrind.h>
void gradaccum_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void gradaccum_stop(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_STOP_INSTRUMENTATION; }
"""


def build_markers(directory: Path) -> Path:
    """Compile the client requests into a shared library; refuse without the tools."""
    for tool, package in (("valgrind", "valgrind"), ("cc", "gcc")):
        if shutil.which(tool) is None:
            sys.exit(f"instructions.py needs {tool}: apt-get install {package}")
    if not Path("/usr/include/valgrind/callgrind.h").is_file():
        sys.exit("instructions.py needs valgrind/callgrind.h: apt-get install valgrind")
    source, library = directory / "markers.c", directory / "markers.so"
    source.write_text(MARKERS, encoding="utf-8")
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    return library


# The child: one loop, counted --------------------------------------------------------------


class Many(nn.Module):
    """``count`` parameter tensors of 16 values, each scaling the input: a model whose
    boundary is all per-tensor work (the ``tensors`` setup)."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.scales = nn.ParameterList(nn.Parameter(torch.randn(16)) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch.stack(list(self.scales)).sum(0)
        return (x * weight).sum(1, keepdim=True)


def build(width: int, mode: str, setup: str) -> tuple[nn.Module, Any, Any, Any]:
    torch.manual_seed(0)
    model: nn.Module = (
        Many(width)
        if setup == "tensors"
        else nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 1))
    )
    if setup == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        store = dist.FileStore(tempfile.mkstemp()[1], 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if mode == "scaler" else None
    return model, optimizer, scheduler, scaler


def hand_block(parts: tuple[Any, ...], mode: str, batches: list[Any], steps: int) -> None:
    """The hand loop."""
    model, optimizer, scheduler, scaler = parts
    ddp = hasattr(model, "require_backward_grad_sync")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    items = 0
    for index, (x, y) in enumerate(batches):
        boundary = index % steps == steps - 1
        if ddp:
            model.require_backward_grad_sync = boundary
        if mode == "items":
            loss = (model(x) - y).square().sum()
            loss.backward()
            items += len(x)
        else:
            loss = (model(x) - y).square().mean()
            scaled = loss / steps if steps > 1 else loss
            (scaled if scaler is None else scaler.scale(scaled)).backward()
        if not boundary:
            continue
        if mode == "items":
            torch._foreach_mul_([p.grad for p in params], 1 / items)
            items = 0
        if scaler is not None:
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
        else:
            if mode == "clip":
                nn.utils.clip_grad_norm_(params, 1.0)
            finite = True
            if mode == "skip":
                finite = bool(torch.isfinite(nn.utils.get_total_norm([p.grad for p in params])))
            if finite:
                optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def floor_block(floor: Any, mode: str, batches: list[Any]) -> None:
    model = floor.model
    for x, y in batches:
        if mode == "items":
            loss = (model(x) - y).square().sum()
            with floor.microstep(loss, len(x)):
                pass
        else:
            loss = (model(x) - y).square().mean()
            with floor.microstep(loss):
                pass


def gradaccum_block(acc: Any, mode: str, batches: list[Any], epoch: Any = None) -> None:
    """``for x, y in acc.epoch(batches)`` (or ``epoch(batches)``) and a microstep each."""
    # As in the hand loop, ``loss`` holds the microstep's graph until the next forward has
    # built its own: the parameters' gradient accumulators are reused, not rebuilt.
    model, epoch = acc.model, acc.epoch if epoch is None else epoch
    if mode == "items":
        for x, y in epoch(batches):
            loss = (model(x) - y).square().sum()
            with acc.microstep(loss, num_items=len(x)):
                pass
    else:
        for x, y in epoch(batches):
            loss = (model(x) - y).square().mean()
            with acc.microstep(loss):
                pass


def make_batches(microsteps: int) -> list[Any]:
    """The warm-up block's microbatches, then the timed block's: ``microsteps`` each."""
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 16, generator=generator), torch.randn(BATCH, 1, generator=generator))
        for _ in range(2 * microsteps)
    ]


def accumulator(parts: tuple[Any, ...], mode: str, steps: int) -> Any:
    """gradaccum's ``Accumulator`` over ``parts`` (`build`), in ``mode``."""
    import gradaccum

    model, optimizer, scheduler, scaler = parts
    return gradaccum.Accumulator(
        model,
        optimizer,
        scheduler,
        steps=steps,
        max_grad_norm=1.0 if mode == "clip" else None,
        scaler=scaler,
        on_nonfinite="skip" if mode == "skip" else None,
    )


def timed(markers: Any, run: Any, batches: list[Any]) -> None:
    """``run`` over the warm-up half of ``batches``, then over the other half between the
    client requests (``markers``), garbage collection off."""
    half = len(batches) // 2
    run(batches[:half])
    gc.collect()
    gc.disable()
    markers.gradaccum_start()
    run(batches[half:])
    markers.gradaccum_stop()
    gc.enable()


def child(loop: str, width: int, mode: str, setup: str, microsteps: int, library: str) -> None:
    markers = ctypes.CDLL(library)
    steps = 1 if setup == "tensors" else STEPS  # there, every microstep is a boundary
    torch.set_num_threads(1)
    parts = build(width, mode, setup)
    batches = make_batches(microsteps)
    guard = None
    if loop == "hand":
        run: Any = lambda data: hand_block(parts, mode, data, steps)  # noqa: E731
    elif loop == "floor":
        sys.path.insert(0, str(HERE))
        from floor import Floor

        model, optimizer, scheduler, scaler = parts
        floor = Floor(
            model,
            optimizer,
            scheduler,
            steps=steps,
            max_grad_norm=1.0 if mode == "clip" else None,
            scaler=scaler,
            skip_nonfinite=mode == "skip",
        )
        run = lambda data: floor_block(floor, mode, data)  # noqa: E731
    else:
        from gradaccum import hooks

        acc = accumulator(parts, mode, steps)
        started = acc._block
        if setup == "ddp" and started.arming.strategy.forward_communicates:
            # The several-ranks path, as on many ranks: the forward guard where the
            # forward runs a collective (DDP with buffers to broadcast; not this MLP).
            guard = hooks.watch(acc.model, failed=started.forward_failed)
        run = lambda data: gradaccum_block(acc, mode, data)  # noqa: E731
    timed(markers, run, batches)
    if guard is not None:
        guard.remove()


# The parent: every cell --------------------------------------------------------------------


def count(
    loop: str, width: int, mode: str, setup: str, microsteps: int, library: Path, layout: int
) -> float:
    """Instructions per microstep of one cell, from its own process under callgrind."""
    child_args = [loop, str(width), mode, setup, str(microsteps), str(library)]
    return callgrind(Path(__file__), child_args, microsteps, layout)


def callgrind(script: Path, child_args: list[str], microsteps: int, layout: int = 0) -> float:
    """Instructions per microstep of ``script --child *child_args`` under callgrind,
    counted between its client requests.

    ``layout`` pads the child's environment by ``layout`` kB: another layout of its heap
    when the timed block starts, which moves the C allocator's share of the count (a
    count repeats exactly for the same layout)."""
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "callgrind.out"
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--collect-atstart=no",
            f"--callgrind-out-file={out}",
            sys.executable,
            str(script),
            "--child",
            *child_args,
        ]
        env = os.environ | {
            "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": "1",
            "GRADACCUM_LAYOUT": "x" * (1024 * layout),
        }
        subprocess.run(command, check=True, env=env, capture_output=True)
        for line in out.read_text().splitlines():
            if line.startswith("totals:"):  # ("summary:" counts what was not collected)
                return int(line.split()[1]) / microsteps
    msg = f"callgrind wrote no total for {script.name} {' '.join(child_args)}"
    raise RuntimeError(msg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, nargs="+", default=[4, 128])
    parser.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--setup", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--microsteps", type=int, default=80, help="timed block (80)")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--jobs", type=int, default=2, help="cells counted at once (2)")
    parser.add_argument(
        "--layouts", type=int, default=3, help="heap layouts each count is the median of (3)"
    )
    parser.add_argument(
        "--tensors",
        type=int,
        help="instead: the boundary on a model of this many parameter tensors, steps=1",
    )
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        loop, width, mode, setup, microsteps, library = args.child
        child(loop, int(width), mode, setup, int(microsteps), library)
        return
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        library = build_markers(Path(directory))
        print(
            f"torch {torch.__version__}; instructions per microstep, steps={STEPS} "
            f"(1 with --tensors), {BATCH} rows; each count the median of {args.layouts} heap "
            "layouts, and the ratio's range over them"
        )
        header = f"{'setup':8} {'width':>5} {'mode':7} {'hand':>10} {'floor':>10} {'gradaccum':>10}"
        print(f"{header} {'floor/hand':>10} {'ratio':>7} {'range':>13}")
        cells = (
            [("tensors", args.tensors, mode) for mode in args.mode]
            if args.tensors
            else [
                (setup, width, mode)
                for setup in args.setup
                for width in args.width
                for mode in args.mode
            ]
        )
        target = TENSORS_TARGET if args.tensors else TARGET
        with ThreadPoolExecutor(args.jobs) as pool:  # each count is its own process
            counts = {
                (cell, loop, layout): pool.submit(
                    count, loop, *cell[1:], cell[0], args.microsteps, library, layout
                )
                for cell in cells
                for layout in range(args.layouts)
                for loop in LOOPS
            }
            for cell in cells:
                setup, width, mode = cell
                each = {
                    loop: [counts[cell, loop, layout].result() for layout in range(args.layouts)]
                    for loop in LOOPS
                }
                got = {loop: statistics.median(each[loop]) for loop in LOOPS}
                ratio = got["gradaccum"] / got["hand"]
                ratios = [ga / by for ga, by in zip(each["gradaccum"], each["hand"], strict=True)]
                rows.append(
                    {"setup": setup, "width": width, "mode": mode, **got, "ratio": ratio}
                    | {"ratios": ratios, "layouts": each}
                )
                print(
                    f"{setup:8} {width:>5} {mode:7} {got['hand']:>10,.0f} "
                    f"{got['floor']:>10,.0f} {got['gradaccum']:>10,.0f} "
                    f"{got['floor'] / got['hand']:>10.3f} {ratio:>7.4f} "
                    f"{min(ratios):.4f}-{max(ratios):.4f}",
                    flush=True,
                )
    worst = max(row["ratio"] for row in rows)
    print(f"worst ratio {worst:.4f} (target {target}); every cell at or under: {worst <= target}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
