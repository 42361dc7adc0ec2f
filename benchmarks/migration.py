"""Hugging Face Accelerate's gradient accumulation against gradaccum, measured on one model.

    pip install accelerate            # not a gradaccum dependency; nothing in tests/ imports it
    python benchmarks/migration.py                                   # 1 process
    torchrun --nproc_per_node 2 benchmarks/migration.py              # 2 gloo processes, CPU

This script is not part of CI. It trains the same float64 ``nn.Linear(4, 1)`` on the same
microbatches through Accelerate (``Accelerator(cpu=True, gradient_accumulation_steps=4)``,
its loops written as its docs write them) and through ``gradaccum.Accumulator(steps=4)``,
and compares each run with an independent float64 reference: one big batch per window,
taken with the windows and the learning rates the contract says (one scheduler step per
optimizer step; a partial window is the mean of its own microbatches). Each rank draws
10 microbatches per epoch from Accelerate's prepared DataLoader (8 where a case says so),
and gradaccum gets the same microbatches. Under ``torchrun`` both wrap the model in DDP.

Cases (one row each):

* ``accumulate``: ``with accelerator.accumulate(model)`` around forward, backward,
  ``optimizer.step()``, ``scheduler.step()``, ``optimizer.zero_grad()``; a LambdaLR
  (``0.9 ** k``) prepared with the rest.
* ``gradaccum``: ``acc.epoch`` / ``acc.microstep`` with the same scheduler, with the default
  ``drop_last=True`` and with ``drop_last=False``.
* ``zero_grad first``: both loops with a leftover ``optimizer.zero_grad()`` at the top of
  the loop body (8 microbatches, no scheduler).
* Token-count (item-mean) loss over microbatches of 1-6 valid tokens out of 6, summed loss,
  no scheduler: Accelerate's documented recipe as of v1.9 (prefetch a window, count its
  tokens, ``gather``, ``model.no_sync`` but the last, one ``optimizer.step()`` per window);
  the v1.3-v1.8 recipe (the same inside ``accelerator.accumulate(model)``, with its manual
  ``gradient_state._set_sync_gradients(...)``); that recipe without the manual override
  (what you get by adding the token count to an ``accumulate()`` loop); and
  ``acc.microstep(loss_sum, num_items=...)``.

Columns: optimizer steps per epoch; scheduler steps per optimizer step (the raw scheduler's
``last_epoch`` over the raw optimizer's steps); the optimizer steps taken during the epoch's
last window; the trailing partial window's weight (its applied gradient projected on the
correct mean gradient at the same parameters: 1.0 is right); max |param - reference| after
the epoch. The script only reports (exit status 0).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, TensorDataset

import gradaccum

N = 4  # microbatches per window
ROWS = 2  # rows (sequences) per microbatch
TOKENS = 6  # token slots per sequence
LR = 0.1

Batch = Any


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1).double()


def mean_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def sum_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Squared error summed over the valid tokens (``mask``)."""
    err = (model(batch["x"]).squeeze(-1) - batch["y"]) ** 2
    return (err * batch["mask"]).sum()


def items(batch: Batch) -> torch.Tensor:
    return batch["mask"].sum()


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Sequences of TOKENS slots, of which 1-6 are valid."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, TOKENS, 4, generator=g, dtype=torch.float64)
        self.y = torch.randn(n, TOKENS, generator=g, dtype=torch.float64)
        lengths = torch.randint(1, TOKENS + 1, (n,), generator=g)
        self.mask = (torch.arange(TOKENS)[None, :] < lengths[:, None]).double()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i], "mask": self.mask[i]}


def rows_dataset(n_rows: int) -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n_rows, 4, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.randn(n_rows, 1, generator=g, dtype=torch.float64))


