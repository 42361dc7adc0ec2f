"""gradaccum.testing.check_accumulation on one process: exact loops pass in both modes,
wrong ones fail with a message naming what broke, and set-ups it cannot check are
refused before any training (2-rank checks: test_testing_distributed.py)."""

from __future__ import annotations

import functools
import math
import random
from typing import Any

import pytest
import torch

import gradaccum
from gradaccum.testing import check_accumulation, expected_windows
from gradaccum.testing.counting import KINDS, in_words
from gradaccum.testing.diagnosis import (
    blind_spots,
    gradient_problem,
    not_per_item_problem,
    unclipped_factor,
)
from tests import loops
from tests.helpers import make_batches, make_model, mean_loss, sum_loss

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
    assert report.max_grad_diff <= TOL
    assert report.gradients == "full"
    expected = gradaccum.total_steps(
        13, 4, options.get("epochs", 1), options.get("drop_last", True)
    )
    assert report.optimizer_steps == report.scheduler_steps == report.expected_steps == expected
    assert report.mode == ("items" if by_items else "mean")
    assert report.per_window == gradaccum.testing.Counts()  # one process: no collective


def test_a_hand_loop_passes_and_its_report_reads_ok() -> None:
    report = loops.check(loops.hand_loop)
    assert report.ok, report
    lines = repr(report).splitlines()
    assert lines[0] == "accumulation at steps=4 on 1 rank (mean mode): ok"
    assert lines[1].startswith("  optimizer/scheduler steps 3/3 of 3; max |grad - reference| ")
    assert lines[2].startswith("  the reference stepped with the hyperparameters the trainer's")


def test_blind_spots_are_shown_where_a_wrong_loop_would_pass() -> None:
    """The hand loop averages its microbatches' means: in item mode it is wrong, and on
    microbatches of equal item counts it trains exactly as the right loop, so it passes
    there; the report says what these batches cannot show (with an epoch that steps
    divides, the trailing partial window too), and on the usual batches says nothing."""
    equal = [make_batches([2] * 12, seed=7)]
    report = check_accumulation(
        make_model, loops.sgd, loops.hand_loop, equal, sum_loss, steps=4, num_items=loops.items
    )
    assert report.ok, report
    assert report.blind_spots == [
        "the epoch's 12 microbatches fill its windows of steps=4, so what the loop does "
        "with a trailing partial window is not seen: give an epoch whose length steps "
        "does not divide",
        "every microbatch of a window holds as many items, so a loop that averages the "
        "microbatches' means (instead of dividing by the window's items) passes too: give "
        "microbatches of different item counts",
    ]
    assert repr(report).splitlines()[-3:] == [  # the heading once, then each spot
        "  not seen with these batches (never failed):",
        *(f"    - {spot}" for spot in report.blind_spots),
    ]
    one = check_accumulation(
        make_model, loops.sgd, loops.hand_loop, [make_batches([1, 2, 3, 4])], mean_loss, steps=4
    )
    assert one.ok, one
    assert [spot.split(":")[0] for spot in one.blind_spots] == [
        "the epoch's 4 microbatches fill its windows of steps=4, so what the loop does with "
        "a trailing partial window is not seen",
        "one window in the run",
    ]
    wrong = loops.check(loops.hand_loop, by_items=True)  # 13 microbatches of varying rows
    assert not wrong.ok
    assert wrong.blind_spots == []


def test_a_threshold_no_window_reaches_is_a_blind_spot_for_clipping() -> None:
    """The hand loop never clips: checked with a max_grad_norm no window's gradient
    reaches it passes, and the report says that clipping was not seen; with one every
    window's exceeds, the missing clip fails; the extremes are said either way."""
    unseen = loops.check(loops.hand_loop, max_grad_norm=1e6)
    assert unseen.ok, unseen
    (spot,) = unseen.blind_spots
    assert spot.startswith("no window's gradient norm (at most ")
    assert "reached max_grad_norm=1e+06, so a loop that does not clip" in spot
    caught = loops.check(loops.hand_loop, max_grad_norm=1e-6)
    assert not caught.ok
    (spot,) = caught.blind_spots
    assert spot.startswith("every window's gradient norm (at least ")
    assert "a gradient off by a constant factor (a loss not divided by steps) passes" in spot
    kept = (0.3, 0.29, 0.34)  # some windows clipped, some not: nothing hidden
    assert blind_spots(expected_windows(9, 4), n_batches=9, steps=4, items=None, clip=kept) == []


def test_a_trainer_under_autocast_is_checked_at_that_precision() -> None:
    """nanoGPT's loop with its forward and loss under bfloat16 autocast, on float32
    parameters: its gradients carry bfloat16's rounding (7e-4 here), which float32's
    tolerance of 1e-4 took for a wrong loop. The forwards' autocast is seen, and the
    default tolerance is bfloat16's; the report says so, and that such a tolerance
    cannot see a gradient off by a factor near 1 on these small gradients. Not dividing
    by steps still fails, named; a tolerance given is kept."""
    right = loops.nanogpt_check(autocast=torch.bfloat16)
    assert right.ok, right
    assert (right.autocast, right.tolerance) == ("bfloat16", 5e-2)
    assert right.max_grad_diff > 1e-4  # what float32's tolerance failed
    assert "(tolerance 5e-02, the forwards ran under autocast to bfloat16)" in repr(right)
    assert right.blind_spots[0].startswith(
        "the tolerance, 5e-02, is 60% of the largest gradient entry (0.084), so a gradient "
        "off by a constant factor from 0.40 to 1.60 passes too"
    )
    wrong = loops.nanogpt_check(autocast=torch.bfloat16, divide=False)
    assert wrong.problems[0] == (
        "the gradient of window 1 is 4.00x the reference's: is the loss divided by steps?"
    )
    strict = loops.nanogpt_check(autocast=torch.bfloat16, tolerance=1e-4)
    assert (strict.ok, strict.autocast, strict.tolerance) == (False, "bfloat16", 1e-4)
    plain = loops.nanogpt_check()
    assert (plain.autocast, plain.tolerance) == (None, 1e-4)
    assert not any(spot.startswith("the tolerance") for spot in plain.blind_spots)
    windows = expected_windows(9, 4)  # a tolerance a tenth of the largest entry hides nothing
    assert blind_spots(windows, n_batches=9, steps=4, items=None, scale=(1e-4, 1e-3)) == []
    (spot,) = blind_spots(windows, n_batches=9, steps=4, items=None, scale=(1e-4, 4e-4))
    assert spot.startswith("the tolerance, 1e-04, is 25% of the largest gradient entry")


