"""gradaccum.testing.check_accumulation on one process: exact loops pass in both modes,
wrong ones fail with a message naming what broke, and set-ups it cannot check are
refused before any training (2-rank checks: test_testing_distributed.py)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import gradaccum
from gradaccum.testing import check_accumulation, expected_windows
from tests import loops
from tests.helpers import make_batches, make_model, mean_loss

TOL = 1e-10


@pytest.mark.parametrize("by_items", [False, True])
@pytest.mark.parametrize(
    "options",
    [{}, {"drop_last": False}, {"epochs": 2}, {"max_grad_norm": 0.5}],
    ids=["drop_last", "keep_last", "2_epochs", "clipped"],
)
def test_the_accumulator_passes(by_items: bool, options: dict[str, Any]) -> None:
    """Mean and item mode, both drop_last, two epochs, clipping: within 1e-10 of one big
    float64 batch per window, and steps as total_steps counts them."""
    settings = {key: value for key, value in options.items() if key != "epochs"}
    loop = functools.partial(loops.accumulator_loop, by_items=by_items, **settings)
    report = loops.check(loop, by_items=by_items, **options)
    assert report.ok, report
    assert report.max_abs_diff <= TOL
    expected = gradaccum.total_steps(
        13, 4, options.get("epochs", 1), options.get("drop_last", True)
    )
    assert report.optimizer_steps == report.scheduler_steps == report.expected_steps == expected
    assert report.mode == ("items" if by_items else "mean")
    assert report.per_window == gradaccum.testing.Counts()  # one process: no collective


def test_a_hand_loop_passes_and_its_report_reads_ok() -> None:
    report = loops.check(loops.hand_loop)
    assert report.ok, report
    assert repr(report).splitlines()[0] == "accumulation at steps=4 on 1 rank (mean mode): ok"
    assert repr(report).splitlines()[1].startswith("  optimizer/scheduler steps 3/3 of 3;")


def unscaled_loop(model: Any, optimizer: Any, scheduler: Any, batches: Any) -> None:
    """Forgets to divide each microbatch's loss by steps: the gradient is 4x too big."""
    for index, batch in enumerate(batches[:12]):
        mean_loss(model, batch).backward()
        if index % 4 == 3:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def remainder_loop(model: Any, optimizer: Any, scheduler: Any, batches: Any) -> None:
    """Steps the trailing partial window although drop_last is the contract."""
    for start in range(0, len(batches), 4):
        window = batches[start : start + 4]
        for batch in window:
            (mean_loss(model, batch) / len(window)).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


@pytest.mark.parametrize(
    ("loop", "by_items", "problems"),
    [
        (unscaled_loop, False, ["parameters off the float64 big-batch reference by"]),
        (
            remainder_loop,
            False,
            [
                "4 optimizer steps, expected 3 = total_steps(13, 4, 1, drop_last=True)",
                "4 scheduler steps, expected 3 = total_steps(13, 4, 1, drop_last=True)",
            ],
        ),
        (
            functools.partial(loops.hand_loop, scheduler_every_microbatch=True),
            False,
            ["12 scheduler steps, expected 3", "parameters off the float64 big-batch reference"],
        ),
        (loops.hand_loop, True, ["parameters off the float64 big-batch reference by"]),
    ],
    ids=["unscaled", "remainder_stepped", "scheduler_every_microbatch", "mean_of_means"],
)
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_wrong_loops_fail_with_what_broke(loop: Any, by_items: bool, problems: list[str]) -> None:
    report = loops.check(loop, by_items=by_items)
    assert not report.ok
    assert len(report.problems) == len(problems)
    for problem, start in zip(report.problems, problems, strict=True):
        assert problem.startswith(start), report
    assert repr(report).splitlines()[1:-1] == [f"  {problem}" for problem in report.problems]


