"""The bad-input catalog in docs/bad-input.md is exact: every row is refused as written there.

The test reads the table itself, so the page and the code cannot drift: a row whose
error type or message changes fails here, and so does a public parameter without a row.
"""

from __future__ import annotations

import argparse
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import gradaccum
import gradaccum.testing
from gradaccum.testing import strategies
from tests import loops
from tests.helpers import make_batches, make_model, mean_loss

CATALOG = Path(__file__).resolve().parent.parent / "docs" / "bad-input.md"
COLUMNS = ["call", "argument", "bad value", "raises", "message includes"]
ERRORS: dict[str, type[BaseException]] = {
    "ConfigError": gradaccum.ConfigError,
    "ConfigTypeError": gradaccum.ConfigTypeError,
    "UsageError": gradaccum.UsageError,
    "SystemExit(2)": SystemExit,
}


@dataclass(frozen=True)
class Row:
    """One row of the catalog: ``call`` with ``{}`` standing for the bad value's source."""

    call: str
    argument: str
    value: str
    raises: str
    fragments: tuple[str, ...]

    @property
    def source(self) -> str:
        """The call with the bad value written in, as a user would type it."""
        return self.call.replace("{}", self.value)


def _unquote(cell: str) -> str:
    """A cell's text without the backticks around the whole of it."""
    cell = cell.strip()
    if len(cell) >= 2 and cell[0] == cell[-1] == "`":
        return cell[1:-1]
    return cell


def parse_catalog(text: str) -> list[Row]:
    """The rows of the one table whose header is `COLUMNS`."""
    lines = text.splitlines()
    header = "| " + " | ".join(COLUMNS) + " |"
    start = lines.index(header)
    rows = []
    for line in lines[start + 2 :]:  # past the header and its --- line
        if not line.startswith("|"):
            break
        cells = line.strip().removeprefix("| ").removesuffix(" |").split(" | ")
        assert len(cells) == len(COLUMNS), f"a row without {len(COLUMNS)} cells: {line}"
        call, argument, value, raises, fragments = cells
        rows.append(
            Row(
                call=_unquote(call),
                argument=_unquote(argument),
                value=_unquote(value),
                raises=raises.strip(),
                fragments=tuple(re.findall(r"`([^`]+)`", fragments)),
            )
        )
    return rows


ROWS = parse_catalog(CATALOG.read_text(encoding="utf-8"))


def loss_of(model: torch.nn.Module) -> torch.Tensor:
    """A 0-dim mean loss of ``model`` that requires grad."""
    return mean_loss(model, make_batches([2])[0])


class Forwarding(torch.optim.Optimizer):
    """A wrapper that forwards to ``optimizer`` without ``Optimizer.__init__`` (no hooks)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups


def namespace() -> dict[str, Any]:
    """The names the catalog's calls and values use, built afresh for each row."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = [param for name, param in model.named_parameters() if name.endswith("weight")]
    biases = [param for name, param in model.named_parameters() if name.endswith("bias")]
    weights_sgd = torch.optim.SGD(weights, lr=0.1)
    other = make_model(seed=1)
    foreign_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    open_model = make_model(seed=2)
    open_acc = gradaccum.Accumulator(
        open_model, torch.optim.SGD(open_model.parameters(), lr=0.1), steps=2
    )
    with open_acc.microstep(loss_of(open_model)):  # 1 of the window's 2 microsteps
        pass
    resumed_model = make_model(seed=3)
    resumed_acc = gradaccum.Accumulator(
        resumed_model, torch.optim.SGD(resumed_model.parameters(), lr=0.1), steps=2
    )
    step_model = make_model(seed=4)
    step_acc = gradaccum.Accumulator(
        step_model, torch.optim.SGD(step_model.parameters(), lr=0.1), microbatch=2
    )
    mid_epoch = {"position": 4, "global_step": 2, "epoch_length": 8}  # 2 windows into 8
    resumed_acc.load_state_dict(dict(resumed_acc.state_dict(), **mid_epoch))
    return {
        **{name: getattr(gradaccum, name) for name in gradaccum.__all__},
        **{name: getattr(gradaccum.testing, name) for name in gradaccum.testing.__all__},
        "strategies": strategies,
        "make_model": make_model,
        "make_sgd": loops.sgd,
        "hand_loop": loops.hand_loop,
        "batches": make_batches([2] * 8),
        "loss_fn": mean_loss,
        "argparse": argparse,
        "math": math,
        "torch": torch,
        "loss_of": loss_of,
        "model": model,
        "optimizer": optimizer,
        "acc": gradaccum.Accumulator(model, optimizer, steps=2),
        "frozen_model": make_model().requires_grad_(False),
        "foreign_optimizer": foreign_optimizer,
        "other_scheduler": torch.optim.lr_scheduler.StepLR(foreign_optimizer, step_size=1),
        "plateau": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer),
        "weights_sgd": weights_sgd,
        "biases_adam": torch.optim.Adam(biases, lr=0.01),
        "weights_scheduler": torch.optim.lr_scheduler.StepLR(weights_sgd, step_size=1),
        "forwarding_optimizer": Forwarding(optimizer),
        "scaler": torch.amp.GradScaler("cpu"),
        "open_model": open_model,
        "open_acc": open_acc,
        "resumed_acc": resumed_acc,
        "step_model": step_model,
        "step_acc": step_acc,
        "saved_window": open_acc.state_dict(include_grads=True)["window"],
        "parser": gradaccum.add_arguments(argparse.ArgumentParser(prog="train")),
    }


