"""How a model is wrapped, and the strategy that turns its gradient communication on and off."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from gradaccum.errors import ConfigError, ConfigTypeError, describe, warn

__all__ = [
    "DDPSync",
    "FSDP1Sync",
    "FullyShardSync",
    "LocalSync",
    "NoSyncContext",
    "ReplicateSync",
    "SeveralDDPSync",
    "StrategyFactory",
    "SyncPolicy",
    "SyncStrategy",
    "clip_grad_norm",
    "ddp_running_around",
    "full_tensor",
    "grad_norm",
    "no_sync",
    "register_sync_strategy",
    "several_processes",
    "strategy_for",
    "unwrap",
]

SyncPolicy = Literal["auto", "boundary", "every"]


@runtime_checkable
class SyncStrategy(Protocol):
    """Turns a wrapped model's gradient communication on and off.

    The accumulator calls `arm` before each microstep's forward, because some
    wrappers (DDP) decide during the forward whether the backward communicates.
    Subclass it to inherit the defaults of the optional members (a strategy for
    `register_sync_strategy` must have them all).

    Attributes:
        group: The process group whose ranks average the model's gradients, or
            ``None`` when the gradients stay on this process.
        grads_in_params: A deferred window's partial gradient is plain ``param.grad``
            (default False): it can be saved mid-window, and a ``zero_grad()`` that
            wipes it is caught.
        decides_in_forward: The wrapper decides during the forward whether the backward
            communicates (DDP; default False). A strategy that needs to see each forward
            overrides `forward_done` (DDP's does not: `overridden` reads what DDP
            recorded of the last forward).
        forward_communicates: The model's forward may run a collective (FSDP's
            all-gather, DDP's buffer broadcast; default True). On several ranks the
            accumulator then watches each forward for a failure, to name the rank that
            failed first (one hook on the model, which costs each of its calls torch's
            slow module call, about 9,000 instructions); a forward without a collective
            cannot fail because another rank did, and is not watched.
        wrappers: The modules whose sync state the strategy sets (default none): one
            accumulator at a time sets it, so a new accumulator over the same wrapper
            takes it over from an open one, as it takes over an optimizer.
    """

    group: dist.ProcessGroup | None
    grads_in_params: bool = False
    decides_in_forward: bool = False
    forward_communicates: bool = True
    wrappers: tuple[Any, ...] = ()

    def arm(self, sync: bool) -> bool | None:
        """Prepare the next backward: ``True`` on a window's last microstep (or under
        ``sync="every"``), ``False`` where the policy lets communication be deferred.
        Return False where the wrapper cannot defer yet and syncs all the same (DDP's
        static graph before its first iteration): it is asked again after the next
        backward, rather than only when the request changes."""

    def restore(self) -> None:
        """Put back the communication state the strategy found."""

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the window's gradient to ``max_norm`` by its total norm over every rank's
        share, and return that norm (default: `clip_grad_norm`)."""
        return clip_grad_norm(params, max_norm)

    def forward_done(self) -> None:
        """Called after each forward of the model, where a strategy overrides it (by
        default nothing is called: no hook is put on the model for it)."""
        return

    def overridden(self) -> bool | None:
        """Called before each microstep's backward: whether that backward will communicate,
        when that is not what the strategy was last armed to (someone else changed the
        wrapper's state, such as a ``no_sync()`` of the user's own, or a wrapper that
        decides in the forward saw another state); else, and by default, None."""
        return None

    def discard(self) -> None:
        """Called when a window's forwards are dropped without their backwards, on every
        rank at once (`Accumulator.step` re-running a window that ran out of memory): forget
        what the wrapper prepared for a backward that will not run (by default nothing)."""
        return


StrategyFactory = Callable[[nn.Module, SyncPolicy], SyncStrategy]
"""Builds the strategy for a model (unwrapped from ``torch.compile``) under a policy."""


class LocalSync(SyncStrategy):
    """A module that is not wrapped: its gradients live on this process, nothing to sync.

    On several processes a module may be wrapped after the accumulator took it (``model =
    DDP(model)``, ``accelerator.prepare(model)`` after ``Accumulator(model, ...)``): then
    the accumulator cannot defer DDP's all-reduce, nor agree with the other ranks, so the
    first forward of such a module is looked at (`ddp_running_around`).
    """

    group: dist.ProcessGroup | None = None
    grads_in_params = True
    forward_communicates = False

    def arm(self, sync: bool) -> None:
        """Nothing to arm: there is no communication."""

    def restore(self) -> None:
        """Nothing was changed."""


