"""What the gloo ranks of the randomized cross test run (a module the ranks can import).

A scenario is plain data drawn by the test process (see tests/test_cross_distributed.py):
``steps``, ``drop_last``, ``sized`` (a list, or a generator without len), ``mode`` ("mean":
mean losses; "int"/"tensor": summed losses with num_items as an int or a 0-dim tensor),
``sizes[epoch][rank]`` (rows of each microbatch), ``seeds[epoch][rank]``, ``step_size`` of
the StepLR, an optional ``change`` of ``steps`` (``epoch``, ``index``, ``when``: "top" of the
loop body of microbatch ``index`` or "after" its block, new ``steps``) and a ``checkpoint``
(``epoch``, ``index``, ``when``: "top", "after" or "between" epochs, ``include_grads``,
``change_first``: at the top of the same microbatch, the change comes before it), and
``optimizers``: 1 (SGD with a StepLR on the whole model) or 2 (that on the weights, and SGD
at ``LR_BIAS`` with a StepLR by ``GAMMA_BIAS`` on the biases). Every rank runs the same
scenarios in the same order, each on its own data.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

import gradaccum
from tests.distributed import full_params, wrap
from tests.helpers import (
    Batch,
    load_parts,
    make_batches,
    make_model,
    mean_loss,
    save_parts,
    sum_loss,
)

Parts = tuple[Any, list[Any], list[Any], gradaccum.Accumulator]
LR_BIAS, GAMMA_BIAS = 0.05, 0.8  # the biases' optimizer and scheduler, with two


def epoch_data(scenario: dict[str, Any], rank: int, epoch: int) -> Iterable[tuple[int, Batch]]:
    """Rank ``rank``'s microbatches of ``epoch``, each with its index: a list, or a generator."""
    batches = make_batches(scenario["sizes"][epoch][rank], seed=scenario["seeds"][epoch][rank])
    pairs = list(enumerate(batches))
    if scenario["sized"]:
        return pairs

    def generator() -> Iterator[tuple[int, Batch]]:
        yield from pairs

    return generator()


def build(scenario: dict[str, Any], steps: int, stepped: list[int]) -> Parts:
    """Fresh DDP model, its optimizers (SGD, lr 0.1, on all of it or on its weights; SGD on
    its biases), their StepLRs and the accumulator; ``stepped[0]`` counts the first
    optimizer's steps."""
    model = wrap("ddp", make_model())
    if scenario.get("optimizers", 1) == 1:
        optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
    else:
        named = list(model.named_parameters())
        optimizers = [
            torch.optim.SGD([p for n, p in named if n.endswith("weight")], lr=0.1),
            torch.optim.SGD([p for n, p in named if n.endswith("bias")], lr=LR_BIAS),
        ]

    def count(*_: object) -> None:
        stepped[0] += 1

    optimizers[0].register_step_post_hook(count)
    schedulers = [
        torch.optim.lr_scheduler.StepLR(optimizer, scenario["step_size"], gamma=gamma)
        for optimizer, gamma in zip(optimizers, (0.5, GAMMA_BIAS), strict=False)
    ]
    several = len(optimizers) > 1
    acc = gradaccum.Accumulator(
        model,
        optimizers if several else optimizers[0],
        schedulers if several else schedulers[0],
        steps=steps,
        drop_last=scenario["drop_last"],
    )
    return model, optimizers, schedulers, acc


def events(
    scenario: dict[str, Any], checkpoint: dict[str, Any] | None, epoch: int, index: int, when: str
) -> list[str]:
    """What happens at the ``when`` ("top"/"after") of microbatch ``index``: "change",
    "checkpoint", in order."""
    here = {"epoch": epoch, "index": index, "when": when}
    change = scenario["change"]
    found = []
    if change is not None and all(change[key] == value for key, value in here.items()):
        found.append("change")
    if checkpoint is not None and all(checkpoint[key] == value for key, value in here.items()):
        if when == "top" and not checkpoint["change_first"]:
            found.insert(0, "checkpoint")
        else:
            found.append("checkpoint")
    return found