def test_catalog_is_parsed_whole() -> None:
    """The table parses into many well-formed rows: a garbled or emptied table fails here."""
    assert len(ROWS) > 50
    assert len({row.source for row in ROWS}) == len(ROWS), "a row is listed twice"
    for row in ROWS:
        assert row.call.count("{}") == 1, row.call
        assert row.raises in ERRORS, row.raises
        assert row.argument, row.call
        assert row.fragments, row.source


@pytest.fixture
def static_ddp(process_group: None) -> torch.nn.Module:
    """A DDP with static_graph=True, on a one-rank gloo group."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(make_model(), static_graph=True)


@pytest.fixture
def split_mesh_model(process_group: None) -> torch.nn.Module:
    """Two layers sharded with fully_shard over different meshes (1-D and 2-D)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)))
    fully_shard(model[2], mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("r", "s")))
    return model


@pytest.fixture
def summing_model(process_group: None) -> torch.nn.Module:
    """A fully_shard model whose gradients FSDP divides by 2 instead of its 1 rank."""
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(make_model())
    model.set_gradient_divide_factor(2.0)
    return model


# The names whose rows need a process group.
FIXTURES = ("static_ddp", "split_mesh_model", "summing_model")


@pytest.mark.parametrize("row", ROWS, ids=[row.source for row in ROWS])
def test_bad_input_is_refused_as_documented(
    row: Row, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    """The call raises exactly the documented error, whose message has every fragment."""
    names = namespace()
    for name in FIXTURES:  # the rows that need a process group get one
        if name in row.source:
            names[name] = request.getfixturevalue(name)
    eval(row.value, names)  # the bad value itself is valid Python in this namespace
    expected = ERRORS[row.raises]
    with pytest.raises(expected) as caught:
        eval(row.source, names)
    error = caught.value
    assert type(error) is expected
    if isinstance(error, SystemExit):
        assert error.code == 2
        message = capsys.readouterr().err  # argparse's usage error
    else:
        assert isinstance(error, gradaccum.GradaccumError)
        message = str(error)
    for fragment in row.fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    # Nothing was half-applied: the accumulators are as they were built.
    assert repr(names["acc"]) == "Accumulator(steps=2, global_step=0, window=0/2)"
    assert all(param.grad is None for param in names["model"].parameters())
    assert repr(names["open_acc"]) == "Accumulator(steps=2, global_step=0, window=1/2)"
    assert repr(names["resumed_acc"]) == "Accumulator(steps=2, global_step=2, window=0/2)"
    assert names["resumed_acc"].position == 4
    assert repr(names["step_acc"]) == "Accumulator(steps=1, global_step=0, window=0/1)"
    assert all(param.grad is None for param in names["step_model"].parameters())


# Every public callable, mapped to what its rows' calls start with.
CALLS: dict[str, tuple[Callable[..., Any], str]] = {
    "Accumulator": (gradaccum.Accumulator, "Accumulator("),
    "Accumulator.microstep": (gradaccum.Accumulator.microstep, "acc.microstep("),
    "Accumulator.epoch": (gradaccum.Accumulator.epoch, "acc.epoch("),
    "Accumulator.step": (gradaccum.Accumulator.step, "step_acc.step("),
    "Accumulator.state_dict": (gradaccum.Accumulator.state_dict, "acc.state_dict("),
    "Accumulator.load_state_dict": (
        gradaccum.Accumulator.load_state_dict,
        "acc.load_state_dict(",
    ),
    "Accumulator.close": (gradaccum.Accumulator.close, "acc.close("),
    "add_arguments": (gradaccum.add_arguments, "add_arguments("),
    "interval": (gradaccum.interval, "interval("),
    "loader_state": (gradaccum.loader_state, "loader_state("),
    "no_sync": (gradaccum.no_sync, "no_sync("),
    "register_sync_strategy": (gradaccum.register_sync_strategy, "register_sync_strategy("),
    "random_state": (gradaccum.random_state, "random_state("),
    "set_random_state": (gradaccum.set_random_state, "set_random_state("),
    "steps_at_epoch": (gradaccum.steps_at_epoch, "steps_at_epoch("),
    "steps_per_epoch": (gradaccum.steps_per_epoch, "steps_per_epoch("),
    "total_steps": (gradaccum.total_steps, "total_steps("),
    "steps_for": (gradaccum.steps_for, "steps_for("),
    "GlobalOrder": (gradaccum.GlobalOrder, "GlobalOrder("),
    "testing.check_accumulation": (gradaccum.testing.check_accumulation, "check_accumulation("),
    "testing.run_ranks": (gradaccum.testing.run_ranks, "run_ranks("),
    "testing.CollectiveCounter": (gradaccum.testing.CollectiveCounter, "CollectiveCounter("),
    "testing.DDPBucketCounter": (gradaccum.testing.DDPBucketCounter, "DDPBucketCounter("),
    "testing.expected_windows": (gradaccum.testing.expected_windows, "expected_windows("),
    **{
        f"testing.strategies.{name}": (getattr(strategies, name), f"strategies.{name}(")
        for name in ("steps", "epoch_lengths", "item_counts", "epochs")
    },
}
# Settable properties: the value assigned is documented under the property's name.
SETTERS = {"Accumulator.steps": 'setattr(acc, "steps", '}
# Public names that users do not call with arguments of their own.
NOT_CALLED = {
    "Step": "built by microstep() and handed to the user",
    "SyncPolicy": "a Literal type alias, checked as Accumulator's sync",
    "SyncStrategy": "a Protocol that register_sync_strategy's factories return",
    "__version__": "a string",
    "testing.AccumulationReport": "returned by check_accumulation()",
    "testing.Counts": "what the counters report; built by hand only to compare with",
    "testing.strategies.Epoch": "drawn by strategies.epochs()",
}
# The modules whose public names the catalog covers, as the keys above prefix them.
PUBLIC = [(gradaccum, ""), (gradaccum.testing, "testing."), (strategies, "testing.strategies.")]


def test_catalog_covers_the_whole_public_api() -> None:
    """Every public name is mapped to its rows above, or is an error or not called."""
    for module, prefix in PUBLIC:
        for name in module.__all__:
            public = getattr(module, name)
            is_error = isinstance(public, type) and issubclass(public, (Exception, Warning))
            key = prefix + name
            assert key in CALLS or key in NOT_CALLED or is_error, f"{key} is not mapped"
    for name, member in vars(gradaccum.Accumulator).items():
        qualified = f"Accumulator.{name}"
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            assert (member.fset is None) != (qualified in SETTERS), f"{qualified} unmapped"
        else:
            assert qualified in CALLS, f"{qualified} is not mapped"


def test_every_public_parameter_has_a_row() -> None:
    """Each parameter of each public callable has a row for a call of that callable."""
    expected = [
        (public, prefix, parameter)
        for public, (function, prefix) in CALLS.items()
        for parameter in inspect.signature(function).parameters
        if parameter != "self"
    ] + [(public, prefix, public.rpartition(".")[2]) for public, prefix in SETTERS.items()]
    missing = [
        f"{public}({parameter})"
        for public, prefix, parameter in expected
        if not any(row.call.startswith(prefix) and row.argument == parameter for row in ROWS)
    ]
    assert not missing, f"parameters without a row in {CATALOG.name}: {missing}"