class DDPSync(SyncStrategy):
    """DDP: sets ``require_backward_grad_sync``, which DDP reads in its forward.

    The flag is set to what each microstep needs rather than toggled by ``no_sync()``,
    so a state left behind by someone else (an open ``no_sync()``, an accumulator that
    was never closed) cannot keep a boundary from all-reducing. Before each backward,
    `overridden` reads what DDP itself recorded of the last forward
    (``require_forward_param_sync``, which DDP sets in every forward), so that a forward
    that saw another flag than the one armed (run ahead of its block, or inside a
    ``no_sync()`` of the user's own) is reported at its backward, with no hook on the
    model: one attribute read a microstep. A forward of the DDP model under ``no_grad``
    after the loss's own is what DDP recorded last, so it is taken for the loss's.
    """

    grads_in_params = True  # a deferred window's gradient is plain `param.grad`
    decides_in_forward = True

    def __init__(self, ddp: Any, *, defer: bool) -> None:
        self._ddp = ddp
        self._defer = defer
        self.group: dist.ProcessGroup | None = ddp.process_group
        self.forward_communicates = _broadcasts_buffers(ddp)
        self.wrappers: tuple[Any, ...] = (ddp,)  # (what `restore` puts back: every one held)
        self._founds = [_ddp_found(ddp)]
        self._armed = ddp.require_backward_grad_sync
        self._holds = True

    def first_iteration(self) -> bool:
        """Whether a DDP held with ``static_graph=True`` has not run its first iteration,
        whose backward must all-reduce (torch's reducer asserts otherwise)."""
        return any(_before_first_iteration(ddp) for ddp in self.wrappers)

    def _will_sync(self, sync: bool) -> bool:
        """What the next backward is armed to do: ``sync``, or all-reduce all the same
        where the policy never defers or a static graph's first iteration is to run (its
        first backward; the window defers after it, as a hand loop's ``no_sync()``
        may)."""
        return sync or not self._defer or self.first_iteration()

    def overridden(self) -> bool | None:
        """Whether this backward all-reduces, if that is not what was armed: DDP decided
        in the last forward, which it recorded (``require_forward_param_sync``: the flag
        under grad mode)."""
        seen: bool = self._ddp.require_forward_param_sync
        return None if seen is self._armed else seen

    def arm(self, sync: bool) -> bool:
        """All-reduce in the next backward unless it is deferred; False where a static
        graph's first iteration all-reduces all the same."""
        self._armed = armed = self._will_sync(sync)
        self._ddp.require_backward_grad_sync = armed
        return armed is sync

    def discard(self) -> None:
        """A forward armed to all-reduce left DDP's reducer expecting its backward, whose
        hooks would then all-reduce in the next backward, deferred or not: reset it (torch's
        ``Reducer._reset_state``, what DDP's own ``_update_process_group`` calls; it also
        rebuilds the buckets after the next all-reducing backward, one broadcast, on every
        rank alike). Where torch has no such reset, `can_discard` is False."""
        for ddp in self.wrappers:
            reset = getattr(getattr(ddp, "reducer", None), "_reset_state", None)
            if reset is not None:
                reset()

    def can_discard(self) -> bool:
        """Every DDP held has a reducer that `discard` can reset."""
        return all(
            callable(getattr(getattr(ddp, "reducer", None), "_reset_state", None))
            for ddp in self.wrappers
        )

    def restore(self) -> None:
        """Put back each flag as it was found (before any strategy still holding it set it)."""
        holds, self._holds = self._holds, False
        for ddp, found in zip(self.wrappers, self._founds, strict=True):
            ddp.require_backward_grad_sync = found
            if holds:
                _before.give(ddp)


def _before_first_iteration(ddp: Any) -> bool:
    """``ddp`` has ``static_graph=True`` and its first backward has not queued DDP's
    delayed all-reduce yet."""
    return bool(
        getattr(ddp, "static_graph", False)
        and getattr(ddp, "_static_graph_delay_allreduce_enqueued", False) is not True
    )


class _Found:
    """The sync state each wrapper (a DDP module, a ``fully_shard`` module) had before the
    strategies that hold it now (not restored yet) set it, and how many they are: a
    strategy made while another one holds the wrapper (an accumulator left open, never
    closed, beside a new one with a new optimizer) finds the state as that one set it, but
    restores the user's."""

    def __init__(self) -> None:
        self._states: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()

    def take(self, module: Any, now: Callable[[], Any]) -> Any:
        """The state ``module`` had before it was held (``now()`` where it is not held); one
        more strategy holds it."""
        entry = self._states.get(module)
        if entry is None:
            entry = self._states[module] = [now(), 0]
        entry[1] += 1
        return entry[0]

    def give(self, module: Any) -> None:
        """One strategy fewer holds ``module``; with none left, its state is forgotten."""
        entry = self._states.get(module)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del self._states[module]


