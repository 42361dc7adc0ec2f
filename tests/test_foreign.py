"""Accelerate's prepared optimizer and scheduler: unwrapped and stepped once per window, or
refused with the object to pass (one process; 2 processes in tests/test_examples_accelerate.py);
its prepared DataLoader resumed mid-epoch. Lightning Fabric's optimizer, with a scheduler
built on the optimizer it wraps."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import gradaccum
from tests.helpers import (
    make_batches,
    make_model,
    max_param_diff,
    mean_loss,
    reference_run,
    windows_of,
)

accelerate = pytest.importorskip("accelerate", reason="Accelerate is a test-only dependency")


@pytest.fixture
def accelerator() -> Iterator[object]:
    """A one-process CPU Accelerator; its process-wide state is reset afterwards."""
    from accelerate.state import AcceleratorState, GradientState

    yield accelerate.Accelerator(cpu=True)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def parts(model: torch.nn.Module) -> tuple[list[torch.optim.Optimizer], list[object]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.9**k)]


def test_prepared_optimizer_and_scheduler_train_exactly(accelerator: object) -> None:
    """``accelerator.prepare(model, optimizer, scheduler)`` kept: the accumulator steps the
    torch optimizer and scheduler they wrap, once per window, and matches the float64
    big batch."""
    batches = make_batches([3] * 10)
    model = make_model()
    expected = reference_run(model, windows_of(batches, 4), parts)
    (optimizer,), (scheduler,) = parts(model)
    model, prepared_optimizer, prepared_scheduler = accelerator.prepare(  # type: ignore[attr-defined]
        model, optimizer, scheduler
    )
    assert type(prepared_optimizer).__name__ == "AcceleratedOptimizer"
    acc = gradaccum.Accumulator(model, prepared_optimizer, prepared_scheduler, steps=4)
    assert acc.optimizers == (optimizer,)
    assert acc.schedulers == (scheduler,)
    assert acc.optimizer is prepared_optimizer  # the argument, as given
    for batch in acc.epoch(batches):
        with acc.microstep(mean_loss(model, batch)):
            pass
    assert scheduler.last_epoch == acc.global_step == 2
    assert max_param_diff(model, expected) < 1e-12


def test_a_scheduler_built_before_fabric_s_setup_steps_the_optimizer_it_wraps() -> None:
    """Lightning Fabric's ``fabric.setup(model, optimizer)`` after the scheduler was built on
    the plain AdamW (the common torch order): the Accumulator refused it ("scheduler steps
    another optimizer (AdamW) than the one given"), though Fabric's optimizer wraps that
    AdamW (its ``.optimizer``). It is accepted, steps Fabric's optimizer and the scheduler
    once per window, and matches the big batch; a scheduler of another optimizer is still
    refused."""
    fabric = pytest.importorskip(
        "lightning_fabric", reason="the trainers extra: pip install gradaccum[trainers]"
    ).Fabric(accelerator="cpu", devices=1)
    batches = make_batches([3] * 10)
    model = make_model()
    expected = reference_run(model, windows_of(batches, 4), parts)
    (optimizer,), (scheduler,) = parts(model)
    model, wrapped = fabric.setup(model, optimizer)
    assert wrapped.optimizer is optimizer
    assert wrapped is not optimizer
    acc = gradaccum.Accumulator(model, wrapped, scheduler, steps=4)
    for batch in acc.epoch(batches):
        with acc.microstep(mean_loss(model, batch)):
            pass
    assert scheduler.last_epoch == acc.global_step == 2
    assert max_param_diff(model, expected) < 1e-12
    _, (elsewhere,) = parts(make_model())
    with pytest.raises(gradaccum.ConfigError, match="steps another optimizer"):
        gradaccum.Accumulator(model, wrapped, elsewhere, steps=4)


def test_a_prepared_fp16_optimizer_needs_accelerates_scaler(accelerator: object) -> None:
    """A prepared optimizer that steps through Accelerate's GradScaler is refused unless
    that scaler is passed; with it, the accumulator scales and steps through it."""
    from accelerate.optimizer import AcceleratedOptimizer

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
    prepared = AcceleratedOptimizer(optimizer, device_placement=False, scaler=scaler)
    with pytest.raises(gradaccum.ConfigError, match=r"pass scaler=accelerator\.scaler"):
        gradaccum.Accumulator(model, prepared, steps=2)
    assert not optimizer._optimizer_step_pre_hooks
    acc = gradaccum.Accumulator(model, prepared, steps=2, scaler=scaler)
    for batch in acc.epoch(make_batches([2] * 4)):
        with acc.microstep(mean_loss(model, batch)):
            pass
    assert acc.global_step == 2
    assert scaler.get_scale() == 2.0**6  # updated once per window, by the accumulator


@pytest.mark.parametrize(
    "attribute", ["optimizer", "optim", "_optimizer", "base_optimizer", "_base_optimizer"]
)
def test_a_wrapper_that_is_no_working_optimizer_is_refused_with_the_object_to_pass(
    attribute: str,
) -> None:
    """A foreign wrapper gradaccum cannot hook is refused in one line that names its type
    and the optimizer it wraps, not with torch's AttributeError: wherever it keeps it
    (``.optimizer``; torch's PostLocalSGDOptimizer's ``.optim``; SAM's ``.base_optimizer``;
    timm's Lookahead's ``._base_optimizer``)."""

    class Lookahead(torch.optim.Optimizer):
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            setattr(self, attribute, optimizer)
            self.param_groups = optimizer.param_groups

    model = make_model()
    with pytest.raises(gradaccum.ConfigTypeError) as caught:
        gradaccum.Accumulator(model, Lookahead(torch.optim.SGD(model.parameters(), lr=0.1)))
    message = str(caught.value)
    assert "\n" not in message
    assert "optimizer is a Lookahead" in message
    assert f"optimizer.{attribute} (a SGD)" in message


def regression_data() -> Any:
    """24 float64 samples of 5 features and a target, the same every time."""
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(3)
    return TensorDataset(
        torch.randn(24, 5, generator=generator, dtype=torch.float64),
        torch.randn(24, 1, generator=generator, dtype=torch.float64),
    )


def resumed_mid_epoch(accelerator: object, stateful: bool, skip_by_hand: bool = False) -> bool:
    """One epoch of 12 microbatches of a prepared DataLoader, windows of 2, saved after
    the third window and resumed with fresh objects and a fresh prepared loader (with
    ``stateful``, its own state loaded too): whether the resumed run ends with exactly the
    parameters of the uninterrupted one."""
    from torch.utils.data import DataLoader

    data = regression_data()

    def run(state: dict[str, object] | None) -> tuple[torch.nn.Module, dict[str, object]]:
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        order = {"shuffle": True, "generator": torch.Generator().manual_seed(5)}
        loader = DataLoader(data, batch_size=2, **({} if stateful else order))
        loader = accelerator.prepare(loader)  # type: ignore[attr-defined]
        acc = gradaccum.Accumulator(model, optimizer, steps=2)
        if state is not None:
            model.load_state_dict(state["model"])  # type: ignore[arg-type]
            optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
            acc.load_state_dict(state["acc"])  # type: ignore[arg-type]
            if stateful:
                loader.load_state_dict(state["loader"])
            if skip_by_hand:
                loader = accelerator.skip_first_batches(loader, acc.position)  # type: ignore[attr-defined]
        saved: dict[str, object] = {}
        for batch in acc.epoch(loader):
            with acc.microstep(mean_loss(model, batch)):
                pass
            if state is None and acc.global_step == 3 and not saved:
                saved = {
                    "model": {k: v.clone() for k, v in model.state_dict().items()},
                    "optimizer": copy.deepcopy(optimizer.state_dict()),
                    "acc": acc.state_dict(),
                    "loader": copy.deepcopy(loader.state_dict()) if stateful else None,
                }
        acc.close()
        return model, saved

    whole, state = run(None)
    resumed, _ = run(state)
    pairs = zip(whole.parameters(), resumed.parameters(), strict=True)
    return all(torch.equal(p, q) for p, q in pairs)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # (torchdata's)
@pytest.mark.parametrize("stateful", [False, True], ids=["DataLoaderShard", "stateful"])
def test_a_prepared_dataloader_resumes_mid_epoch_exactly(
    accelerator: object, stateful: bool
) -> None:
    """Accelerate's prepared DataLoader has ``state_dict`` and ``load_state_dict`` methods
    whatever it wraps; only over a ``StatefulDataLoader`` (``use_stateful_dataloader=True``)
    does it restore its position. Over a plain one the accumulator skips for it (it drew
    the epoch's first microbatches again, and trained on them twice); over a stateful one
    its own state resumes it. Both resume bit for bit."""
    from accelerate.utils import DataLoaderConfiguration

    if stateful:
        accelerator = accelerate.Accelerator(
            cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
        )
    assert resumed_mid_epoch(accelerator, stateful)


def fresh_accelerator(**config: Any) -> Any:
    """A one-process CPU Accelerator with this DataLoader configuration, from a clean
    process-wide state (the fixture resets it after the test)."""
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return accelerate.Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))


@pytest.mark.usefixtures("accelerator")
def test_a_prepared_loader_runs_to_its_end_every_epoch() -> None:
    """Accelerate's prepared loader advances its epoch (so a seedable sampler's order,
    the Hugging Face Trainer's default) in code after its last batch. An epoch of
    ``acc.epoch`` stopped after its last trained microbatch, so that code never ran: every
    epoch trained on the first epoch's order, and the loader stayed "in the dataloader"
    (``gather_for_metrics`` then cut an evaluation's results). Each epoch now runs it to
    its end: three epochs see the plain loop's three orders."""
    from torch.utils.data import DataLoader

    def orders(through_accumulator: bool) -> tuple[list[list[float]], Any]:
        accelerator = fresh_accelerator(use_seedable_sampler=True)
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        data = torch.arange(20.0)[:, None]
        model, optimizer, loader = accelerator.prepare(
            model, optimizer, DataLoader(data, batch_size=2, shuffle=True)
        )
        acc = gradaccum.Accumulator(model, optimizer, steps=5) if through_accumulator else None
        seen = []
        for _ in range(3):
            epoch: list[float] = []
            for batch in loader if acc is None else acc.epoch(loader):
                epoch += batch.flatten().tolist()
                if acc is not None:
                    with acc.microstep(model(batch).sum()):
                        pass
            seen.append(epoch)
        return seen, (loader.iteration, accelerator.gradient_state.in_dataloader)

    by_hand, ended = orders(through_accumulator=False)
    assert len({tuple(epoch) for epoch in by_hand}) == 3
    assert orders(through_accumulator=True) == (by_hand, ended)
    assert ended == (3, False)


@pytest.mark.usefixtures("accelerator")
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # (torchdata's)
def test_a_prepared_stateful_loader_resumes_at_an_epochs_last_window() -> None:
    """``use_stateful_dataloader=True``, 12 microbatches in windows of 5 (2 dropped), saved
    at the boundary of the first epoch's last window and resumed with the loader's state
    loaded as the recipe does: the resumed first epoch has nothing left to train, and its
    loader was never run, so its loaded position (10 of 12) carried into the next epoch,
    which ended after 2 ("the iterable ended after 2 items"). It now runs to its end, and
    the two epochs end bit for bit where the uninterrupted run did."""
    from torch.utils.data import DataLoader

    data = regression_data()

    def run(state: dict[str, Any] | None) -> tuple[torch.nn.Module, dict[str, Any]]:
        accelerator = fresh_accelerator(use_stateful_dataloader=True)
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer, loader = accelerator.prepare(
            model, optimizer, DataLoader(data, batch_size=2)
        )
        acc = gradaccum.Accumulator(model, optimizer, steps=5)
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            acc.load_state_dict(state["acc"])
            if acc.position:
                loader.load_state_dict(state["loader"])
        saved: dict[str, Any] = {}
        for _ in range(acc.epochs_completed, 2):
            for batch in acc.epoch(loader):
                with acc.microstep(mean_loss(model, batch)) as step:
                    pass
                if state is None and step.boundary and acc.global_step == 2:
                    saved = {
                        "model": copy.deepcopy(model.state_dict()),
                        "optimizer": copy.deepcopy(optimizer.state_dict()),
                        "acc": acc.state_dict(),
                        "loader": copy.deepcopy(loader.state_dict()),
                    }
        assert acc.global_step == 4
        acc.close()
        return model, saved

    whole, state = run(None)
    assert state["acc"]["position"] == 10
    resumed, _ = run(state)
    for p, q in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_prepared_dataloader_skipped_by_hand_is_refused_naming_it(accelerator: object) -> None:
    """Accelerate's resume recipe, ``accelerator.skip_first_batches(loader, n)``, kept beside
    the accumulator's own resume: the epoch is short by the trained microbatches, and its
    first ``next()`` refuses it, naming the recipe and the fix."""
    with pytest.raises(gradaccum.ConfigError, match="skip_first_batches: pass the whole epoch"):
        resumed_mid_epoch(accelerator, stateful=False, skip_by_hand=True)


def test_accelerates_own_checkpoint_resumes_the_accumulator_mid_epoch(
    tmp_path: Path,
) -> None:
    """Accelerate's checkpointing as its scripts use it: the accumulator registered with
    ``accelerator.register_for_checkpointing``, ``save_state`` at a boundary mid-epoch of
    the second epoch, ``load_state`` into fresh prepared objects (the prepared loader
    shuffles by its own generator, seeded each epoch; the model has dropout, whose random
    state Accelerate restores): the resumed run ends bit for bit where the whole one did."""
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader

    data = regression_data()

    def run(load: bool) -> list[torch.Tensor]:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = accelerate.Accelerator(cpu=True)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(5, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1)
        ).double()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 0.9**k)
        order = torch.Generator()
        loader = DataLoader(data, batch_size=2, shuffle=True, generator=order)
        model, optimizer, loader, scheduler = accelerator.prepare(
            model, optimizer, loader, scheduler
        )
        acc = gradaccum.Accumulator(model, optimizer, scheduler, steps=2)
        accelerator.register_for_checkpointing(acc)
        if load:
            accelerator.load_state(str(tmp_path))
        for epoch in range(acc.epochs_completed, 2):
            order.manual_seed(100 + epoch)
            for batch in acc.epoch(loader):
                with acc.microstep(mean_loss(model, batch)):
                    pass
                if not load and (epoch, acc.position) == (1, 6):  # between two windows
                    accelerator.save_state(str(tmp_path))
        acc.close()
        return [p.detach().clone() for p in model.parameters()]

    whole = run(load=False)
    assert all(torch.equal(p, q) for p, q in zip(run(load=True), whole, strict=True))


def accelerate_bf16_loop(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batches: list[Any],
    *,
    divide: bool = True,
) -> None:
    """Accelerate's own accumulation as its docs write it, with ``mixed_precision="bf16"``
    (which puts an autocast inside the prepared model's ``forward``): ``accumulate()``,
    ``accelerator.backward``, step and ``zero_grad`` every microbatch (Accelerate skips
    them inside a window); not ``divide``: the loss multiplied back by the steps, the bug
    of a loss not divided by them."""
    from accelerate.state import AcceleratorState, GradientState

    from tests.loops import STEPS

    AcceleratorState._reset_state(True)  # (an Accelerator's precision is set once a process)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(
        cpu=True, mixed_precision="bf16", gradient_accumulation_steps=STEPS
    )
    try:
        model, optimizer = accelerator.prepare(model, optimizer)
        for batch in batches:
            with accelerator.accumulate(model):
                loss = mean_loss(model, batch)
                accelerator.backward(loss if divide else loss * STEPS)
                optimizer.step()
                optimizer.zero_grad()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_the_kit_checks_accelerates_mixed_precision_at_its_precision() -> None:
    """The testing kit on a right Accelerate trainer with ``mixed_precision="bf16"``: its
    autocast runs inside the model's forward, where the kit's forward pre-hook does not
    see it, and float32's tolerance took bfloat16's rounding for a wrong loop ("off the
    float64 big-batch reference"). The forwards' graph carries bfloat16: it passes at
    bfloat16's tolerance, and the same trainer with its loss not divided is named."""
    import functools

    from gradaccum.testing import check_accumulation
    from tests import loops

    def check(divide: bool) -> Any:
        return check_accumulation(
            functools.partial(make_model, dtype=torch.float32),
            loops.adamw,
            functools.partial(accelerate_bf16_loop, divide=divide),
            [loops.small_batches(0)],
            mean_loss,
            steps=loops.STEPS,
        )

    right = check(divide=True)
    assert right.ok, right
    assert (right.computed, right.tolerance) == ("bfloat16", 5e-2)
    assert right.max_grad_diff > 1e-4  # bfloat16's rounding, which float32's tolerance failed
    wrong = check(divide=False)
    assert wrong.problems[0] == (
        "the gradient of window 1 is 4.00x the reference's: is the loss divided by steps?"
    )
