"""A tiny float64 regression problem and the independent references the tests compare to."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradaccum.testing import expected_windows

Batch = tuple[torch.Tensor, torch.Tensor]


def make_model(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1)).to(dtype)


def make_batches(
    sizes: list[int], seed: int = 1, dtype: torch.dtype = torch.float64
) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, 5, generator=generator, dtype=dtype),
            torch.randn(size, 1, generator=generator, dtype=dtype),
        )
        for size in sizes
    ]


def mean_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    inputs, targets = batch
    return (model(inputs) - targets).square().mean()


def sum_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    inputs, targets = batch
    return (model(inputs) - targets).square().sum()


def concat(window: list[Batch]) -> Batch:
    return torch.cat([x for x, _ in window]), torch.cat([y for _, y in window])


def windows_of(batches: list[Batch], steps: int, drop_last: bool = True) -> list[list[Batch]]:
    """The microbatches of each window, as `expected_windows` cuts the epoch."""
    return [[batches[i] for i in w] for w in expected_windows(len(batches), steps, drop_last)]


def reference_sgd(model: nn.Module, windows: list[list[Batch]], lr: float) -> nn.Module:
    """Plain SGD, one step per window on the window as one big batch (item-mean loss)."""
    twin = copy.deepcopy(model)
    params = list(twin.parameters())
    for window in windows:
        grads = torch.autograd.grad(mean_loss(twin, concat(window)), params)
        with torch.no_grad():
            for param, grad in zip(params, grads, strict=True):
                param -= lr * grad
    return twin


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def sgd(model: nn.Module, lr: float = 0.1) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr)


def save_checkpoint(parts: tuple[Any, ...], *, include_grads: bool = False) -> bytes:
    """``(model, optimizer, scheduler, acc)``'s states, as the guide's checkpoint saves them."""
    model, optimizer, scheduler, acc = parts
    buffer = io.BytesIO()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "acc": acc.state_dict(include_grads=include_grads),
        },
        buffer,
    )
    return buffer.getvalue()


def load_checkpoint(parts: tuple[Any, ...], blob: bytes) -> tuple[Any, ...]:
    """Load `save_checkpoint`'s ``blob`` into fresh ``(model, optimizer, scheduler, acc)``."""
    model, optimizer, scheduler, acc = parts
    state = torch.load(io.BytesIO(blob))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    acc.load_state_dict(state["acc"])
    return parts


