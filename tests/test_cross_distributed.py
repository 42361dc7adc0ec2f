"""Randomized 2-rank DDP scenarios that cross the distributed paths: sized and unsized
epochs (the ranks agreeing on each window of a generator), drop_last on and off, mean losses
and num_items (ints, 0-dim tensors) over microbatches of varying sizes, a ``steps`` change at
a window boundary (after a block, or at the top of the loop body) and a checkpoint at any
legal point (at the top of the loop body between windows, after a block, mid-window with
include_grads=True, between epochs) resumed into fresh objects.

The scenarios are drawn in this process with ``random.Random(SEED)`` and run in one launch
of 2 gloo ranks. Each is checked against the same scenario run uninterrupted (bit for bit)
and against a float64 single-process reference whose cut of the epochs into windows is
written here from the documented semantics, independently of gradaccum.plan.
``GRADACCUM_CROSS_SEED`` and ``GRADACCUM_CROSS_COUNT`` draw other or more scenarios.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests import cross_distributed
from tests.cross_distributed import GAMMA_BIAS, LR_BIAS
from tests.distributed import run
from tests.helpers import make_batches, make_model, mean_loss, sum_loss

WORLD = 2
TOL = 1e-10
LR, GAMMA = 0.1, 0.5
SEED = int(os.environ.get("GRADACCUM_CROSS_SEED", "0"))
COUNT = int(os.environ.get("GRADACCUM_CROSS_COUNT", "16"))
COMBOS = [
    (sized, drop_last, mode)
    for sized in (True, False)
    for drop_last in (True, False)
    for mode in ("mean", "int", "tensor")
]
CHECKPOINTS = ["top of a window", "top mid-window", "after a window", "after mid-window", "epochs"]


# The reference's cut of the epochs into windows ------------------------------------------


def window_at(start: int, n: int, steps: int, drop_last: bool) -> int:
    """The size of the window that starts at microbatch ``start`` of an epoch of ``n``,
    cut with ``steps``: ``steps`` where it fits, else the remainder unless drop_last (0:
    no window)."""
    left = n - start
    if left >= steps:
        return steps
    return 0 if drop_last else max(left, 0)


@dataclass
class Plan:
    """What the reference expects of a scenario."""

    windows: list[list[list[int]]] = field(default_factory=list)  # [epoch][window]: indices
    start_steps: list[int] = field(default_factory=list)  # steps when each epoch is planned
    points: list[tuple[str, int, int | None, bool]] = field(default_factory=list)
    saved: dict[str, int] | None = None  # the accumulator state at the checkpoint


def matches(event: dict[str, Any] | None, when: str, epoch: int, index: int | None) -> bool:
    """``event`` (a change or a checkpoint) happens at (when, epoch, index)."""
    return event is not None and (event["when"], event["epoch"], event.get("index")) == (
        when,
        epoch,
        index,
    )


def simulate(scenario: dict[str, Any]) -> Plan:
    """Cut every epoch into windows with the documented semantics: windows of the ``steps``
    in force from the epoch's start; a change applies from the next window's start (at
    the top of the loop body: from the microbatch just handed out); a trailing partial
    window is a shorter window without drop_last and is not trained on with it (a
    microbatch handed out before a change that leaves no window is discarded). Also lists
    the legal checkpoint points, as (when, epoch, index, between windows), and what
    ``state_dict()`` gives at the scenario's checkpoint."""
    plan = Plan()
    steps, closed, drop_last = scenario["steps"], 0, scenario["drop_last"]
    change, checkpoint = scenario["change"], scenario["checkpoint"]
    epochs = len(scenario["sizes"])

    def save(position: int) -> None:
        plan.saved = {"steps": steps, "position": position, "global_step": closed}

    for epoch, per_rank in enumerate(scenario["sizes"]):
        n = len(per_rank[0])
        plan.start_steps.append(steps)
        windows: list[list[int]] = []
        start = 0
        while window_at(start, n, steps, drop_last):
            plan.points.append(("top", epoch, start, True))  # handed out, not back-propagated
            at_top = [("change", change), ("checkpoint", checkpoint)]
            if checkpoint is not None and not checkpoint["change_first"]:
                at_top.reverse()
            for what, event in at_top:
                if matches(event, "top", epoch, start):
                    if what == "change":
                        assert event is not None
                        steps = event["steps"]
                    else:
                        save(start)
            size = window_at(start, n, steps, drop_last)
            if not size:  # the microbatch handed out opens a window that is dropped
                plan.points.append(("after", epoch, start, False))
                if matches(checkpoint, "after", epoch, start):
                    save(start + 1)
                break
            for index in range(start, start + size):
                if index > start:
                    plan.points.append(("top", epoch, index, False))
                    if matches(checkpoint, "top", epoch, index):
                        save(index)
                last = index == start + size - 1
                closed += last
                plan.points.append(("after", epoch, index, last))
                if matches(change, "after", epoch, index):
                    assert last, "a change mid-window"
                    steps = change["steps"]
                if matches(checkpoint, "after", epoch, index):
                    save(index + 1)
            windows.append(list(range(start, start + size)))
            start += size
        plan.windows.append(windows)
        if epoch < epochs - 1:
            plan.points.append(("between", epoch, None, True))
            if matches(checkpoint, "between", epoch, None):
                save(0)
    return plan


