"""Elastic resume on real gloo ranks: a run checkpointed mid-epoch on one number of ranks
and resumed on another with the global batch kept (2 -> 1, 1 -> 2, 4 -> 2, 2 -> 4), under
DDP and ``fully_shard`` (model and optimizer through torch.distributed.checkpoint), in mean
and ``num_items`` mode, with a DistributedSampler (shuffled, and not) that pads or cuts
(every config under DDP, two under ``fully_shard``: `elastic.CONFIGS_OF`): after every
window of two epochs its float64 parameters are the uninterrupted run's within 1e-12, and
its learning rate is the same; what cannot be continued exactly is refused, naming the
numbers. On the same number of ranks the resume stays bit for bit. Four launches in all
(`tests/elastic.py`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests import elastic
from tests.distributed import run

TOLERANCE = 1e-12
PAIRS = [(2, 1), (1, 2), (4, 2), (2, 4)]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The four launches, in the order their checkpoints need: 2 ranks (uninterrupted runs,
    saved), 1 (its own, and 2 -> 1), 4 (its own, and 2 -> 4), 2 (1 -> 2, 4 -> 2, 2 -> 2)."""
    root = str(tmp_path_factory.mktemp("elastic"))
    on_two, _, _ = run(elastic.launch, 2, root, [], "save")[0]
    on_one, from_two_on_one, load_refusals = run(elastic.launch, 1, root, [2], "load")[0]
    on_four, from_two_on_four, _ = run(elastic.launch, 4, root, [2])[0]
    resumed_on_two, epoch_refusals = run(elastic.resume_only, 2, root, [1, 4, 2])[0]
    resumed = {}
    for (case, saved_on), outcome in from_two_on_one.items():
        resumed[case, saved_on, 1] = outcome
    for (case, saved_on), outcome in from_two_on_four.items():
        resumed[case, saved_on, 4] = outcome
    for (case, saved_on), outcome in resumed_on_two.items():
        resumed[case, saved_on, 2] = outcome
    return {
        "references": {1: on_one, 2: on_two, 4: on_four},
        "resumed": resumed,
        "load refusals": load_refusals,
        "epoch refusals": epoch_refusals,
    }


def refused(case: elastic.Case, saved_on: int, here: int) -> bool:
    """The pairs whose epochs' ends cut the windows otherwise: between 4 and 2 ranks, the
    padded last window, and the short microbatches' weights in mean mode."""
    if {saved_on, here} != {2, 4}:
        return False
    return case.config == "padded, partial" or (case.config == "short" and case.mode == "mean")


@pytest.mark.parametrize(("saved_on", "here"), PAIRS)
def test_resumed_on_another_number_of_ranks_within_1e_12(
    outcomes: dict[str, Any], saved_on: int, here: int
) -> None:
    """Every case resumed from its checkpoint after window 2 on ``here`` ranks: after each
    later window of the two epochs its parameters are within 1e-12 of the uninterrupted
    run's on ``saved_on`` ranks, with the same learning rate; it ends at the same global
    step, both epochs completed (or, for the pairs `refused` names, it is refused)."""
    largest = dict.fromkeys(elastic.WRAPPERS, 0.0)
    for case in elastic.CASES:
        outcome = outcomes["resumed"][str(case), saved_on, here]
        if refused(case, saved_on, here):
            assert isinstance(outcome, str), case
            continue
        assert not isinstance(outcome, str), (case, outcome)
        seen, global_step, epochs = outcome
        expected = outcomes["references"][saved_on][str(case)]
        assert list(seen) == [step for step in expected if step > elastic.CHECKPOINT_AT], case
        assert (global_step, epochs) == (max(expected), elastic.EPOCHS), case
        for step, (params, lr) in seen.items():
            want, want_lr = expected[step]
            assert lr == want_lr, (case, step)
            moved = (want[0] - expected[step - 1][0][0]).abs().max().item()
            assert moved > 1e-5, (case, step)  # every window moves them: 1e-12 is tight
            for got, wanted in zip(params, want, strict=True):
                assert got.dtype == torch.float64
                difference = (got - wanted).abs().max().item()
                largest[case.wrapper] = max(largest[case.wrapper], difference)
        assert max(largest.values()) <= TOLERANCE, (case, largest)
    report = ", ".join(f"{value:.3g} under {wrapper}" for wrapper, value in largest.items())
    print(f"\n{saved_on} -> {here} ranks: largest |difference| {report}")