def test_an_autocast_inside_the_models_forward_is_seen_in_its_graph() -> None:
    """A model whose own ``forward`` enters bfloat16 autocast (as Accelerate's
    ``mixed_precision`` patches a prepared model's): no autocast is on around its forward,
    so the forward pre-hook saw none and float32's tolerance failed the right loop. Its
    outputs' autograd graph carries bfloat16: the default tolerance is bfloat16's, the
    report says where it comes from, and not dividing by steps still fails, named."""
    right = loops.nanogpt_check(inner_autocast=torch.bfloat16)
    assert right.ok, right
    assert (right.autocast, right.computed, right.tolerance) == (None, "bfloat16", 5e-2)
    assert right.max_grad_diff > 1e-4  # what float32's tolerance failed
    assert "(tolerance 5e-02, the forwards computed in bfloat16)" in repr(right)
    wrong = loops.nanogpt_check(inner_autocast=torch.bfloat16, divide=False)
    assert wrong.problems[0] == (
        "the gradient of window 1 is 4.00x the reference's: is the loss divided by steps?"
    )
    around = loops.nanogpt_check(autocast=torch.bfloat16)  # seen around: named so
    assert (around.autocast, around.computed) == ("bfloat16", None)
    plain = loops.nanogpt_check()
    assert (plain.autocast, plain.computed, plain.tolerance) == (None, None, 1e-4)