_before = _Found()


def _ddp_found(ddp: Any) -> bool:
    """The flag ``ddp`` had before the strategies holding it set it; one more holds it."""
    found: bool = _before.take(ddp, lambda: ddp.require_backward_grad_sync)
    return found


def _broadcasts_buffers(ddp: Any) -> bool:
    """DDP's forward broadcasts the buffers from rank 0 when it has any to broadcast."""
    return bool(getattr(ddp, "broadcast_buffers", True) and getattr(ddp, "modules_buffers", True))


class NoSyncContext(SyncStrategy):
    """A wrapper with a ``no_sync()`` context manager (FSDP1, unknown types): held open
    while deferring.

    The wrapper's own context manager sets and restores its state, so whatever the
    model's flags were before, they are exactly what `restore` leaves.
    """

    def __init__(self, module: Any, *, defer: bool, group: dist.ProcessGroup | None) -> None:
        self._module = module
        self.wrappers = (module,)
        self._defer = defer
        self.group = group
        self._held: AbstractContextManager[Any] | None = None

    def arm(self, sync: bool) -> None:
        """Enter ``no_sync()`` for a deferred microstep, leave it for a syncing one."""
        if not sync and self._defer and self._held is None:
            held = self._module.no_sync()
            held.__enter__()
            self._held = held
        elif sync:
            self.restore()

    def restore(self) -> None:
        """Leave ``no_sync()`` if it is held."""
        held, self._held = self._held, None
        if held is not None:
            held.__exit__(None, None, None)


class FullyShardSync(SyncStrategy):
    """FSDP2 ``fully_shard`` modules: FSDP, HSDP, and either on the data-parallel dims of a
    larger mesh (tensor parallelism).

    What FSDP reduces over is read from its own mesh information, not from the parameters'
    mesh, which also has the dims FSDP does not reduce over (a TP dim): `group` is the
    data-parallel ranks, the shard dim's (FSDP) or the shard and replicate dims' (HSDP).
    ``"auto"`` reduce-scatters every microstep, so that no unsharded gradient is held
    between microsteps; under HSDP it all-reduces across replicas only on the boundary;
    with no shard dim (``"replicate"``: each rank holds the whole gradient anyway) it
    defers as ``"boundary"`` does. ``"boundary"`` keeps unsharded gradients until the
    boundary.

    Attributes:
        kind: What was detected: ``"fully_shard"``, ``"HSDP"`` or ``"replicate"`` (no
            shard dim), with ``" + TP"`` when the parameters are also split over dims
            that FSDP does not reduce over.
    """

    def __init__(self, modules: list[Any], policy: SyncPolicy) -> None:
        self._modules = modules
        self.wrappers = tuple(modules)
        self._policy = policy
        info = _mesh_info(modules)
        _check_averaging(modules, info.mesh.size())
        shards, replicates = info.shard_mesh_dim is not None, info.replicate_mesh_dim is not None
        self._hsdp = shards and replicates
        self._defers = policy == "boundary" or (policy == "auto" and not shards)
        self.group: dist.ProcessGroup | None = _mesh_group(info.mesh)
        name = "HSDP" if self._hsdp else "fully_shard" if shards else "replicate"
        beyond = _mesh_of(modules).size() > info.mesh.size()
        self.kind = f"{name} + TP" if beyond else name
        self._found = [
            _before.take(module, functools.partial(_fsdp_flags, module)) for module in modules
        ]
        self._holds = True
        # One parameter group stands for all: a set_requires_gradient_sync() of the user's
        # own (recursive by default) changes them all.
        self._watched = next((group for m in modules for group in _param_groups(m)), None)
        self._armed: bool | None = None

    def __repr__(self) -> str:
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else []
        return f"FullyShardSync({self.kind}, data-parallel ranks {ranks})"

    def arm(self, sync: bool) -> None:
        """Set reduce-scatter and (HSDP) all-reduce for the next backward."""
        reduce_scatter = sync or not self._defers
        all_reduce = sync or self._policy == "every" or (reduce_scatter and not self._hsdp)
        for module in self._modules:
            module.set_requires_gradient_sync(reduce_scatter, recurse=False)
            module.set_requires_all_reduce(all_reduce, recurse=False)
        self._armed = reduce_scatter

    def overridden(self) -> bool | None:
        """Whether this backward reduce-scatters, when someone else changed the flag since
        `arm` (a ``set_requires_gradient_sync()`` of the user's own)."""
        watched = self._watched
        if watched is None or self._armed is None or watched.reduce_grads is self._armed:
            return None
        return bool(watched.reduce_grads)

    def restore(self) -> None:
        """Put back each parameter group's flags as they were found (before any strategy
        still holding them set them: see `_Found`)."""
        holds, self._holds = self._holds, False
        for module, found in zip(self._modules, self._found, strict=True):
            for param_group, (reduce_scatter, all_reduce) in zip(
                _param_groups(module), found, strict=True
            ):
                param_group.reduce_grads = reduce_scatter
                param_group.all_reduce_grads = all_reduce
            if holds:
                _before.give(module)


