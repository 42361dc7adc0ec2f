"""The user's model stays as it is: what gradaccum installs (gradaccum/hooks.py) survives
saving the whole model, deepcopy, an EMA copy, torch.compile and state_dict(), open or
closed, one accumulator or several in turn, and close() leaves the model exactly as it
was; the hooks' state stays bounded; the watches are not fooled."""

from __future__ import annotations

import functools
import itertools
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import gradaccum
from tests import hooks_distributed
from tests.distributed import run
from tests.helpers import make_batches, make_model, max_param_diff, mean_loss, reference_sgd
from tests.test_distributed import global_windows

TOL = 1e-10
KINDS = {2: ["ddp", "fsdp1", "fully_shard", "compile_ddp_eager", "replicate", "replicate_fsdp"]}
PHASES = ("open", "open closed", "second open", "second open closed")


@functools.cache
def _habits(world: int) -> list[dict[str, Any]]:
    return run(hooks_distributed.habits_around_accumulators, world, KINDS[world])


def check_habits(seen: dict[str, Any]) -> None:
    """Every habit that works without gradaccum works alike with an accumulator open,
    closed, and a second one open after the first; the model ends exactly as it began; no
    warning (a copy's forwards reach no accumulator)."""
    legal = {
        name: got for name, got in seen["without"].items() if not str(got).startswith("raised")
    }
    assert legal, seen["without"]
    for phase in PHASES:
        for name, got in legal.items():
            assert seen[phase][name] == got, (phase, name, seen[phase][name])
    assert seen["after"] == seen["before"]
    assert seen["warnings"] == []


@pytest.mark.parametrize("kind", KINDS[2])
def test_the_habits_around_the_loop_work_under_every_wrapping(kind: str) -> None:
    """On 2 gloo ranks (where the forward guard is on): DDP, FSDP1, fully_shard and
    compiled DDP; a habit that is illegal without gradaccum (deepcopy of FSDP1) is not
    asked for."""
    for rank in _habits(2):
        check_habits(rank[kind])
    ddp = _habits(2)[0]["ddp"]
    assert set(ddp["without"]) == {"torch.save", "deepcopy", "ema", "state_dict", "compile"}
    assert ddp["without"]["torch.save"] == "DistributedDataParallel"


@pytest.mark.parametrize("kind", ["plain", "ddp"])
@pytest.mark.usefixtures("process_group")
def test_the_habits_work_on_one_process(kind: str) -> None:
    """A plain module, and DDP on one rank (whose forward pre-hook is on), alike."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel if kind == "ddp" else (lambda model: model)
    model = wrapped(make_model())
    batches = make_batches([2] * 2)
    mean_loss(model, batches[0]).backward()
    for param in model.parameters():
        param.grad = None
    seen: dict[str, Any] = {"without": hooks_distributed.habits(model, batches[0])}
    seen["before"] = hooks_distributed.fingerprint(model)  # torch.compile marks the model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gradaccum.GradaccumWarning)
        for phase in ("open", "second open"):
            acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters()), steps=2)
            with acc.microstep(mean_loss(model, batches[0])):
                pass
            seen[phase] = hooks_distributed.habits(model, batches[0])
            with acc.microstep(mean_loss(model, batches[1])):
                pass
            acc.close()
            seen[f"{phase} closed"] = hooks_distributed.habits(model, batches[0])
    seen["after"] = hooks_distributed.fingerprint(model)
    seen["warnings"] = [str(w.message) for w in caught]
    check_habits(seen)


@pytest.mark.parametrize("kind", ["compile(ddp)", "ddp(compile)"])
def test_a_compiled_ddp_model_compiles_once_whatever_the_accumulators(kind: str) -> None:
    """3 accumulators in turn on one compiled DDP model, after the same windows by hand:
    no compilation more than the hand loop's (the model's type and attributes do not
    change per accumulator; before, each new accumulator recompiled)."""
    for counts in run(hooks_distributed.compilations, 2, kind):
        assert counts[0] > 0
        assert counts == [counts[0]] * 4


@pytest.mark.usefixtures("process_group")
def test_forwards_without_microsteps_keep_the_hooks_state_bounded() -> None:
    """Under DDP the accumulator follows each forward's flag: 2,000 forwards under grad
    without a microstep allocate nothing in gradaccum that stays."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make_model())
    x = make_batches([2])[0][0]
    with gradaccum.Accumulator(model, torch.optim.SGD(model.parameters()), steps=2):
        tracemalloc.start()
        try:
            for _ in range(50):
                model(x)
            mine = [tracemalloc.Filter(True, str(Path(gradaccum.__file__).parent / "*"))]
            before = tracemalloc.take_snapshot().filter_traces(mine)
            for _ in range(2000):
                model(x)
            after = tracemalloc.take_snapshot().filter_traces(mine)
        finally:
            tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert grown <= 0, after.compare_to(before, "lineno")[:3]


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "ddp"])
def test_model_zero_grad_is_caught_when_the_optimizer_starts_outside_the_model(
    wrapped: bool, request: pytest.FixtureRequest
) -> None:
    """An optimizer whose first parameter is a learnable loss temperature, not the
    model's: ``model.zero_grad()`` inside the window wipes the model's share and is
    refused at the next microstep (it used to be trained through, 8e-2 off)."""
    model: torch.nn.Module = make_model()
    if wrapped:
        from torch.nn.parallel import DistributedDataParallel

        request.getfixturevalue("process_group")
        model = DistributedDataParallel(model)
    temperature = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
    optimizer = torch.optim.SGD([temperature, *model.parameters()], lr=0.1)
    acc = gradaccum.Accumulator(model, optimizer, steps=3)
    batches = make_batches([2] * 2)
    with acc.microstep(mean_loss(model, batches[0]) * temperature):
        pass
    model.zero_grad()
    with pytest.raises(gradaccum.UsageError, match=r"model\.zero_grad"):  # noqa: SIM117
        with acc.microstep(mean_loss(model, batches[1]) * temperature):
            pass
    acc.close()


