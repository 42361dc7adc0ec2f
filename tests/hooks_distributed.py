"""What the gloo ranks of tests/test_hooks.py run: the habits of training code around the
loop (save the whole model, deepcopy it, keep an EMA copy, compile it) with and without an
open accumulator, and the watches that must not be fooled (a learnable temperature first
in the optimizer, DDP's bucket rebuild, a no_sync() of the user's own)."""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import warnings
from typing import Any

import torch
from torch import nn

import gradaccum
from tests.distributed import Holder, full_params, rank_batches, wrap
from tests.helpers import make_model, mean_loss

HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


def fingerprint(model: nn.Module) -> list[Any]:
    """What a model is, module by module: its type, its attributes' names, its hooks, and
    the sync flags gradaccum sets."""
    from torch.distributed._composable.replicate import DDP as Replicated  # noqa: N811
    from torch.distributed._composable.replicate import replicate

    found = []
    for module in [model, *model.modules()]:
        hooks = {
            name: [(key, getattr(hook, "__qualname__", repr(hook))) for key, hook in d.items()]
            for name in HOOK_DICTS
            if isinstance(d := getattr(module, name, None), dict)
        }
        flags = [getattr(module, "require_backward_grad_sync", None)]
        if isinstance(module, Replicated):  # the composable replicate(): its own flag
            flags.append(replicate.state(module)._no_sync)  # type: ignore[attr-defined]
        state = getattr(module, "_get_fsdp_state", None)
        if callable(state) and hasattr(module, "set_requires_gradient_sync"):
            groups = getattr(state(), "_fsdp_param_groups", [])
            flags += [(g.reduce_grads, g.all_reduce_grads) for g in groups]
        found.append((type(module).__qualname__, sorted(vars(module)), hooks, flags))
    return found


def habits(model: nn.Module, batch: Any) -> dict[str, Any]:
    """Each habit's outcome on ``model``: what it gave, or the error type it raised."""

    def saved() -> Any:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        return type(torch.load(buffer, weights_only=False)).__qualname__

    def deepcopied() -> Any:
        twin = copy.deepcopy(model)
        with torch.no_grad():
            twin(batch[0])
        mean_loss(twin, batch).backward()  # a copy's forward under grad reaches no accumulator
        return type(twin).__qualname__

    def ema() -> Any:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
        averaged.update_parameters(model)
        with torch.no_grad():
            averaged(batch[0])
        return type(averaged.module).__qualname__

    def state_dict() -> Any:
        return sorted(model.state_dict())

    def compiled() -> Any:
        with torch.no_grad():
            return tuple(torch.compile(model, backend="eager")(batch[0]).shape)

    found: dict[str, Any] = {}
    for name, habit in (
        ("torch.save", saved),
        ("deepcopy", deepcopied),
        ("ema", ema),
        ("state_dict", state_dict),
        ("compile", compiled),
    ):
        try:
            found[name] = habit()
        except Exception as error:  # an illegal habit is an outcome too
            found[name] = f"raised {type(error).__name__}"
    return found


def build(kind: str) -> nn.Module:
    if kind == "compile_ddp_eager":
        return torch.compile(wrap("ddp", make_model()), backend="eager")  # type: ignore[return-value]
    return wrap(kind, make_model())


def habits_around_accumulators(rank: int, world: int, kinds: list[str]) -> dict[str, Any]:
    """For each wrapping: the habits without an accumulator, with one open mid-window, after
    it closed, and with a second open after the first closed; the model's fingerprint
    before and after; and the warnings the accumulators gave (none expected)."""
    results = {}
    batches = rank_batches(rank, [2] * 8)
    for kind in kinds:
        model = build(kind)
        mean_loss(model, batches[0]).backward()
        for param in model.parameters():
            param.grad = None
        seen: dict[str, Any] = {"without": habits(model, batches[0])}
        seen["before"] = fingerprint(model)  # after the habits: torch.compile marks the model
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", gradaccum.GradaccumWarning)
            for phase in ("open", "second open"):
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                acc = gradaccum.Accumulator(model, optimizer, steps=2)
                with acc.microstep(mean_loss(model, batches[0])):
                    pass
                seen[phase] = habits(model, batches[0])
                with acc.microstep(mean_loss(model, batches[1])):
                    pass
                acc.close()
                seen[f"{phase} closed"] = habits(model, batches[0])
        seen["after"] = fingerprint(model)
        seen["warnings"] = [str(w.message) for w in caught]
        results[kind] = seen
    return results