def _param_groups(module: Any) -> list[Any]:
    # FSDP2 keeps its flags on private parameter groups and has no public getter; reading
    # them is the only way to restore exactly what was found (torch 2.6 has one group).
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def _fsdp_flags(module: Any) -> list[tuple[bool, bool]]:
    return [(group.reduce_grads, group.all_reduce_grads) for group in _param_groups(module)]


def _mesh_info(modules: list[Any]) -> Any:
    """FSDP's own record of the mesh it reduces the gradients over, and which of its dims
    shard and which replicate (``FSDPParamGroup.mesh_info``; private, but the only place
    that tells the data-parallel dims from a TP dim of the parameters' mesh).

    Raises:
        ConfigError: No parameter group has one (no sharded parameter, or a torch that
            keeps it elsewhere), or the groups reduce over different meshes.
    """
    infos = [
        info
        for module in modules
        for group in _param_groups(module)
        if (info := getattr(group, "mesh_info", None)) is not None
    ]
    if not infos:
        msg = (
            "the fully_shard model has no parameter group that records its data-parallel "
            "mesh (FSDPParamGroup.mesh_info), so gradaccum cannot tell which ranks average "
            "the gradients; shard at least one parameter with fully_shard, or register a "
            "strategy with gradaccum.register_sync_strategy()"
        )
        raise ConfigError(msg)
    first = infos[0]
    for info in infos[1:]:
        if (info.mesh, info.shard_mesh_dim, info.replicate_mesh_dim) != (
            first.mesh,
            first.shard_mesh_dim,
            first.replicate_mesh_dim,
        ):
            msg = (
                f"the fully_shard modules reduce their gradients over different meshes "
                f"({first.mesh} and {info.mesh}), so no one item total or rank group fits "
                "them all; shard every module over the same data-parallel mesh"
            )
            raise ConfigError(msg)
    return first


def _check_averaging(modules: list[Any], ranks: int) -> None:
    """The normalization (``num_items``, the mean of microbatches) assumes FSDP averages the
    gradients over the data-parallel ranks; a custom divide factor changes that.

    Raises:
        ConfigError: A module's ``set_gradient_divide_factor()`` set another factor than
            the number of data-parallel ranks.
    """
    for module in modules:
        for group in _param_groups(module):
            factor = getattr(group, "gradient_divide_factor", None)
            if factor is not None and factor != ranks:
                msg = (
                    f"a fully_shard module divides its gradients by {factor} "
                    f"(set_gradient_divide_factor), not by its {ranks} data-parallel ranks, "
                    "and gradaccum normalizes by the items or microbatches of every rank "
                    "assuming FSDP averages; remove the set_gradient_divide_factor() call "
                    "(num_items= already gives the item mean over all ranks)"
                )
                raise ConfigError(msg)


def _mesh_of(modules: list[Any]) -> Any:
    """The sharded parameters' mesh (with any TP dims), read from FSDP's own record of
    them: the module's parameters are plain tensors while unsharded (``replicate()`` keeps
    them unsharded after its forward)."""
    for module in modules:
        for group in _param_groups(module):
            for fsdp_param in getattr(group, "fsdp_params", ()):
                mesh = getattr(fsdp_param.sharded_param, "device_mesh", None)
                if mesh is not None:
                    return mesh
    msg = "the fully_shard model has no sharded parameter to read its device mesh from"
    raise ConfigError(msg)


def _mesh_group(mesh: Any) -> dist.ProcessGroup:
    """The group of every rank in the data-parallel mesh: they all average the gradients."""
    if mesh.ndim == 1:
        return mesh.get_group()  # type: ignore[no-any-return]
    if mesh.size() == dist.get_world_size():
        return _world()
    return mesh._flatten().get_group()  # type: ignore[no-any-return]  # no public flatten


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None  # only called once a process group is up
    return group