@pytest.mark.parametrize("static_graph", [False, True])
def test_ddp_bucket_views_rebuilt_after_the_first_backward_are_no_wipe(static_graph: bool) -> None:
    """``gradient_as_bucket_view=True`` under ``sync="every"`` (what ``static_graph=True``
    needs): DDP re-points every ``param.grad`` at rebuilt buckets with the same values
    after its first all-reducing backward; the first window is not refused, no warning,
    and 3 windows match the float64 big batch."""
    windows = global_windows([[2] * 12] * 2, 2)
    expected = reference_sgd(make_model(), windows, lr=0.1)
    for outcome in run(hooks_distributed.bucket_views, 2, static_graph):
        assert outcome["error"] is None
        assert outcome["warnings"] == []
        assert outcome["global_step"] == 3
        got = make_model()
        with torch.no_grad():
            for param, value in zip(got.parameters(), outcome["params"], strict=True):
                param.copy_(value)
        assert max_param_diff(got, expected) < TOL


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("ddp", "inside a no_sync() of your own"),
        ("fsdp1", "the sync state of FSDP1Sync was changed"),
        ("fully_shard", "the sync state of FullyShardSync was changed"),
        ("replicate", "inside a no_sync() of your own"),
    ],
)
def test_a_no_sync_of_the_users_own_around_the_boundary_is_warned_about(
    kind: str, says: str
) -> None:
    """A hand loop's leftover ``no_sync()`` (``set_requires_gradient_sync(False)``) that
    also covers each window's last microstep: its backward does not reduce (under DDP the
    ranks drift apart; FSDP1 then fails to step); each such boundary is warned about,
    comparing with what was armed."""
    ranks = run(hooks_distributed.own_no_sync, 2, kind)
    for rank in ranks:
        boundary = [m for m in rank["warnings"] if "not reduced over the ranks" in m]
        if kind == "fsdp1":  # FSDP1 then fails to step its shards with unsharded grads
            assert "must match the size" in rank["error"]
            assert len(boundary) == 1, rank["warnings"]
        else:
            assert len(boundary) == 2, rank["warnings"]
        assert all(says in message for message in boundary)
    if kind in ("ddp", "replicate"):  # each rank applied its own gradient
        pairs = zip(ranks[0]["params"], ranks[1]["params"], strict=True)
        assert not all(torch.equal(p, q) for p, q in pairs)


def test_a_deferred_forward_of_the_users_own_is_no_false_alarm() -> None:
    """``no_sync()`` of the user's own around a non-boundary microstep only, where the
    accumulator defers anyway: armed and seen agree, no warning."""
    model = make_model()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters()), steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradaccum.GradaccumWarning)
        for batch in itertools.islice(acc.epoch(make_batches([2] * 4)), 4):
            with acc.microstep(mean_loss(model, batch)):
                pass
    acc.close()