class Recorder:
    """Watches the raw optimizer: which microbatch each real step came after, its gradient
    (and the parameters it was taken at), and the parameters after the epoch."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.params = list(model.parameters())
        self.micro = 0  # microbatches started so far in the epoch (set by the loop)
        self.steps: list[tuple[int, list[torch.Tensor], list[torch.Tensor]]] = []
        optimizer.register_step_pre_hook(self._pre)

    def _pre(self, *_: Any) -> None:
        grads = [p.grad.detach().clone() for p in self.params]  # type: ignore[union-attr]
        self.steps.append((self.micro, grads, [p.detach().clone() for p in self.params]))


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_ranks(local: list[Batch]) -> list[list[Batch]]:
    size = world()[1]
    if size == 1:
        return [local]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, local)
    return out


def reference_grad(
    params: list[torch.Tensor], window: list[Batch], by_items: bool
) -> list[torch.Tensor]:
    """The correct window gradient at ``params``: mean of the microbatch means, or summed
    losses over total items, over every rank's microbatches of the window."""
    model = make_model()
    with torch.no_grad():
        for p, v in zip(model.parameters(), params, strict=True):
            p.copy_(v)
    if by_items:
        loss = sum(sum_loss(model, b) for b in window) / sum(items(b) for b in window)
    else:
        loss = sum(mean_loss(model, b) for b in window) / len(window)
    return list(torch.autograd.grad(loss, list(model.parameters())))


def reference_params(windows: list[list[Batch]], lrs: list[float], by_items: bool) -> torch.Tensor:
    params = [p.detach().clone() for p in make_model().parameters()]
    for window, lr in zip(windows, lrs, strict=True):
        grads = reference_grad(params, window, by_items)
        params = [p - lr * g for p, g in zip(params, grads, strict=True)]
    return torch.cat([p.flatten() for p in params])


def global_windows(local: list[Batch], bounds: list[tuple[int, int]]) -> list[list[Batch]]:
    per_rank = all_ranks(local)
    return [[b for batches in per_rank for b in batches[lo:hi]] for lo, hi in bounds]


def windows_of(n: int, drop_last: bool) -> list[tuple[int, int]]:
    full = [(i, i + N) for i in range(0, n - n % N, N)]
    return full if drop_last or n % N == 0 else [*full, (n - n % N, n)]


def measure(
    name: str,
    rec: Recorder,
    local: list[Batch],
    bounds: list[tuple[int, int]],
    lrs: list[float],
    by_items: bool,
    scheduler_steps: int | None,
    note: str = "",
) -> dict[str, Any]:
    """One row: compares what the run did with the reference for ``bounds``."""
    n = len(local)
    wins = global_windows(local, bounds)
    last_lo = n - (n % N or N)
    in_last = sum(1 for micro, _, _ in rec.steps if micro > last_lo)
    weight = "-"
    if n % N and bounds[-1][1] == n:  # the reference has a partial window: who applied it?
        partial = [s for s in rec.steps if s[0] > last_lo]
        if len(partial) > 1:
            weight = f"split in {len(partial)}"
        elif partial:
            _, grads, params = partial[-1]
            ref = reference_grad(params, wins[-1], by_items)
            dot = sum(float((g * r).sum()) for g, r in zip(grads, ref, strict=True))
            weight = f"{dot / sum(float((r * r).sum()) for r in ref):.3f}"
        else:
            weight = "not applied"
    final = torch.cat([p.detach().flatten() for p in rec.params])
    gap = f"{float((final - reference_params(wins, lrs, by_items)).abs().max()):.1e}"
    full = n // N  # the run's parameters after its first n // N steps, against full windows
    after = torch.cat([p.flatten() for p in rec.steps[full][2]]) if len(rec.steps) > full else final
    full_ref = reference_params(wins[:full], lrs[:full], by_items)
    full_gap = f"{float((after - full_ref).abs().max()):.1e}"
    opt_steps = len(rec.steps)
    if opt_steps < full:  # refused: nothing to compare
        gap = full_gap = "-"
    return {
        "case": name,
        "opt steps": opt_steps,
        "sched/opt": "-" if scheduler_steps is None else f"{scheduler_steps / opt_steps:g}",
        "last-window steps": in_last,
        "partial weight": weight,
        "gap full windows": full_gap,
        "gap epoch": gap,
        "note": note,
    }


# Accelerate runs -------------------------------------------------------------------------


