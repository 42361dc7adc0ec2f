"""What a trainer's optimizers held at each ``optimizer.step()``: the hyperparameters of
every param group and the full (unsharded) gradient of their parameters, read by a step
pre-hook, so that the reference can step as the trainer did and be compared with what
each step saw; the precision its model's forwards computed in: the autocast they ran
under (a forward pre-hook), or the dtypes their autograd graph carries (a forward hook);
and a learning rate that moved between two forwards of one window (the pre-hook), which
the reference, stepping with the rates held at each step, cannot show."""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradaccum.errors import ConfigError
from gradaccum.ranks import Ranks
from gradaccum.sync import full_tensor, unwrap
from gradaccum.testing.counting import CollectiveCounter, Counts

__all__ = [
    "Gradient",
    "Observed",
    "RateMoved",
    "apply_hyperparameters",
    "cpu64",
    "flat",
    "full_params",
]

Groups = list[dict[str, Any]]  # one optimizer's param groups, without their params
# Param-group entries that choose an implementation, not the update: the reference, on
# the CPU in float64, keeps its own (a CUDA trainer's capturable=True cannot run there).
_IMPLEMENTATION = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


def cpu64(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, dense, detached, in float64 on the CPU, a copy."""
    dense = tensor.to_dense() if tensor.is_sparse else tensor
    return dense.detach().to("cpu", torch.float64).clone()


def _fsdp1(model: nn.Module) -> Any:
    """The outermost FSDP1 module of ``model``, or None."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return next((m for m in model.modules() if isinstance(m, FullyShardedDataParallel)), None)


def full_params(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter, whole, in float64 on the CPU, in the unwrapped module's order."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if _fsdp1(model) is not None:
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return [cpu64(param) for param in model.parameters()]
    return [cpu64(full_tensor(param.detach())) for param in unwrap(model).parameters()]


def _fsdp1_grad_norm(model: nn.Module) -> float:
    """The norm of an FSDP1 model's whole gradient, from each module's flat gradient
    shard: its squared norm, summed over the ranks it is sharded across, in float64."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    total = 0.0
    for module in FullyShardedDataParallel.fsdp_modules(model):
        flat = module._flat_param  # a module that wraps no parameter has none
        if flat is None:
            continue
        grad = flat.grad if flat.grad is not None else torch.zeros_like(flat)
        squared = grad.detach().to(torch.float64).square().sum()
        if module.sharding_strategy != ShardingStrategy.NO_SHARD:
            dist.all_reduce(squared, group=module.process_group)
        total += squared.item()
    return math.sqrt(total)


# The collectives that reduce a gradient over the ranks (an all-gather only shares one).
_REDUCING = ("all_reduce", "reduce_scatter", "reduce")
_LOOKS = 3  # training forwards whose graph is looked at: a precision is the same in each
_NODES = 100_000  # autograd nodes looked at in one graph, at most


def graph_dtypes(output: object, below: torch.dtype) -> set[torch.dtype]:
    """The floating-point dtypes of lower precision than ``below`` that the autograd graph
    of ``output`` (a tensor, or tuples, lists and dicts of them) carries: the dtype of the
    gradient each node takes, from its input metadata. No saved tensor is unpacked (an
    unpack runs the hooks of activation checkpointing or offloading), so nothing is
    computed; a graph compiled into one node shows only its ends, and a torch without
    that metadata shows nothing."""
    found: set[torch.dtype] = set()
    stack: list[Any] = [tensor.grad_fn for tensor in _tensors(output)]
    seen: set[Any] = set()  # (the nodes themselves: torch keeps one wrapper per live node)
    while stack and len(seen) < _NODES:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for metadata in getattr(node, "_input_metadata", ()):
            dtype = getattr(metadata, "dtype", None)
            if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
                found.add(dtype)
        stack.extend(following for following, _ in node.next_functions)
    return {dtype for dtype in found if torch.finfo(dtype).eps > torch.finfo(below).eps}


def _tensors(output: object) -> Iterator[torch.Tensor]:
    """The tensors of ``output``: itself, or those in its tuples, lists and dict values."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


@dataclass
class Gradient:
    """The gradient one window's optimizer steps saw, flat, in float64.

    Attributes:
        values: The gradients of the parameters at ``positions``, one after another; or,
            with ``positions`` None, the whole gradient's norm alone.
        positions: The parameters (indices in the unwrapped module's order) it holds.
    """

    values: torch.Tensor
    positions: tuple[int, ...] | None


@dataclass(frozen=True)
class RateMoved:
    """A learning rate that changed between two training forwards of one window.

    Attributes:
        window: The window (from 1) whose microbatches it changed between.
        optimizer: The optimizer's index among the trainer's.
        group: The param group's index in it.
        groups: The optimizer's param groups then.
        before: The learning rate at the earlier forward.
        after: The one at the later forward.
    """

    window: int
    optimizer: int
    group: int
    groups: int
    before: float
    after: float


class Observed:
    """Reads, at each step of each of ``optimizers``, the hyperparameters of its param
    groups and the full gradient of its parameters (``with observed:`` installs the
    hooks). Under FSDP1, whose gradients are flat shards, it reads the whole gradient's
    norm instead, at the first optimizer's step.

    Attributes:
        hyperparameters: Per optimizer, per step, each param group's entries but its
            parameters and implementation flags (a tensor value cloned).
        grads: Per optimizer, per step, each parameter's full gradient (None without
            one) by its index in the unwrapped module's order.
        norms: Under FSDP1, the whole gradient's norm at each step of the first optimizer.
        autocast: The dtypes the model's forwards ran under ``torch.autocast`` to (for
            its parameters' device type), as nanoGPT's ``with ctx:`` around the forward
            and the loss runs them.
        computed: The floating-point dtypes below the parameters' that the autograd
            graph of the model's outputs carries, looked at in its first few training
            forwards (`graph_dtypes`): an autocast inside ``forward`` itself, as
            Accelerate's ``mixed_precision`` puts one there, or a cast.
        not_per_item: The modules whose output the reference cannot reproduce, by name:
            a dropout with ``p > 0`` (its masks are its own draws), or a `SyncBatchNorm`
            over several ranks (its statistics span every rank's microbatch), in
            training mode. A plain batch norm is not one: it normalizes each microbatch
            by its own statistics, as the reference, which computes each microbatch's
            loss alone, does too.
        forwards_after: The model's forwards under grad mode since the last optimizer step
            (all of them, before the first).
        rate_moved: The first learning rate that changed between two training forwards
            with no optimizer step between them (of one window: a schedule that moves
            every microbatch), as `RateMoved`, or None. Each epoch starts afresh (the
            microbatches an epoch drops at its end are of no window).
        dtype: The parameters' floating-point dtype (the first's; float64 without one).
        bypassed: Under DDP, the training forwards of the module inside it that ran
            outside DDP's forward (``model.module(x)``, or a method of the inner module
            that calls it), whose backward DDP does not all-reduce.
        consumed: Per epoch, the microbatches (their indices in the list the epoch was
            handed) that training forwards ran on, in the order they ran: each forward's
            not yet consumed microbatch that holds the most of its input tensors (by
            value: a loader's collate makes new tensors), as a shuffling sampler, Hugging
            Face's Trainer's by default, orders them.
        sync_turned_off: Under DDP, whether a backward ran with its sync off (read as the
            backward reaches the model's output): False for a loop with no ``no_sync()``
            at all; None for a model that is no DDP.
        in_step: Per window, the collectives that ran inside the optimizers' ``step()``
            (`end_window` closes one): an optimizer that reduces the gradient itself,
            as nanochat's DistAdamW does, runs its reductions there.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        counter: CollectiveCounter,
    ) -> None:
        self._model = model
        self._optimizers = tuple(optimizers)
        self._counter = counter
        self._fsdp1 = _fsdp1(model)
        self._index = {id(param): i for i, param in enumerate(unwrap(model).parameters())}
        self.hyperparameters: list[list[Groups]] = [[] for _ in optimizers]
        self.grads: list[list[dict[int, torch.Tensor | None]]] = [[] for _ in optimizers]
        self.norms: list[float] = []
        self.autocast: set[torch.dtype] = set()
        self.computed: set[torch.dtype] = set()
        self.dtype = next(
            (p.dtype for p in model.parameters() if p.is_floating_point()), torch.float64
        )
        self._looks = _LOOKS
        self.forwards_after = 0
        self.rate_moved: RateMoved | None = None
        self._rates: list[list[float | None]] | None = None  # at the window's last forward
        self.not_per_item: dict[str, str] = {}
        self._suspects = [
            (name, module)
            for name, module in unwrap(model).named_modules()
            if isinstance(module, (nn.modules.dropout._DropoutNd, nn.SyncBatchNorm))
        ]
        self._device = next((p.device.type for p in model.parameters()), "cpu")
        self.bypassed = 0
        self._inside = 0  # the wrapper's forwards running now
        self._inner = _inside_ddp(model)
        self.in_step: list[Counts] = []
        self.sync_turned_off: bool | None = None if self._inner is None else False
        self.consumed: list[list[int]] = []
        self._batches: list[list[torch.Tensor]] = []  # the epoch's, their tensors each
        self._stepping = Counts()  # the open window's, so far
        self._before = Counts()  # the counts as the step being run began
        self._hooks = ExitStack()

    @property
    def norm_only(self) -> bool:
        """Whether the gradients are compared by their norm alone (FSDP1)."""
        return self._fsdp1 is not None

    def __enter__(self) -> Observed:
        for index, optimizer in enumerate(self._optimizers):
            hook = optimizer.register_step_pre_hook(functools.partial(self._read, index))
            self._hooks.callback(hook.remove)
            self._hooks.callback(optimizer.register_step_post_hook(self._stepped).remove)
        self._hooks.callback(
            self._model.register_forward_pre_hook(self._forward, with_kwargs=True).remove
        )
        self._hooks.callback(
            self._model.register_forward_hook(self._forward_done, always_call=True).remove
        )
        if self._inner is not None:
            self._hooks.callback(self._inner.register_forward_pre_hook(self._inner_forward).remove)
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.close()

    def new_epoch(self, batches: Sequence[object]) -> None:
        """An epoch of ``batches`` starts: its first forward is compared with no earlier
        one, and its forwards are matched with ``batches``."""
        self._rates = None
        self._batches = [list(_tensors(batch)) for batch in batches]
        self.consumed.append([])

    def _consume(self, inputs: object) -> None:
        """Note which of the epoch's microbatches a training forward runs on (`consumed`)."""
        taken = self.consumed[-1] if self.consumed else None
        given = [tensor.detach() for tensor in _tensors(inputs)]
        if taken is None or not given:
            return
        with self._counter.paused():
            shared = [
                0 if index in taken else len([a for a in given if any(_same(a, b) for b in held)])
                for index, held in enumerate(self._batches)
            ]
        most = max(shared, default=0)  # (the most tensors in common: not a mere padding mask)
        if most:
            taken.append(shared.index(most))

    def orders(self) -> list[list[int]]:
        """Per epoch, the order its microbatches were consumed in: those `consumed`, then
        the rest as given (all of them as given for a loop that cuts or joins the
        microbatches, whose forwards see none of them whole)."""
        n = len(self._batches)
        return [[*taken, *(i for i in range(n) if i not in taken)] for taken in self.consumed]

    def _inner_forward(self, *_: object) -> None:
        if not self._inside and torch.is_grad_enabled():
            self.bypassed += 1

    def _forward(self, _: nn.Module, args: object, kwargs: object) -> None:
        self._inside += 1
        if torch.is_grad_enabled():  # (a training forward, not an evaluation's)
            self.forwards_after += 1
            self._consume((args, kwargs))
            if self.rate_moved is None:
                self._follow_rates()
        if torch.is_autocast_enabled(self._device):
            self.autocast.add(torch.get_autocast_dtype(self._device))
        for name, module in self._suspects:
            if not module.training:
                continue
            kind = type(module).__name__
            if isinstance(module, nn.SyncBatchNorm):
                ranks = _sync_ranks(module)
                if ranks > 1:
                    self.not_per_item.setdefault(name, f"{kind} over {ranks} ranks")
            elif (p := getattr(module, "p", 0)) != 0:
                self.not_per_item.setdefault(name, f"{kind}(p={p})")

    def _follow_rates(self) -> None:
        """Read every param group's learning rate at this training forward, and keep the
        first that differs from the one at the window's previous forward."""
        with self._counter.paused():  # (a tensor learning rate on a device is read here)
            rates = [
                [float(group["lr"]) if "lr" in group else None for group in optimizer.param_groups]
                for optimizer in self._optimizers
            ]
        before, self._rates = self._rates, rates
        if before is None:
            return
        for index, (was, now) in enumerate(zip(before, rates, strict=True)):
            for group, (old, new) in enumerate(zip(was, now, strict=False)):
                if old is not None and new is not None and old != new:
                    window = min(self.steps()) + 1
                    self.rate_moved = RateMoved(window, index, group, len(now), old, new)
                    return

    def _forward_done(self, _: nn.Module, __: object, output: object) -> None:
        self._inside -= 1
        if self._inner is not None and torch.is_grad_enabled():
            tensor = next((t for t in _tensors(output) if t.requires_grad), None)
            if tensor is not None:
                tensor.register_hook(self._backward_starts)  # type: ignore[no-untyped-call]
        if self._looks and torch.is_grad_enabled():
            self._looks -= 1
            self.computed |= graph_dtypes(output, below=self.dtype)

    def _backward_starts(self, _: torch.Tensor) -> None:
        if not getattr(unwrap(self._model), "require_backward_grad_sync", True):
            self.sync_turned_off = True

    def _read(self, index: int, optimizer: torch.optim.Optimizer, *_: object) -> None:
        self.forwards_after = 0
        self._rates = None  # the next forward is the next window's first
        with self._counter.paused():  # reading and gathering is not training
            self.hyperparameters[index].append(
                [
                    {
                        key: value.detach().clone()
                        if isinstance(value, torch.Tensor)
                        else copy.deepcopy(value)
                        for key, value in group.items()
                        if key not in _IMPLEMENTATION
                    }
                    for group in optimizer.param_groups
                ]
            )
            if self._fsdp1 is None:
                self.grads[index].append(self._full_grads(optimizer))
            elif index == 0:
                self.norms.append(_fsdp1_grad_norm(self._model))
        self._before = self._counter.counts

    def _stepped(self, *_: object) -> None:
        self._stepping += self._counter.counts - self._before

    def end_window(self) -> None:
        """A window closed: what ran inside its steps goes to `in_step`."""
        self.in_step.append(self._stepping)
        self._stepping = Counts()

    def reduced_in_step(self, counts: Counts) -> bool:
        """The optimizers reduced the gradient over the ranks inside ``step()``, and no
        backward of the run (``counts``) did: nanochat's DistAdamW and DistMuon,
        ZeRO-style optimizers, with no DDP around the model. The gradient they are
        handed is each rank's own."""
        return any(
            window.collectives.get(kind) for window in self.in_step for kind in _REDUCING
        ) and not any(counts.backwards.get(kind) for kind in _REDUCING)

    def average_over_ranks(self, shapes: Sequence[torch.Size]) -> None:
        """Each step's gradients, on every rank, become their mean over the ranks: what an
        optimizer that averages them inside ``step()`` applies. Collective: every rank
        calls it, for the steps every rank made."""
        import torch.distributed as dist

        device = Ranks(dist.group.WORLD, torch.device("cpu")).device
        made = torch.tensor(self.steps(), device=device)
        dist.all_reduce(made, dist.ReduceOp.MIN)
        found = [
            (steps[k], position)
            for steps, n in zip(self.grads, made.tolist(), strict=True)
            for k in range(n)
            for position in sorted(steps[k])
        ]
        total = flat(
            [
                torch.zeros(shapes[i], dtype=torch.float64) if (grad := step[i]) is None else grad
                for step, i in found
            ]
        ).to(device)
        dist.all_reduce(total)
        mean = (total / dist.get_world_size()).cpu()
        start = 0
        for step, i in found:
            size = shapes[i].numel()
            step[i] = mean[start : start + size].reshape(shapes[i])
            start += size

    def _full_grads(self, optimizer: torch.optim.Optimizer) -> dict[int, torch.Tensor | None]:
        found: dict[int, torch.Tensor | None] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                position = self._index.get(id(param))
                if position is not None:
                    grad = param.grad
                    found[position] = None if grad is None else cpu64(full_tensor(grad))
        return found

    def steps(self) -> list[int]:
        """How many times each optimizer stepped."""
        return [len(steps) for steps in self.hyperparameters]

    def window_gradients(self, shapes: Sequence[torch.Size]) -> Iterator[Gradient]:
        """The gradient each window's steps saw: the first optimizer's ``k``-th step with
        the others' ``k``-th, a missing gradient as zeros of the parameter's ``shapes``."""
        if self.norm_only:
            yield from (
                Gradient(torch.tensor([norm], dtype=torch.float64), None) for norm in self.norms
            )
            return
        for steps in zip(*self.grads, strict=False):
            merged = {position: grad for step in steps for position, grad in step.items()}
            positions = tuple(sorted(merged))
            values = [
                torch.zeros(shapes[i], dtype=torch.float64) if merged[i] is None else merged[i]
                for i in positions
            ]
            yield Gradient(flat(values), positions)

    def learning_rates(self) -> list[list[float]]:
        """Per window, the learning rate of every param group, optimizer by optimizer."""
        return [
            [float(group["lr"]) for groups in steps for group in groups if "lr" in group]
            for steps in zip(*self.hyperparameters, strict=False)
        ]


def _same(got: torch.Tensor, given: torch.Tensor) -> bool:
    """Whether a forward's input ``got`` is the microbatch's tensor ``given``, by value (in
    the input's dtype and device, where the trainer cast or moved it)."""
    return got.shape == given.shape and torch.equal(got, given.to(got.device, got.dtype))


def _sync_ranks(module: nn.SyncBatchNorm) -> int:
    """The ranks a training `SyncBatchNorm`'s statistics span: those of its process group
    (the world's by default), or 1 with none up, where it is a plain batch norm (as torch
    decides, in its forward)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(module.process_group or dist.group.WORLD)


def flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors`` one after another, flat (float64 when there are none)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([tensor.reshape(-1) for tensor in tensors])


def apply_hyperparameters(optimizer: torch.optim.Optimizer, groups: Groups, step: int) -> None:
    """Set ``optimizer``'s param groups to the entries a trainer's optimizer held at its
    ``step``-th step (from 0); a 0-dim tensor value as a float.

    Raises:
        ConfigError: The trainer's optimizer had another number of param groups.
    """
    if len(groups) != len(optimizer.param_groups):
        msg = (
            f"the trainer's optimizer held {len(groups)} param groups at its step {step + 1}, "
            f"make_optimizer builds {len(optimizer.param_groups)}: the reference cannot "
            "follow hyperparameters set on groups it does not have; build every group in "
            "make_optimizer"
        )
        raise ConfigError(msg)
    for group, seen in zip(optimizer.param_groups, groups, strict=True):
        for key, value in seen.items():
            is_scalar = isinstance(value, torch.Tensor) and value.numel() == 1
            group[key] = value.item() if is_scalar else value


def _inside_ddp(model: nn.Module) -> nn.Module | None:
    """The module a DDP ``model`` (through ``torch.compile``) wraps, whose forward can be
    called around DDP's (``model.module(x)``); None for any other model."""
    from torch.nn.parallel import DistributedDataParallel

    outer = unwrap(model)
    inner: nn.Module | None = outer.module if isinstance(outer, DistributedDataParallel) else None
    return inner