def test_graph_dtypes_reads_the_graph_without_unpacking_saved_tensors() -> None:
    """`graph_dtypes` finds a lower precision in any nesting of the outputs, only below
    the given dtype, and unpacks no saved tensor: under non-reentrant checkpointing (whose
    unpack recomputes the forward) nothing is recomputed by looking."""
    from torch.utils.checkpoint import checkpoint

    from gradaccum.testing.observed import graph_dtypes

    weight = torch.nn.Parameter(torch.randn(3, 3))
    forwards = []

    def low(inputs: torch.Tensor) -> torch.Tensor:
        forwards.append(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (inputs @ weight).float()

    out = low(torch.randn(2, 3))
    assert graph_dtypes({"logits": [out], "n": 3}, below=torch.float32) == {torch.bfloat16}
    assert graph_dtypes(out, below=torch.bfloat16) == set()
    assert graph_dtypes(out.detach(), below=torch.float32) == set()
    checkpointed = checkpoint(low, torch.randn(2, 3), use_reentrant=False)
    assert len(forwards) == 2
    assert graph_dtypes(checkpointed, below=torch.float32) == {torch.bfloat16}
    assert len(forwards) == 2  # nothing recomputed
    checkpointed.sum().backward()
    assert len(forwards) == 3  # (the backward recomputes, once)


def clipped_nanogpt(dtype: torch.dtype, *, divide: bool, clip: float) -> Any:
    """`loops.nanogpt_loop` (dividing by steps or not) in ``dtype``, clipped at ``clip``."""
    return check_accumulation(
        functools.partial(make_model, dtype=dtype),
        loops.adamw,
        functools.partial(loops.nanogpt_loop, divide=divide, grad_clip=clip),
        [[(x.to(dtype), y.to(dtype)) for x, y in loops.rank_batches(0)]],
        mean_loss,
        steps=loops.STEPS,
        max_grad_norm=clip,
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_factor_hidden_by_clipping_is_read_from_clip_grad_norms_eps(dtype: torch.dtype) -> None:
    """nanoGPT's loop clipping at a norm every window's gradient exceeds: a loss not
    divided by steps is clipped to the same norm as the right one, a hair apart (the 1e-6
    ``clip_grad_norm_`` adds to the norm it divides by). In float64 that hair is above the
    tolerance, and the report once said "1.00x the reference's", with no cause; it now
    reads the factor back from it. In float32 the hair is under the tolerance: both loops
    pass, and the blind spot says a factor is not seen."""
    right = clipped_nanogpt(dtype, divide=True, clip=0.05)
    wrong = clipped_nanogpt(dtype, divide=False, clip=0.05)
    assert right.ok, right
    hidden = [spot for spot in right.blind_spots if spot.startswith("every window's gradient")]
    if dtype == torch.float64:
        assert wrong.problems[0] == (
            "the gradient of window 1 was 4.00x the reference's before clipping (both were "
            "clipped to max_grad_norm=0.05, and only the 1e-6 that clip_grad_norm_ adds to "
            "the norm tells them apart): is the loss divided by steps?"
        )
        assert hidden == []
    else:
        assert wrong.ok  # what the blind spot says
        assert len(hidden) == 1


@pytest.mark.parametrize("count_on", [True, False], ids=["count_runs_on", "never_cleared"])
def test_a_gradient_carried_into_the_next_epoch_is_named(count_on: bool) -> None:
    """An epoch of 13 microbatches at steps=4 drops its last one. A loop whose microbatch
    count runs on across epochs, or that leaves that microbatch's gradient uncleared,
    adds it to the next epoch's first window: over two epochs that window is off, and
    the report says why (it gave no cause before). Over one epoch nothing is off, and a
    blind spot says that the gradient the loop left is not followed; a loop that leaves
    none (gradaccum's; the hand loop, which back-propagates whole windows only) gets no
    such spot."""
    loop = functools.partial(loops.epoch_spanning_loop, count_on=count_on)
    two = loops.check(loop, epochs=2)
    assert two.problems[0].startswith("the gradient of window 4 is off the float64")
    assert two.problems[0].endswith(
        ": it is the first window of an epoch, after the 1 microbatch that drop_last dropped "
        "at the previous epoch's end; is its gradient left in it (no zero_grad() at the "
        "epoch's end), or does the loop's microbatch count run on across epochs, so that "
        "windows span them?"
    )
    one = loops.check(loop)
    assert one.ok, one
    carried = [spot for spot in one.blind_spots if spot.startswith("one epoch, whose last 1")]
    assert len(carried) == 1
    assert carried[0].endswith("is not seen: give epochs=2")
    for right in (loops.accumulator_loop, loops.hand_loop):
        report = loops.check(right)
        assert report.ok, report
        assert not any(spot.startswith("one epoch") for spot in report.blind_spots)


@pytest.mark.parametrize("factor", [0.5, 2.0, 4.0, 8.0])
def test_unclipped_factor_inverts_clip_grad_norms_eps(factor: float) -> None:
    """A gradient ``factor`` times the reference's, both clipped by ``clip_grad_norm_``
    (``max_norm / (norm + 1e-6)``), comes out ``factor (n + 1e-6) / (factor n + 1e-6)``
    times the reference's clipped one; `unclipped_factor` gives ``factor`` back from it,
    and nothing for a scale of 1 or one too far from 1 to come from clipping."""
    norm = 3.0
    scale = factor * (norm + 1e-6) / (factor * norm + 1e-6)
    found = unclipped_factor(scale, norm, 1.0)
    assert found is not None
    assert math.isclose(found, factor, rel_tol=1e-6)
    assert unclipped_factor(1.0, norm, 1.0) is None
    assert unclipped_factor(1.01, norm, 1.0) is None
    # The reference's gradient under max_norm, the trainer's (factor > 1) over it.
    if factor > 1:
        under = 0.9 / factor + 0.05
        scale = factor * 1.0 / (factor * under + 1e-6)
        found = unclipped_factor(scale, under, 1.0)
        assert found is not None
        assert math.isclose(found, factor, rel_tol=1e-6)


@pytest.mark.parametrize("p", [0.1, 0.0])
def test_a_functional_dropout_is_named_as_the_cause(p: float) -> None:
    """A right loop on a model whose own ``forward`` calls ``F.dropout`` (GPT-2's
    attention dropout is often written so): no dropout module to see, and the report
    said only "off the float64 big-batch reference". Two losses of one microbatch at the
    same parameters now show the forward is random, named first (looked at only when a
    window is off, under a forked random state). A dropout of 0 passes."""
    report = loops.check(loops.hand_loop, make_model=functools.partial(loops.FunctionalDropout, p))
    if p == 0.0:
        assert report.ok, report
        return
    assert report.problems[0] == (
        "two losses of the same microbatch at the same parameters differ: the model's "
        "forward draws random numbers (a functional F.dropout with training=True, or "
        "another random op), so its gradients cannot match the reference's whatever the "
        "loop: build make_model's model for the check without them (dropout 0)"
    )


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_schedule_in_epochs_is_checked_as_one(epochs: int) -> None:
    """A scheduler stepped once at each epoch's end was read as windows never stepped
    ("is scheduler.step() reached at the end of every window?"), a false alarm on a
    schedule in epochs. The count is now named as one per epoch, with the option that
    checks it so: ``scheduler_per="epoch"``, under which it passes, and a scheduler
    stepped every window fails."""
    window = loops.check(loops.epoch_scheduler_loop, epochs=epochs)
    assert window.problems == [
        f"{epochs} scheduler step{'s' * (epochs > 1)}, expected {3 * epochs} = "
        f"total_steps(13, 4, {epochs}, "
        "drop_last=True): one per epoch: right for a schedule in epochs (a StepLR by epochs, "
        "say): pass scheduler_per='epoch'; a schedule in optimizer steps has its step() "
        "outside the loop over the windows"
    ]
    epoch = loops.check(loops.epoch_scheduler_loop, epochs=epochs, scheduler_per="epoch")
    assert epoch.ok, epoch
    assert epoch.scheduler_steps == epochs
    every_window = loops.check(loops.hand_loop, epochs=epochs, scheduler_per="epoch")
    assert every_window.problems == [
        f"{3 * epochs} scheduler steps, expected {epochs}: one per epoch "
        "(scheduler_per='epoch'); is scheduler.step() called once, at every epoch's end?"
    ]
    with pytest.raises(gradaccum.ConfigError, match="scheduler_per must be one of 'window'"):
        loops.check(loops.hand_loop, scheduler_per="step")


def with_middle(middle: Any, argument: float) -> torch.nn.Module:
    """`make_model`'s layers with ``middle(argument)`` after the first."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 7), middle(argument), torch.nn.Tanh(), torch.nn.Linear(7, 1)
    ).double()


@pytest.mark.parametrize(
    ("middle", "argument", "divisor", "first"),
    [
        (
            torch.nn.Dropout,
            0.1,
            4,
            "the model's forwards ran Dropout(p=0.1) at '1' in training mode, whose output "
            "the reference cannot reproduce (dropout draws its own masks), so its gradients "
            "cannot match the reference's whatever the loop: build the model for the check "
            "(make_model's, and what wrap makes of it) without them (dropout 0)",
        ),
        (torch.nn.BatchNorm1d, 7, 4, None),
        (
            torch.nn.BatchNorm1d,
            7,
            1,
            "the gradient of window 1 is 4.00x the reference's: is the loss divided by steps?",
        ),
        (torch.nn.SyncBatchNorm, 7, 4, None),
        (torch.nn.Dropout, 0.0, 4, None),
        (torch.nn.LayerNorm, 7, 4, None),
    ],
    ids=[
        "dropout",
        "batch_norm",
        "batch_norm_not_divided",
        "sync_batch_norm_one_process",
        "dropout_0",
        "layer_norm",
    ],
)
def test_a_model_that_is_not_per_item_is_named_as_the_cause(
    middle: Any, argument: float, divisor: int, first: str | None
) -> None:
    """A right loop on a model with dropout in training mode: its gradients cannot match
    the reference's, which once read as a wrong loop ("off the float64 big-batch
    reference by ..."); the report now says first which module makes the check
    impossible, and how to build the model for it. Dropout 0 and a per-item norm pass,
    and so does a batch norm in training mode: the reference computes each microbatch's
    loss alone, so it normalizes each by its own statistics as the trainer does (it was
    once named as the cause, next to gradients matched to 1e-14); a wrong loop on it is
    named by its own mistake. A SyncBatchNorm on one process is a plain batch norm."""
    report = check_accumulation(
        functools.partial(with_middle, middle, argument),
        loops.sgd,
        functools.partial(loops.hand_loop, divisor=divisor),
        [make_batches([2] * 13)],  # (a batch norm refuses a microbatch of one row)
        mean_loss,
        steps=4,
    )
    if first is None:
        assert report.ok, report
        assert report.max_grad_diff <= TOL
        return
    assert report.problems[0] == first


def test_a_sync_batch_norm_over_several_ranks_is_named() -> None:
    """A SyncBatchNorm over several ranks normalizes by every rank's microbatch, which the
    reference, each microbatch alone, cannot: it is named, with the plain batch norm as
    the fix (the 2-rank forward it is seen in: test_testing_distributed.py)."""
    assert not_per_item_problem(
        {"module.1": "SyncBatchNorm over 2 ranks", "module.3": "Dropout(p=0.1)"}
    ) == (
        "the model's forwards ran SyncBatchNorm over 2 ranks at 'module.1', Dropout(p=0.1) "
        "at 'module.3' in training mode, whose output the reference cannot reproduce "
        "(dropout draws its own masks; a SyncBatchNorm normalizes by the statistics of "
        "every rank's microbatch, which the reference, computing each microbatch alone, "
        "never sees), so its gradients cannot match the reference's whatever the loop: "
        "build the model for the check (make_model's, and what wrap makes of it) without "
        "them (dropout 0; a plain BatchNorm instead of the SyncBatchNorm (it normalizes "
        "each microbatch by its own statistics, as the reference does), or the norm in "
        "eval mode)"
    )


def cast_loss(model: Any, batch: Any, to: torch.dtype = torch.float32) -> torch.Tensor:
    """`mean_loss` on inputs cast to the fixed dtype ``to``, as ``x.float() / 255`` on
    image bytes casts them."""
    inputs, targets = batch
    return (model(inputs.to(to)) - targets).square().mean()


class CastsInput(torch.nn.Module):
    """`make_model`'s layers in float32, its ``forward`` casting the input to float32."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model(dtype=torch.float32)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.inner(inputs.float())  # type: ignore[no-any-return]


def loss_loop(
    model: Any, optimizer: Any, scheduler: Any, batches: Any, *, loss: Any, divisor: int
) -> None:
    """The hand loop of ``loss``, each microbatch's loss divided by ``divisor``."""
    for index, batch in enumerate(batches):
        (loss(model, batch) / divisor).backward()
        if (index + 1) % 4 == 0:
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize("where", ["loss", "forward"])
@pytest.mark.parametrize("divisor", [4, 1], ids=["right", "not_divided"])
def test_a_cast_to_float32_is_checked_by_a_float32_reference(where: str, divisor: int) -> None:
    """A float32 model whose loss, or forward, casts its input to float32: the float64
    reference once crashed inside torch ("mat1 and mat2 must have the same dtype") after
    the trainer ran. The first microbatch's loss is now tried on the float64 copy first;
    it raises, so the reference runs in the parameters' dtype, which the report notes, at
    float32's tolerance: a right loop passes, a wrong one is named by its mistake."""
    model = CastsInput if where == "forward" else functools.partial(make_model, dtype=torch.float32)
    loss = mean_loss if where == "forward" else cast_loss
    report = check_accumulation(
        model,
        loops.sgd,
        functools.partial(loss_loop, loss=loss, divisor=divisor),
        [make_batches([1, 3, 2, 4, 2, 1, 3, 3, 2, 1, 4, 2, 2], dtype=torch.float32)],
        loss,
        steps=4,
    )
    assert (report.reference, report.tolerance) == ("float32", 1e-4)
    assert (
        "  the reference ran in float32: the loss or the model's forward does not run in "
        "float64 (it casts to a fixed dtype)"
    ) in repr(report).splitlines()
    if divisor == 4:
        assert report.ok, report
        return
    assert report.problems == [
        "the gradient of window 1 is 4.00x the reference's: is the loss divided by steps?",
        report.problems[1],
    ]
    assert report.problems[1].startswith("parameters off the float32 big-batch reference by")


def test_a_loss_the_reference_cannot_run_is_refused_before_training() -> None:
    """A loss that casts to a dtype neither the float64 copy nor a float32 one runs in
    (float16 inputs to a float32 model) is refused up front, naming what raised and the
    fix, before the trainer runs a step."""
    trained = []
    with pytest.raises(gradaccum.ConfigError) as caught:
        check_accumulation(
            functools.partial(make_model, dtype=torch.float32),
            loops.adamw,
            lambda *args: trained.append(args),
            [make_batches([2] * 8, dtype=torch.float32)],
            functools.partial(cast_loss, to=torch.float16),
            steps=4,
        )
    assert trained == []
    message = str(caught.value)
    assert message.startswith(
        "the reference cannot run make_model's model and the loss: loss(model, "
        "batches[0][0]) on its copy on the CPU in float64 raised RuntimeError: "
    )
    assert ", then in float32 raised RuntimeError: " in message
    assert message.endswith(
        "The reference trains a copy in float64, or else in the trainer's parameters' "
        "dtype, so a cast in the loss or the model's forward must follow the parameters' "
        "dtype rather than a fixed one: x.to(next(model.parameters()).dtype), not x.float()"
    )


def bf16_unscaled_loop(model: Any, optimizer: Any, scheduler: Any, batches: Any) -> None:
    """nanoGPT's forward and loss under a bfloat16 autocast, the loss not divided by
    steps (the bug)."""
    for index, batch in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = mean_loss(model, batch)
        loss.backward()
        if (index + 1) % 4 == 0:
            optimizer.step()
            optimizer.zero_grad()


def test_a_factor_is_named_as_near_as_a_coarse_tolerance_allows() -> None:
    """Under a bfloat16 autocast a loss not divided by steps came out 4.01x the
    reference's, and the hint, which wanted 4 to 0.1%, was lost. A factor is now named
    as near as the tolerance can tell (5e-2 over the largest entry, at most a tenth of
    the factor), while a float64 check names none for a scale the tolerance tells from
    4, and none for a scale a tenth of a factor away, however coarse the tolerance."""
    report = check_accumulation(
        functools.partial(make_model, dtype=torch.float32),
        loops.adamw,
        bf16_unscaled_loop,
        [[(0.2 * x, 0.2 * y) for x, y in make_batches(list(loops.SIZES), dtype=torch.float32)]],
        mean_loss,
        steps=4,
    )
    assert report.tolerance == 5e-2
    assert report.problems[0] == (
        "the gradient of window 1 is 4.01x the reference's: is the loss divided by steps?"
    )
    want = torch.tensor([0.2, -0.1, 0.05], dtype=torch.float64)
    options: dict[str, Any] = {
        "length": 4,
        "steps": 4,
        "world": 1,
        "items": False,
        "norm_only": False,
    }
    coarse = gradient_problem(1, 4.01 * want, want, None, tolerance=5e-2, **options)
    assert coarse == (
        "the gradient of window 1 is 4.01x the reference's: is the loss divided by steps?"
    )
    fine = gradient_problem(1, 4.01 * want, want, None, tolerance=1e-10, **options)
    assert fine == "the gradient of window 1 is 4.01x the reference's"
    assert gradient_problem(1, 4.003 * want, want, None, tolerance=1e-10, **options) == (
        "the gradient of window 1 is 4.00x the reference's: is the loss divided by steps?"
    )  # (0.1%: the rounding of the gradients, as before)
    partial = {**options, "length": 3}  # 3/4 of the reference's: a partial window / steps
    assert gradient_problem(1, 0.74 * want, want, None, tolerance=5e-2, **partial).endswith(
        "is its loss divided by steps=4 instead of by 3?"
    )
    huge = gradient_problem(1, 0.9 * want, want, None, tolerance=1.0, **partial)
    assert huge == "the gradient of window 1 is 0.90x the reference's"


def test_blind_spots_of_the_ranks_item_counts() -> None:
    """Two ranks whose windows hold as many items each (though their microbatches differ):
    a loop that divides by its own rank's items would pass; other counts show it."""
    windows = expected_windows(8, 4)
    (spot,) = blind_spots(windows, n_batches=9, steps=4, items=[[1, 3, 2, 2] * 2, [2] * 8])
    assert spot.startswith("every rank's window holds as many items, so a loop that divides")
    assert blind_spots(windows, n_batches=9, steps=4, items=[[1, 3, 2, 2] * 2, [3] * 8]) == []
    assert blind_spots(windows, n_batches=9, steps=4, items=None) == []
    # One window an epoch, over two epochs: two windows in the run.
    assert blind_spots(expected_windows(5, 4) * 2, n_batches=5, steps=4, items=None) == []


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


def no_zero_grad_loop(model: Any, optimizer: Any, scheduler: Any, batches: Any) -> None:
    """Never zeroes the gradient: each window's adds to the last one's."""
    for index, batch in enumerate(batches[:12]):
        (mean_loss(model, batch) / 4).backward()
        if index % 4 == 3:
            optimizer.step()
            scheduler.step()


def zero_before_step_loop(model: Any, optimizer: Any, scheduler: Any, batches: Any) -> None:
    """Clears the gradient at the boundary before the step (the lines swapped)."""
    for index, batch in enumerate(batches[:12]):
        (mean_loss(model, batch) / 4).backward()
        if index % 4 == 3:
            optimizer.zero_grad()
            optimizer.step()
            scheduler.step()


def partial_by_steps_loop(model: Any, optimizer: Any, scheduler: Any, batches: Any) -> None:
    """Steps the trailing partial window, as drop_last=False asks, but divides its
    microbatch's loss by steps, not by the window's 1 microbatch."""
    for index, batch in enumerate(batches):
        (mean_loss(model, batch) / 4).backward()
        if index % 4 == 3 or index == len(batches) - 1:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def early_stop_loop(model: Any, optimizer: Any, scheduler: Any, batches: Any) -> None:
    """Leaves its loop one microbatch early: the last window is never stepped."""
    for index in range(len(batches) // 4 * 4 - 1):
        (mean_loss(model, batches[index]) / 4).backward()
        if index % 4 == 3:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def divided_twice_loop(model: Any, optimizer: Any, scheduler: Any, batches: Any) -> None:
    """Divides the loss by steps before the Accumulator, which divides it again."""
    with gradaccum.Accumulator(model, optimizer, scheduler, steps=4) as acc:
        for batch in acc.epoch(batches):
            with acc.microstep(mean_loss(model, batch) / 4):
                pass


def early_step_loop(model: Any, optimizer: Any, scheduler: Any, batches: Any) -> None:
    """Steps at ``i % 4 == 0``: after the epoch's first microbatch, then every 4th."""
    for index, batch in enumerate(batches[:12]):
        (mean_loss(model, batch) / 4).backward()
        if index % 4 == 0:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def counted_from_one_loop(model: Any, optimizer: Any, scheduler: Any, batches: Any) -> None:
    """Counts its microbatches from 1 and steps at ``(i + 1) % 4 == 0``: after 3."""
    for index, batch in enumerate(batches, 1):
        (mean_loss(model, batch) / 4).backward()
        if (index + 1) % 4 == 0:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def late_step_loop(
    model: Any, optimizer: Any, scheduler: Any, batches: Any, *, by_items: bool = False
) -> None:
    """Steps at ``i % 4 == 0`` once ``i > 0``: the first window holds 5 microbatches.
    With ``by_items``, each window's summed loss over its own items (the gradient divided
    by them before the step)."""
    rows = 0
    for index, batch in enumerate(batches):
        loss = sum_loss(model, batch) if by_items else mean_loss(model, batch) / 4
        loss.backward()
        rows += len(batch[0])
        if index % 4 == 0 and index > 0:
            for param in model.parameters():
                if by_items and param.grad is not None:
                    param.grad /= rows
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            rows = 0
    optimizer.zero_grad()


STEPS_FORMULA = "expected 3 = total_steps(13, 4, 1, drop_last=True)"
PARAMETERS = "parameters off the float64 big-batch reference by"


@pytest.mark.parametrize(
    ("loop", "options", "problems"),
    [
        (
            unscaled_loop,
            {},
            ["the gradient of window 1 is 4.00x the reference's: is the loss divided by steps?"],
        ),
        (
            divided_twice_loop,
            {},
            [
                "the gradient of window 1 is 0.25x the reference's: is the loss divided by "
                "steps twice?"
            ],
        ),
        (
            partial_by_steps_loop,
            {"drop_last": False},
            [
                "the gradient of window 4 is 0.25x the reference's: it is the trailing partial "
                "window, of 1 microbatch; is its loss divided by steps=4 instead of by 1?"
            ],
        ),
        (
            no_zero_grad_loop,
            {},
            [
                "the gradient of window 2 is the reference's plus window 1's: is zero_grad() "
                "called after every optimizer.step()?"
            ],
        ),
        (
            functools.partial(loops.hand_loop, clip_every_microstep=0.5),
            {"max_grad_norm": 0.5},
            [
                "the gradient of window 1 is what clipping after every backward gives (the "
                "window's partial sums clipped each microbatch): is clip_grad_norm_ called "
                "inside the window? Clip once, after the window's last backward (or pass "
                "max_grad_norm= to the Accumulator)"
            ],
        ),
        (
            functools.partial(loops.hand_loop, zero_every_microstep=True),
            {},
            [
                "the gradient of window 1 is its last microbatch's alone (scaled): is "
                "zero_grad() called before every backward, inside the window? Clear the "
                "gradient once a window, after its optimizer.step()"
            ],
        ),
        (
            zero_before_step_loop,
            {},
            [
                "the gradient of window 1 is 0.00x the reference's: the optimizer stepped with "
                "no gradient: is zero_grad() called before step(), or, under fully_shard, "
                "set_requires_gradient_sync(False) left on for the window's last microbatch"
            ],
        ),
        (
            remainder_loop,
            {},
            [
                f"4 {name} steps, {STEPS_FORMULA}: the trailing partial window of 1 "
                "microbatch was stepped; with drop_last=True it is dropped (pass drop_last=False)"
                for name in ("optimizer", "scheduler")
            ],
        ),
        (
            early_stop_loop,
            {},
            [
                f"2 {name} steps, {STEPS_FORMULA}: 1 window was never stepped; is {name}.step() "
                "reached at the end of every window, each epoch's last included?"
                for name in ("optimizer", "scheduler")
            ],
        ),
        (
            loops.hand_loop,
            {"drop_last": False},
            [
                f"3 {name} steps, expected 4 = total_steps(13, 4, 1, drop_last=False): the "
                "trailing partial window of 1 microbatch was never stepped; with "
                "drop_last=False it is (pass drop_last=True)"
                for name in ("optimizer", "scheduler")
            ],
        ),
        (
            functools.partial(loops.hand_loop, scheduler_every_microbatch=True),
            {},
            [
                f"12 scheduler steps, {STEPS_FORMULA}: one per microbatch; is scheduler.step() "
                "called every microbatch, not once per window?"
            ],
        ),
        (
            early_step_loop,
            {},
            [
                "the gradient of window 1 is its first microbatch's alone (scaled): the "
                "optimizer stepped after the epoch's first microbatch, so each window after "
                "it ends with the next one's first; is the step taken at i % steps == 0 "
                "rather than at (i + 1) % steps == 0?"
            ],
        ),
        (
            counted_from_one_loop,
            {},
            [
                "the gradient of window 1 is that of its first 3 microbatches (scaled): the "
                "window ended one microbatch early; does the microbatch count start at 1 "
                "(enumerate(batches, 1)) while the step is taken at (i + 1) % steps == 0?"
            ],
        ),
        *(
            (
                functools.partial(late_step_loop, by_items=by_items),
                {"by_items": by_items},
                [
                    "the gradient of window 1 is that of its 4 microbatches and the next one "
                    "(scaled): the window ended one microbatch late; is the step taken at "
                    "i % steps == 0 for i > 0 rather than at (i + 1) % steps == 0?"
                ],
            )
            for by_items in (False, True)
        ),
        (
            loops.hand_loop,
            {"by_items": True},
            [
                "the gradient of window 1 is the mean of its microbatches' means (mean mode's "
                "reference): does the loop average the microbatches' means instead of "
                "dividing the window's summed loss by its items? Item mode (num_items=) "
                "weighs each microbatch by its items; check a loop of means without num_items"
            ],
        ),
        (
            functools.partial(loops.hand_loop, divisor=1),
            {"by_items": True},
            ["the gradient of window 1 is 4.00x the mean of its microbatches' means (mean "],
        ),
        (
            functools.partial(loops.own_items_loop, by_steps=True),
            {"by_items": True},
            [
                "the gradient of window 1 is 0.25x the reference's: is the loss divided by "
                "steps as well as by the window's items? A loss normalized by the window's "
                "item count is not divided by steps again"
            ],
        ),
    ],
    ids=[
        "unscaled",
        "divided_twice",
        "partial_window_by_steps",
        "no_zero_grad",
        "clip_every_microstep",
        "zero_every_microstep",
        "zero_before_step",
        "remainder_stepped",
        "last_window_never_stepped",
        "partial_window_never_stepped",
        "scheduler_every_microbatch",
        "step_after_the_first_microbatch",
        "counted_from_one",
        "step_one_late",
        "step_one_late_by_items",
        "mean_of_means",
        "mean_of_means_not_divided",
        "items_divided_by_steps",
    ],
)
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_wrong_loops_fail_with_the_likely_mistake(
    loop: Any, options: dict[str, Any], problems: list[str]
) -> None:
    """Each problem is derived from what was observed (the steps counted, a window's
    gradient against the reference's) and names the mistake that explains it; where the
    gradient of a window was off, the parameters after it are too, and said second."""
    report = loops.check(loop, **options)
    assert not report.ok
    if problems[0].startswith("the gradient"):
        problems = [*problems, PARAMETERS]
    assert len(report.problems) == len(problems), report
    for problem, start in zip(report.problems, problems, strict=True):
        assert problem.startswith(start), report
    shown = repr(report).splitlines()
    assert shown[1 : 1 + len(problems)] == [f"  {problem}" for problem in report.problems]
    assert shown[1 + len(problems)].startswith("  optimizer")  # then the figures


def sgd_by_hand_loop(model: Any, optimizer: Any, scheduler: Any, batches: Any) -> None:
    """`loops.hand_loop`, with the learning rate, momentum and weight decay of each
    window set by hand on the param group before its step, and no scheduler."""
    for window in range(3):
        for batch in batches[4 * window : 4 * window + 4]:
            (mean_loss(model, batch) / 4).backward()
        group = optimizer.param_groups[0]
        group["lr"] = 0.3 / (1 + window)
        group["momentum"] = 0.5 + 0.2 * window
        group["weight_decay"] = 0.01 * window
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_hyperparameters_set_by_hand_need_no_scheduler() -> None:
    """The reference steps with every param-group entry the trainer's optimizer held at
    its step; given a scheduler the trainer never steps, the count says what to do."""
    report = loops.check(sgd_by_hand_loop, make_scheduler=None)
    assert report.ok, report
    assert report.max_abs_diff <= TOL
    assert report.max_grad_diff <= TOL
    assert report.scheduler_steps is None
    assert report.learning_rates == [[0.3 / 1], [0.3 / 2], [0.3 / 3]]
    assert repr(report).splitlines()[-1] == (
        "  the reference stepped with the hyperparameters the trainer's optimizers held "
        "(lr in [1.0e-01, 3.0e-01])"
    )
    report = loops.check(sgd_by_hand_loop)  # loops.check gives a StepLR
    assert report.problems == [
        f"0 scheduler steps, {STEPS_FORMULA}: scheduler.step() was never called; a trainer "
        "that sets the learning rate by hand needs no make_scheduler"
    ]


def test_train_gets_each_epoch_s_batches_as_a_fresh_list() -> None:
    """A loop that shuffles its batches in place (``random.shuffle``) raised TypeError on
    the tuple it was given. Each epoch now gets a list of its own, in the order given, and
    the order the loop's forwards consumed them in is the reference's: the shuffled loop
    is judged exact (its gradient read as off the reference before), and says so."""
    given: list[list[Any]] = []

    def shuffled_loop(model: Any, optimizer: Any, scheduler: Any, batches: Any) -> None:
        given.append(batches)
        order = list(batches)
        random.Random(len(given)).shuffle(batches)
        given.append(order)
        loops.hand_loop(model, optimizer, scheduler, batches)

    report = loops.check(shuffled_loop, epochs=2)
    first, first_order, second, second_order = given
    assert type(first) is list
    assert first is not second
    for order in (first_order, second_order):  # (epoch 1's shuffle left epoch 2's alone)
        assert all(
            torch.equal(got[0], want[0])
            for got, want in zip(order, loops.rank_batches(0), strict=True)
        )
    assert report.ok, report
    assert report.max_grad_diff <= TOL
    assert report.reordered
    assert (
        "  the trainer consumed the microbatches in another order than given (it shuffles "
        "them): the reference cut its windows in the order consumed"
    ) in repr(report).splitlines()


def popping_loop(model: Any, optimizer: Any, scheduler: Any, batches: Any) -> None:
    """torchtune's full-finetune recipe's inner loop, in its shape: each batch a dict whose
    ``labels`` the loop takes out (``labels = batch.pop("labels")``) before the forward."""
    for index, batch in enumerate(batches[:12]):
        labels = batch.pop("labels")
        ((model(batch["inputs"]) - labels).square().mean() / 4).backward()
        if index % 4 == 3:
            optimizer.step()
            optimizer.zero_grad()


def dict_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(batch["inputs"]) - batch["labels"]).square().mean()


def test_a_loop_that_consumes_its_batches_is_judged_every_epoch() -> None:
    """torchtune's ``batch.pop("labels")``: the second epoch raised KeyError inside the
    loop, as every epoch was handed the same batch objects; each epoch now gets copies,
    so over 2 epochs the loop is judged exact, and the check's own batches are left
    whole."""
    batches = [{"inputs": x, "labels": y} for x, y in loops.rank_batches(0)]
    report = check_accumulation(
        make_model, loops.sgd, popping_loop, [batches], dict_loss, steps=4, epochs=2
    )
    assert report.ok, report
    assert report.optimizer_steps == 6
    assert report.max_grad_diff <= TOL
    assert all("labels" in batch for batch in batches)


def own_schedule_loop(
    model: Any, optimizer: Any, scheduler: Any, batches: Any, *, every_microbatch: bool
) -> None:
    """`loops.hand_loop` with a LambdaLR of the loop's own (none given to the check),
    stepped after each optimizer step, or after every microbatch (the bug)."""
    own = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    loops.hand_loop(model, optimizer, own, batches, scheduler_every_microbatch=every_microbatch)


def tensor_rates(params: Any) -> torch.optim.Optimizer:
    """Adam with a param group for the weights and one for the biases, each with a
    tensor learning rate of its own."""
    params = list(params)
    return torch.optim.Adam(
        [
            {
                "params": [p for p in params if p.ndim > 1],
                "lr": torch.tensor(0.01, dtype=torch.float64),
            },
            {
                "params": [p for p in params if p.ndim == 1],
                "lr": torch.tensor(0.01, dtype=torch.float64),
            },
        ],
        foreach=False,
    )


def rate_by_index_loop(
    model: Any, optimizer: Any, scheduler: Any, batches: Any, *, per_window: bool
) -> None:
    """Sets the biases' tensor learning rate in place, ``0.01 / (1 + i)``: at every
    microbatch from its index (the bug, nanoGPT's ``get_lr(it)`` with ``it`` counting
    microbatches), or at each window's start from the window's."""
    for index, batch in enumerate(batches[:12]):
        if not per_window or index % 4 == 0:
            optimizer.param_groups[1]["lr"].fill_(
                0.01 / (1 + (index // 4 if per_window else index))
            )
        (mean_loss(model, batch) / 4).backward()
        if index % 4 == 3:
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_a_schedule_the_trainer_advances_every_microbatch_is_named() -> None:
    """The reference steps with the learning rates the trainer's optimizers held, and a
    scheduler the trainer builds itself is not counted: a schedule advanced every
    microbatch trained as the reference and passed. A learning rate that changes between
    two training forwards of one window (no optimizer step between them) now fails,
    naming the window, the optimizer (its param group, where it has several) and the
    rates; a tensor learning rate set in place too. Set once a window at its start
    (nanoGPT), or stepped after each optimizer step, it passes."""
    stepped = loops.check(
        functools.partial(own_schedule_loop, every_microbatch=True), make_scheduler=None
    )
    assert stepped.problems == [
        "the learning rate of optimizer changed between the microbatches of window 1 (0.1, "
        "then 0.05): a schedule that moves every microbatch runs 4 times too fast; is a "
        "scheduler stepped, or the learning rate set from the microbatch index, every "
        "microbatch instead of once per window?"
    ]
    by_index = check_accumulation(
        make_model,
        tensor_rates,
        functools.partial(rate_by_index_loop, per_window=False),
        [loops.rank_batches(0)],
        mean_loss,
        steps=4,
    )
    assert by_index.problems == [
        "the learning rate of optimizer.param_groups[1] changed between the microbatches of "
        "window 1 (0.01, then 0.005): a schedule that moves every microbatch runs 4 times "
        "too fast; is a scheduler stepped, or the learning rate set from the microbatch "
        "index, every microbatch instead of once per window?"
    ]
    for right in (
        loops.check(
            functools.partial(own_schedule_loop, every_microbatch=False), make_scheduler=None
        ),
        check_accumulation(
            make_model,
            tensor_rates,
            functools.partial(rate_by_index_loop, per_window=True),
            [loops.rank_batches(0)],
            mean_loss,
            steps=4,
        ),
        loops.nanogpt_check(),
        loops.check(loops.epoch_scheduler_loop, epochs=2, scheduler_per="epoch"),
    ):
        assert right.ok, right


def test_a_trainer_s_optimizer_that_grew_a_param_group_is_refused() -> None:
    def add_a_group(model: Any, optimizer: Any, scheduler: Any, batches: Any) -> None:
        optimizer.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})
        loops.hand_loop(model, optimizer, scheduler, batches)

    with pytest.raises(gradaccum.ConfigError, match="held 2 param groups at its step 1, "):
        loops.check(add_a_group)


def test_two_optimizers_and_their_schedulers() -> None:
    """SGD on the weights and Adam on the biases, a StepLR for the SGD only: one window
    per pair of steps; what either optimizer's step saw, or its count, is checked."""
    report = loops.two_optimizer_check()
    assert report.ok, report
    through_the_accumulator = loops.two_optimizer_check(loop=loops.accumulator_loop)
    assert through_the_accumulator.ok, through_the_accumulator
    assert report.max_grad_diff <= TOL
    assert report.max_abs_diff <= TOL
    assert (report.optimizer_steps, report.scheduler_steps) == (3, 3)
    assert len(report.windows) == 3
    assert report.learning_rates == [[0.1, 1e-2], [0.1 * 0.8, 1e-2], [0.1 * 0.8 * 0.8, 1e-2]]
    assert loops.two_optimizer_check(divide=False).problems[0] == (
        "the gradient of window 1 is 4.00x the reference's: is the loss divided by steps?"
    )
    assert loops.two_optimizer_check(skip_last_adam_step=True).problems == [
        f"2 optimizers[1] steps, {STEPS_FORMULA}: 1 window was never stepped; is "
        "optimizers[1].step() reached at the end of every window, each epoch's last included?"
    ]
    with pytest.warns(UserWarning, match="lr_scheduler.step"):
        report = loops.two_optimizer_check(scheduler_every_microbatch=True)
    assert report.problems[0].startswith(f"12 schedulers[0] steps, {STEPS_FORMULA}: one per")
    # One zero_grad() for the two (the Adam's parameters keep the last window's gradient).
    assert loops.two_optimizer_check(zero_first_only=True).problems[0] == (
        "the gradient of window 2 is the reference's, plus window 1's in the parameters of "
        "optimizers[1] alone: is optimizers[1].zero_grad() called after every step? Each "
        "optimizer's zero_grad() clears its own parameters' gradients only (a Muon + AdamW "
        "trainer zeroes both)"
    )


def test_expect_collectives_takes_every_name_a_report_prints() -> None:
    """Each kind, by its name or its words, singular or plural."""
    names = {name: 0 for kind in KINDS for name in (kind, in_words(2, kind).split(" ", 1)[1])}
    report = loops.check(loops.hand_loop, expect_collectives=names | {"reduce": 0})
    assert report.ok, report
    assert report.expected_collectives == dict.fromkeys(KINDS, 0)


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
        ({"timeout": 0}, gradaccum.ConfigError, "timeout must be a positive number of seconds"),
        ({"timeout": "60"}, gradaccum.ConfigTypeError, "timeout must be a positive number"),
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


def normed_model() -> torch.nn.Module:
    """A float32 MLP whose first layer's bias feeds a batch norm: its true gradient is 0,
    its float32 one rounding."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def decayed_by_hand_loop(model: Any, optimizer: Any, scheduler: Any, batches: Any) -> None:
    """The hand loop, then a weight decay of its own after each step (not the
    optimizer's): its parameters are no optimizer step of its gradients."""
    for index, batch in enumerate(batches[: len(batches) // 4 * 4]):
        (mean_loss(model, batch) / 4).backward()
        if index % 4 == 3:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(0.99)


def test_adam_s_step_of_a_rounding_level_gradient_is_no_false_alarm() -> None:
    """A correct float32 AdamW loop over a bias whose true gradient is 0 (before a batch
    norm): Adam turns its float32 rounding into steps of the learning rate, which the
    float64 reference does not take, so its parameters are off the reference by far more
    than the tolerance, with its gradients on it. That passes, and the report says why:
    a float64 copy of the optimizer stepped with the trainer's own gradients lands on its
    parameters. A loop that changes its parameters after the step is still failed."""
    batches = make_batches([3] * 13, dtype=torch.float32)
    report = check_accumulation(normed_model, adamw, loops.hand_loop, [batches], mean_loss, steps=4)
    assert report.ok, report
    assert report.max_abs_diff > report.tolerance  # (the gap that failed it before)
    assert report.max_grad_diff <= report.tolerance
    assert report.amplified is not None
    assert report.amplified <= report.tolerance
    assert "the parameters' gap to the reference is the optimizer's" in repr(report)
    decayed = check_accumulation(
        normed_model, adamw, decayed_by_hand_loop, [batches], mean_loss, steps=4
    )
    assert not decayed.ok
    assert any(problem.startswith("parameters off the float64") for problem in decayed.problems)
    assert decayed.amplified is None


def test_a_loop_stepping_every_microbatch_is_named_by_its_count_alone() -> None:
    """The steps do not line up with the windows, so no window's gradient is compared as
    if they did (it read as a boundary one microbatch off): the counts name the mistake."""
    report = loops.check(functools.partial(loops.hand_loop, steps=1))
    assert report.problems[0].startswith(f"13 optimizer steps, {STEPS_FORMULA}: one per microbatch")
    assert not any(problem.startswith("the gradient") for problem in report.problems), report
    assert report.problems[-1].startswith(PARAMETERS)


def test_a_clip_left_out_and_a_tiny_factor_are_named() -> None:
    """A loop that never clips, checked with ``max_grad_norm``: its gradient is the
    window's norm over max_grad_norm times the reference's, named as unclipped; a
    gradient a thousandth of the reference's reads as such, not as "0.00x"."""
    report = loops.check(loops.hand_loop, max_grad_norm=0.05)
    assert (
        "x the reference's: the optimizer stepped with the window's unclipped gradient"
        in (report.problems[0])
    ), report
    assert "is clip_grad_norm_ called on it before optimizer.step()?" in report.problems[0]
    tiny = loops.check(functools.partial(loops.hand_loop, divisor=4000))
    assert tiny.problems[0].startswith("the gradient of window 1 is 0.001x the reference's"), tiny


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_factor_the_trainer_s_clip_alone_hid_is_named(dtype: torch.dtype) -> None:
    """nanoGPT's loop without ``/ steps``, clipped at 1.5, which its 4x windows exceed and
    the reference's (norm 0.94) do not: the report read "1.59x the reference's" with no
    hint. In float64 the factor is read back from the clip (4.00x); in float32, where it
    cannot be, the report says the trainer clipped a gradient at least that much larger."""
    report = clipped_nanogpt(dtype, divide=False, clip=1.5)
    if dtype == torch.float64:
        assert report.problems[0] == (
            "the gradient of window 1 was 4.00x the reference's before clipping (the trainer "
            "clipped it to max_grad_norm=1.5; the reference's, of norm 0.943, was under it): "
            "is the loss divided by steps?"
        )
    else:
        assert report.problems[0] == (
            "the gradient of window 1 is 1.59x the reference's: its norm is "
            "max_grad_norm=1.5, the reference's 0.943: the trainer clipped a gradient at "
            "least that many times the reference's; is the loss divided by steps?"
        )


def test_means_averaged_and_clipped_are_named_without_the_clip_factor() -> None:
    """The Hugging Face Trainer of 4.45's loop in item mode: each microbatch's mean loss
    over the steps, clipped at 0.3, which every window exceeds. The report called its
    gradient "0.60x the mean of its microbatches' means", a factor that is the clip's;
    the reference's mean of means is now clipped as the trainer clips, and the report
    names the mistake alone."""
    report = check_accumulation(
        make_model,
        loops.adamw,
        functools.partial(loops.nanogpt_loop, grad_clip=0.3),
        [loops.rank_batches(0)],
        sum_loss,
        steps=loops.STEPS,
        max_grad_norm=0.3,
        num_items=loops.items,
    )
    assert report.problems[0].startswith(
        "the gradient of window 1 is the mean of its microbatches' means (mean mode's "
        "reference): does the loop average"
    ), report
