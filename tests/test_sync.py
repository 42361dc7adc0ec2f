"""Wrapping detection through torch.compile, gradaccum.no_sync, unknown and registered wrappers."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

import gradaccum
from gradaccum.sync import (
    DDPSync,
    FSDP1Sync,
    FullyShardSync,
    LocalSync,
    strategy_for,
    unwrap,
)
from tests.distributed import Pair
from tests.helpers import make_batches, make_model, mean_loss, sgd


def test_compile_wrappers_are_seen_through() -> None:
    """torch.compile(model) unwraps to the module; detection compiles nothing."""
    model = make_model()
    compiled = torch.compile(model)
    assert unwrap(compiled) is model
    assert isinstance(strategy_for(compiled), LocalSync)


def test_no_sync_on_a_plain_module_accumulates_normally() -> None:
    """No communication to skip: gradients accumulate exactly as without the block."""
    model, twin = make_model(), make_model()
    batches = make_batches([2, 2])
    with gradaccum.no_sync(model):
        mean_loss(model, batches[0]).backward()
    mean_loss(model, batches[1]).backward()
    for batch in batches:
        mean_loss(twin, batch).backward()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.usefixtures("process_group")
def test_wrappings_are_detected_through_compile() -> None:
    """DDP (also inside torch.compile), FSDP1 and fully_shard each get their strategy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(make_model())
    sharded = make_model()
    fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
    fsdp1 = FullyShardedDataParallel(make_model(), device_id=torch.device("cpu"))
    for model, strategy in (
        (ddp, DDPSync),
        (torch.compile(ddp), DDPSync),
        (fsdp1, FSDP1Sync),
        (sharded, FullyShardSync),
        (torch.compile(sharded), FullyShardSync),
    ):
        assert type(strategy_for(model)) is strategy
        assert strategy_for(model).group is not None


@pytest.mark.usefixtures("process_group")
def test_ddp_modules_side_by_side_are_each_armed() -> None:
    """A model holding two DDP modules: both are armed alike, each one's last forward is
    read, close() restores both (before, only the first was armed: the second
    all-reduced every microbatch; counted on 2 ranks in test_distributed.py)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gradaccum.sync import SeveralDDPSync

    pair = Pair(make_model(), DistributedDataParallel)
    strategy = strategy_for(pair)
    assert type(strategy) is SeveralDDPSync
    with gradaccum.no_sync(pair):
        assert not pair.first.require_backward_grad_sync
        assert not pair.second.require_backward_grad_sync
    assert pair.first.require_backward_grad_sync
    assert pair.second.require_backward_grad_sync
    strategy.arm(False)
    mean_loss(pair, make_batches([2])[0]).backward()
    assert strategy.overridden() is None
    pair.second.require_backward_grad_sync = True  # a flag set otherwise than armed
    mean_loss(pair, make_batches([2])[0]).backward()
    assert strategy.overridden() is True
    strategy.restore()
    apart = Pair(
        make_model(),
        lambda module: DistributedDataParallel(module, process_group=dist.new_group([0])),
    )
    apart.first = DistributedDataParallel(apart.first.module)
    with pytest.raises(gradaccum.ConfigError, match="over different process groups"):
        strategy_for(apart)


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`:UserWarning")
@pytest.mark.usefixtures("process_group")
def test_fsdp1_roots_side_by_side_are_refused() -> None:
    """Two FSDP1 roots side by side: gradaccum drives one root's no_sync() and clipping,
    which would miss the other's gradients: refused, naming the fix."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    pair = Pair(
        make_model(), lambda module: FullyShardedDataParallel(module, device_id=torch.device("cpu"))
    )
    with pytest.raises(gradaccum.ConfigError, match="2 FullyShardedDataParallel roots"):
        gradaccum.Accumulator(pair, sgd(pair), steps=2, max_grad_norm=1.0)