@pytest.mark.parametrize(
    ("buffers", "broadcast", "communicates"),
    [(False, True, False), (True, True, True), (True, False, False)],
    ids=["no buffers", "buffers broadcast", "buffers not broadcast"],
)
@pytest.mark.filterwarnings("ignore:`broadcast_buffers` is deprecated:FutureWarning")
@pytest.mark.usefixtures("process_group")
def test_ddp_forward_communicates_only_when_it_broadcasts_buffers(
    buffers: bool, broadcast: bool, communicates: bool
) -> None:
    """The forward guard of several ranks watches forwards that run a collective: DDP's
    runs one only to broadcast buffers. On one rank no hook is put on a DDP model at all
    (DDP's decision is read from what DDP recorded), so its calls keep torch's fast path."""
    from torch.nn.parallel import DistributedDataParallel

    from gradaccum.sync import strategy_for

    inner = make_model()
    if buffers:
        inner.register_buffer("running", torch.zeros(1, dtype=torch.float64))
    model = DistributedDataParallel(inner, broadcast_buffers=broadcast)
    assert strategy_for(model).forward_communicates is communicates
    with gradaccum.Accumulator(model, torch.optim.SGD(model.parameters()), steps=2) as acc:
        for batch in acc.epoch(make_batches([2] * 2)):
            assert not model._forward_hooks
            assert not model._forward_pre_hooks
            with acc.microstep(mean_loss(model, batch)):
                pass
    assert acc.global_step == 1