def several_processes() -> bool:
    """Whether this process is one of several in an initialized default group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def ddp_running_around(model: nn.Module) -> Any:
    """The DDP module whose forward is running now, if it holds ``model`` (or, as the one a
    ``replicate()`` builds, its parameters), else None: what DDP records of its running
    forward for dynamo (``_active_ddp_module``)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)
    if ddp is None:
        return None
    first = next(model.parameters(), None)
    holds = any(module is model for module in ddp.modules()) or (
        first is not None and any(param is first for param in ddp.parameters())
    )
    return ddp if holds else None


def _outermost(model: nn.Module, cls: type) -> list[Any]:
    """The ``cls`` modules of ``model`` that no other one contains, in module order: the
    wrappers side by side in a model that holds several (an encoder and a head wrapped
    apart)."""
    if isinstance(model, cls):
        return [model]
    return [found for child in model.children() for found in _outermost(child, cls)]


def _ddp(model: nn.Module, policy: SyncPolicy) -> SyncStrategy:
    from torch.nn.parallel import DistributedDataParallel

    ddps = _outermost(model, DistributedDataParallel)
    defer = policy != "every"
    if len(ddps) == 1:
        return DDPSync(ddps[0], defer=defer)
    if len({id(ddp.process_group) for ddp in ddps}) > 1:
        msg = (
            f"model holds {len(ddps)} DistributedDataParallel modules over different "
            "process groups; gradaccum arms them alike but reduces its own values (item "
            "counts, the inf/NaN check) over one group: wrap them over the same group"
        )
        raise ConfigError(msg)
    return SeveralDDPSync(ddps, defer=defer)


class SeveralDDPSync(DDPSync):
    """Several DDP modules side by side in the model (an encoder and a head wrapped apart,
    under one optimizer or several): each is armed alike, and each one's last forward is
    read before the backward (the first that saw another flag than armed is reported)."""

    def __init__(self, ddps: Sequence[Any], *, defer: bool) -> None:
        super().__init__(ddps[0], defer=defer)
        self.wrappers = tuple(ddps)
        self.forward_communicates = any(_broadcasts_buffers(ddp) for ddp in ddps)
        self._founds += [_ddp_found(ddp) for ddp in ddps[1:]]

    def overridden(self) -> bool | None:
        """Whether this backward reduces, if that is not what was armed, on any of them."""
        for ddp in self.wrappers:
            seen: bool = ddp.require_forward_param_sync
            if seen is not self._armed:
                return seen
        return None

    def arm(self, sync: bool) -> bool:
        """All-reduce in the next backward, on every one, unless it is deferred; False
        where a static graph's first iteration all-reduces all the same."""
        self._armed = armed = self._will_sync(sync)
        for ddp in self.wrappers:
            ddp.require_backward_grad_sync = armed
        return armed is sync


class ReplicateSync(DDPSync):
    """The composable ``replicate()`` (torchtitan's DDP): a DDP over a module's parameters,
    built in the module's first forward, whose flag the module's forward pre-hook sets
    from ``set_requires_gradient_sync()`` (``_no_sync`` on its state), so that is what is
    armed, on each replicated module side by side; before each backward what each DDP
    recorded of the last forward is read, as under `DDPSync`. The parameters stay the
    module's own (there is no ``.module``)."""

    def __init__(self, modules: Sequence[Any], *, defer: bool) -> None:
        self._states = [_replicate_state(module) for module in modules]
        self._defer = defer
        self.wrappers = tuple(modules)
        groups = {id(group): group for group in map(_replicate_group, self._states)}
        if len(groups) > 1:
            msg = (
                f"model holds {len(modules)} replicate() modules over different process "
                "groups; gradaccum reduces its own values (item counts, the inf/NaN check) "
                "over one group: replicate them over the same mesh"
            )
            raise ConfigError(msg)
        (self.group,) = groups.values()
        self._founds = [
            _before.take(module, functools.partial(getattr, state, "_no_sync"))
            for module, state in zip(modules, self._states, strict=True)
        ]
        self._armed = not self._states[0]._no_sync
        self._holds = True
        # Each DDP is built in its module's first forward (which verifies and broadcasts
        # the parameters); its forwards then communicate no more: replicate() wraps the
        # parameters only, so it broadcasts no buffers.
        self.forward_communicates = not all(self._ddps())

    def _ddps(self) -> list[Any]:
        """Each module's DDP, None where its first forward has not built it yet."""
        return [getattr(state, "_ddp", None) for state in self._states]

    def first_iteration(self) -> bool:
        """Whether a module asked for ``static_graph=True`` and its first iteration has not
        run (its DDP is not even built before its first forward)."""
        return any(
            bool(state._init_kwargs.get("static_graph"))
            if ddp is None
            else _before_first_iteration(ddp)
            for state, ddp in zip(self._states, self._ddps(), strict=True)
        )

    def overridden(self) -> bool | None:
        """Whether this backward all-reduces, if that is not what was armed (what a DDP
        recorded of its last forward; nothing for one not built yet)."""
        for ddp in self._ddps():
            if ddp is not None and ddp.require_forward_param_sync is not self._armed:
                return bool(ddp.require_forward_param_sync)
        return None

    def arm(self, sync: bool) -> bool:
        """All-reduce in the next backward unless it is deferred (each pre-hook sets its
        DDP's flag from it); False where a static graph's first iteration all-reduces all
        the same."""
        self._armed = armed = self._will_sync(sync)
        for state in self._states:
            state._no_sync = not armed
        return armed is sync

    def restore(self) -> None:
        """Put back the ``set_requires_gradient_sync()`` state each module had."""
        holds, self._holds = self._holds, False
        for module, state, found in zip(self.wrappers, self._states, self._founds, strict=True):
            state._no_sync = found
            if holds:
                _before.give(module)