@pytest.mark.usefixtures("process_group")
def test_ddp_static_graph_defers_after_its_first_iteration() -> None:
    """static_graph=True cannot skip its first iteration's all-reduce (torch's reducer
    asserts), and can defer after it: the first window all-reduces on every microstep,
    the later ones on their last only (what each forward was set to, as DDP recorded
    it), bit for bit the same on one rank as without static_graph. Raising steps from 1
    later defers from then on."""
    from torch.nn.parallel import DistributedDataParallel

    trained = []
    for static in (True, False):
        ddp = DistributedDataParallel(make_model(), static_graph=static)
        seen = []
        with gradaccum.Accumulator(ddp, sgd(ddp), steps=2) as acc:
            for batch in acc.epoch(make_batches([2] * 6)):
                loss = mean_loss(ddp, batch)
                seen.append(ddp.require_forward_param_sync)
                with acc.microstep(loss):
                    pass
        assert seen == ([True, True] if static else [False, True]) + [False, True] * 2
        trained.append(list(ddp.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(*trained, strict=True))
    ddp = DistributedDataParallel(make_model(), static_graph=True)
    acc = gradaccum.Accumulator(ddp, sgd(ddp), steps=1)
    for batch in acc.epoch(make_batches([2] * 2)):
        with acc.microstep(mean_loss(ddp, batch)):
            pass
    acc.steps = 2  # its first iteration ran: it defers from now on
    seen = []
    for batch in acc.epoch(make_batches([2] * 2)):
        loss = mean_loss(ddp, batch)
        seen.append(ddp.require_forward_param_sync)
        with acc.microstep(loss):
            pass
    assert (seen, acc.global_step) == ([False, True], 3)
    acc.close()


@pytest.mark.usefixtures("process_group")
def test_a_divide_factor_other_than_the_ranks_is_refused() -> None:
    """fully_shard's set_gradient_divide_factor (torchtitan sets 1.0 to sum) breaks the
    normalization, which assumes FSDP averages: refused at construction. A factor equal
    to the data-parallel ranks averages, and trains."""
    from torch.distributed.fsdp import fully_shard

    summing = fully_shard(make_model())
    summing.set_gradient_divide_factor(4.0)
    with pytest.raises(gradaccum.ConfigError, match=r"divides its gradients by 4\.0"):
        gradaccum.Accumulator(summing, sgd(summing), steps=2)
    averaging = fully_shard(make_model())
    averaging.set_gradient_divide_factor(1.0)  # one rank: the average
    with gradaccum.Accumulator(averaging, sgd(averaging), steps=2) as acc:
        for batch in acc.epoch(make_batches([2] * 4)):
            with acc.microstep(mean_loss(averaging, batch)):
                pass
    assert acc.global_step == 2


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize("frozen_first", [False, True], ids=["trainable", "frozen_first"])
def test_no_sync_around_a_backward_whose_forward_ran_before_it_is_warned_about(
    frozen_first: bool,
) -> None:
    """The bug gradaccum was born from, in a hand loop that takes only gradaccum.no_sync:
    the forward before the block, the backward inside it. DDP decided in the forward, so
    the backward all-reduced after all (counted); leaving the block warns. The forward
    inside the block all-reduces nothing and warns nothing; neither does a block that ran
    no backward. A first parameter that is frozen (an embedding, when fine-tuning) once
    hid the all-reduce: the block watched its gradient, which never comes."""
    from torch.nn.parallel import DistributedDataParallel

    from gradaccum.testing import CollectiveCounter

    model = make_model()
    if frozen_first:
        model[0].weight.requires_grad_(False)
    ddp = DistributedDataParallel(model)
    batch = make_batches([2])[0]
    with CollectiveCounter() as outside:
        loss = mean_loss(ddp, batch)
        with pytest.warns(gradaccum.GradaccumWarning) as caught, gradaccum.no_sync(ddp):
            loss.backward()
    (warning,) = caught
    assert str(warning.message).startswith(
        "the backward inside gradaccum.no_sync(model) all-reduced the gradient: DDP decides "
        "during the forward"
    )
    assert warning.filename == __file__
    assert outside.counts.all_reduces == 1
    ddp.zero_grad()
    with warnings.catch_warnings(), CollectiveCounter() as inside:
        warnings.simplefilter("error", gradaccum.GradaccumWarning)
        with gradaccum.no_sync(ddp):
            mean_loss(ddp, batch).backward()
        mean_loss(ddp, batch)  # the flag is back: a forward before an empty block
        with gradaccum.no_sync(ddp):
            pass
    assert inside.counts.all_reduces == 0
    assert ddp.require_backward_grad_sync


def _sync_flags(model: nn.Module) -> list[Any]:
    """What every DDP and ``fully_shard`` module of ``model`` will do in its next backward:
    DDP's flag, each FSDP parameter group's reduce-scatter and all-reduce flags."""
    from torch.nn.parallel import DistributedDataParallel

    from gradaccum.sync import _fsdp_flags

    return [
        module.require_backward_grad_sync
        if isinstance(module, DistributedDataParallel)
        else _fsdp_flags(module)
        for module in model.modules()
        if isinstance(module, DistributedDataParallel) or hasattr(module, "_get_fsdp_state")
    ]


@pytest.mark.usefixtures("process_group")
@pytest.mark.parametrize("wrap", ["ddp", "pair", "fully_shard"])
def test_an_accumulator_left_open_does_not_change_what_a_new_one_restores(wrap: str) -> None:
    """A model trained by one accumulator that is never closed, then by a new one on a new
    optimizer (DDP, two DDPs side by side, ``fully_shard`` deferring to the boundary): the
    second found the sync flags as the first left them (off, for the first's next
    window), and used to leave them off when it closed, so that a loop of one's own on
    the model would never reduce again. It restores what the user had; so does the
    first, closed last; flags the user set with no accumulator open are theirs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if wrap == "ddp":
        model: nn.Module = DistributedDataParallel(make_model())
    elif wrap == "pair":
        model = Pair(make_model(), DistributedDataParallel)
    else:
        model = make_model()
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    users = _sync_flags(model)
    batches = make_batches([2] * 4)
    first = gradaccum.Accumulator(model, sgd(model), steps=2, sync="boundary")
    for batch in first.epoch(batches):
        with first.microstep(mean_loss(model, batch)):
            pass
    assert _sync_flags(model) != users  # off, for the first's next window
    with pytest.warns(gradaccum.GradaccumWarning, match="same DDP or FSDP model"):
        second = gradaccum.Accumulator(  # (it takes the model over: the first is closed)
            model, torch.optim.AdamW(model.parameters()), steps=2, sync="boundary"
        )
    for batch in second.epoch(batches):
        with second.microstep(mean_loss(model, batch)):
            pass
    second.close()
    assert _sync_flags(model) == users
    first.close()
    assert _sync_flags(model) == users
    for module in model.modules():  # the user's own state, set with no accumulator open
        if isinstance(module, DistributedDataParallel):
            module.require_backward_grad_sync = False
        elif hasattr(module, "set_requires_gradient_sync"):
            module.set_requires_gradient_sync(False, recurse=False)
    left = _sync_flags(model)
    assert left != users
    with gradaccum.Accumulator(model, sgd(model), steps=2, sync="boundary"):
        pass
    assert _sync_flags(model) == left


@pytest.mark.usefixtures("process_group")
def test_no_sync_refuses_static_graph_only_before_its_first_iteration() -> None:
    """no_sync() has no sync argument, so its refusal of a static graph's first
    iteration says what to do instead, and leaves the DDP flag as it was; once a first
    microstep has all-reduced outside it, no_sync() keeps the next backward local."""
    from torch.nn.parallel import DistributedDataParallel

    from gradaccum.testing import CollectiveCounter

    ddp = DistributedDataParallel(make_model(), static_graph=True)
    with pytest.raises(gradaccum.ConfigError) as caught, gradaccum.no_sync(ddp):
        pass
    assert str(caught.value) == (
        "no_sync() cannot keep the gradients of a DistributedDataParallel with "
        "static_graph=True local before its first iteration, which must all-reduce "
        "(torch's reducer asserts): run the run's first microstep outside no_sync() "
        "(its backward all-reduces; averaging is linear, so the window stays exact)"
    )
    assert ddp.require_backward_grad_sync
    batches = make_batches([2, 2])
    mean_loss(ddp, batches[0]).backward()  # the first iteration, all-reducing
    counter = CollectiveCounter()
    with counter, gradaccum.no_sync(ddp):
        mean_loss(ddp, batches[1]).backward()
    assert counter.counts.all_reduces == 0
    assert ddp.require_backward_grad_sync


class Wrapper(nn.Module):
    """A wrapper gradaccum does not know, with its own no_sync(); records what forward saw."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model()
        self.syncing = True
        self.seen: list[bool] = []

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        before, self.syncing = self.syncing, False
        try:
            yield
        finally:
            self.syncing = before

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.syncing)
        return self.inner(x)  # type: ignore[no-any-return]


