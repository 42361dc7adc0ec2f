"""What the gloo ranks of tests/test_edges_distributed.py run: failing ranks under every
wrapping, and DDP with two forwards in one microstep."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch

import gradaccum
from gradaccum.testing import CollectiveCounter, DDPBucketCounter
from tests.distributed import full_params, rank_batches, wrap
from tests.helpers import make_model, mean_loss


def fail_in_a_block(rank: int, world: int, kind: str, index: int) -> dict[str, Any]:
    """Rank 1 raises in the block of its microbatch ``index`` (steps=4); rank 0 goes on.

    What rank 0 caught (a `RankFailedError`, or the collective's own error with the note
    naming rank 1 when a forward's collective failed), whether its model kept its type
    during and after the accumulator, and what the accumulator says on rank 1 afterwards."""
    model = wrap(kind, make_model())
    found = type(model)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=4)
    batches = rank_batches(rank, [2] * 12)
    outcome: dict[str, Any] = {"same_type_open": type(model) is found}
    try:
        for position, batch in enumerate(acc.epoch(batches)):
            with acc.microstep(mean_loss(model, batch)):
                if rank == 1 and position == index:
                    raise KeyError("rank 1 fails on purpose")
    except gradaccum.RankFailedError as error:
        outcome.update(
            message=str(error), rank=error.rank, window=error.window, applied=error.applied
        )
    except RuntimeError as error:  # a forward's collective: its own error, with the note
        prefix = "gradaccum.RankFailedError: "
        notes = [note for note in getattr(error, "__notes__", ()) if note.startswith(prefix)]
        if not notes:
            raise
        outcome["message"] = notes[0].removeprefix(prefix)
    except KeyError:
        try:  # the failed rank cannot carry on: its windows no longer line up
            acc.microstep(mean_loss(model, batches[0]))
        except gradaccum.UsageError as refused:
            outcome["refused"] = str(refused)
    outcome["global_step"] = acc.global_step
    acc.close()
    outcome["same_type_closed"] = type(model) is found
    return outcome


def two_forwards(rank: int, world: int) -> dict[str, Any]:
    """DDP, steps=2, a loss with a regularizer's second forward: warnings, all-reduces per
    epoch (besides the length agreement), the parameters."""
    model = wrap("ddp", make_model())
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
    counter = CollectiveCounter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gradaccum.GradaccumWarning)
        epoch = iter(acc.epoch(rank_batches(rank, [2] * 8)))
        first = [next(epoch)]  # plans the epoch: the length agreement, not counted
        with counter:
            for inputs, targets in itertools.chain(first, epoch):
                loss = mean_loss(model, (inputs, targets)) + 0.1 * model(inputs).square().mean()
                with acc.microstep(loss):
                    pass
    acc.close()
    return {
        "warnings": [str(w.message) for w in caught],
        "allreduces": counter.counts.all_reduces,
        "params": full_params(model, "ddp"),
        "global_step": acc.global_step,
    }


def fail_then_leave(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Rank 1 raises in the block of its second microbatch (steps=4) and leaves; rank 0
    meets the failure in its next forward's collective (FSDP's all-gather), outside any
    gradaccum call. What rank 0 caught (its type, notes and cause, and as a
    `RankFailedError` its message and fields), and what its accumulator says next."""
    model = wrap(kind, make_model())
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=4)
    batches = rank_batches(rank, [2] * 8)
    outcome: dict[str, Any] = {}
    try:
        for position, batch in enumerate(acc.epoch(batches)):
            loss = mean_loss(model, batch)  # rank 0's third forward is where it fails
            with acc.microstep(loss):
                if rank == 1 and position == 1:
                    raise KeyError("rank 1 fails on purpose")
    except KeyError:
        acc.close()
        return outcome  # rank 1 leaves: its process ends
    except Exception as error:  # the collective's own error type
        outcome.update(
            type=type(error).__name__,
            notes=list(getattr(error, "__notes__", [])),
            rank_failed=isinstance(error, gradaccum.RankFailedError),
            cause=repr(error.__cause__),
            message=str(error),
        )
        if isinstance(error, gradaccum.RankFailedError):
            outcome.update(rank=error.rank, window=error.window, applied=error.applied)
    try:  # a loss without a forward: the collectives are gone
        acc.microstep(torch.zeros((), requires_grad=True))
    except gradaccum.UsageError as refused:
        outcome["refused"] = str(refused)
    acc.close()
    return outcome


