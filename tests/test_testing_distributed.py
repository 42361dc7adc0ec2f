"""gradaccum.testing on 2 real gloo ranks, in one launch shared by these tests: the
equivalence check passes the Accumulator under every wrapping and mode, and loops written
the way real trainers write them (nanoGPT's, two optimizers, metrics reduced), and fails
wrong loops with the message that names the likely mistake; the counters see DDP's
reducer, FSDP and every plain torch.distributed call, by kind."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from tests import loops
from tests.distributed import run

TOL = 1e-10


@functools.cache
def _checks() -> list[dict[str, Any]]:
    return run(loops.checks, 2)


def checked(name: str) -> list[Any]:
    """What each rank found for ``name`` (see `loops.checks`)."""
    return [rank[name] for rank in _checks()]


@pytest.mark.parametrize(
    ("name", "per_window"),
    [
        ("ddp", {"all_reduce": 1}),
        ("ddp_items", {"all_reduce": 2}),  # the bucket, and the window's item count
        ("fully_shard", {"all_gather": 16, "reduce_scatter": 8}),  # 2 units x 4 microsteps
        ("fsdp1", {"all_gather": 4, "reduce_scatter": 4}),
        ("forward_inside", {"all_reduce": 1}),
    ],
)
def test_exact_loops_pass_on_every_rank_alike(name: str, per_window: dict[str, int]) -> None:
    """The Accumulator (mean and item mode, DDP, fully_shard, FSDP1) and a hand loop with
    the forward inside no_sync(): parameters within 1e-10 of the float64 reference after
    every window, 3 optimizer and scheduler steps, and what a window costs."""
    reports = checked(name)
    for report in reports:
        assert report.ok, report
        assert report.max_abs_diff <= TOL
        assert report.max_grad_diff <= TOL
        assert report.gradients == ("norm" if name == "fsdp1" else "full")
        assert (report.optimizer_steps, report.scheduler_steps, report.expected_steps) == (3, 3, 3)
        assert report.per_window.collectives == per_window
        assert report.per_window.host_syncs == 0
        assert len(report.windows) == 3
    assert repr(reports[0]) == repr(reports[1])  # every rank reports the whole job


def test_a_zero_grad_inside_the_window_is_named_on_every_rank() -> None:
    """Under DDP on 2 ranks, a loop that clears the gradient before every backward steps
    with the ranks' last microbatches' gradient alone, averaged: named as that on every
    rank (the reference's "last microbatch alone" is every rank's last, as DDP averages)."""
    for report in checked("zero_every_microstep"):
        assert report.problems[0] == (
            "the gradient of window 1 is its last microbatch's alone (scaled): is "
            "zero_grad() called before every backward, inside the window? Clear the "
            "gradient once a window, after its optimizer.step()"
        )


def test_the_forward_outside_no_sync_is_caught_by_the_count() -> None:
    """The bug this library was born from: the gradients are exact, so only the count of
    all-reduces per window fails the check, with a message that says so."""
    for report in checked("forward_outside"):
        assert report.max_abs_diff <= TOL
        assert report.optimizer_steps == report.scheduler_steps == 3
        assert report.problems == [
            "4 all-reduces per window at steps=4, expected 1: DDP all-reduced on every "
            "microbatch. It decides during the forward whether the backward all-reduces, so "
            "the forward belongs inside no_sync() with its backward, on every microbatch but "
            "a window's last (or set require_backward_grad_sync before the forward, or use "
            "gradaccum.Accumulator)"
        ]
        assert [window.all_reduces for window in report.windows[1:]] == [4, 4]
        assert repr(report).splitlines()[:2] == [
            "accumulation at steps=4 on 2 ranks (mean mode): FAILED",
            f"  {report.problems[0]}",
        ]


HINT = (
    "It decides during the forward whether the backward all-reduces, so the forward belongs "
    "inside no_sync() with its backward, on every microbatch but a window's last (or set "
    "require_backward_grad_sync before the forward, or use gradaccum.Accumulator)"
)


def test_ddp_s_sync_is_checked_without_an_expected_count() -> None:
    """Under DDP the check counts the backward passes that all-reduced in each window,
    with no ``expect_collectives`` given: the forward outside no_sync() fails (it passed
    before, with exact gradients), and so does a loop that syncs the last two
    microbatches of each window (exact too: the second all-reduce adds the last
    microbatch's gradient to an average), and one that never syncs is told why its
    gradient is off; one with no no_sync() at all is told to add one (it was told to
    move its forward into one); the right loop passes."""
    for report in checked("forward_outside_unexpected"):
        assert report.max_abs_diff <= TOL
        assert report.problems == [
            f"4 all-reduces per window at steps=4: DDP all-reduced on every microbatch. {HINT}"
        ]
        assert report.per_window.backwards == {"all_reduce": 4}
    for report in checked("synced_twice"):
        assert report.max_abs_diff <= TOL
        assert report.max_grad_diff <= TOL
        assert report.problems == [
            "2 all-reduces per window at steps=4: DDP all-reduced on 2 of a window's 4 "
            f"microbatches, not only its last. {HINT}"
        ]
    # A loop with no no_sync() at all is told to add one, not to move its forward into it.
    for report in checked("no_no_sync"):
        assert report.problems == [
            "4 all-reduces per window at steps=4: DDP all-reduced on every microbatch: no "
            "backward ran with its sync off; run every microbatch but a window's last, its "
            "forward and its backward, inside model.no_sync() (or set "
            "require_backward_grad_sync = False before the forward, or use "
            "gradaccum.Accumulator)"
        ]
    for report in checked("forward_inside_unexpected"):
        assert report.ok, report
        assert report.per_window.backwards == {"all_reduce": 1}
    # The same, on a DDP the trainer made itself inside train.
    for report in checked("ddp_made_inside_outside"):
        assert report.problems == [
            f"4 all-reduces per window at steps=4: DDP all-reduced on every microbatch. {HINT}"
        ]
    for report in checked("ddp_made_inside"):
        assert report.ok, report
        assert report.per_window.backwards == {"all_reduce": 1}
    for report in checked("never_synced"):  # no_sync() on the last microbatch too
        assert report.problems[-1] == (
            "0 all-reduces per window at steps=4: DDP never all-reduced the window's "
            "gradient, so each rank stepped with its own: is no_sync() (or "
            "require_backward_grad_sync = False) left on for the window's last microbatch?"
        )
        assert report.problems[0].startswith("the gradient of window 1 is off the float64")


BYPASS = (
    "the module inside DDP ran its forward 12 times outside DDP's (model.module(x), or a "
    "method of the inner module): DDP prepares each backward's all-reduce in its own "
    "forward, so the backward of such a forward all-reduces nothing. Call the DDP model "
    "itself, model(x) (a loss computed by a method of the inner module belongs in its "
    "forward)"
)


def test_forwards_around_ddp_are_named() -> None:
    """A loss computed through ``model.module`` (a habit of trainers that call a method of
    the inner module for it): DDP never sees the forward, so no backward all-reduces and
    each rank steps with its own gradient. The check counts the inner module's forwards
    outside DDP's and names them as the cause, for a hand loop and for the Accumulator,
    which warns at every microstep the window defers that DDP shows an earlier forward's
    record, naming the forward around DDP's. A right loop that also runs the inner module
    for a value it never back-propagates passes."""
    for name in ("around_ddp", "around_ddp_accumulator"):
        for report in checked(name):
            assert f"0 all-reduces per window at steps=4: {BYPASS}" in report.problems, report
            assert report.per_window.backwards == {}
    # A forward around DDP's that is never back-propagated harms nothing: not blamed.
    for report in checked("peek_around_ddp"):
        assert report.ok, report
    for told in checked("around_ddp_warnings"):
        assert told, "the Accumulator said nothing"
        for message in told:
            assert "did not run through DDP's forward at all (model.module(x)" in message
            assert "the ranks' parameters drift apart" in message


def test_each_rank_dividing_by_its_own_items_fails_where_the_ranks_differ() -> None:
    """Item mode done per rank (each divides by its own window's items, DDP averages the
    means): wrong, and caught where the ranks' windows hold different items; where they
    hold as many (the same rows on every rank) it trains as the right loop and passes,
    and the report names that blind spot. The Accumulator passes the uneven ranks."""
    for report in checked("own_rank_items"):
        assert report.problems[0].startswith("the gradient of window 1 is off the float64")
        assert report.blind_spots == []
    for report in checked("own_rank_items_even"):
        assert report.ok, report
        (spot,) = report.blind_spots
        assert spot.startswith("every rank's window holds as many items, so a loop that")
    for report in checked("ddp_items_uneven"):
        assert report.ok, report
        assert report.blind_spots == []


def test_hugging_face_s_num_items_in_batch_is_judged_right() -> None:
    """Item mode as Hugging Face's Trainer writes it: every rank's window items all-reduced
    before the window, each summed loss divided by them and multiplied by the world size
    (DDP averages). Right, on ranks of different items: it passes, its own all-reduce
    told from DDP's. Without the world size the gradient is half the reference's, and
    divided by steps as well a quarter: each named."""
    for report in checked("every_rank_items"):
        assert report.ok, report
        assert report.blind_spots == []
        assert report.per_window.outside_backward == {"all_reduce": 1}
        assert report.per_window.backwards == {"all_reduce": 1}
    for report in checked("every_rank_items_not_times_world"):
        assert report.problems[0] == (
            "the gradient of window 1 is 0.50x the reference's: is the loss divided by every "
            "rank's items but not multiplied by the 2 ranks? DDP averages the ranks' "
            "gradients, so a loss normalized by the items of every rank's window must be "
            "multiplied by the world size, 2"
        )
    for report in checked("every_rank_items_by_steps"):
        assert report.problems[0] == (
            "the gradient of window 1 is 0.25x the reference's: is the loss divided by steps "
            "as well as by the window's items? A loss normalized by the window's item count "
            "is not divided by steps again"
        )


def test_a_trainer_s_own_all_reduces_pass_without_an_expected_count() -> None:
    """A correct DDP loop that all-reduces three metrics a window, checked without
    ``expect_collectives``: 4 all-reduces a window, of which one backward's; it passes."""
    for report in checked("metrics_all_reduced_unexpected"):
        assert report.ok, report
        assert report.per_window.all_reduces == 4
        assert report.per_window.outside_backward == {"all_reduce": 3}
        assert report.per_window.backwards == {"all_reduce": 1}


def test_a_scheduler_stepped_every_microbatch_fails_on_its_count_named() -> None:
    """The reference steps with the learning rates the trainer's optimizer held, so the
    gradients and parameters agree: the count shows the bug, and says which it is."""
    for report in checked("scheduler_every_microbatch"):
        assert report.optimizer_steps == 3
        assert report.scheduler_steps == 12
        assert report.problems == [
            "12 scheduler steps, expected 3 = total_steps(13, 4, 1, drop_last=True): one per "
            "microbatch; is scheduler.step() called every microbatch, not once per window?"
        ]
        assert report.max_abs_diff <= TOL


def test_averaging_microbatch_means_fails_the_item_mode() -> None:
    """A loop that averages per-microbatch means, checked against the token mean of
    microbatches of different lengths: the gradient of window 1 is off (by no constant
    factor), named as the mean of its microbatches' means (every rank's, as DDP averages
    them), then the parameters."""
    for report in checked("mean_of_means"):
        assert report.mode == "items"
        assert report.max_abs_diff > 1e-3
        assert len(report.problems) == 2
        assert report.problems[0].startswith(
            "the gradient of window 1 is the mean of its microbatches' means (mean mode's "
        )
        assert report.problems[1].startswith("parameters off the float64 big-batch reference")


def test_nanogpt_s_loop_passes_with_no_scheduler_and_no_host_sync() -> None:
    """AdamW, the learning rate set by hand each iteration (warmup, then cosine), DDP's
    sync flag set before each forward, loss / steps, clipping, float32: exact to float32's
    tolerance, one all-reduce and no host sync in any window, the reference stepped with
    the learning rates the trainer set."""
    for report in checked("nanogpt"):
        assert report.ok, report
        assert report.scheduler_steps is None
        assert report.max_grad_diff < 1e-6
        assert report.max_abs_diff < 1e-6
        assert report.learning_rates == [[loops.get_lr(it)] for it in range(3)]
        assert [window.host_syncs for window in report.windows] == [0, 0, 0]
        assert [window.all_reduces for window in report.windows[1:]] == [1, 1]


def test_nanogpt_s_loop_under_autocast_passes_at_bfloat16_s_tolerance() -> None:
    """Its forward and loss under bfloat16 autocast (DDP's forward runs inside it): the
    autocast is seen on every rank, one all-reduce a window."""
    for report in checked("nanogpt_autocast"):
        assert report.ok, report
        assert (report.autocast, report.tolerance) == ("bfloat16", 5e-2)
        assert [window.all_reduces for window in report.windows[1:]] == [1, 1]


def test_dropout_under_ddp_is_named_as_the_cause() -> None:
    """A right DDP loop on a model with dropout: the report names the dropout first, by its
    path in the wrapped model."""
    for report in checked("dropout"):
        assert report.problems[0].startswith(
            "the model's forwards ran Dropout(p=0.1) at 'module.1' in training mode"
        )


def test_a_batch_norm_under_ddp_passes_and_a_sync_batch_norm_is_named() -> None:
    """A right DDP loop on a model with a batch norm in training mode passes: each rank
    normalizes each microbatch by its own statistics, as the reference computes each
    microbatch alone. A SyncBatchNorm over the 2 ranks, whose statistics span them, is
    named (in training mode only: in eval mode it uses its running statistics)."""
    for report in checked("batch_norm"):
        assert report.ok, report
        assert report.max_grad_diff <= TOL
    assert checked("sync_batch_norm") == [{"1": "SyncBatchNorm over 2 ranks"}] * 2
    assert checked("sync_batch_norm_eval") == [{}] * 2


def test_a_functional_dropout_under_ddp_is_named_as_the_cause() -> None:
    """A right DDP loop on a model whose forward calls ``F.dropout`` (no module shows it):
    the report says first that two forwards of a microbatch differ."""
    for report in checked("functional_dropout"):
        assert report.problems[0].startswith(
            "two losses of the same microbatch at the same parameters differ"
        )


@pytest.mark.parametrize("name", ["nanogpt_unscaled", "nanogpt_unscaled_sgd"])
def test_nanogpt_s_loop_without_dividing_by_steps_fails_with_the_factor(name: str) -> None:
    """Under AdamW, whose update ignores the gradient's scale, the parameters stay within
    float32's tolerance: only the gradient shows the bug. Under SGD both do."""
    for report in checked(name):
        assert report.problems[0] == (
            "the gradient of window 1 is 4.00x the reference's: is the loss divided by steps?"
        )
        if name == "nanogpt_unscaled":
            assert report.problems == report.problems[:1]
            assert report.max_abs_diff < report.tolerance
        else:
            assert report.problems[1].startswith("parameters off the float64 big-batch")


def test_fsdp1_gradients_are_compared_by_their_norm() -> None:
    """FSDP1 keeps flat gradient shards: their norm shows a loss not divided by steps."""
    for report in checked("fsdp1_unscaled"):
        assert report.gradients == "norm"
        assert report.problems[0] == (
            "the gradient norm of window 1 is 4.00x the reference's: is the loss divided by steps?"
        )
        assert (
            repr(report)
            .splitlines()[-2]
            .startswith("  optimizer/scheduler steps 3/3 of 3; max |grad norm - reference|")
        )


def test_a_gradient_summed_over_the_ranks_is_named() -> None:
    """A loss multiplied by the world size (DDP averages; the loop meant to undo it)."""
    for report in checked("summed_over_ranks"):
        assert report.problems[0] == (
            "the gradient of window 1 is 2.00x the reference's: are the gradients summed "
            "over the 2 ranks instead of averaged?"
        )


def test_a_loss_divided_by_the_world_size_is_named() -> None:
    """A loss divided by the world size as well as by steps (as if DDP summed the ranks'
    gradients): half the reference's on 2 ranks, named (it gave no cause before)."""
    for report in checked("divided_by_world"):
        assert report.problems[0] == (
            "the gradient of window 1 is 0.50x the reference's: is the loss divided by the "
            "world size, 2? DDP (and FSDP) average the ranks' gradients already"
        )


def test_ranks_that_step_apart_are_named() -> None:
    """A hand loop whose one all-reduce a window runs in its first backward (``no_sync()``
    around the other three): the count is the expected one and the gradient is off by
    no factor, so the report once said only that; the ranks' parameters differ after the
    first window, which is said first, with the cause. A loop whose one optimizer is
    never zeroed (Muon + AdamW, one zero_grad()) is named by that optimizer."""
    for report in checked("synced_first"):
        assert report.problems[0] == (
            "the ranks' parameters differ after window 1: each rank stepped with a gradient "
            "of its own. DDP all-reduced in one backward a window, but not the window's "
            "last, so the microbatches after it stayed on each rank: run the window's last "
            "microbatch (its forward and backward) outside no_sync(), the others inside it"
        )
        assert report.per_window.collectives == {"all_reduce": 1}
    for report in checked("two_optimizers_one_zeroed"):
        assert report.problems[0].startswith(
            "the gradient of window 2 is the reference's, plus window 1's in the parameters "
            "of optimizers[1] alone: is optimizers[1].zero_grad() called after every step?"
        )
    for report in [*checked("never_synced"), *checked("forward_outside")]:
        assert not any("ranks' parameters differ" in problem for problem in report.problems)
    # torchtitan's DDP, the composable replicate(): the same judgment.
    for report in [*checked("replicate"), *checked("replicate_accumulator")]:
        assert report.ok, report
        # (its DDP is built in the first forward, and rebuilds its buckets in the second
        # window's: broadcasts there)
        assert [window.all_reduces for window in report.windows[1:]] == [1, 1]
    for report in checked("replicate_synced_first"):
        assert report.problems[0].startswith(
            "the ranks' parameters differ after window 1: each rank stepped with a gradient "
            "of its own. DDP all-reduced in one backward a window, but not the window's last"
        ), report.problems


def test_two_optimizers_under_ddp() -> None:
    """SGD on the weights and Adam on the biases, one all-reduce per window: exact, by hand
    and through the several-optimizer `Accumulator`; not dividing by steps is named."""
    for report in [*checked("two_optimizers"), *checked("two_optimizers_accumulator")]:
        assert report.ok, report
        assert len(report.windows) == 3
        assert report.max_grad_diff <= TOL
    for report in checked("two_optimizers_unscaled"):
        assert report.problems[0] == (
            "the gradient of window 1 is 4.00x the reference's: is the loss divided by steps?"
        )


def test_metrics_reduced_each_window_count_as_reduce() -> None:
    """Two ``dist.reduce`` of a window's metrics, read on rank 0: expected by the name a
    report prints, and counted as host syncs there (a device run reduces device tensors)."""
    reports = checked("metrics")
    for report in reports:
        assert report.ok, report
        assert report.expected_collectives == {"all_reduce": 1, "reduce": 2}
        assert str(report.per_window) == "1 all-reduce + 2 reduce, 2 host syncs"
        # The second window also runs DDP's one-time bucket-rebuild broadcasts.
        assert str(report.windows[2]) == "1 all-reduce + 2 reduce, 2 host syncs"


def test_metrics_all_reduced_are_told_from_the_gradient_s() -> None:
    """Three ``dist.all_reduce`` of a window's metrics, a correct DDP loop, and
    ``expect_collectives={"all_reduce": 1}`` copied from the guide: 4 all-reduces a window,
    which once read as DDP's all-reduce on every microbatch. The count says that 3 of them
    ran outside the backward, the trainer's own, and blames no forward; with the forward
    outside ``no_sync()`` as well, 7 a window, of which the 4 in the backward are DDP's
    every microbatch, as before."""
    for report in checked("metrics_all_reduced"):
        assert report.max_abs_diff <= TOL
        assert report.problems == [
            "4 all-reduces per window at steps=4, expected 1 (1 in the backward, 3 outside "
            "it: the trainer's own, such as a metric's all-reduce, which expect_collectives "
            "counts too)"
        ]
        assert report.per_window.outside_backward == {"all_reduce": 3}
    for report in checked("metrics_all_reduced_forward_outside"):
        assert report.problems == [
            "7 all-reduces per window at steps=4, expected 4 (4 in the backward, 3 outside "
            "it: the trainer's own, such as a metric's all-reduce, which expect_collectives "
            "counts too): DDP all-reduced on every microbatch. "
            "It decides during the forward whether the backward all-reduces, so the "
            "forward belongs inside no_sync() with its backward, on every microbatch but a "
            "window's last (or set require_backward_grad_sync before the forward, or use "
            "gradaccum.Accumulator)"
        ]


def test_ddp_bucket_counter_counts_each_synced_backward() -> None:
    """The comm-hook fallback: one bucket per window with the forward inside no_sync(),
    one per microstep (3 windows x 4) with it outside."""
    for buckets in checked("buckets"):
        assert buckets == {"forward_outside": 12, "forward_inside": 3}


def test_plain_collectives_count_by_kind() -> None:
    """Every kind of ``torch.distributed`` call, the coalesced and functional forms too,
    counts under its kind's name."""
    for rank, counted in enumerate(checked("plain")):
        assert counted == {
            "all_reduce": {"all_reduce": 1},
            "broadcast": {"broadcast": 1},
            "all_gather_into_tensor": {"all_gather": 1},
            "all_gather": {"all_gather": 1},
            "reduce_scatter_tensor": {"reduce_scatter": 1},
            "barrier": {"barrier": 1},
            "monitored_barrier": {"barrier": 1},
            "reduce": {"reduce": 1},
            "all_to_all": {"all_to_all": 1},
            "all_to_all_single": {"all_to_all": 1},
            "gather": {"gather": 1},
            "scatter": {"scatter": 1},
            "send_or_recv": {"send": 1} if rank == 0 else {"recv": 1},
            "batch_isend_irecv": {"recv": 1, "send": 1},
            "all_reduce_coalesced": {"all_reduce": 1},
            "coalescing_manager": {"all_reduce": 1},
            "functional_all_reduce": {"all_reduce": 1},
            "functional_all_to_all_single": {"all_to_all": 1},
        }


def test_an_optimizer_that_averages_inside_its_step_is_judged_on_the_average() -> None:
    """nanochat's DistAdamW shape, examples/testing_your_trainer/test_dist_adamw.py (no
    DDP; step() reduce-scatters or all-reduces each gradient, averages it, steps its slice
    and all-gathers the parameter), checked in the shared launch: judged on the
    ranks' mean gradient against a reference that steps the same optimizer as one rank,
    the exact loop is ok and the report says what it saw; the same optimizer summing
    without dividing fails on its parameters, with that cause."""
    for report in checked("dist_adamw"):
        assert report.ok, report
        assert report.max_grad_diff <= TOL
        assert report.reduced_in_step is not None
        assert report.reduced_in_step.collectives == report.per_window.collectives
        assert (
            "  the optimizers average the gradients over the ranks inside step(): judged on "
            "the averaged gradient, 2 all-gathers + 2 all-reduces + 2 reduce-scatters per "
            "window, all at the boundary"
        ) in repr(report).splitlines()
    for report in checked("dist_adamw_summed"):
        assert len(report.problems) == 1, report
        assert report.problems[0].startswith("parameters off the float64 big-batch reference")
        assert report.problems[0].endswith(
            ": the optimizers' step() applies the sum of the 2 ranks' gradients (a copy "
            "stepped with 2x their mean lands on the trainer's parameters); does it reduce "
            "them without dividing by the 2 ranks?"
        )
