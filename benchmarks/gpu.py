"""gradaccum on one GPU: window time, peak memory and host syncs against the hand loop.

What is measured:
    A GPT-2-small-shaped causal language model built in code (12 layers, 768 wide, 12
    heads, 1024 positions, a vocabulary of 50257 with the output layer tied to the
    embedding: 124 M parameters; random weights, nothing downloaded), trained on
    microbatches of 4 sequences of random tokens whose lengths vary from 256 to 1024
    (padded to 1024, the padding's labels ignored), with bf16 autocast, fused AdamW, a
    ``LambdaLR`` warm-up, ``max_grad_norm=1.0`` and ``steps=8``. Each microbatch's loss
    is the sum over its tokens and ``num_items`` its token count, a Python int known
    when the batch is made, so the window's gradient is the token mean whatever the
    lengths. Two loops do the same training on twin models (the same initial weights,
    the same data in the same order):

    * ``hand``: what a careful user writes by hand. For each microbatch: the forward
      under autocast, ``loss.backward()``, the detached loss kept (to log the window's
      loss) and the tokens counted; on the 8th, the gradients multiplied by ``1 /
      tokens`` (``torch._foreach_mul_``), ``clip_grad_norm_(params, 1.0)``,
      ``optimizer.step()``, ``scheduler.step()``, ``zero_grad(set_to_none=True)``;
    * ``gradaccum``: ``for ids, labels, n in acc.epoch(window): loss = model(ids,
      labels); with acc.microstep(loss, num_items=n): pass``, with ``acc =
      Accumulator(model, optimizer, scheduler, steps=8, max_grad_norm=1.0)``.

    Both rows, ``eager`` and ``compile`` (both twins wrapped in ``torch.compile`` with its
    defaults, the loss computed inside the compiled forward), report:

    * the window time of each loop and the ratio gradaccum / hand (target: at most 1.01);
    * the peak memory of each loop's window (``torch.cuda.max_memory_allocated`` after
      ``torch.cuda.reset_peak_memory_stats()``), which should be equal, to the byte;
    * host syncs: one window of each loop under ``torch.cuda.set_sync_debug_mode("warn")``,
      its warnings counted on the 7 microsteps before the boundary and on the boundary
      microstep (its forward, backward and update); then one gradaccum window with the
      7 non-boundary microsteps under ``"error"``, which raises on the first synchronizing
      call. With these options nothing needs the host: ``num_items`` as Python ints, the
      clipping (the norm stays a device tensor) and fused AdamW (its step counts live on
      the GPU) all run without a sync, so every count should be 0. A sync both loops have
      comes from the model or torch, not from gradaccum;
    * the largest parameter difference between the twins after the timed windows:
      informative only, since a GPU kernel whose reduction order varies from run to run
      (attention's backward) can make it non-zero. That both loops do the same
      arithmetic is tested on the CPU, where it is 0.0 (tests/test_benchmarks_gpu.py).

How it is measured:
    After ``--warmup`` untimed rounds (the first compiles, under ``torch.compile``), each
    of ``--rounds`` rounds runs one window of each loop, the order alternating from round
    to round, each between ``torch.cuda.synchronize()`` calls and timed with
    ``time.perf_counter_ns``, so a window's time is all of it: the host's work, the
    launches and the kernels, with an empty queue at its start. Garbage collection runs
    before each window, outside it. The ratio is the median of the per-round ratios
    gradaccum / hand, with their 10th and 90th percentiles for the spread.

The script only reports; it never fails on a figure (exit status 0). Without CUDA it says
so and exits 0. A row that fails (``torch.compile`` unavailable, or failing on this
machine) is reported with its error and the next row runs. ``--device cpu`` runs the same
loops on the CPU, in float32 without autocast and without the memory and sync checks: a
check of the script itself, not a figure for the GPU claim.

Usage:
    python benchmarks/gpu.py [--quick] [--modes eager compile] [--rounds 12]
        [--warmup 3] [--json PATH] [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812  # the usual PyTorch alias
from torch.optim.lr_scheduler import LambdaLR

import gradaccum

STEPS = 8
MAX_GRAD_NORM = 1.0
TARGET = 1.01
LR = 6e-4
WARMUP_STEPS = 10  # the LambdaLR's linear warm-up, in optimizer steps
DISTINCT_WINDOWS = 4  # windows of data, cycled: both loops see the same ones in order
MODES = ("eager", "compile")
SYNC_WORD = "synchroniz"  # in the message of every sync that sync debug mode reports
TORCH_DIR = str(Path(torch.__file__).resolve().parent)

Microbatch = tuple[torch.Tensor, torch.Tensor, int]  # token ids, labels, tokens counted
OnMicrostep = Callable[[int], None]


@dataclass(frozen=True)
class Shape:
    """The model's and the microbatch's sizes.

    Attributes:
        layers: Transformer blocks.
        width: The residual stream's width.
        heads: Attention heads per block.
        context: Positions, and the padded length of every sequence.
        vocab: Vocabulary size.
        batch: Sequences per microbatch.
    """

    layers: int
    width: int
    heads: int
    context: int
    vocab: int
    batch: int

    def describe(self) -> str:
        """The shape in words."""
        return (
            f"{self.layers} layers x {self.width} wide, {self.heads} heads, "
            f"{self.context} positions, vocabulary {self.vocab}"
        )


GPT2_SMALL = Shape(layers=12, width=768, heads=12, context=1024, vocab=50257, batch=4)
QUICK = Shape(layers=4, width=256, heads=4, context=256, vocab=8192, batch=4)


# The model ---------------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        split = (b, t, self.heads, c // self.heads)
        q = q.view(split).transpose(1, 2)
        k = k.view(split).transpose(1, 2)
        v = v.view(split).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """A GPT-2-shaped language model whose forward returns the summed token loss.

    Positions whose label is ``-100`` (the padding) are left out of the sum. The output
    layer shares the embedding's weight, as GPT-2's does.
    """

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.wte = nn.Embedding(shape.vocab, shape.width)
        self.wpe = nn.Embedding(shape.context, shape.width)
        self.blocks = nn.ModuleList(Block(shape.width, shape.heads) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.width)
        self.head = nn.Linear(shape.width, shape.vocab, bias=False)
        self.head.weight = self.wte.weight
        self.register_buffer("positions", torch.arange(shape.context), persistent=False)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif name.endswith(("proj.weight", "out.weight")):  # GPT-2's: residual outputs
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * shape.layers))
            elif param.dim() > 1:
                nn.init.normal_(param, std=0.02)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions: torch.Tensor = self.positions
        x = self.wte(ids) + self.wpe(positions[: ids.shape[1]])
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
        )


def build_model(shape: Shape, seed: int = 0) -> GPT:
    """The model with seeded random weights, in float32 on the CPU."""
    torch.manual_seed(seed)
    return GPT(shape)


def make_windows(
    shape: Shape,
    device: torch.device,
    count: int = DISTINCT_WINDOWS,
    steps: int = STEPS,
    seed: int = 1,
) -> list[list[Microbatch]]:
    """``count`` windows of ``steps`` microbatches: random tokens in sequences of random
    lengths from a quarter of the context to all of it, padded to the context.

    Each microbatch is ``(ids, labels, tokens)``: labels are the next token, ``-100`` past
    a sequence's end; ``tokens`` counts the labels that are not, a Python int.
    """
    generator = torch.Generator().manual_seed(seed)
    windows = []
    for _ in range(count):
        window = []
        for _ in range(steps):
            tokens = torch.randint(
                shape.vocab, (shape.batch, shape.context + 1), generator=generator
            )
            lengths = torch.randint(
                shape.context // 4, shape.context + 1, (shape.batch,), generator=generator
            )
            ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
            past = torch.arange(shape.context)[None, :] >= lengths[:, None]
            ids[past] = 0
            labels[past] = -100
            counted = int((labels != -100).sum())
            window.append((ids.to(device), labels.to(device), counted))
        windows.append(window)
    return windows


def autocast_for(device: torch.device) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """bf16 autocast on a GPU; nothing on the CPU (a check of the script, in float32)."""
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


# The two loops -----------------------------------------------------------------------------


def _warmup(step: int) -> float:
    """The LambdaLR factor: a linear warm-up over `WARMUP_STEPS` optimizer steps."""
    return min(1.0, (step + 1) / WARMUP_STEPS)


@dataclass
class Twin:
    """One side's model, optimizer and scheduler, and the accumulator on the gradaccum side.

    Attributes:
        module: The model itself (its parameters, for the optimizer and the hand loop).
        model: What the loop calls: ``module``, or ``torch.compile(module)``.
        optimizer: Fused AdamW (where the device has it).
        scheduler: A `LambdaLR` warm-up.
        params: ``list(module.parameters())``, made once, as a careful hand loop does.
        acc: The accumulator (gradaccum's side only).
    """

    module: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    params: list[torch.Tensor]
    acc: gradaccum.Accumulator | None = None


def make_twin(
    base: nn.Module,
    device: torch.device,
    *,
    use_gradaccum: bool,
    compiled: bool = False,
    steps: int = STEPS,
    fused: bool = True,
) -> Twin:
    """A copy of ``base`` on ``device`` with its own optimizer and scheduler (and accumulator)."""
    module = copy.deepcopy(base).to(device)
    model: nn.Module = torch.compile(module) if compiled else module  # type: ignore[assignment]
    optimizer = torch.optim.AdamW(
        module.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=fused
    )
    scheduler = LambdaLR(optimizer, _warmup)
    twin = Twin(module, model, optimizer, scheduler, list(module.parameters()))
    if use_gradaccum:
        twin.acc = gradaccum.Accumulator(
            model, optimizer, scheduler, steps=steps, max_grad_norm=MAX_GRAD_NORM
        )
    return twin


def hand_window(
    twin: Twin,
    window: Sequence[Microbatch],
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    on_microstep: OnMicrostep | None = None,
) -> list[torch.Tensor]:
    """One window of the hand-written loop; returns the microbatches' detached losses.

    ``on_microstep(index)``, when given, runs before each microbatch's forward.
    """
    model, optimizer, scheduler, params = twin.model, twin.optimizer, twin.scheduler, twin.params
    losses = []
    tokens = 0
    for index, (ids, labels, counted) in enumerate(window):
        if on_microstep is not None:
            on_microstep(index)
        with autocast():
            loss = model(ids, labels)
        loss.backward()
        losses.append(loss.detach())
        tokens += counted
    torch._foreach_mul_([p.grad for p in params if p.grad is not None], 1 / tokens)
    nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return losses


def gradaccum_window(
    twin: Twin,
    window: Sequence[Microbatch],
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    on_microstep: OnMicrostep | None = None,
) -> gradaccum.Step | None:
    """One window of the gradaccum loop (one epoch of ``window``); returns its boundary
    `gradaccum.Step`.

    ``on_microstep(index)``, when given, runs before each microbatch's forward.
    """
    acc, model = twin.acc, twin.model
    assert acc is not None
    boundary = None
    for index, (ids, labels, counted) in enumerate(acc.epoch(window)):
        if on_microstep is not None:
            on_microstep(index)
        with autocast():
            loss = model(ids, labels)
        with acc.microstep(loss, num_items=counted) as step:
            if step.boundary:
                boundary = step
    return boundary


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between corresponding parameters."""
    with torch.no_grad():
        return max(
            (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
        )


# Syncs -------------------------------------------------------------------------------------


@dataclass
class Syncs:
    """The host syncs torch's sync debug mode reported in one window of one loop.

    Attributes:
        microsteps: On the microsteps before the boundary (forward and backward).
        boundary: On the boundary microstep: its forward, backward and the update.
        where: The first few distinct reports, with the Python line they came from.
    """

    microsteps: int = 0
    boundary: int = 0
    where: list[str] = field(default_factory=list)


@contextlib.contextmanager
def sync_debug_mode(mode: str) -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode(mode)`` inside, ``"default"`` after."""
    torch.cuda.synchronize()  # (itself a sync: before the mode is set)
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def count_syncs(run: Callable[[OnMicrostep], object], steps: int = STEPS) -> Syncs:
    """Run one window under sync debug mode ``"warn"`` and count its warnings per part."""
    boundary_starts = [0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def on_microstep(index: int) -> None:
            if index == steps - 1:
                boundary_starts[0] = len(caught)

        with sync_debug_mode("warn"):
            run(on_microstep)
    syncs = Syncs()
    for index, warning in enumerate(caught):
        text = str(warning.message)
        if SYNC_WORD not in text:
            continue
        if index < boundary_starts[0]:
            syncs.microsteps += 1
        else:
            syncs.boundary += 1
        where = f"{text.splitlines()[0][:80]} ({Path(warning.filename).name}:{warning.lineno})"
        if where not in syncs.where and len(syncs.where) < 5:
            syncs.where.append(where)
    return syncs


def first_sync_off_the_boundary(
    run: Callable[[OnMicrostep], object], steps: int = STEPS
) -> str | None:
    """Run one window with its non-boundary microsteps under sync debug mode ``"error"``;
    return where the first sync raised, or None when none did."""

    def on_microstep(index: int) -> None:
        torch.cuda.set_sync_debug_mode("error" if index < steps - 1 else "default")

    torch.cuda.synchronize()
    try:
        run(on_microstep)
    except RuntimeError as error:
        if SYNC_WORD not in str(error):
            raise
        frames = traceback.extract_tb(error.__traceback__)
        outside = [f for f in frames if not f.filename.startswith(TORCH_DIR)] or frames
        last = outside[-1]
        return f"{str(error).splitlines()[0][:80]} ({Path(last.filename).name}:{last.lineno})"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return None


# One row -----------------------------------------------------------------------------------


def _quantiles(values: Sequence[float]) -> tuple[float, float, float]:
    """The 10th percentile, median and 90th percentile of ``values`` (at least 2)."""
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return deciles[0], statistics.median(values), deciles[-1]


def _timed(run: Callable[[], object], device: torch.device) -> tuple[float, tuple[int, int] | None]:
    """Run ``run`` once between syncs: its wall time in ms, and on a GPU its peak memory:
    allocated (the allocator's blocks) and requested (the tensors' own bytes, whatever
    blocks the allocator's cache had to hand)."""
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter_ns()
    run()
    if cuda:
        torch.cuda.synchronize()
    elapsed = (time.perf_counter_ns() - start) / 1e6
    if not cuda:
        return elapsed, None
    requested = torch.cuda.memory_stats().get("requested_bytes.all.peak", -1)
    return elapsed, (torch.cuda.max_memory_allocated(), requested)


def measure(
    shape: Shape, mode: str, device: torch.device, *, rounds: int, warmup: int
) -> dict[str, Any]:
    """One row: the warm-up, the interleaved timed rounds, the param difference, the syncs.

    Args:
        shape: The model's and microbatch's sizes.
        mode: ``"eager"`` or ``"compile"``.
        device: Where to run.
        rounds: Timed rounds, one window of each loop each (at least 2).
        warmup: Untimed rounds before them.

    Returns:
        The row, as `main` prints it and writes it to JSON.
    """
    started = time.perf_counter()
    base = build_model(shape)
    hand = make_twin(base, device, use_gradaccum=False, compiled=mode == "compile")
    ours = make_twin(base, device, use_gradaccum=True, compiled=mode == "compile")
    del base
    windows = make_windows(shape, device)
    autocast = autocast_for(device)
    served = [0, 0]  # windows run by each side: both train on windows[served % len] in turn

    def run_hand(on_microstep: OnMicrostep | None = None) -> None:
        hand_window(hand, windows[served[0] % len(windows)], autocast, on_microstep)
        served[0] += 1

    def run_ours(on_microstep: OnMicrostep | None = None) -> None:
        gradaccum_window(ours, windows[served[1] % len(windows)], autocast, on_microstep)
        served[1] += 1

    try:
        for _ in range(warmup):
            run_hand()
            run_ours()
        compiled_s = time.perf_counter() - started
        gc.collect()
        gc.freeze()  # keep the collections before each window quick
        times: dict[str, list[float]] = {"hand": [], "gradaccum": []}
        peaks: dict[str, list[tuple[int, int]]] = {"hand": [], "gradaccum": []}
        for index in range(rounds):
            order = [("hand", run_hand), ("gradaccum", run_ours)]
            for side, run in order if index % 2 == 0 else order[::-1]:
                elapsed, peak = _timed(run, device)
                times[side].append(elapsed)
                if peak is not None:
                    peaks[side].append(peak)
        row: dict[str, Any] = {"mode": mode, "error": None}
        ratios = [a / h for a, h in zip(times["gradaccum"], times["hand"], strict=True)]
        p10, median, p90 = _quantiles(ratios)
        row |= {
            "hand_ms": statistics.median(times["hand"]),
            "gradaccum_ms": statistics.median(times["gradaccum"]),
            "ratio_p10": p10,
            "ratio_median": median,
            "ratio_p90": p90,
            "within_target": median <= TARGET,
            "rounds": rounds,
            "warmup_rounds": warmup,
            "warmup_s": round(compiled_s, 1),
        }
        if peaks["hand"]:
            hand_peak, ours_peak = max(peaks["hand"]), max(peaks["gradaccum"])
            row |= {
                "peak_hand_bytes": hand_peak[0],
                "peak_gradaccum_bytes": ours_peak[0],
                "peak_equal": hand_peak[0] == ours_peak[0],
                "peak_requested_hand_bytes": hand_peak[1],
                "peak_requested_gradaccum_bytes": ours_peak[1],
            }
        row["max_param_diff"] = max_param_diff(hand.module, ours.module)
        if device.type == "cuda":
            row["syncs_hand"] = asdict(count_syncs(run_hand))
            row["syncs_gradaccum"] = asdict(count_syncs(run_ours))
            # Last: a raise leaves this twin's window broken off.
            row["error_mode_off_boundary"] = first_sync_off_the_boundary(run_ours)
        row["seconds"] = round(time.perf_counter() - started, 1)
        return row
    finally:
        gc.unfreeze()
        assert ours.acc is not None
        ours.acc.close()


# Reporting ---------------------------------------------------------------------------------


def _setup(shape: Shape, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """What the rows were measured on."""
    with torch.device("meta"):  # counted without the memory or the random draws
        params = sum(p.numel() for p in GPT(shape).parameters())
    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name()
        if cuda
        else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "gradaccum": gradaccum.__version__,
        "python": platform.python_version(),
        "model": f"GPT ({shape.describe()}), {params / 1e6:.1f} M parameters",
        "microbatch": (
            f"{shape.batch} x {shape.context} tokens "
            f"(lengths {shape.context // 4} to {shape.context})"
        ),
        "steps": STEPS,
        "precision": "bf16 autocast" if cuda else "float32",
        "optimizer": (
            f"AdamW(lr={LR}, fused=True) + LambdaLR warm-up, "
            f"max_grad_norm={MAX_GRAD_NORM}, num_items"
        ),
        "rounds": args.rounds,
        "warmup_rounds": args.warmup,
        "target": TARGET,
    }


def _syncs_cell(row: dict[str, Any], part: str) -> str:
    return (
        f"{row['syncs_hand'][part]} / {row['syncs_gradaccum'][part]}"
        if "syncs_hand" in row
        else "n/a"
    )


def print_row(row: dict[str, Any]) -> None:
    """One row of the table, as soon as it is measured."""
    if row["error"] is not None:
        print(f"{row['mode']:<8} failed: {row['error']}", flush=True)
        return
    mib = 2**20
    peaks = (
        f"{row['peak_hand_bytes'] / mib:>9.1f} {row['peak_gradaccum_bytes'] / mib:>9.1f} "
        f"{row['peak_gradaccum_bytes'] - row['peak_hand_bytes']:>+8d}"
        if "peak_hand_bytes" in row
        else f"{'n/a':>9} {'n/a':>9} {'n/a':>8}"
    )
    strict = row.get("error_mode_off_boundary", "n/a")
    strict = "none raised" if strict is None else strict if strict == "n/a" else "raised"
    print(
        f"{row['mode']:<8}{row['hand_ms']:>9.2f}{row['gradaccum_ms']:>10.2f}"
        f"{row['ratio_p10']:>7.3f}{row['ratio_median']:>7.3f}{row['ratio_p90']:>7.3f} {peaks}"
        f"{_syncs_cell(row, 'microsteps'):>11}{_syncs_cell(row, 'boundary'):>10}"
        f"  {strict:<12}{row['max_param_diff']:>10.1e}",
        flush=True,
    )


HEADER = (
    f"{'mode':<8}{'hand ms':>9}{'gradaccum':>10}{'p10':>7}{'median':>7}{'p90':>7} "
    f"{'peak MiB':>9} {'peak MiB':>9} {'Δpeak B':>8}{'syncs off':>11}{'boundary':>10}"
    f"  {'error mode':<12}{'max|Δparam|':>10}"
)
SUBHEADER = (
    f"{'':<8}{'window':>9}{'ms':>10}{'ratio gradaccum / hand':>21} "
    f"{'hand':>9} {'gradaccum':>9} {'':>8}{'hand / ga':>11}{'hand / ga':>10}"
)


def summarize(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The verdicts, one line per row and check."""
    lines = []
    for row in rows:
        mode = row["mode"]
        if row["error"] is not None:
            lines.append(f"{mode}: not measured ({row['error']})")
            continue
        verdict = "within target" if row["within_target"] else "over target"
        lines.append(
            f"{mode}: window time ratio {row['ratio_median']:.3f} (target <= {TARGET}): {verdict}"
        )
        if "peak_equal" in row:
            same = "equal" if row["peak_equal"] else "NOT equal"
            hand, ours = row["peak_requested_hand_bytes"], row["peak_requested_gradaccum_bytes"]
            lines.append(
                f"{mode}: peak memory allocated {same} to the hand loop's "
                f"({row['peak_gradaccum_bytes']:,} and {row['peak_hand_bytes']:,} bytes); "
                f"peak requested {ours:,} and {hand:,} bytes"
            )
        if "syncs_gradaccum" in row:
            ours, hand = row["syncs_gradaccum"], row["syncs_hand"]
            strict = row["error_mode_off_boundary"]
            lines.append(
                f"{mode}: host syncs off the boundary: {ours['microsteps']} (hand loop "
                f"{hand['microsteps']}); sync debug mode 'error' there: "
                f"{'none raised' if strict is None else 'raised: ' + strict}; at the "
                f"boundary: {ours['boundary']} (hand loop {hand['boundary']}; these options "
                "need none)"
            )
            for where in ours["where"]:
                lines.append(f"{mode}:   gradaccum window: {where}")
            for where in hand["where"]:
                lines.append(f"{mode}:   hand window: {where}")
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true", help="a smaller model and fewer rounds, for a first look"
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--rounds", type=int, help="timed rounds (12; 4 with --quick)")
    parser.add_argument("--warmup", type=int, help="untimed rounds first (3; 2 with --quick)")
    parser.add_argument("--json", type=Path, help="also write the setup and rows to this file")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a check of the script"
    )
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 4 if args.quick else 12
    if args.warmup is None:
        args.warmup = 2 if args.quick else 3
    if args.rounds < 2 or args.warmup < 1:
        parser.error(
            "--rounds must be at least 2 and --warmup at least 1, "
            f"got {args.rounds} and {args.warmup}"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Measure each mode, printing its row as it comes, then the verdicts.

    Returns:
        The exit status: 0, figures are reported, never asserted on.
    """
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"benchmarks/gpu.py needs a CUDA GPU, and torch.cuda.is_available() is False "
            f"here (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
            "nothing was measured"
        )
        return 0
    shape = QUICK if args.quick else GPT2_SMALL
    setup = _setup(shape, device, args)
    print(
        f"gradaccum {setup['gradaccum']} on {setup['device']}: torch {setup['torch']}"
        f"{' (CUDA ' + str(setup['cuda']) + ')' if setup['cuda'] else ''}, Python {setup['python']}"
    )
    print(
        f"{setup['model']}; microbatches of {setup['microbatch']}, steps={STEPS}, "
        f"{setup['precision']}, {setup['optimizer']}"
    )
    print(
        f"{args.rounds} rounds (+{args.warmup} warm-up) of one window per loop, interleaved; "
        "window time between synchronizes"
    )
    print(HEADER)
    print(SUBHEADER)
    rows: list[dict[str, Any]] = []
    for mode in args.modes:
        try:
            row = measure(shape, mode, device, rounds=args.rounds, warmup=args.warmup)
        except Exception as error:  # a row that fails is reported; the next one runs
            traceback.print_exc()
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            row = {"mode": mode, "error": f"{type(error).__name__}: {first[:200]}"}
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
            if mode == "compile" and "torch._dynamo" in sys.modules:  # (compile ran)
                with contextlib.suppress(Exception):
                    torch.compiler.reset()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print_row(row)
        if args.json:  # after every row, so a run cut short keeps what it measured
            args.json.write_text(
                json.dumps({"setup": setup, "rows": rows}, indent=2), encoding="utf-8"
            )
    print()
    for line in summarize(rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