def test_the_same_number_of_ranks_stays_bit_for_bit(outcomes: dict[str, Any]) -> None:
    """A checkpoint saved on 2 ranks and resumed on 2 (DCP, allow_world_size_change=True
    changing nothing) gives the uninterrupted run's parameters exactly, every window."""
    for case in elastic.CASES:
        seen, _, _ = outcomes["resumed"][str(case), 2, 2]
        expected = outcomes["references"][2][str(case)]
        for step, (params, lr) in seen.items():
            assert lr == expected[step][1]
            assert all(map(torch.equal, params, expected[step][0])), (case, step)


def test_the_epochs_end_that_cuts_otherwise_is_refused(outcomes: dict[str, Any]) -> None:
    """Between 4 and 2 ranks: the trailing partial window holds 4 samples (2 padded) on 4
    ranks and 2 on 2; the short microbatches weigh otherwise in mean mode (num_items is
    exact). Each refusal names both cuts and what would work."""
    messages = {
        (str(case), saved_on, here): outcomes["resumed"][str(case), saved_on, here]
        for case in elastic.CASES
        for saved_on, here in [(4, 2), (2, 4)]
        if refused(case, saved_on, here)
    }
    assert len(messages) == 8  # DDP: 3 a pair; fully_shard: the short one in mean mode
    padded = (
        "on {} ranks (steps={}) the rest of this epoch is 1 window of 16 samples, then a last "
        "window of {} samples (each weighing 1/{}), from sample 32, but on {} ranks (steps={}) "
        "it would be 1 window of 16 samples, then a last window of {} samples (each weighing "
        "1/{}), from sample 32: the order holds {} samples on {} ranks and {} on {} ranks (the "
        "sampler pads or cuts it to a multiple of the ranks, and the loader's drop_last may "
        "drop a last, shorter batch); resume on {} ranks with steps={}, as saved"
    )
    four, two = ("4", "2", "4", "4"), ("2", "4", "2", "2")
    short = (
        "on {} ranks (steps={}) the rest of this epoch is a last window of 12 samples ({}), "
        "from sample 32, but on {} ranks (steps={}) it would be a last window of 12 samples "
        "({}), from sample 32: the same samples, weighed otherwise in mean mode: a last window "
        "that holds the epoch's last, shorter microbatches weighs their samples more (this "
        "resume would be exact with num_items); resume on {} ranks with steps={}, as saved"
    )
    on_four, on_two = ("8 weighing 1/16, 4 weighing 1/8"), "each weighing 1/12"
    for mode in elastic.MODES:
        assert messages[f"ddp-{mode}-padded, partial", 4, 2] == padded.format(
            *four, *two, "52", "4", "50", "2", "4", "2"
        )
        assert messages[f"ddp-{mode}-padded, partial", 2, 4] == padded.format(
            *two, *four, "50", "2", "52", "4", "2", "4"
        )
    for wrapper in elastic.WRAPPERS:
        assert messages[f"{wrapper}-mean-short", 4, 2] == short.format(
            4, 2, on_four, 2, 4, on_two, 4, 2
        )
        assert messages[f"{wrapper}-mean-short", 2, 4] == short.format(
            2, 4, on_two, 4, 2, on_four, 2, 4
        )


