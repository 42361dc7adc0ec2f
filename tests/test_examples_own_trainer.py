"""examples/own_trainer.py: a loop of its own built from gradaccum's parts trains exactly
(one big float64 batch per window), all-reduces once per window under DDP, and runs as
its docstring says, alone and on 2 ranks (its main() on the launcher's ranks, which set
the variables torchrun sets; examples/distributed.py is the one script the suite runs
under torchrun itself)."""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest
from torch.nn.parallel import DistributedDataParallel

from gradaccum.testing import check_accumulation
from tests.distributed import example_main, run
from tests.helpers import make_model
from tests.loops import decay, rank_batches, sgd

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def own_trainer(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The example, imported by name from examples/ as the ranks will import it."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.delitem(sys.modules, "own_trainer", raising=False)
    return importlib.import_module("own_trainer")


@pytest.mark.parametrize("steps", [1, 3, 4])
def test_its_loop_is_exact_on_one_process(own_trainer: ModuleType, steps: int) -> None:
    """13 microbatches of varying rows: the parameters after every optimizer step equal
    one big batch per window, and it takes 13 // steps optimizer and scheduler steps (the
    remainder dropped)."""
    report = check_accumulation(
        make_model,
        sgd,
        functools.partial(own_trainer.train_epoch, steps=steps),
        [rank_batches(0)],
        own_trainer.loss_fn,
        steps=steps,
        make_scheduler=decay,
        epochs=2,
    )
    assert report.ok, report
    assert report.optimizer_steps == report.scheduler_steps == 2 * (13 // steps)


def test_its_loop_all_reduces_once_per_window_under_ddp(own_trainer: ModuleType) -> None:
    """On 2 gloo ranks with different data, the loop is exact against one big batch of both
    ranks' windows, and no_sync around forward and backward leaves 1 all-reduce a window."""
    report = check_accumulation(
        make_model,
        sgd,
        functools.partial(own_trainer.train_epoch, steps=4),
        [rank_batches(0), rank_batches(1)],
        own_trainer.loss_fn,
        steps=4,
        make_scheduler=decay,
        wrap=DistributedDataParallel,
        expect_collectives={"all_reduce": 1},
    )
    assert report.ok, report
    assert report.per_window.collectives == {"all_reduce": 1}


def test_the_script_logs_every_quarter_epoch(
    own_trainer: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """Alone: 50 microbatches at steps=4 give 12 optimizer steps an epoch (2 dropped),
    24 in 2 epochs, and interval(0.25, 12) = 3 logs a step every 3."""
    own_trainer.main(["--gradient-accumulation-steps", "4"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[:-1]] == [str(s) for s in range(3, 25, 3)]
    assert lines[-1] == "24 of 24 optimizer steps on 1 process(es)"


def test_the_script_runs_on_two_ranks() -> None:
    """As its docstring launches it, on 2 ranks that set what torchrun sets: 2 DDP ranks
    of 25 microbatches each, 6 optimizer steps an epoch, a log every interval(0.25, 6) = 2
    steps."""
    printed = run(example_main, 2, "own_trainer.py", "--gradient-accumulation-steps", "4")[0]
    lines = printed.splitlines()
    assert [line.split()[1] for line in lines[:-1]] == [str(s) for s in range(2, 13, 2)]
    assert lines[-1] == "12 of 12 optimizer steps on 2 process(es)"