def _replicate_state(module: Any) -> Any:
    from torch.distributed._composable.replicate import replicate

    return replicate.state(module)


def _replicate_group(state: Any) -> dist.ProcessGroup | None:
    """The group DDP averages over: the built DDP's, or the one ``replicate()`` was given
    (its ``process_group=`` or 1-D ``device_mesh=``, as DDP reads them)."""
    ddp = getattr(state, "_ddp", None)
    if ddp is not None:
        return ddp.process_group  # type: ignore[no-any-return]
    kwargs = state._init_kwargs
    mesh = kwargs.get("device_mesh")
    if mesh is not None:
        return mesh.get_group(mesh_dim=0)  # type: ignore[no-any-return]
    return kwargs.get("process_group") or dist.group.WORLD


def _replicate(model: nn.Module, policy: SyncPolicy) -> SyncStrategy:
    from torch.distributed._composable.replicate import DDP

    return ReplicateSync(_outermost(model, DDP), defer=policy != "every")


class FSDP1Sync(NoSyncContext):
    """FSDP1 (``FullyShardedDataParallel``): its flat gradient shards are clipped by FSDP1.

    Deferring holds unsharded gradients, so only ``"boundary"`` defers, and ``"auto"``
    where no FSDP module shards (``NO_SHARD``: each rank holds the whole gradient anyway).
    """

    def __init__(self, module: Any, policy: SyncPolicy) -> None:
        defer = policy == "boundary" or (policy == "auto" and not _fsdp1_shards(module))
        super().__init__(module, defer=defer, group=module.process_group)

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """FSDP1's own clipping: the norm of the whole gradient over the shards."""
        return self._module.clip_grad_norm_(max_norm)  # type: ignore[no-any-return]

    def overridden(self) -> bool | None:
        """Whether this backward reduces, when that is not what was armed: a ``no_sync()``
        of the user's own around the microstep (FSDP1's ``_sync_gradients``, which its
        ``no_sync()`` sets on every FSDP module)."""
        actual = getattr(self._module, "_sync_gradients", None)
        armed = self._held is None
        return None if actual is None or bool(actual) is armed else bool(actual)