def legal(scenario: dict[str, Any], plan: Plan) -> bool:
    """Every epoch passes the guard when it is planned and trains at least one window."""
    return all(
        window_at(0, len(per_rank[0]), steps, scenario["drop_last"]) and windows
        for per_rank, steps, windows in zip(
            scenario["sizes"], plan.start_steps, plan.windows, strict=True
        )
    )


def reference(scenario: dict[str, Any], plan: Plan) -> tuple[list[torch.Tensor], list[float]]:
    """Float64 SGD with the StepLRs' rates, one step per global window (window w of both
    ranks) on its microbatches: the item mean of summed losses (num_items), or the mean
    of the per-microbatch mean losses. With two optimizers the biases have their own
    rate and decay. The parameters, and each optimizer's final learning rate."""
    model = make_model()
    params = list(model.parameters())
    two = scenario.get("optimizers", 1) == 2
    rates = [
        (LR_BIAS, GAMMA_BIAS) if two and name.endswith("bias") else (LR, GAMMA)
        for name, _ in model.named_parameters()
    ]
    applied = 0
    for epoch, windows in enumerate(plan.windows):
        data = [
            make_batches(scenario["sizes"][epoch][rank], seed=scenario["seeds"][epoch][rank])
            for rank in range(WORLD)
        ]
        for window in windows:
            batches = [data[rank][index] for rank in range(WORLD) for index in window]
            if scenario["mode"] == "mean":
                losses = [mean_loss(model, batch) for batch in batches]
                loss = torch.stack(losses).sum() / len(batches)
            else:
                losses = [sum_loss(model, batch) for batch in batches]
                loss = torch.stack(losses).sum() / sum(len(batch[0]) for batch in batches)
            decays = applied // scenario["step_size"]
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for param, grad, (lr, gamma) in zip(params, grads, rates, strict=True):
                    param.sub_(lr * gamma**decays * grad)
            applied += 1
    decays = applied // scenario["step_size"]
    lrs = [LR * GAMMA**decays] + ([LR_BIAS * GAMMA_BIAS**decays] if two else [])
    return [p.detach() for p in params], lrs


# Drawing scenarios -----------------------------------------------------------------------