def compilations(rank: int, world: int, kind: str) -> list[int]:
    """Frames dynamo compiled after two windows by hand (deferred, then synced), then after
    each of 3 accumulators in turn, each training one window of the same compiled DDP
    model (``torch.compile(DDP(m))``, or ``DDP(torch.compile(m))``)."""
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel

    if kind == "compile(ddp)":
        model = torch.compile(DistributedDataParallel(make_model()), backend="eager")
    else:
        model = DistributedDataParallel(torch.compile(make_model(), backend="eager"))
    batches = rank_batches(rank, [2] * 2)
    ddp = next(m for m in model.modules() if isinstance(m, DistributedDataParallel))
    for _ in range(2):  # by hand first: DDP's own first iterations compile on their own
        for index, batch in enumerate(batches):
            ddp.require_backward_grad_sync = index == 1
            mean_loss(model, batch).backward()
    ddp.require_backward_grad_sync = True
    counts = [counters["frames"]["total"]]
    for _ in range(3):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with gradaccum.Accumulator(model, optimizer, steps=2) as acc:
            for batch in acc.epoch(batches):
                with acc.microstep(mean_loss(model, batch)):
                    pass
        counts.append(counters["frames"]["total"])
    return counts


def bucket_views(rank: int, world: int, static_graph: bool) -> dict[str, Any]:
    """DDP with ``gradient_as_bucket_view=True`` (and maybe ``static_graph=True``) under
    ``sync="every"``, 3 windows of 4: DDP re-points ``param.grad`` at rebuilt buckets after
    the first all-reducing backward. What was raised or warned, and the parameters."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(
        make_model(), gradient_as_bucket_view=True, static_graph=static_graph
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outcome: dict[str, Any] = {"error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gradaccum.GradaccumWarning)
        try:
            with gradaccum.Accumulator(model, optimizer, steps=4, sync="every") as acc:
                for batch in acc.epoch(rank_batches(rank, [2] * 12)):
                    with acc.microstep(mean_loss(model, batch)):
                        pass
        except gradaccum.GradaccumError as error:
            outcome["error"] = f"{type(error).__name__}: {error}"
    outcome.update(
        warnings=[str(w.message) for w in caught],
        params=full_params(model, "ddp"),
        global_step=acc.global_step,
    )
    return outcome


def own_no_sync(rank: int, world: int, kind: str) -> dict[str, Any]:
    """A hand loop's leftover around the accumulator, off by one: the user's own
    ``no_sync()`` (``set_requires_gradient_sync(False)`` under fully_shard) is on for
    every microbatch but the first of each window, so the boundary's runs inside it.
    The warnings, and the parameters of both ranks (do they still agree?)."""
    model = wrap(kind, make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def leftover(index: int) -> Any:
        if index % 4 == 0:
            return contextlib.nullcontext()
        if kind in ("fully_shard", "replicate"):
            model.set_requires_gradient_sync(False)  # type: ignore[operator]
            return contextlib.nullcontext()
        return model.no_sync()  # type: ignore[operator]

    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gradaccum.GradaccumWarning)
        acc = gradaccum.Accumulator(model, optimizer, steps=4)
        try:
            epoch = acc.epoch(rank_batches(rank, [2] * 8))
            for index, batch in zip(itertools.count(), epoch, strict=False):
                with leftover(index):
                    loss = mean_loss(model, batch)
                    with acc.microstep(loss):
                        pass
        except RuntimeError as failed:  # FSDP1 steps its flat shards with unsharded grads
            error = f"{type(failed).__name__}: {failed}"
        acc.close()
    return {
        "warnings": [str(w.message) for w in caught],
        "error": error,
        "params": None if error else full_params(model, kind),
    }


def forward_hooks(rank: int, world: int) -> dict[str, Any]:
    """The forward hooks an open accumulator puts on a DDP model over several ranks: none
    where the forward runs no collective (no buffers), the guard where it broadcasts
    buffers; and whether two windows ran without a warning, equal on every rank."""
    found: dict[str, Any] = {}
    for name, buffers in (("no buffers", False), ("buffers", True)):
        inner = make_model()
        if buffers:
            inner.register_buffer("running", torch.zeros(1, dtype=torch.float64))
        model = wrap("ddp", inner)
        acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", gradaccum.GradaccumWarning)
            for batch in acc.epoch(rank_batches(rank, [2] * 4)):
                hooks = len(model._forward_hooks) + len(model._forward_pre_hooks)
                with acc.microstep(mean_loss(model, batch)):
                    pass
        acc.close()
        found[name] = {
            "hooks": hooks,
            "after close": len(model._forward_hooks),
            "warnings": [str(w.message) for w in caught],
            "global_step": acc.global_step,
            "params": full_params(model, "ddp"),
        }
    return found


def boundary_zero_grad(rank: int, world: int, kind: str) -> dict[str, Any]:
    """A leftover ``optimizer.zero_grad()`` in the boundary's block, on every rank: the
    error each rank raised leaving the block, whether the optimizer stepped, and whether
    the parameters are still those it started with."""
    model = wrap(kind, make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = full_params(model, kind)
    stepped: list[None] = []
    optimizer.register_step_post_hook(lambda *_: stepped.append(None))
    acc = gradaccum.Accumulator(model, optimizer, steps=2)
    error = None
    try:
        for batch in acc.epoch(rank_batches(rank, [2] * 4)):
            with acc.microstep(mean_loss(model, batch)) as step:
                if step.boundary:
                    optimizer.zero_grad()
    except gradaccum.UsageError as refused:
        error = f"{type(refused).__name__}: {refused}"
    acc.close()
    after = full_params(model, kind)
    return {
        "error": error,
        "stepped": len(stepped),
        "global_step": acc.global_step,
        "unchanged": all(torch.equal(p, q) for p, q in zip(before, after, strict=True)),
    }


def wrapped_after(rank: int, world: int) -> dict[str, Any]:
    """An Accumulator built on a plain model that DDP wraps only afterwards (directly, or
    inside a larger model), and one on a plain model that no DDP wraps (also scripted,
    which takes no hook), each evaluated first under no_grad: the error the first
    training forward raised, the hooks left on the model, and whether it trained."""
    from torch.nn.parallel import DistributedDataParallel

    found: dict[str, Any] = {}
    from torch.distributed._composable.replicate import replicate

    names = ("wrapped after", "inside a wrapped model", "replicated after", "never wrapped")
    for name in (*names, "scripted"):
        model = torch.jit.script(make_model()) if name == "scripted" else make_model()
        before = full_params(model, "plain")
        acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
        hooked = 0 if name == "scripted" else len(model._forward_hooks)
        runs = model
        if name == "wrapped after":
            runs = DistributedDataParallel(model)
        elif name == "inside a wrapped model":
            runs = DistributedDataParallel(Holder(model))
        elif name == "replicated after":  # torchtitan's DDP, in place: the model itself
            replicate(model)
        error = None
        with torch.no_grad():  # an evaluation first, of the model itself: still looked at after
            mean_loss(model, rank_batches(rank, [2])[0])
        try:
            for batch in acc.epoch(rank_batches(rank, [2] * 4)):
                with acc.microstep(mean_loss(runs, batch)):
                    pass
        except gradaccum.UsageError as refused:
            error = str(refused)
        found[name] = {
            "error": error,
            "hooked": hooked,
            "hooks after": 0 if name == "scripted" else len(model._forward_hooks),
            "global_step": acc.global_step,
            "trained": not all(
                torch.equal(p, q) for p, q in zip(before, full_params(model, "plain"), strict=True)
            ),
            "grads": [p.grad is None for p in model.parameters()],
        }
        acc.close()
    return found


def fullgraph_compiled(rank: int, world: int) -> dict[str, str]:
    """A plain model on several ranks (which carries the hook until its first training
    forward), compiled with ``fullgraph=True`` in place before the Accumulator or by
    ``torch.compile`` after it, where the hook is traced into the compiled forward: how
    two windows went."""
    torch._dynamo.reset()
    found = {}
    for how in ("model.compile() before", "torch.compile after"):
        model = make_model()
        if how == "model.compile() before":
            model.compile(backend="eager", fullgraph=True)
        acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
        runs = (
            model
            if how == "model.compile() before"
            else torch.compile(model, backend="eager", fullgraph=True)
        )
        try:
            for batch in acc.epoch(rank_batches(rank, [2] * 4)):
                with acc.microstep(mean_loss(runs, batch)):
                    pass
            found[how] = f"global_step {acc.global_step}"
        except Exception as error:  # (what went wrong is the outcome)
            found[how] = f"{type(error).__name__}: {error}"[:300]
        acc.close()
    return found