def compiled_step(
    model: torch.nn.Module, batches: list[Any], *, steps: int, accumulator: bool
) -> dict[str, Any]:
    """The whole training step compiled (``torch.compile``, backend "eager"): the forward
    and the microstep block in one function, as trainers that compile their step write it;
    or, without ``accumulator``, the hand loop's step compiled the same way (DDP's flag
    set before the forward, loss / steps, clipping at 0.5). AdamW; the parameters after
    the epoch, the optimizer steps, the graphs dynamo compiled, under DDP the buckets it
    all-reduced, and gradaccum's warnings.

    No `CollectiveCounter` runs around it: dynamo runs every frame eagerly while a
    dispatch mode is on (testing.md), and this is what compiles."""
    from torch._dynamo.utils import counters

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ddp = hasattr(model, "require_backward_grad_sync")
    buckets = DDPBucketCounter(model) if ddp else None
    graphs = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if accumulator:
            acc = gradaccum.Accumulator(model, optimizer, steps=steps, max_grad_norm=0.5)

            @torch.compile(backend="eager")
            def step(batch: Any) -> gradaccum.Step:
                with acc.microstep(mean_loss(model, batch)) as done:
                    pass
                return done

            done = [step(batch) for batch in acc.epoch(batches)]
            acc.close()
            stepped = sum(window.boundary for window in done)
        else:

            @torch.compile(backend="eager")
            def hand_step(index: int, batch: Any) -> None:
                boundary = index % steps == steps - 1
                if ddp:
                    model.require_backward_grad_sync = boundary
                (mean_loss(model, batch) / steps).backward()
                if boundary:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                    optimizer.step()
                    optimizer.zero_grad()

            for index, batch in enumerate(batches[: len(batches) // steps * steps]):
                hand_step(index, batch)
            stepped = len(batches) // steps
    return {
        "params": [param.detach().clone() for param in model.parameters()],
        "stepped": stepped,
        "graphs": counters["stats"]["unique_graphs"] - graphs,
        "buckets": None if buckets is None else buckets.buckets,
        "warnings": [str(w.message) for w in caught if "gradaccum" in w.category.__module__],
    }


def compiled_steps(rank: int, world: int) -> dict[str, Any]:
    """`compiled_step` under DDP, by the accumulator and by hand, steps=4."""
    batches = rank_batches(rank, [2] * 13)
    return {
        name: compiled_step(wrap("ddp", make_model()), batches, steps=4, accumulator=use)
        for name, use in (("accumulator", True), ("hand", False))
    }


class Checkpointed(torch.nn.Module):
    """`make_model`'s layers, the last two under reentrant activation checkpointing (what
    DDP's ``static_graph=True`` is most often for; their input requires grad, without
    which reentrant checkpointing computes no gradient for what it holds)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.body[1:], self.body[0](inputs), use_reentrant=True)  # type: ignore[no-any-return]


def static_graph(rank: int, world: int, checkpointed: bool) -> dict[str, Any]:
    """DDP with ``static_graph=True`` under the Accumulator, steps=4 over 8 microbatches:
    per window, the backward passes that all-reduced; the parameters."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(
        Checkpointed() if checkpointed else make_model(), static_graph=True
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = CollectiveCounter(optimizer)
    with counter, gradaccum.Accumulator(model, optimizer, steps=4) as acc:
        for batch in acc.epoch(rank_batches(rank, [2] * 8)):
            with acc.microstep(mean_loss(model, batch)):
                pass
    return {
        "backwards": [window.backwards.get("all_reduce", 0) for window in counter.windows],
        "params": [param.detach().clone() for param in model.parameters()],
    }


def joined(rank: int, world: int) -> dict[str, Any]:
    """DDP's answer to uneven inputs, the loop inside ``with model.join():`` (which the
    Accumulator's length agreement makes unneeded), steps=4 over 8 microbatches: per
    window, the backward passes that all-reduced and the all-reduces outside a backward
    (Join's, in each forward); the parameters."""
    model = wrap("ddp", make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = CollectiveCounter(optimizer)
    with counter, gradaccum.Accumulator(model, optimizer, steps=4) as acc, model.join():
        for batch in acc.epoch(rank_batches(rank, [2] * 8)):
            with acc.microstep(mean_loss(model, batch)):
                pass
    return {
        "backwards": [window.backwards.get("all_reduce", 0) for window in counter.windows],
        "all_reduces": [window.collectives.get("all_reduce", 0) for window in counter.windows],
        "params": [param.detach().clone() for param in model.parameters()],
    }