@pytest.mark.usefixtures("process_group")
def test_ddp_boundary_forward_under_a_no_sync_of_ones_own_is_caught_on_one_rank() -> None:
    """What DDP recorded of the boundary's forward (``require_forward_param_sync``) is read
    before its backward: a forward inside a ``no_sync()`` of the user's own is warned
    about, and the same loop without it warns nothing."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make_model())
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters()), steps=2)
    batches = make_batches([2] * 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", gradaccum.GradaccumWarning)
        for index, batch in enumerate(acc.epoch(batches)):
            if index == 1:
                with model.no_sync():
                    loss = mean_loss(model, batch)
            else:
                loss = mean_loss(model, batch)
            with acc.microstep(loss):
                pass
    acc.close()
    (message,) = [str(w.message) for w in caught]
    assert "the forward of microstep 2 of 2 ran while DDP was set to defer" in message
    assert "not reduced over the ranks" in message


def test_on_several_ranks_only_a_forward_that_communicates_is_hooked() -> None:
    """2 DDP ranks: without buffers the model gets no hook (its forward keeps torch's fast
    module call: DDP's decision is read from DDP itself); with buffers to broadcast, the
    forward guard's one hook; both train alike on every rank, with no warning, and
    close() takes the hook back."""
    ranks = run(hooks_distributed.forward_hooks, 2)
    for rank in ranks:
        assert rank["no buffers"]["hooks"] == 0
        assert rank["buffers"]["hooks"] == 1
        for seen in rank.values():
            assert seen["after close"] == 0
            assert seen["warnings"] == []
            assert seen["global_step"] == 2
    for name in ("no buffers", "buffers"):
        pairs = zip(ranks[0][name]["params"], ranks[1][name]["params"], strict=True)
        assert all(torch.equal(p, q) for p, q in pairs)


@pytest.mark.parametrize("kind", ["ddp", "fully_shard"])
def test_zero_grad_in_the_boundary_block_is_refused_on_every_rank(kind: str) -> None:
    """``optimizer.zero_grad()`` left in the boundary's block on 2 ranks (DDP, whose
    window's gradient is ``param.grad`` throughout, and ``fully_shard``, whose is only at
    the boundary): each rank refuses it leaving the block, before any optimizer step, so
    the parameters are as they started."""
    for rank in run(hooks_distributed.boundary_zero_grad, 2, kind):
        assert "inside its boundary block" in (rank["error"] or "")
        assert (rank["stepped"], rank["global_step"], rank["unchanged"]) == (0, 0, True)


def test_a_model_wrapped_in_ddp_after_the_accumulator_is_refused_at_its_first_forward() -> None:
    """2 ranks, an Accumulator built on a plain model that DDP then wraps (``model =
    DDP(model)``, or ``accelerator.prepare`` after the accumulator), directly or inside a
    larger model: the accumulator took it for unwrapped, so DDP would all-reduce on every
    microbatch (exact gradients: only a count shows it) and the ranks' epochs would not be
    agreed (so for the composable ``replicate()`` applied in place after it). The first
    training forward is refused, before any backward (an evaluation's
    under no_grad before it is not looked at); on a plain model that no DDP wraps (each
    rank trains its own), the one-forward look leaves no hook and it trains."""
    for rank in run(hooks_distributed.wrapped_after, 2):
        for name in ("wrapped after", "inside a wrapped model", "replicated after"):
            seen = rank[name]
            assert seen["error"].startswith(
                "the model's forward runs inside a DistributedDataParallel built around it "
                "after the Accumulator"
            ), seen
            assert "Build the Accumulator on the wrapped model" in seen["error"]
            own = 1 if name == "replicated after" else 0  # replicate()'s own forward hook
            assert (seen["hooked"], seen["hooks after"], seen["global_step"]) == (1, own, 0)
            assert not seen["trained"]
            assert all(seen["grads"])
        alone = rank["never wrapped"]
        assert (alone["error"], alone["hooked"], alone["hooks after"]) == (None, 1, 0)
        assert alone["global_step"] == 2
        assert alone["trained"]
        scripted = rank["scripted"]  # a ScriptModule takes no hook: it is not looked at
        assert (scripted["error"], scripted["global_step"], scripted["trained"]) == (None, 2, True)


def test_a_plain_model_compiled_with_fullgraph_on_several_ranks_trains() -> None:
    """On several ranks a plain model carries gradaccum's hook until its first training
    forward; traced into a ``fullgraph=True`` compiled forward (``model.compile()`` in
    place, or ``torch.compile`` of the model after the Accumulator), it once failed the
    compilation (dynamo cannot call its weak references). It does nothing there now."""
    for rank in run(hooks_distributed.fullgraph_compiled, 2):
        assert rank == {
            "model.compile() before": "global_step 2",
            "torch.compile after": "global_step 2",
        }, rank


class _Listener:
    """A ``failed`` listener that gives ``instead`` (held weakly by the hook: kept here)."""

    def __init__(self, instead: BaseException | None) -> None:
        self.instead = instead
        self.seen: list[BaseException] = []

    def failed(self, error: BaseException) -> BaseException | None:
        self.seen.append(error)
        return self.instead


@pytest.mark.parametrize("replaces", [True, False], ids=["replaced", "noted_as_on_3_10"])
def test_a_listener_replaces_the_error_of_a_failing_forward(
    replaces: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward whose pre-hook fails (as FSDP's all-gather does) raises the error the
    ``failed`` listener gives, from the forward's own; where CPython cannot replace it
    (3.10), the forward's own error, with the replacement's message as a note. A listener
    that gives nothing leaves the error as it was; the model keeps its class."""
    from gradaccum import hooks

    if not replaces:
        monkeypatch.setattr(hooks, "_set_handled", None)
    elif hooks._set_handled is None:
        pytest.skip("no PyErr_SetHandledException on this Python")
    model = make_model()
    found = type(model)

    def collective(module: torch.nn.Module, args: Any) -> None:
        raise RuntimeError("Connection closed by peer")

    model.register_forward_pre_hook(collective)
    instead = gradaccum.RankFailedError("rank 1 failed first", 1, 1)
    listener = _Listener(instead)
    watching = hooks.watch(model, failed=listener.failed)
    with pytest.raises(RuntimeError) as caught:
        model(torch.ones(2, 5, dtype=torch.float64))
    if replaces:
        assert caught.value is instead
        assert isinstance(caught.value.__cause__, RuntimeError)
        assert str(caught.value.__cause__) == "Connection closed by peer"
    else:
        assert str(caught.value) == "Connection closed by peer"
        assert caught.value.__notes__ == ["gradaccum.RankFailedError: rank 1 failed first"]
    assert [str(seen) for seen in listener.seen] == ["Connection closed by peer"]
    listener.instead = None
    with pytest.raises(RuntimeError, match="Connection closed by peer") as caught:
        model(torch.ones(2, 5, dtype=torch.float64))
    assert not isinstance(caught.value, gradaccum.RankFailedError)
    assert type(model) is found
    watching.remove()