def draw(
    rng: random.Random, number: int, combo: tuple[bool, bool, str], kind: str
) -> dict[str, Any]:
    """One legal scenario with ``combo`` = (sized, drop_last, mode) and, where it has such
    a point, a checkpoint of ``kind`` (one of CHECKPOINTS)."""
    sized, drop_last, mode = combo
    while True:
        counts = [rng.randint(3, 11) for _ in range(rng.randint(1, 2))]
        scenario: dict[str, Any] = {
            "number": number,
            "steps": rng.randint(1, 4),
            "drop_last": drop_last,
            "sized": sized,
            "mode": mode,
            "sizes": [
                [[rng.randint(1, 4) for _ in range(n)] for _ in range(WORLD)] for n in counts
            ],
            "seeds": [
                [1000 * number + 10 * epoch + rank for rank in range(WORLD)]
                for epoch in range(len(counts))
            ],
            "step_size": rng.randint(1, 2),
            "change": None,
            "checkpoint": None,
            "optimizers": 1,
        }
        plain = simulate(scenario)
        if not legal(scenario, plain):
            continue
        if rng.random() < 0.85:
            boundaries = [p for p in plain.points if p[3] and p[0] != "between"]
            when, epoch, index, _ = rng.choice(boundaries)
            new = rng.choice([k for k in range(1, 5) if k != scenario["steps"]])
            scenario["change"] = {"epoch": epoch, "index": index, "when": when, "steps": new}
        plan = simulate(scenario)
        if legal(scenario, plan):
            break
    wanted = {
        "top of a window": ("top", True),
        "top mid-window": ("top", False),
        "after a window": ("after", True),
        "after mid-window": ("after", False),
        "epochs": ("between", True),
    }[kind]
    points = [p for p in plan.points if (p[0], p[3]) == wanted] or plan.points
    when, epoch, index, between_windows = rng.choice(points)
    scenario["checkpoint"] = {
        "epoch": epoch,
        "index": index,
        "when": when,
        "include_grads": not between_windows or rng.random() < 0.5,
        "change_first": rng.random() < 0.5,
    }
    scenario["optimizers"] = rng.choice((1, 2))
    return scenario


def draw_all(seed: int, count: int) -> list[dict[str, Any]]:
    """``count`` scenarios; every (sized, drop_last, mode) and every checkpoint kind comes
    up once in each cycle of 12 and 5."""
    rng = random.Random(seed)
    combos = rng.sample(COMBOS, len(COMBOS))
    return [
        draw(rng, number, combos[number % len(combos)], CHECKPOINTS[number % len(CHECKPOINTS)])
        for number in range(count)
    ]


def describe(scenario: dict[str, Any]) -> str:
    """The scenario in one line."""
    counts = [len(per_rank[0]) for per_rank in scenario["sizes"]]
    return (
        f"scenario {scenario.get('name', scenario['number'])}: steps={scenario['steps']} "
        f"drop_last={scenario['drop_last']} {'sized' if scenario['sized'] else 'unsized'} "
        f"mode={scenario['mode']} epochs of {counts} change={scenario['change']} "
        f"checkpoint={scenario['checkpoint']} optimizers={scenario.get('optimizers', 1)}"
    )


# The tests -------------------------------------------------------------------------------


def problems_of(scenario: dict[str, Any], ranks: list[dict[str, Any]]) -> list[str]:
    """What the ranks' runs of ``scenario`` got wrong (empty: nothing)."""
    plan = simulate(scenario)
    expected, lr = reference(scenario, plan)
    applied = sum(len(windows) for windows in plan.windows)
    found = []
    for rank, runs in enumerate(ranks):
        for name, seen in runs.items():
            where = f"rank {rank} {name}"
            if seen["error"] is not None:
                found.append(f"{where}: raised {seen['error']}")
                continue
            got = (seen["global_step"], seen["optimizer_steps"], seen["lr"], seen["warnings"])
            if got != (applied, applied, lr, []):
                found.append(
                    f"{where}: (global_step, optimizer steps, lr, warnings) {got}, "
                    f"expected {(applied, applied, lr, [])}"
                )
            worst = max(
                (p - q).abs().max().item() for p, q in zip(seen["params"], expected, strict=True)
            )
            if worst >= TOL:
                found.append(f"{where}: parameters {worst:.3g} off the reference")
        resumed, whole = runs["resumed"], runs["whole"]
        if resumed["saved"] != plan.saved and resumed["error"] is None:
            found.append(
                f"rank {rank}: state_dict() gave {resumed['saved']}, expected {plan.saved}"
            )
        if resumed["error"] is None and whole["error"] is None:
            pairs = zip(resumed["params"], whole["params"], strict=True)
            if not all(torch.equal(p, q) for p, q in pairs):
                found.append(f"rank {rank}: resumed parameters differ from the uninterrupted")
    if all(runs["whole"]["error"] is None for runs in ranks):
        pairs = zip(ranks[0]["whole"]["params"], ranks[1]["whole"]["params"], strict=True)
        if not all(torch.equal(p, q) for p, q in pairs):
            found.append("the ranks' parameters differ")
    return found