def test_an_unknown_wrapper_with_no_sync_is_used_with_one_warning() -> None:
    """Its no_sync() is held over the forwards of deferred microsteps; warned once per type."""
    models = [Wrapper(), Wrapper()]
    with pytest.warns(gradaccum.GradaccumWarning, match="Wrapper, which gradaccum does not know"):
        accs = [gradaccum.Accumulator(models[0], sgd(models[0]), steps=3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accs.append(gradaccum.Accumulator(models[1], sgd(models[1]), steps=3))
    for model, acc in zip(models, accs, strict=True):
        for batch in acc.epoch(make_batches([2] * 6)):
            with acc.microstep(mean_loss(model, batch)):
                pass
        acc.close()
        assert model.seen == [False, False, True] * 2
        assert model.syncing


def test_a_registered_strategy_is_used_for_its_type() -> None:
    """register_sync_strategy: the factory gets the unwrapped model and the policy."""

    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = make_model()

        def no_sync(self) -> None: ...  # would otherwise be used with a warning

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)  # type: ignore[no-any-return]

    calls: list[object] = []

    class Recording(LocalSync):
        def arm(self, sync: bool) -> None:
            calls.append(sync)

        def restore(self) -> None:
            calls.append("restore")

    def factory(model: nn.Module, policy: gradaccum.SyncPolicy) -> gradaccum.SyncStrategy:
        calls.append((type(model).__name__, policy))
        return Recording()

    gradaccum.register_sync_strategy(Custom, factory)
    model = Custom()
    with gradaccum.Accumulator(torch.compile(model), sgd(model), steps=2, sync="boundary") as acc:
        for batch in acc.epoch(make_batches([2] * 2)):
            with acc.microstep(mean_loss(model, batch)):
                pass
    assert calls == [("Custom", "boundary"), False, True, False, "restore"]


def test_register_sync_strategy_refuses_bad_arguments() -> None:
    """Only a Module subclass and a callable factory are accepted, named in the message."""
    with pytest.raises(gradaccum.ConfigTypeError, match=r"wrapper_type must be .* got 3 \(int\)"):
        gradaccum.register_sync_strategy(3, lambda model, policy: LocalSync())  # type: ignore[arg-type]
    with pytest.raises(gradaccum.ConfigTypeError, match="factory must be callable"):
        gradaccum.register_sync_strategy(nn.Linear, None)  # type: ignore[arg-type]


class Wrapped(nn.Module):
    """A wrapper type of its own, registered by the tests below."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 1)


class Structural:
    """A strategy with only the required members, not a subclass of SyncStrategy."""

    group = None

    def arm(self, sync: bool) -> None: ...

    def restore(self) -> None: ...


class Subclassed(gradaccum.SyncStrategy):
    """The same strategy as a subclass: the optional members come with their defaults."""

    group = None

    def arm(self, sync: bool) -> None: ...

    def restore(self) -> None: ...


def test_a_strategy_without_the_optional_members_is_refused_up_front() -> None:
    """A factory whose strategy lacks the optional members is refused when the model is
    detected, naming the fix; subclassing SyncStrategy inherits their defaults."""
    model = Wrapped()
    gradaccum.register_sync_strategy(Wrapped, lambda model, policy: Structural())  # type: ignore[arg-type, return-value]
    with pytest.raises(gradaccum.ConfigTypeError, match="subclass SyncStrategy"):
        gradaccum.Accumulator(model, sgd(model), steps=2)
    gradaccum.register_sync_strategy(Wrapped, lambda model, policy: Subclassed())
    acc = gradaccum.Accumulator(model, sgd(model), steps=2)
    strategy = strategy_for(model)
    assert strategy.grads_in_params is False
    assert strategy.overridden() is None
    acc.close()
