"""Count, at the dispatcher, the collectives and the device-to-host syncs a training runs.

Equal gradients cannot show that a microstep skipped its all-reduce; a count can.
`CollectiveCounter` is a ``TorchDispatchMode``: every ``torch.distributed`` collective
runs through a ``c10d::`` (or ``_c10d_functional::``) op, whoever calls it (DDP's
reducer, FSDP1, ``fully_shard``, HSDP, a plain ``dist.all_reduce``), on gloo and NCCL
alike. `DDPBucketCounter` is the fallback for DDP where the dispatcher cannot see.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from gradaccum.errors import ConfigTypeError, describe

__all__ = ["CollectiveCounter", "Counts", "DDPBucketCounter"]

# Each collective op, by the kind it counts as (a coalesced form is one launch of its
# kind); an op not listed here counts under its own name.
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
    **dict.fromkeys(["alltoall_", "alltoall_base_", "all_to_all_single"], "all_to_all"),
    **dict.fromkeys(["barrier", "monitored_barrier_"], "barrier"),
    **dict.fromkeys(["send", "isend"], "send"),
    **dict.fromkeys(["recv_", "recv_any_source_", "irecv"], "recv"),
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
    "batch_p2p_ops": "send_recv",
}
KINDS = (  # every kind, the usual four first
    *("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather"),
    *("scatter", "all_to_all", "barrier", "send", "recv", "send_recv"),
)
_NAMESPACES = frozenset({"c10d", "_c10d_functional"})
_NOT_COLLECTIVES = frozenset({"wait_tensor", "check_for_nan", "_wrap_tensor_autograd"})
_WORDS = {  # the kinds in words, for messages: "4 all-reduces"; the others as named
    "all_reduce": "all-reduce",
    "reduce_scatter": "reduce-scatter",
    "all_gather": "all-gather",
    "broadcast": "broadcast",
}
# Every name a count is printed or asked for by: the kind, its words, their plural.
_NAMES = {
    **{kind: kind for kind in KINDS},
    **{word: kind for kind, word in _WORDS.items()},
    **{f"{word}s": kind for kind, word in _WORDS.items()},
}


def kind_of(op: str) -> str:
    """The kind an op name (``"c10d::allreduce_"`` or ``"allreduce_"``) counts as."""
    name = op.rpartition("::")[2]
    return _KINDS.get(name, name)


def kind_named(name: str) -> str | None:
    """The kind ``name`` means: a kind (``"all_reduce"``, ``"reduce"``) or its words as
    a report prints them (``"all-reduce"``, ``"all-reduces"``); None for no kind."""
    return _NAMES.get(name)


def in_words(n: int, kind: str) -> str:
    """``4 all-reduces``, ``1 all-gather``, ``2 host syncs``; other kinds as named:
    ``2 reduce``, ``1 barrier``."""
    if kind not in _WORDS and kind != "host sync":
        return f"{n} {kind}"
    return f"{n} {_WORDS.get(kind, kind)}{'' if n == 1 else 's'}"


@dataclass(frozen=True)
class Counts:
    """What ran in a stretch of training: collectives by kind, and host syncs.

    Attributes:
        collectives: Count by kind: ``"all_reduce"``, ``"reduce"``, ``"broadcast"``,
            ``"all_gather"`` (``all_gather_into_tensor`` too), ``"gather"``,
            ``"scatter"``, ``"reduce_scatter"`` (``reduce_scatter_tensor`` too),
            ``"all_to_all"`` (``all_to_all_single`` too), ``"barrier"``, ``"send"``,
            ``"recv"``, ``"send_recv"`` (a functional batch of them); a coalesced call
            counts once, as its kind. Kinds that did not run are absent.
        host_syncs: Device-to-host reads of tensors that live, or in a CPU run would
            live, on the device (see `CollectiveCounter`).
        outside_backward: Of `collectives`, by kind, those that ran outside any backward:
            the trainer's own (a metric's all-reduce), FSDP's forward all-gathers, DDP's
            buffer broadcasts, a gradient all-reduced by hand after the backward. The
            gradient's reductions by DDP and FSDP run inside it. Neither compared nor
            shown: two ``Counts`` are equal when their collectives and host syncs are.
        backwards: By kind, how many backward passes ran one or more of it: DDP that
            syncs once per window all-reduces in one backward a window, whatever its
            number of buckets; DDP that syncs on every microbatch, in each of them.
            Neither compared nor shown.
    """

    collectives: Mapping[str, int] = field(default_factory=dict)
    host_syncs: int = 0
    outside_backward: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)
    backwards: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)

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
        return Counts(
            _combined(self.collectives, other.collectives, 1),
            self.host_syncs + other.host_syncs,
            _combined(self.outside_backward, other.outside_backward, 1),
            _combined(self.backwards, other.backwards, 1),
        )

    def __sub__(self, other: Counts) -> Counts:
        """What ran beyond ``other`` (kinds that ran fewer times count negative)."""
        return Counts(
            _combined(self.collectives, other.collectives, -1),
            self.host_syncs - other.host_syncs,
            _combined(self.outside_backward, other.outside_backward, -1),
            _combined(self.backwards, other.backwards, -1),
        )

    def __str__(self) -> str:
        """``4 all-reduces + 2 broadcasts, 0 host syncs``."""
        parts = [in_words(n, kind) for kind, n in self.collectives.items()]
        return f"{' + '.join(parts) or 'no collective'}, {in_words(self.host_syncs, 'host sync')}"


def _combined(a: Mapping[str, int], b: Mapping[str, int], sign: int) -> dict[str, int]:
    """``a + sign * b`` by kind, in kind order: a sum keeps the kinds that ran (as a
    ``Counter``'s does), a difference those that do not come to 0."""
    kinds = {kind: a.get(kind, 0) + sign * b.get(kind, 0) for kind in sorted({*a, *b})}
    return {kind: n for kind, n in kinds.items() if (n > 0 if sign > 0 else n)}


def usual(windows: Sequence[Counts]) -> Counts:
    """Per kind, the count most windows ran (the later windows win a tie): what a window
    costs, without the one-time work of the first (DDP's bucket rebuild, an epoch's
    length agreement)."""

    def most(counts: Sequence[Mapping[str, int]]) -> dict[str, int]:
        steady = {}
        for kind in sorted({kind for count in counts for kind in count}):
            tally = collections.Counter(count.get(kind, 0) for count in reversed(counts))
            if n := tally.most_common(1)[0][0]:
                steady[kind] = n
        return steady

    syncs = collections.Counter(window.host_syncs for window in reversed(windows))
    return Counts(
        most([window.collectives for window in windows]),
        syncs.most_common(1)[0][0] if syncs else 0,
        most([window.outside_backward for window in windows]),
        most([window.backwards for window in windows]),
    )


def check_optimizers(optimizers: object, expected: str) -> tuple[torch.optim.Optimizer, ...]:
    """``optimizers`` (one optimizer or a sequence of them) as a tuple.

    Raises:
        ConfigTypeError: Something else, or an empty sequence; the message starts with
            ``expected`` (``"optimizer must be a torch.optim.Optimizer or ..."``).
    """
    if isinstance(optimizers, Sequence) and not isinstance(optimizers, str):
        found: tuple[object, ...] = tuple(optimizers)
    else:
        found = (optimizers,)
    checked = tuple(one for one in found if isinstance(one, torch.optim.Optimizer))
    if not checked or len(checked) != len(found):
        msg = f"{expected}, got {describe(optimizers)}"
        raise ConfigTypeError(msg)
    return checked


class WindowWatch:
    """Calls ``closed()`` each time every one of ``optimizers`` has stepped since the last
    call: where a window ends, whatever order a loop steps its optimizers in."""

    def __init__(
        self, optimizers: Sequence[torch.optim.Optimizer], closed: Callable[[], object]
    ) -> None:
        self._optimizers = tuple(optimizers)
        self._closed = closed
        self._stepped: set[int] = set()
        self._hooks: list[Any] = []

    def __enter__(self) -> WindowWatch:
        if self._hooks:
            return self  # entered again inside its own block: watching already
        for index, optimizer in enumerate(self._optimizers):
            self._hooks.append(
                optimizer.register_step_post_hook(functools.partial(self._stepped_one, index))
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _stepped_one(self, index: int, *_: object) -> None:
        self._stepped.add(index)
        if len(self._stepped) == len(self._optimizers):
            self._stepped.clear()
            self._closed()


class CollectiveCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Count the collectives and host syncs that run inside ``with counter:``.

    Use it around one microstep or a whole training function; enter it again to go on
    counting. Given an ``optimizer`` (or a sequence of them), a window closes once each
    has stepped inside the block, so `windows` holds what each window ran and
    `per_window` what a window usually costs, for any loop; `end_window` closes one by
    hand.

    Collectives: every ``c10d::`` and ``_c10d_functional::`` op, which is how
    ``torch.distributed`` runs each collective since torch 2.0, including those DDP's
    reducer issues from the autograd engine's threads, FSDP1, ``fully_shard``/HSDP and
    functional collectives, on gloo and NCCL.

    Host syncs: reads of a tensor's value by the host (``aten._local_scalar_dense``:
    ``.item()``, ``bool(t)``, ``float(t)``, ``int(t)``, ``if t:``) that would stall a
    device. Counted: a read of a tensor on an accelerator; and, since a CPU run stands
    in for a device run, a read of a CPU tensor that would be on the device there: a
    parameter, or a tensor computed inside the block from a parameter or from a
    collective's tensors (model outputs, losses, gradients, optimizer state such as
    Adam's moments, metrics all-reduced, and whatever is computed from them, written
    in place included). Not counted: reads of CPU tensors built from Python values and
    never mixed with those: the ``step`` counters that non-capturable, non-fused Adam and
    AdamW keep on the CPU on every device (and read with ``.item()`` each step), counters
    a trainer keeps itself, the CPU side of a device run.

    Inside it ``torch.compile`` runs eagerly: dynamo compiles no frame while a dispatch
    mode is on, so that the mode sees every op (torch 2.13 also keeps the frames it
    skipped from compiling later in the process: pytorch#190286).

    What it does not see: a DDP communication hook that sends through something other
    than a ``ProcessGroup`` (count with `DDPBucketCounter` instead), collectives issued
    in C++ extensions outside ``torch.distributed``; as host syncs, ``.tolist()``,
    ``.cpu()``, ``torch.cuda.synchronize()`` (none dispatches ``_local_scalar_dense``),
    and reads of tensors computed before the block (other than parameters).

    Attributes:
        ops: Every collective op seen, by its full name (``"c10d::allreduce_"``).
        outside_backward: Of ``ops``, those that ran while no backward was running.
        backwards: By kind, the backward passes that ran one or more of it.
        host_syncs: Host syncs seen.
        windows: What each closed window ran.

    Examples:
        >>> model = torch.nn.Linear(2, 1)
        >>> with CollectiveCounter() as counter:
        ...     loss = model(torch.ones(1, 2)).sum()
        ...     loss.backward()
        ...     value = loss.item()  # a model's output: a host sync
        ...     steps = torch.tensor(3.0).item()  # built on the host: none
        >>> counter.counts
        Counts(collectives={}, host_syncs=1)
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        optimizers = (
            ()
            if optimizer is None
            else check_optimizers(
                optimizer,
                "optimizer must be a torch.optim.Optimizer, a non-empty sequence of them, or None",
            )
        )
        self.ops: collections.Counter[str] = collections.Counter()
        self.outside_backward: collections.Counter[str] = collections.Counter()
        self.backwards: collections.Counter[str] = collections.Counter()
        self._last_backward: dict[str, int] = {}  # by kind, the last backward that ran it
        self.host_syncs = 0
        self.windows: list[Counts] = []
        self._watch = WindowWatch(optimizers, self.end_window) if optimizers else None
        self._closed = Counts()  # the counts when the last window closed
        self._paused = False
        # CPU tensors that a device run would hold on the device (see the class docstring).
        self._on_device = WeakTensorKeyDictionary()

    def __enter__(self) -> CollectiveCounter:
        if self._watch is not None:
            self._watch.__enter__()
        return super().__enter__()  # type: ignore[no-any-return, no-untyped-call]

    def __exit__(self, *exc: object) -> None:
        if self._watch is not None:
            self._watch.__exit__()
        super().__exit__(*exc)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        collective = func.namespace in _NAMESPACES
        if not self._paused:
            if collective:
                name = func.name()
                if name.rpartition("::")[2] not in _NOT_COLLECTIVES:
                    self.ops[name] += 1
                    backward = torch._C._current_graph_task_id()  # unique per backward pass
                    if backward == -1:  # no backward is running
                        self.outside_backward[name] += 1
                    elif self._last_backward.get(kind := kind_of(name)) != backward:
                        self._last_backward[kind] = backward
                        self.backwards[kind] += 1
            elif func is torch.ops.aten._local_scalar_dense.default and self._would_sync(args[0]):
                self.host_syncs += 1
        out = func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        if collective or any(self._stands_in(tensor) for tensor in inputs):
            # NCCL takes device tensors only; what a device tensor writes or makes stays there.
            made = _tensors(out) + (inputs if collective else _written(func, args, kwargs))
            for tensor in made:
                self._mark(tensor)
        return out

    def _would_sync(self, tensor: torch.Tensor) -> bool:
        """Whether reading ``tensor`` on the host waits, or in a device run would wait,
        for a device."""
        return tensor.device.type != "cpu" or self._stands_in(tensor)

    def _stands_in(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is on the CPU where a device run would hold it on the device."""
        return tensor.device.type == "cpu" and (
            isinstance(tensor, nn.Parameter)
            or tensor in self._on_device
            or (tensor._base is not None and tensor._base in self._on_device)
        )

    def _mark(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cpu":
            self._on_device[tensor] = True
            if tensor._base is not None:  # written through a view: its base holds it too
                self._on_device[tensor._base] = True

    @property
    def counts(self) -> Counts:
        """Everything counted so far."""

        def by_kind(ops: Mapping[str, int]) -> dict[str, int]:
            kinds: collections.Counter[str] = collections.Counter()
            for op, n in ops.items():
                kinds[kind_of(op)] += n
            return dict(sorted(kinds.items()))

        return Counts(
            by_kind(self.ops),
            self.host_syncs,
            by_kind(self.outside_backward),
            dict(sorted(self.backwards.items())),
        )

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


def _tensors(tree: object) -> list[torch.Tensor]:
    """The tensors in ``tree``: an op's arguments or results (a tensor, or lists, tuples
    and dicts of them and of other values). Not pytree's flattening: this runs for every
    op, and is several times faster."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [tensor for item in tree for tensor in _tensors(item)]
    if isinstance(tree, dict):
        return [tensor for item in tree.values() for tensor in _tensors(item)]
    return []


@functools.cache
def _writes(func: Any) -> tuple[tuple[int, str], ...]:
    """The position and name of each argument ``func`` writes in place."""
    return tuple(
        (index, argument.name)
        for index, argument in enumerate(func._schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


def _written(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors ``func`` wrote in place (``add_``'s self, ``_foreach_add_``'s list)."""
    return _tensors(
        [args[index] if index < len(args) else kwargs.get(name) for index, name in _writes(func)]
    )


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