def accelerate_run(
    accelerator: Any,
    loader: DataLoader[Any],
    loop: Callable[[Any, nn.Module, Any, Any, Recorder], None],
    with_scheduler: bool,
) -> tuple[Recorder, int | None, list[Batch]]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    raw_opt = optimizer
    rec = Recorder(model, raw_opt)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.9**k)
    raw_sched = scheduler
    if with_scheduler:
        model, optimizer, scheduler, loader = accelerator.prepare(
            model, optimizer, scheduler, loader
        )
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        scheduler = None
    accelerator.step = 0
    accelerator.gradient_state._set_sync_gradients(True)
    seen: list[Batch] = []
    loop(accelerator, model, optimizer, scheduler, _Seen(loader, rec, seen))
    return rec, (raw_sched.last_epoch if with_scheduler else None), seen


class _Seen:
    """Iterates a loader, recording each microbatch and numbering it for the Recorder."""

    def __init__(self, loader: Any, rec: Recorder, seen: list[Batch]) -> None:
        self.loader, self.rec, self.seen = loader, rec, seen

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.loader:
            self.seen.append(batch)
            self.rec.micro = len(self.seen)
            yield batch


def accelerate_loop(accelerator: Any, model: nn.Module, optimizer: Any, scheduler: Any, data: Any):
    for batch in data:
        with accelerator.accumulate(model):
            loss = mean_loss(model, batch)
            accelerator.backward(loss)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()


def accelerate_zero_grad_first(
    accelerator: Any, model: nn.Module, optimizer: Any, _: Any, data: Any
):
    for batch in data:
        optimizer.zero_grad()  # left over from a plain loop
        with accelerator.accumulate(model):
            accelerator.backward(mean_loss(model, batch))
            optimizer.step()
            optimizer.zero_grad()


def prefetched_windows(data: Any) -> Iterator[list[Batch]]:
    """The docs recipe's prefetch: ceil(n / N) windows, the last of the remainder."""
    iterator = iter(data)
    n = len(data)
    remainder = n % N or N
    total_updates = math.ceil(n / N)
    for update_step in range(total_updates):
        size = N if update_step != total_updates - 1 else remainder
        yield [next(iterator) for _ in range(size)]


def global_items(accelerator: Any, window: list[Batch]) -> torch.Tensor:
    return accelerator.gather(sum(items(b) for b in window)).sum().item()


def recipe_v19(accelerator: Any, model: nn.Module, optimizer: Any, _: Any, data: Any) -> None:
    """Accelerate's docs recipe since v1.9 (usage_guides/gradient_accumulation.md)."""
    for window in prefetched_windows(data):
        num_items = global_items(accelerator, window)
        for i, batch in enumerate(window):
            ctx: Any = contextlib.nullcontext
            if i < len(window) - 1 and accelerator.num_processes > 1:
                ctx = model.no_sync
            with ctx():
                loss = sum_loss(model, batch) * N * accelerator.num_processes / num_items
                accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def recipe_v13(
    accelerator: Any, model: nn.Module, optimizer: Any, _: Any, data: Any, override: bool = True
) -> None:
    """Accelerate's docs recipe in v1.3-v1.8: the same inside accumulate()."""
    total_batched_samples = 0
    for window in prefetched_windows(data):
        num_items = global_items(accelerator, window)
        for batch in window:
            total_batched_samples += 1
            with accelerator.accumulate(model):
                if (
                    override
                ):  # "Since we performed prefetching, we need to manually set sync_gradients"
                    accelerator.gradient_state._set_sync_gradients(total_batched_samples % N == 0)
                loss = sum_loss(model, batch) * N * accelerator.num_processes / num_items
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()


def recipe_accumulate(accelerator: Any, model: nn.Module, optimizer: Any, s: Any, data: Any):
    recipe_v13(accelerator, model, optimizer, s, data, override=False)


# gradaccum runs --------------------------------------------------------------------------