def test_refusals_when_loading(outcomes: dict[str, Any]) -> None:
    """On 1 process, states saved on 2 ranks: without the opt-in, with steps that do not
    keep the global batch, saved mid-window, or mid-epoch with no global order known; each
    is refused naming the numbers and what would work, and nothing is loaded."""
    refusals = outcomes["load refusals"]
    saved = "the state was saved with world_size=2 (data-parallel ranks)"
    assert refusals == {
        "not allowed": f"{saved} but this Accumulator has world_size=1: its position counts "
        "the microbatches of each rank's shard and its windows the global batch of 2 ranks, "
        "which this run would not continue; resume on 2 ranks, as saved, or pass "
        "allow_world_size_change=True to continue on 1, 2, 4 or 8 ranks with steps 8, 4, 2 "
        "or 1 (the same global batch)",
        "steps": f"{saved} and steps=4, a global window of 2 x 4 = 8 microbatches, but this "
        "Accumulator has steps=4 on 1 rank (4 microbatches); construct it with steps=8 to "
        "keep the global batch (gradaccum.steps_for(global_batch, micro_batch, world_size))",
        "mid-window": f"{saved} mid-window (1 of 4 microsteps, include_grads=True): each "
        "rank's partial gradient holds its own microbatches, which do not carry over to 1 "
        "rank; resume on 2 ranks, as saved, or from a checkpoint after a window's last "
        "microstep",
        "no order saved": f"{saved} at microbatch 8 of an epoch whose global order was not "
        "known (an iterable other than a DataLoader over a DistributedSampler, without a "
        "global_order() method, or a state from before version 6), so where the job stands "
        "in its samples was not recorded; resume on 2 ranks, as saved, or from a checkpoint "
        "between epochs",
        **{f"{name} counters": (0, 0) for name in ("not allowed", "steps", "mid-window")},
        "no order saved counters": (0, 0),
    }


def test_refusals_when_the_epoch_begins(outcomes: dict[str, Any]) -> None:
    """On 2 ranks, a state saved on 1 loads, but an epoch whose global order is not known,
    or of another epoch's order, is refused by its first next()."""
    where = (
        "the loaded state resumes after sample 32 of DistributedSampler(shuffle=True, seed=3) "
        "of 50 samples, epoch 0"
    )
    assert outcomes["epoch refusals"] == {
        "no order here": f"{where}, but this epoch's iterable does not declare its global "
        "order (a DataLoader over a DistributedSampler sharded over the ranks that average "
        "the gradients, or an iterable with len() and a global_order() method), so where "
        "that sample falls on these ranks is not known; pass such an iterable, or resume on "
        "1 rank with steps=8, as saved",
        "another epoch": f"{where}, but this epoch's order is DistributedSampler(shuffle=True, "
        "seed=3) of 50 samples, epoch 1; pass the data the state was saved with, in the "
        "epoch's order (with a DistributedSampler, call sampler.set_epoch(0) before the "
        "epoch)",
        # loaded (global step 2, 32 samples = 8 microbatches of 2 ranks), the resume ahead
        "no order here counters": (2, 8),
        "another epoch counters": (2, 8),
    }


def test_a_checkpoint_at_an_epochs_end_resumes_on_another_number_of_ranks(
    tmp_path: Any,
) -> None:
    """Saved on 2 ranks after the first epoch's last window (its position is the epoch's
    end: a checkpoint cadence that divides the epoch), resumed on 1: the resumed first
    epoch hands out nothing, which once left its resume pending, so that the next epoch's
    order was refused as "another epoch" ("call sampler.set_epoch(0)"). Both epochs now
    end within 1e-12 of the uninterrupted run (the same samples, cut into one rank's
    microbatches)."""
    whole = run(elastic.saved_at_an_epochs_end, 2, str(tmp_path), True)[0]
    (resumed,) = run(elastic.saved_at_an_epochs_end, 1, str(tmp_path), False)
    assert not isinstance(resumed, str), resumed
    assert resumed[0] == whole[0] == 4
    for got, want in zip(resumed[1], whole[1], strict=True):
        assert (got - want).abs().max().item() <= TOLERANCE