def _fsdp1_shards(root: Any) -> bool:
    """Whether any FSDP1 module under ``root`` shards its gradients (not ``NO_SHARD``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    return any(
        module.sharding_strategy != ShardingStrategy.NO_SHARD
        for module in FullyShardedDataParallel.fsdp_modules(root)
    )


def _fsdp1(model: nn.Module, policy: SyncPolicy) -> SyncStrategy:
    from torch.distributed.fsdp import FullyShardedDataParallel

    roots = _outermost(model, FullyShardedDataParallel)
    if len(roots) > 1:
        msg = (
            f"model holds {len(roots)} FullyShardedDataParallel roots side by side; "
            "gradaccum drives one root's no_sync() and clip_grad_norm_(), which would miss "
            "the others' gradients: wrap them under one FSDP root, or use fully_shard"
        )
        raise ConfigError(msg)
    return FSDP1Sync(roots[0], policy)


def _fully_shard(model: nn.Module, policy: SyncPolicy) -> SyncStrategy:
    from torch.distributed.fsdp import FSDPModule

    return FullyShardSync([m for m in model.modules() if isinstance(m, FSDPModule)], policy)


_registry: dict[type, StrategyFactory] = {}
_warned: set[type] = set()


def register_sync_strategy(wrapper_type: type[nn.Module], factory: StrategyFactory) -> None:
    """Use ``factory`` for models that contain a ``wrapper_type`` module.

    The outermost wrapper in the model decides (see `strategy_for`); a module of a
    registered type is matched before the built-in types, the latest registration
    first, so registering a built-in type replaces its strategy. The factory gets the
    model (unwrapped from ``torch.compile``) and the ``sync`` policy, and returns a
    `SyncStrategy`.

    Raises:
        ConfigTypeError: ``wrapper_type`` is not a subclass of ``torch.nn.Module`` or
            ``factory`` is not callable.

    Examples:
        >>> class Replicated(torch.nn.Module):  # a wrapper that never communicates
        ...     pass
        >>> register_sync_strategy(Replicated, lambda model, policy: LocalSync())
    """
    if not (isinstance(wrapper_type, type) and issubclass(wrapper_type, nn.Module)):
        msg = (
            f"wrapper_type must be a torch.nn.Module subclass, got {describe(wrapper_type)}; "
            "pass the wrapper's class itself, such as DistributedDataParallel"
        )
        raise ConfigTypeError(msg)
    if not callable(factory):
        msg = f"factory must be callable as factory(model, policy), got {describe(factory)}"
        raise ConfigTypeError(msg)
    _registry.pop(wrapper_type, None)
    _registry[wrapper_type] = factory


def _builtin() -> dict[type, StrategyFactory]:
    """The wrappers torch ships, imported only once a model may contain one."""
    from torch.distributed._composable.replicate import DDP as Replicated  # noqa: N811
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    return {
        DistributedDataParallel: _ddp,
        FullyShardedDataParallel: _fsdp1,
        FSDPModule: _fully_shard,
        Replicated: _replicate,
    }


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside any ``torch.compile`` wrappers (they keep it as ``_orig_mod``)."""
    inner = getattr(model, "_orig_mod", None)
    while isinstance(inner, nn.Module):
        model = inner
        inner = getattr(model, "_orig_mod", None)
    return model


def strategy_for(model: nn.Module, policy: SyncPolicy = "auto") -> SyncStrategy:
    """Detect how ``model`` is wrapped, through ``torch.compile``, and return its strategy.

    The outermost module that is a wrapper decides: a registered type (the latest
    registration first), then DDP, FSDP1, ``fully_shard`` or the composable
    ``replicate()``, then any module with its own ``no_sync()``, which is deferred
    through like DDP, with a warning (once per type, on rank 0). A model with none of
    them is local.

    Raises:
        ConfigError: The wrapping cannot be accumulated over as it is (DDP modules side
            by side over different process groups, a ``fully_shard`` divide factor other
            than its ranks), or on several processes a module has an unknown
            ``set_requires_gradient_sync()``.

    A DDP with ``static_graph=True`` all-reduces in every backward until its first
    iteration has run (torch's reducer asserts on a first iteration that skips it), and
    defers after it.
    """
    model = unwrap(model)
    modules = list(model.modules())
    communicates = any(
        callable(getattr(module, name, None))
        for module in modules
        for name in ("no_sync", "set_requires_gradient_sync")
    )
    builtin = _builtin() if communicates and dist.is_available() else {}
    known = [*reversed(_registry.items()), *builtin.items()]
    for module in modules:
        for wrapper_type, factory in known:
            if isinstance(module, wrapper_type):
                return _checked(factory(model, policy), factory)
        if callable(getattr(module, "no_sync", None)):
            _warn_unknown(type(module))
            group = _world() if dist.is_available() and dist.is_initialized() else None
            return NoSyncContext(module, defer=policy != "every", group=group)
        if callable(getattr(module, "set_requires_gradient_sync", None)) and several_processes():
            msg = (
                f"model contains a {type(module).__name__}, which has a "
                "set_requires_gradient_sync() but is no wrapper gradaccum knows, so it "
                "cannot tell which ranks average its gradients nor defer their "
                "communication (it would sync every microstep and normalize num_items per "
                "rank); register a strategy for it with gradaccum.register_sync_strategy()"
            )
            raise ConfigError(msg)
    return LocalSync()