def save_parts(parts: tuple[Any, ...], *, include_grads: bool = False) -> tuple[bytes, Any]:
    """``(model, optimizers, schedulers, acc)``'s states (lists of optimizers and
    schedulers, as the several-optimizer `Accumulator` takes them), and the accumulator's."""
    model, optimizers, schedulers, acc = parts
    state = {
        "model": model.state_dict(),
        "optimizers": [optimizer.state_dict() for optimizer in optimizers],
        "schedulers": [scheduler.state_dict() for scheduler in schedulers],
        "acc": acc.state_dict(include_grads=include_grads),
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue(), state["acc"]


def load_parts(parts: tuple[Any, ...], blob: bytes) -> tuple[Any, ...]:
    """Load `save_parts`'s ``blob`` into fresh ``(model, optimizers, schedulers, acc)``."""
    model, optimizers, schedulers, acc = parts
    state = torch.load(io.BytesIO(blob))
    model.load_state_dict(state["model"])
    for optimizer, saved in zip(optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(saved)
    for scheduler, saved in zip(schedulers, state["schedulers"], strict=True):
        scheduler.load_state_dict(saved)
    acc.load_state_dict(state["acc"])
    return parts


def torchrun(
    script: Path, nproc: int, *args: str, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """Launch ``script`` as its docstring does, ``torchrun --nproc_per_node nproc``, on
    loopback; the result's output is text."""
    command = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return subprocess.run(
        [sys.executable, *command, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=os.environ | {"GLOO_SOCKET_IFNAME": "lo"},
    )


def shown_output(page: str, heading: str) -> str:
    """The first ``text`` block after ``heading`` on ``docs/<page>``: output a page shows."""
    text = (Path(__file__).resolve().parent.parent / "docs" / page).read_text(encoding="utf-8")
    return text.split(heading)[1].split("```text\n")[1].split("```")[0]


def split_optimizers(
    model: nn.Module, *, schedulers: bool = True
) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """Two optimizers over ``model``, as a Muon + AdamW split does it, in float64-exact
    form: SGD with momentum on the weights (with a StepLR) and AdamW on the rest (with a
    LambdaLR, or no scheduler). Split by name, not by shape: FSDP1's parameters are flat
    views of their shards."""
    named = list(model.named_parameters())
    matrices = [param for name, param in named if name.endswith("weight")]
    rest = [param for name, param in named if not name.endswith("weight")]
    weights = torch.optim.SGD(matrices, lr=0.1, momentum=0.9)
    others = torch.optim.AdamW(rest, lr=0.01, weight_decay=0.1)
    if not schedulers:
        return [weights, others], [None, None]
    return [weights, others], [
        torch.optim.lr_scheduler.StepLR(weights, step_size=1, gamma=0.8),
        torch.optim.lr_scheduler.LambdaLR(others, lambda k: 1 / (k + 1)),
    ]


def reference_run(
    model: nn.Module,
    windows: list[list[Batch]],
    make_parts: Any,
    *,
    items: bool = False,
    max_grad_norm: float | None = None,
) -> nn.Module:
    """A float64 copy of ``model`` trained one big batch per window with the optimizers and
    schedulers ``make_parts(copy)`` builds: the window's loss is the mean of its
    microbatches' mean losses (equal sizes), or with ``items`` its summed losses over its
    rows; one clip of the total norm over every parameter; every optimizer stepped, then
    every scheduler."""
    twin = copy.deepcopy(model)
    optimizers, schedulers = make_parts(twin)
    for window in windows:
        if items:
            loss = sum(sum_loss(twin, batch) for batch in window) / sum(len(x) for x, _ in window)
        else:
            loss = torch.stack([mean_loss(twin, batch) for batch in window]).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        if max_grad_norm is not None:
            nn.utils.clip_grad_norm_(twin.parameters(), max_grad_norm)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for scheduler in schedulers:
            if scheduler is not None:
                scheduler.step()
    return twin


# acc.step's loss functions, and an out-of-memory error injected into one ----------


def mean_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    """A microbatch's mean loss, as `Accumulator.step` takes it."""
    return mean_loss(model, batch)


def items_fn(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, int]:
    """A microbatch's summed loss and its rows, as `Accumulator.step` takes them."""
    return sum_loss(model, batch), len(batch[0])


POINTS = [
    f"{where}-{phase}" for where in ("first", "middle", "last") for phase in ("forward", "backward")
]
"""Where in a window `oom_at` injects: the first, second or last microbatch's forward or
backward."""


def _raise_oom(*_: object) -> None:
    raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 GiB")


def oom_at(point: str, limit: int, fn: Callable[..., Any] = mean_fn) -> Callable[..., Any]:
    """``fn``, raising torch.OutOfMemoryError at ``point`` (`POINTS`) of every window whose
    microbatches are over ``limit`` rows: in the forward, or from a hook on the model's
    output, at the start of the backward. The microbatch's place in the window is read from
    where its rows start in the batch, a contiguous tensor its pieces are views of."""
    where, phase = point.split("-")

    def loss_fn(model: nn.Module, batch: Batch) -> Any:
        x = batch[0]
        rows, start = len(x), x.storage_offset() // x.stride(0)
        last = start + rows == x.untyped_storage().nbytes() // (x.element_size() * x.stride(0))
        hit = {"first": start == 0, "middle": start == rows and not last, "last": last}[where]
        if not (hit and rows > limit):
            return fn(model, batch)
        if phase == "forward":
            _raise_oom()
        out = model(x)
        out.register_hook(_raise_oom)
        errors = (out - batch[1]).square()
        return (errors.sum(), rows) if fn is items_fn else errors.mean()

    return loss_fn