def test_expected_collectives_that_did_not_run_fail() -> None:
    """One process all-reduces nothing: asking for one per window fails, in words."""
    report = loops.check(loops.hand_loop, expect_collectives={"all_reduce": 1})
    assert report.problems == ["0 all-reduces per window at steps=4, expected 1"]


def test_a_float32_model_is_checked_at_a_float32_tolerance() -> None:
    report = check_accumulation(
        lambda: make_model(dtype=torch.float32),
        loops.sgd,
        loops.accumulator_loop,
        [make_batches([2] * 8, dtype=torch.float32)],
        mean_loss,
        steps=4,
    )
    assert report.ok, report
    assert report.tolerance == 1e-4
    assert 0 < report.max_abs_diff < 1e-5


def test_expected_windows_cut_an_epoch() -> None:
    assert expected_windows(13, 4) == [range(4), range(4, 8), range(8, 12)]
    assert expected_windows(13, 4, drop_last=False)[-1] == range(12, 13)
    assert expected_windows(3, 4) == []
    assert expected_windows(0, 1, drop_last=False) == []


BATCHES = [make_batches([2] * 8)]


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"batches": []}, gradaccum.ConfigError, "batches must hold each rank's microbatches"),
        ({"batches": [5]}, gradaccum.ConfigTypeError, "batches[0] must be a sequence of rank 0's"),
        (
            {"batches": BATCHES[0]},  # one process's microbatches, not in a list of ranks
            gradaccum.ConfigError,
            "gives no optimizer step with steps=4 and drop_last=True (batches holds 8 ranks' "
            "microbatches; for one process pass batches=[microbatches])",
        ),
        (
            {"batches": [BATCHES[0], BATCHES[0][:4]]},
            gradaccum.ConfigError,
            "batches must give every rank as many microbatches, got [8, 4]",
        ),
        ({"steps": 0}, gradaccum.ConfigError, "steps must be a positive int, got 0"),
        (
            {"steps": 9},
            gradaccum.ConfigError,
            "an epoch of 8 microbatches gives no optimizer step with steps=9",
        ),
        ({"epochs": 0}, gradaccum.ConfigError, "epochs must be a positive int, got 0"),
        ({"train": None}, gradaccum.ConfigTypeError, "train must be callable, got None"),
        ({"wrap": 3}, gradaccum.ConfigTypeError, "wrap must be callable or None, got 3 (int)"),
        (
            {"expect_collectives": {"allreduce": 1}},
            gradaccum.ConfigError,
            "expect_collectives has the key 'allreduce'; the kinds are 'all_reduce'",
        ),
        (
            {"expect_collectives": {"all_reduce": -1}},
            gradaccum.ConfigError,
            "expect_collectives['all_reduce'] must be a non-negative int, got -1",
        ),
        ({"tolerance": -1.0}, gradaccum.ConfigError, "tolerance must be a non-negative number"),
        ({"backend": "mpi"}, gradaccum.ConfigError, "backend must be one of 'gloo', 'nccl'"),
        (
            {"batches": BATCHES * 2, "train": lambda *args: None},
            gradaccum.ConfigTypeError,
            "train cannot be sent to the launched ranks",
        ),
    ],
)
def test_what_cannot_be_checked_is_refused_before_training(
    change: dict[str, Any], error: type[Exception], message: str
) -> None:
    trained = []
    arguments: dict[str, Any] = {
        "make_model": make_model,
        "make_optimizer": loops.sgd,
        "train": lambda *args: trained.append(args),
        "batches": BATCHES,
        "loss": mean_loss,
        "steps": 4,
    } | change
    with pytest.raises(error) as caught:
        check_accumulation(**arguments)
    assert message in str(caught.value)
    assert not trained


@pytest.mark.usefixtures("process_group")
def test_batches_for_another_number_of_ranks_than_the_group_s_are_refused() -> None:
    with pytest.raises(gradaccum.ConfigError, match="microbatches of 2 ranks but this process"):
        check_accumulation(make_model, loops.sgd, loops.hand_loop, BATCHES * 2, mean_loss, steps=4)