def _checked(strategy: object, factory: StrategyFactory) -> SyncStrategy:
    if not isinstance(strategy, SyncStrategy):
        msg = (
            f"the sync strategy factory {factory!r} returned {describe(strategy)}, which "
            "lacks members of gradaccum.SyncStrategy; subclass SyncStrategy to inherit "
            "the defaults of its optional members"
        )
        raise ConfigTypeError(msg)
    return strategy


def _warn_unknown(wrapper_type: type) -> None:
    if wrapper_type in _warned:
        return
    _warned.add(wrapper_type)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    warn(
        f"model contains a {wrapper_type.__name__}, which gradaccum does not know; its "
        "no_sync() is held open on deferred microsteps, as for DDP. Register a strategy "
        "with gradaccum.register_sync_strategy() to silence this"
    )


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank: a DTensor (``fully_shard``) gathered, else itself."""
    gather = getattr(tensor, "full_tensor", None)
    return gather() if gather is not None else tensor


def grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The total norm of the gradients, a 0-dim tensor; gathered over the mesh when they
    are DTensors (``fully_shard``), so it is the full norm, the same on every rank. A
    sparse gradient (``nn.Embedding(sparse=True)``) counts by its coalesced values."""
    grads = [grad for param in params if (grad := param.grad) is not None]
    try:
        total = nn.utils.get_total_norm(grads)
    except NotImplementedError:  # (no norm kernel for a sparse tensor: read only then)
        if not any(grad.is_sparse for grad in grads):
            raise
        total = nn.utils.get_total_norm(
            [grad.coalesce().values() if grad.is_sparse else grad for grad in grads]
        )
    return full_tensor(total)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip to ``max_norm`` by the total norm of the full gradient (`grad_norm`), without
    host sync, and return that norm."""
    total = grad_norm(params)
    nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def no_sync(model: nn.Module) -> AbstractContextManager[None]:
    """Keep the gradients of the backwards run inside the block local to this process.

    Use it around both the forward and the backward of a non-boundary microstep;
    the state found on entry is restored on exit. An unwrapped module has nothing
    to sync, so the block is a no-op. Under ``fully_shard`` (and HSDP) neither the
    reduce-scatter nor the all-reduce runs, so unsharded gradients are held. Under DDP,
    which decides in the forward, a block whose backward's forward ran before it (so
    that it all-reduced after all) is warned about on leaving it.

    Raises:
        ConfigTypeError: ``model`` is not a ``torch.nn.Module``.
        ConfigError: On entering, ``model`` is a DDP with ``static_graph=True`` that
            has not run its first iteration, whose all-reduce it cannot skip.

    Examples:
        >>> model = torch.nn.Linear(2, 1)
        >>> with no_sync(model):
        ...     model(torch.ones(1, 2)).sum().backward()
    """
    if not isinstance(model, nn.Module):
        msg = (
            f"model must be a torch.nn.Module, got {describe(model)}; pass the wrapped "
            "model whose gradient sync to skip (the DDP or FSDP module)"
        )
        raise ConfigTypeError(msg)
    return _no_sync(model)


@contextmanager
def _no_sync(model: nn.Module) -> Iterator[None]:
    strategy = strategy_for(model, "boundary")
    if isinstance(strategy, DDPSync) and strategy.first_iteration():
        strategy.restore()
        msg = (
            "no_sync() cannot keep the gradients of a DistributedDataParallel with "
            "static_graph=True local before its first iteration, which must all-reduce "
            "(torch's reducer asserts): run the run's first microstep outside no_sync() "
            "(its backward all-reduces; averaging is linear, so the window stays exact)"
        )
        raise ConfigError(msg)
    strategy.arm(False)
    # (the first that can have a gradient: a frozen embedding or backbone has none)
    first = next((param for param in model.parameters() if param.requires_grad), None)
    before = None if first is None else first.grad
    version = None if before is None else before._version
    try:
        yield
        # A wrapper that decides in the forward records what its last forward decided:
        # one that ran before the block, set to sync, made the block's backward sync
        # (a backward ran: the first parameter's gradient is another, or written since).
        now = None if first is None else first.grad
        synced = (
            strategy.decides_in_forward
            and strategy.overridden() is not None
            and (now is not before or (now is not None and now._version != version))
        )
    finally:
        strategy.restore()
    if synced:
        warn(
            "the backward inside gradaccum.no_sync(model) all-reduced the gradient: DDP "
            "decides during the forward whether the backward all-reduces, and the last "
            "forward ran before the block, while DDP was set to all-reduce; put the "
            "microbatch's forward inside the block with its backward"
        )