def test_the_reference_cuts_windows_as_documented() -> None:
    """The reference itself, on hand-computed cases: 7 microbatches with steps=3 give
    windows of 3, 3 (and 1 without drop_last); steps 2 -> 3 after the first window of 8
    gives [0, 1], [2, 3, 4], [5, 6, 7]; the same change at the top of microbatch 2 also
    does; steps 2 -> 4 at the top of microbatch 6 of 8 under drop_last hands out 6 and
    trains no window from it; the checkpoint state at each kind of point."""

    def scenario(
        n: int, steps: int, drop_last: bool, change: Any, checkpoint: Any
    ) -> dict[str, Any]:
        return {
            "steps": steps,
            "drop_last": drop_last,
            "sizes": [[[1] * n] * WORLD],
            "change": change,
            "checkpoint": checkpoint,
        }

    def point(when: str, index: int | None, first: bool = True) -> dict[str, Any]:
        return {"epoch": 0, "index": index, "when": when, "change_first": first}

    assert simulate(scenario(7, 3, True, None, None)).windows == [[[0, 1, 2], [3, 4, 5]]]
    assert simulate(scenario(7, 3, False, None, None)).windows[0][-1] == [6]
    for when, index in (("after", 1), ("top", 2)):
        change = {"epoch": 0, "index": index, "when": when, "steps": 3}
        plan = simulate(scenario(8, 2, True, change, point("top", 2)))
        assert plan.windows == [[[0, 1], [2, 3, 4], [5, 6, 7]]]
        assert plan.saved == {"steps": 3, "position": 2, "global_step": 1}
    plan = simulate(scenario(8, 2, True, None, point("after", 4)))
    assert plan.saved == {"steps": 2, "position": 5, "global_step": 2}
    change = {"epoch": 0, "index": 6, "when": "top", "steps": 4}
    plan = simulate(scenario(8, 2, True, change, point("top", 6, first=False)))
    assert plan.windows == [[[0, 1], [2, 3], [4, 5]]]
    assert plan.saved == {"steps": 2, "position": 6, "global_step": 3}
    assert ("after", 0, 6, False) in plan.points


