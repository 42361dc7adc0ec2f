"""Count, at the dispatcher, the collectives and the device-to-host syncs a training runs.

Equal gradients cannot show that a microstep skipped its all-reduce; a count can.
`CollectiveCounter` is a ``TorchDispatchMode``: every ``torch.distributed`` collective
runs through a ``c10d::`` (or ``_c10d_functional::``) op, whoever calls it (DDP's
reducer, FSDP1, ``fully_shard``, HSDP, a plain ``dist.all_reduce``), on gloo and NCCL
alike. `DDPBucketCounter` is the fallback for DDP where the dispatcher cannot see.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradaccum.errors import ConfigTypeError, describe

__all__ = ["CollectiveCounter", "Counts", "DDPBucketCounter"]

# Each collective op, by the kind it counts as; an op not listed here counts under its
# own name (barrier, alltoall_, send, ...).
_KINDS = {
    **dict.fromkeys(
        [
            *("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_"),
            *("all_reduce_coalesced", "all_reduce_coalesced_"),
        ],
        "all_reduce",
    ),
    **dict.fromkeys(
        [
            *("reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"),
            *("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"),
            "reduce_scatter_tensor_out",
        ],
        "reduce_scatter",
    ),
    **dict.fromkeys(
        [
            *("allgather_", "_allgather_base_", "allgather_coalesced_"),
            *("allgather_into_tensor_coalesced_", "all_gather_into_tensor"),
            *("all_gather_into_tensor_coalesced", "all_gather_into_tensor_out"),
        ],
        "all_gather",
    ),
    **dict.fromkeys(["broadcast_", "broadcast"], "broadcast"),
}
_NAMESPACES = frozenset({"c10d", "_c10d_functional"})
_NOT_COLLECTIVES = frozenset({"wait_tensor", "check_for_nan", "_wrap_tensor_autograd"})
_WORDS = {  # the kinds in words, for messages: "4 all-reduces"
    "all_reduce": "all-reduce",
    "reduce_scatter": "reduce-scatter",
    "all_gather": "all-gather",
    "broadcast": "broadcast",
}


def kind_of(op: str) -> str:
    """The kind an op name (``"c10d::allreduce_"`` or ``"allreduce_"``) counts as."""
    name = op.rpartition("::")[2]
    return _KINDS.get(name, name)


def in_words(n: int, kind: str) -> str:
    """``4 all-reduces``, ``1 all-gather``, ``2 host syncs``; other ops as named: ``2 barrier``."""
    if kind not in _WORDS and kind != "host sync":
        return f"{n} {kind}"
    return f"{n} {_WORDS.get(kind, kind)}{'' if n == 1 else 's'}"


@dataclass(frozen=True)
class Counts:
    """What ran in a stretch of training: collectives by kind, and host syncs.

    Attributes:
        collectives: Count by kind: ``"all_reduce"``, ``"reduce_scatter"``,
            ``"all_gather"``, ``"broadcast"``, or an op's own name for other collectives
            (``"barrier"``). Kinds that did not run are absent.
        host_syncs: Device-to-host synchronizations (``aten._local_scalar_dense``: what
            ``.item()``, ``bool(t)``, ``float(t)`` and ``if t:`` run).
    """

    collectives: Mapping[str, int] = field(default_factory=dict)
    host_syncs: int = 0

    @property
    def all_reduces(self) -> int:
        """All-reduces (DDP's buckets, HSDP's replicas, ``dist.all_reduce``)."""
        return self.collectives.get("all_reduce", 0)

    @property
    def reduce_scatters(self) -> int:
        """Reduce-scatters (FSDP1, ``fully_shard``)."""
        return self.collectives.get("reduce_scatter", 0)

    @property
    def all_gathers(self) -> int:
        """All-gathers (FSDP's unsharding in forward and backward)."""
        return self.collectives.get("all_gather", 0)

    @property
    def broadcasts(self) -> int:
        """Broadcasts (DDP's parameters at construction, its rebuilt buckets once)."""
        return self.collectives.get("broadcast", 0)

    def __add__(self, other: Counts) -> Counts:
        kinds = collections.Counter(self.collectives) + collections.Counter(other.collectives)
        return Counts(dict(sorted(kinds.items())), self.host_syncs + other.host_syncs)

    def __sub__(self, other: Counts) -> Counts:
        """What ran beyond ``other`` (kinds that ran fewer times count negative)."""
        kinds = {
            kind: self.collectives.get(kind, 0) - other.collectives.get(kind, 0)
            for kind in sorted({*self.collectives, *other.collectives})
        }
        return Counts({k: n for k, n in kinds.items() if n}, self.host_syncs - other.host_syncs)

    def __str__(self) -> str:
        """``4 all-reduces + 2 broadcasts, 0 host syncs``."""
        parts = [in_words(n, kind) for kind, n in self.collectives.items()]
        return f"{' + '.join(parts) or 'no collective'}, {in_words(self.host_syncs, 'host sync')}"


def usual(windows: Sequence[Counts]) -> Counts:
    """Per kind, the count most windows ran (the later windows win a tie): what a window
    costs, without the one-time work of the first (DDP's bucket rebuild, an epoch's
    length agreement)."""
    kinds = {kind for window in windows for kind in window.collectives}
    steady = {}
    for kind in sorted(kinds):
        tally = collections.Counter(window.collectives.get(kind, 0) for window in reversed(windows))
        if count := tally.most_common(1)[0][0]:
            steady[kind] = count
    syncs = collections.Counter(window.host_syncs for window in reversed(windows))
    return Counts(steady, syncs.most_common(1)[0][0] if syncs else 0)


class CollectiveCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Count the collectives and host syncs that run inside ``with counter:``.

    Use it around one microstep or a whole training function; enter it again to go on
    counting. Given an ``optimizer``, each ``optimizer.step()`` inside the block closes a
    window, so `windows` holds what each window ran and `per_window` what a window
    usually costs, for any loop; `end_window` closes one by hand.

    What it sees: every ``c10d::`` and ``_c10d_functional::`` op, which is how
    ``torch.distributed`` runs each collective since torch 2.0, including those DDP's
    reducer issues from the autograd engine's threads, FSDP1, ``fully_shard``/HSDP and
    functional collectives, on gloo and NCCL. Host syncs: ``aten._local_scalar_dense``
    (``.item()``, ``bool(t)``, ``float(t)``), counted on CPU too, so a CPU test catches
    what would stall a GPU. What it does not see: a DDP communication hook that sends
    through something other than a ``ProcessGroup`` (count with `DDPBucketCounter`
    instead), collectives issued in C++ extensions outside ``torch.distributed``,
    ``.tolist()``, ``.cpu()`` and ``torch.cuda.synchronize()`` (none dispatches
    ``_local_scalar_dense``).

    Attributes:
        ops: Every collective op seen, by its full name (``"c10d::allreduce_"``).
        host_syncs: Host syncs seen.
        windows: What each closed window ran.

    Examples:
        >>> model = torch.nn.Linear(2, 1)
        >>> with CollectiveCounter() as counter:
        ...     loss = model(torch.ones(1, 2)).sum()
        ...     loss.backward()
        ...     value = loss.item()
        >>> counter.counts
        Counts(collectives={}, host_syncs=1)
    """

    def __init__(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            msg = f"optimizer must be a torch.optim.Optimizer or None, got {describe(optimizer)}"
            raise ConfigTypeError(msg)
        self.ops: collections.Counter[str] = collections.Counter()
        self.host_syncs = 0
        self.windows: list[Counts] = []
        self._optimizer = optimizer
        self._closed = Counts()  # the counts when the last window closed
        self._paused = False
        self._hook: Any = None

    def __enter__(self) -> CollectiveCounter:
        if self._optimizer is not None and self._hook is None:
            self._hook = self._optimizer.register_step_post_hook(self._step_taken)
        return super().__enter__()  # type: ignore[no-any-return, no-untyped-call]

    def _step_taken(self, *_: object) -> None:
        self.end_window()  # a window ends where the optimizer steps

    def __exit__(self, *exc: object) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        super().__exit__(*exc)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if not self._paused:
            if func.namespace in _NAMESPACES:
                name = func.name()
                if name.rpartition("::")[2] not in _NOT_COLLECTIVES:
                    self.ops[name] += 1
            elif func is torch.ops.aten._local_scalar_dense.default:
                self.host_syncs += 1
        return func(*args, **(kwargs or {}))

    @property
    def counts(self) -> Counts:
        """Everything counted so far."""
        kinds: collections.Counter[str] = collections.Counter()
        for op, n in self.ops.items():
            kinds[kind_of(op)] += n
        return Counts(dict(sorted(kinds.items())), self.host_syncs)

    @property
    def open_window(self) -> Counts:
        """What ran since the last window closed (or since counting began)."""
        return self.counts - self._closed

    @property
    def per_window(self) -> Counts:
        """What a window usually ran: per kind, the count most `windows` ran."""
        return usual(self.windows)

    def end_window(self) -> Counts:
        """Close the open window, record it in `windows` and return it."""
        window = self.open_window
        self.windows.append(window)
        self._closed = self.counts
        return window

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Count nothing inside: for the checks a test runs between microsteps (gathering
        sharded parameters to compare them runs collectives the training does not)."""
        paused, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = paused


class DDPBucketCounter:
    """Count DDP's bucket all-reduces through a communication hook: the fallback for a
    torch or a backend where the dispatcher does not see DDP's reducer.

    It installs ``allreduce_hook`` (DDP's default reduction), counting each bucket it
    reduces, so register it before the first backward and instead of any hook of your
    own (DDP takes one hook).

    Attributes:
        buckets: Buckets all-reduced so far; a window that syncs once all-reduces each
            of DDP's buckets once (one bucket for a small model).
    """

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            msg = f"model must be a DistributedDataParallel, got {describe(model)}"
            raise ConfigTypeError(msg)
        self.buckets = 0

        def counted(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
            self.buckets += 1
            return allreduce_hook(state, bucket)

        # DDP checks the hook's annotations as objects, not the strings this module has.
        counted.__annotations__ = {
            "state": object,
            "bucket": dist.GradBucket,  # type: ignore[attr-defined]
            "return": torch.futures.Future[torch.Tensor],
        }
        model.register_comm_hook(model.process_group, counted)