def gradaccum_run(
    batches: list[Batch],
    drop_last: bool,
    with_scheduler: bool,
    by_items: bool = False,
    zero_grad_first: bool = False,
) -> tuple[Recorder, int | None, str]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rec = Recorder(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.9**k)
    wrapped: nn.Module = DistributedDataParallel(model) if world()[1] > 1 else model
    acc = gradaccum.Accumulator(
        wrapped, optimizer, scheduler if with_scheduler else None, steps=N, drop_last=drop_last
    )
    note = ""
    try:
        for i, batch in enumerate(acc.epoch(batches), 1):
            rec.micro = i
            if zero_grad_first:
                optimizer.zero_grad()
            if by_items:
                with acc.microstep(sum_loss(wrapped, batch), num_items=items(batch)):
                    pass
            else:
                with acc.microstep(mean_loss(wrapped, batch)):
                    pass
    except gradaccum.UsageError as e:
        note = f"UsageError at microbatch {rec.micro}: {str(e).split(';')[0]}"
    acc.close()
    return rec, (scheduler.last_epoch if with_scheduler else None), note


def lrs(k: int, scheduled: bool) -> list[float]:
    return [LR * 0.9**t if scheduled else LR for t in range(k)]


def main() -> None:
    from accelerate import Accelerator, __version__

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=N)
    rank, size = world()
    rows: list[dict[str, Any]] = []

    def rows_loader(n: int) -> DataLoader[Any]:
        return DataLoader(rows_dataset(n * ROWS * size), batch_size=ROWS)

    def tokens_loader(n: int) -> DataLoader[Any]:
        return DataLoader(Tokens(n * ROWS * size), batch_size=ROWS)

    # Mean loss, LambdaLR, 10 microbatches per rank: 2 full windows and 2 microbatches.
    rec, sched, seen = accelerate_run(accelerator, rows_loader(10), accelerate_loop, True)
    bounds = windows_of(10, False)
    rows.append(measure("accumulate()", rec, seen, bounds, lrs(len(bounds), True), False, sched))
    for drop_last in (True, False):
        rec, sched, _ = gradaccum_run(seen, drop_last, True)
        bounds = windows_of(10, drop_last)
        rows.append(
            measure(
                f"gradaccum drop_last={drop_last}",
                rec,
                seen,
                bounds,
                lrs(len(bounds), True),
                False,
                sched,
            )
        )

    # A leftover zero_grad() at the top of the loop, 8 microbatches.
    rec, _, seen = accelerate_run(accelerator, rows_loader(8), accelerate_zero_grad_first, False)
    rows.append(
        measure(
            "accumulate(), zero_grad 1st",
            rec,
            seen,
            windows_of(8, True),
            lrs(2, False),
            False,
            None,
        )
    )
    rec, _, note = gradaccum_run(seen, True, False, zero_grad_first=True)
    rows.append(
        measure(
            "gradaccum, zero_grad 1st",
            rec,
            seen,
            windows_of(8, True),
            lrs(2, False),
            False,
            None,
            note,
        )
    )

    # Token-count loss, no scheduler; epochs of 8 (last window full) and 10 microbatches.
    recipes = [
        ("recipe v1.9+", recipe_v19),
        ("recipe v1.3-1.8", recipe_v13),
        ("recipe + accumulate()", recipe_accumulate),
    ]
    for n in (8, 10):
        bounds = windows_of(n, False)
        for name, loop in recipes:
            rec, _, seen = accelerate_run(accelerator, tokens_loader(n), loop, False)
            rows.append(
                measure(f"{name} ({n} mb)", rec, seen, bounds, lrs(len(bounds), False), True, None)
            )
        rec, _, _ = gradaccum_run(seen, False, False, by_items=True)
        rows.append(
            measure(
                f"gradaccum num_items ({n} mb)",
                rec,
                seen,
                bounds,
                lrs(len(bounds), False),
                True,
                None,
            )
        )

    if rank == 0:
        print(
            f"accelerate {__version__}, torch {torch.__version__}, "
            f"gradaccum {gradaccum.__version__}; {size} process(es), steps={N}, "
            f"float64 nn.Linear(4, 1), SGD lr={LR}"
        )
        keys = list(rows[0])[:-1]
        widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
        print("  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)))
        for r in rows:
            print("  ".join(str(r[k]).ljust(w) for k, w in zip(keys, widths, strict=True)).rstrip())
        for r in rows:
            if r["note"]:
                print(f"{r['case']}: {r['note']}")


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