def pinned(
    number: int,
    name: str,
    n: int,
    steps: int,
    drop_last: bool,
    change: tuple[str, int, int] | None = None,
    checkpoint: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """A hand-shrunk scenario (``number`` from 10000): one unsized epoch of ``n``
    microbatches of 2 rows per rank, mean losses; ``change`` = (when, index, steps),
    ``checkpoint`` = (when, index) saved with include_grads=True."""
    return {
        "number": number,
        "name": name,
        "steps": steps,
        "drop_last": drop_last,
        "sized": False,
        "mode": "mean",
        "sizes": [[[2] * n for _ in range(WORLD)]],
        "seeds": [[1000 * number + rank for rank in range(WORLD)]],
        "step_size": 1,
        "change": None
        if change is None
        else {"epoch": 0, "index": change[1], "when": change[0], "steps": change[2]},
        "checkpoint": None
        if checkpoint is None
        else {
            "epoch": 0,
            "index": checkpoint[1],
            "when": checkpoint[0],
            "include_grads": True,
            "change_first": True,
        },
    }


# Minimal scenarios shrunk from drawn ones that disagreed with the reference.
PINNED = [
    # Windows [0, 1, 2], [3, 4]: the restored trailing window of 2 must close after 4.
    pinned(10000, "resume in the trailing short window", 5, 3, False, checkpoint=("after", 3)),
    # Windows [0], [1]: the new steps=2 cannot fill the last window; it is a window of 1.
    pinned(10001, "steps raised at the top of the last window", 2, 1, False, change=("top", 1, 2)),
    # Window [0, 1, 2] was trained: no ConfigError for steps=4 set after it.
    pinned(10002, "steps raised after the last window", 3, 3, True, change=("after", 2, 4)),
    # Windows [0], [1]; microbatch 2, handed out before steps=4, is dropped.
    pinned(10003, "steps raised at the top of a dropped window", 3, 1, True, change=("top", 2, 4)),
    # Window [0, 1], then steps=3 and a checkpoint: the resumed rest of the epoch trains
    # nothing, and the epoch (it trained [0, 1]) is no reason for a ConfigError.
    pinned(
        10004,
        "resume after steps raised after the last window",
        2,
        2,
        True,
        change=("after", 1, 3),
        checkpoint=("after", 1),
    ),
]


@pytest.fixture(scope="module")
def outcomes() -> dict[int, list[dict[str, Any]]]:
    """Every scenario's runs on each rank, by its number: PINNED and the drawn ones, in
    one launch (the ranks' start-up dominates)."""
    scenarios = PINNED + draw_all(SEED, COUNT)
    ranks = run(cross_distributed.scenarios, WORLD, scenarios)
    return {
        scenario["number"]: [runs[index] for runs in ranks]
        for index, scenario in enumerate(scenarios)
    }


def report(scenarios: list[dict[str, Any]], outcomes: dict[int, list[dict[str, Any]]]) -> str:
    """Every scenario that went wrong and how (empty: none)."""
    found = []
    for scenario in scenarios:
        problems = problems_of(scenario, outcomes[scenario["number"]])
        found += [describe(scenario), *(f"    {p}" for p in problems)] if problems else []
    return "\n".join(found)


def test_pinned_unsized_ddp_scenarios_match_the_reference(
    outcomes: dict[int, list[dict[str, Any]]],
) -> None:
    """Unsized epochs on 2 DDP ranks, shrunk from drawn scenarios: a resume mid-way through
    the trailing shorter window (drop_last=False) closes it as the uninterrupted run does;
    ``steps`` raised at the top of the last window's first microbatch (drop_last=False)
    still trains that short window; ``steps`` raised after the epoch's last window, or at
    the top of a window then dropped (drop_last=True), raises no ConfigError for an epoch
    that trained windows, nor does the rest of such an epoch after a resume. Each as the
    random test checks it."""
    found = report(PINNED, outcomes)
    if found:
        pytest.fail(found, pytrace=False)


def test_random_ddp_scenarios_resume_bit_for_bit_and_match_the_reference(
    outcomes: dict[int, list[dict[str, Any]]],
) -> None:
    """COUNT random scenarios on 2 DDP ranks in float64 (each: steps 1..4, 1-2 epochs of
    3-11 microbatches per rank of 1-4 rows, different data per rank), each run
    uninterrupted and interrupted by its checkpoint, every part reloaded into fresh
    objects. Each run, on each rank, must end within 1e-10 of the reference with
    global_step, the optimizer's step count and StepLR's rate as the reference's windows
    give, and without a warning; the checkpoint's (steps, position, global_step) must be
    the documented ones; the resumed run must equal the uninterrupted one bit for bit,
    and the ranks each other."""
    found = report(draw_all(SEED, COUNT), outcomes)
    if found:
        pytest.fail(found, pytrace=False)