def save(parts: Parts, include_grads: bool) -> tuple[bytes, dict[str, Any]]:
    """Every part's state (this rank's), and the accumulator's steps, position, global_step."""
    blob, state = save_parts(parts, include_grads=include_grads)
    return blob, {key: state[key] for key in ("steps", "position", "global_step")}


def act(
    parts: Parts,
    scenario: dict[str, Any],
    checkpoint: dict[str, Any] | None,
    where: tuple[int, int, str],
) -> tuple[bytes, dict[str, Any]] | None:
    """Do what happens at ``where`` (epoch, microbatch, "top"/"after"): the steps change,
    then or before it the checkpoint, whose saved state is returned (the loop stops)."""
    for what in events(scenario, checkpoint, *where):
        if what == "change":
            parts[3].steps = scenario["change"]["steps"]
        else:
            assert checkpoint is not None
            return save(parts, checkpoint["include_grads"])
    return None


def train(
    scenario: dict[str, Any],
    rank: int,
    parts: Parts,
    first_epoch: int,
    checkpoint: dict[str, Any] | None,
) -> tuple[bytes, dict[str, Any]] | None:
    """The scenario's loop from ``first_epoch`` on; stops at ``checkpoint`` (if any) and
    returns what `save` took there (the epoch's generator is closed by the return)."""
    model, _, _, acc = parts
    for epoch in range(first_epoch, len(scenario["sizes"])):
        for index, batch in acc.epoch(epoch_data(scenario, rank, epoch)):
            saved = act(parts, scenario, checkpoint, (epoch, index, "top"))
            if saved is not None:
                return saved
            rows = len(batch[0])
            if scenario["mode"] == "mean":
                loss, items = mean_loss(model, batch), None
            else:
                loss = sum_loss(model, batch)
                items = rows if scenario["mode"] == "int" else torch.tensor(rows)
            with acc.microstep(loss, num_items=items):
                pass
            saved = act(parts, scenario, checkpoint, (epoch, index, "after"))
            if saved is not None:
                return saved
        if checkpoint is not None and (checkpoint["when"], checkpoint["epoch"]) == (
            "between",
            epoch,
        ):
            return save(parts, checkpoint["include_grads"])
    return None


def play(scenario: dict[str, Any], rank: int, interrupted: bool) -> dict[str, Any]:
    """The scenario uninterrupted, or stopped at its checkpoint, every part loaded into
    fresh objects and continued on the same data. What the rank ended with; an exception
    is reported as ``error``, not raised (the ranks fail alike: the next scenario runs)."""
    stepped = [0]
    seen: dict[str, Any] = {"saved": None, "error": None}
    checkpoint = scenario["checkpoint"] if interrupted else None
    parts: Parts | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gradaccum.GradaccumWarning)
        try:
            parts = build(scenario, scenario["steps"], stepped)
            stopped = train(scenario, rank, parts, 0, checkpoint)
            if stopped is not None:
                assert checkpoint is not None
                blob, seen["saved"] = stopped
                parts[3].close()
                parts = load_parts(build(scenario, seen["saved"]["steps"], stepped), blob)
                resume_at = checkpoint["epoch"] + (checkpoint["when"] == "between")
                train(scenario, rank, parts, resume_at, None)
            model, optimizers, _, acc = parts
            acc.close()
            seen.update(
                params=full_params(model, "ddp"),
                global_step=acc.global_step,
                optimizer_steps=stepped[0],
                lr=[optimizer.param_groups[0]["lr"] for optimizer in optimizers],
            )
        except Exception as error:
            seen["error"] = f"{type(error).__name__}: {error}"
            if parts is not None:
                with contextlib.suppress(Exception):
                    parts[3].close()
    seen["warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, gradaccum.GradaccumWarning)
    ]
    return seen


def scenarios(rank: int, world: int, drawn: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every scenario of ``drawn``, uninterrupted then interrupted, on this rank."""
    return [
        {"whole": play(scenario, rank, False), "resumed": play(scenario, rank, True)}
        for scenario in drawn
    ]
