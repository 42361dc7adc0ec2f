"""What a broken promise most likely means: each of `check_accumulation`'s problems in
words, with the mistake that explains what was observed (step counts, collectives per
window, a window's gradient against the reference's), never from knowing the trainer."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from gradaccum.schedule import total_steps
from gradaccum.schedule import trained_microbatches as _trained
from gradaccum.testing.counting import in_words

__all__ = [
    "blind_spots",
    "bypass_problem",
    "clip_factor",
    "collective_problem",
    "ddp_problem",
    "gap",
    "gradient_problem",
    "not_per_item_problem",
    "per_microbatch",
    "random_forward_problem",
    "rate_problem",
    "step_problem",
    "unclipped_factor",
    "worse",
]

_CLIP_EPS = 1e-6  # what clip_grad_norm_ adds to the norm it divides by


def clip_factor(norm: float, max_norm: float) -> float:
    """What ``clip_grad_norm_`` multiplies a gradient of ``norm`` by, clipping to
    ``max_norm``."""
    return min(1.0, max_norm / (norm + _CLIP_EPS))


def gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest absolute difference between two tensors (NaN if one holds NaN)."""
    return (got - want).abs().max().item() if got.numel() else 0.0


def worse(candidate: float, worst: float) -> bool:
    """Whether ``candidate`` is a worse gap than ``worst``: larger, or the first NaN."""
    return not math.isnan(worst) and (math.isnan(candidate) or candidate > worst)


def per_microbatch(count: int, *, n_batches: int, steps: int, epochs: int, drop_last: bool) -> bool:
    """Whether ``count`` steps are one per microbatch (of every window's, or of every
    microbatch of the epochs), where that is not one per window."""
    if steps == 1:
        return False
    return count in (_trained(n_batches, steps, drop_last) * epochs, n_batches * epochs)


def rate_problem(label: str, window: int, before: float, after: float, steps: int) -> str:
    """A learning rate of ``label`` (an optimizer, or one of its param groups) moved from
    ``before`` to ``after`` between two microbatches of ``window``: the reference steps
    with the rates held at each step, so only this shows a schedule advanced every
    microbatch (one the trainer owns, or a rate set from the microbatch index)."""
    was, now = _apart(before, after)
    return (
        f"the learning rate of {label} changed between the microbatches of window {window} "
        f"({was}, then {now}): a schedule that moves every microbatch runs {steps} times too "
        "fast; is a scheduler stepped, or the learning rate set from the microbatch index, "
        "every microbatch instead of once per window?"
    )


def _apart(first: float, second: float) -> tuple[str, str]:
    """``first`` and ``second`` in the fewest significant digits (3 at least) that tell
    them apart."""
    for digits in range(3, 18):
        shown = f"{first:.{digits}g}", f"{second:.{digits}g}"
        if shown[0] != shown[1]:
            return shown
    return f"{first!r}", f"{second!r}"


def step_problem(
    label: str,
    count: int,
    *,
    n_batches: int,
    steps: int,
    epochs: int,
    drop_last: bool,
    per_epoch: bool = False,
) -> str | None:
    """``12 scheduler steps, expected 3 = total_steps(...)``, and what the count suggests;
    None when the count is the expected one (``per_epoch``: one per epoch, for a
    scheduler of a schedule in epochs)."""
    if per_epoch:
        if count == epochs:
            return None
        return (
            f"{count} {label} step{'s' * (count != 1)}, expected {epochs}: one per epoch "
            f"(scheduler_per='epoch'); is {label}.step() called once, at every epoch's end?"
        )
    expected = total_steps(n_batches, steps, epochs, drop_last)
    if count == expected:
        return None
    formula = f"total_steps({n_batches}, {steps}, {epochs}, drop_last={drop_last})"
    problem = f"{count} {label} step{'s' * (count != 1)}, expected {expected} = {formula}"
    remainder = n_batches % steps
    partial = f"the trailing partial window of {remainder} microbatch{'es' * (remainder > 1)}"
    if per_microbatch(count, n_batches=n_batches, steps=steps, epochs=epochs, drop_last=drop_last):
        hint = (
            f"one per microbatch; is {label}.step() called every microbatch, not once per window?"
        )
    elif remainder and drop_last and count == expected + epochs:
        hint = f"{partial} was stepped; with drop_last=True it is dropped (pass drop_last=False)"
    elif remainder and not drop_last and count == expected - epochs:
        hint = f"{partial} was never stepped; with drop_last=False it is (pass drop_last=True)"
    elif label.startswith("scheduler") and count == epochs and expected > epochs:
        hint = (
            "one per epoch: right for a schedule in epochs (a StepLR by epochs, say): pass "
            "scheduler_per='epoch'; a schedule in optimizer steps has its step() outside "
            "the loop over the windows"
        )
    elif count == 0:
        hint = f"{label}.step() was never called" + (
            "; a trainer that sets the learning rate by hand needs no make_scheduler"
            if label.startswith("scheduler")
            else ""
        )
    elif count < expected:
        hint = (
            f"{expected - count} window{'s were' if expected - count > 1 else ' was'} never "
            f"stepped; is {label}.step() reached at the end of every window, each epoch's "
            "last included?"
        )
    else:
        return problem
    return f"{problem}: {hint}"


def gradient_problem(
    window: int,
    got: torch.Tensor,
    want: torch.Tensor,
    accumulated: torch.Tensor | None,
    *,
    kept: Mapping[str, torch.Tensor] | None = None,
    last: torch.Tensor | None = None,
    clipped_each: torch.Tensor | None = None,
    first: dict[int, torch.Tensor] | None = None,
    means: torch.Tensor | None = None,
    length: int,
    steps: int,
    world: int,
    items: bool,
    norm_only: bool,
    tolerance: float,
    clip: tuple[float, float] | None = None,
    dropped_before: int = 0,
    reference: str = "float64",
) -> str:
    """What the first window whose gradient is off the reference's shows.

    Args:
        window: The window, from 1.
        got: The gradient its optimizer steps saw (flat), or its norm alone.
        want: The reference's, clipped as the trainer's was.
        accumulated: What a trainer that never zeroed the gradient would have seen: the
            previous window's gradient plus this one's (clipped), or None.
        kept: With several optimizers, by the name of each, what a trainer that zeroed
            all but that one's parameters would have seen (``accumulated`` there, the
            reference's elsewhere).
        last: The gradient of the window's last microbatches alone (a window of more than
            one), or None: a trainer that clears the gradient before every backward
            steps with a multiple of it.
        clipped_each: What a trainer that clips after every backward steps with, or None.
        first: Where this is an epoch's first window, the gradient of the epoch's first
            ``m`` microbatches as one window (up to a factor), by ``m``: a trainer whose
            windows end a microbatch off steps with ``m`` one from ``length``, or 1 where
            it steps after the epoch's first microbatch (``i % steps == 0``).
        means: In item mode, the window's gradient as mean mode's reference weighs it
            (the mean of its microbatches' item means), or None: a loop that averages
            its microbatches' means steps with a multiple of it.
        length: The window's microbatches.
        steps: Microbatches per full window.
        world: Ranks.
        items: Item mode (the loss a sum over the window's items).
        norm_only: ``got`` and ``want`` are norms.
        tolerance: The largest gap accepted.
        clip: The reference's norm before clipping and ``max_grad_norm``, where the
            trainer clips (`unclipped_factor`).
        dropped_before: The microbatches the previous epoch dropped at its end, where
            this is the first window of an epoch after the first (else 0).
        reference: The dtype the reference ran in. Below float64 no factor is read from
            clipping's 1e-6 (`unclipped_factor`): in float32 it is under the rounding of
            a norm above about 8, so the reference's own clipping keeps no true trace.
    """
    noun = "gradient norm" if norm_only else "gradient"

    def factor_hint(found: float, slack: float = 0.0) -> str | None:
        """The mistake a gradient ``found`` times the reference's points to."""
        return (
            _items_hint(found, length, world, slack)
            if items
            else _factor_hint(found, length, steps, world, slack)
        )

    scale = _multiple_of(got, want, tolerance)
    # How far off a factor the tolerance cannot tell: a gradient ``k + d`` times the
    # reference's is within it of ``k`` times it where ``d`` times the largest entry is.
    largest = float(want.abs().max()) if want.numel() else 0.0
    slack = tolerance / largest if largest > 0 else 0.0
    clipped = clip if clip is not None and clip[0] > clip[1] else None
    factor = None
    if clip is not None and scale is not None and reference == "float64":
        factor = unclipped_factor(scale, *clip, slack)
    if factor is not None and clip is not None:
        why = factor_hint(factor)
        how = (
            "both were clipped to max_grad_norm={:g}, and only the 1e-6 that clip_grad_norm_ "
            "adds to the norm tells them apart"
            if clipped
            else "the trainer clipped it to max_grad_norm={:g}; the reference's, of norm "
            f"{clip[0]:.3g}, was under it"
        )
        return (
            f"the {noun} of window {window} was {_times(factor)}x the reference's before "
            f"clipping ({how.format(clip[1])})" + (f": {why}" if why else "")
        )
    if scale is not None and not _near(scale, 1):
        if not got.any():
            hint: str | None = (
                "the optimizer stepped with no gradient: is zero_grad() called before "
                "step(), or, under fully_shard, set_requires_gradient_sync(False) left on "
                "for the window's last microbatch (its gradient then never reaches the "
                "shards)?"
            )
        elif clipped is not None and _near(scale, clipped[0] / clipped[1], slack):
            hint = (
                f"the optimizer stepped with the window's unclipped gradient (its norm "
                f"{clipped[0]:.3g} over max_grad_norm={clipped[1]:g}): is clip_grad_norm_ "
                "called on it before optimizer.step()?"
            )
        elif clip is not None and scale > 1 and _near(scale * clip[0], clip[1], slack):
            hint = (
                f"its norm is max_grad_norm={clip[1]:g}, the reference's {clip[0]:.3g}: the "
                "trainer clipped a gradient at least that many times the reference's; is "
                "the loss divided by steps?"
            )
        else:
            hint = factor_hint(scale, slack)
        return f"the {noun} of window {window} is {_times(scale)}x the reference's" + (
            f": {hint}" if hint else ""
        )
    if accumulated is not None and gap(got, accumulated) <= tolerance:
        return (
            f"the gradient of window {window} is the reference's plus window {window - 1}'s: "
            "is zero_grad() called after every optimizer.step()?"
        )
    for name, one_kept in (kept or {}).items():
        if gap(got, one_kept) <= tolerance:
            return (
                f"the gradient of window {window} is the reference's, plus window "
                f"{window - 1}'s in the parameters of {name} alone: is {name}.zero_grad() "
                "called after every step? Each optimizer's zero_grad() clears its own "
                "parameters' gradients only (a Muon + AdamW trainer zeroes both)"
            )
    if clipped_each is not None and gap(got, clipped_each) <= tolerance:
        return (
            f"the gradient of window {window} is what clipping after every backward gives "
            "(the window's partial sums clipped each microbatch): is clip_grad_norm_ called "
            "inside the window? Clip once, after the window's last backward (or pass "
            "max_grad_norm= to the Accumulator)"
        )
    alone = None if last is None else _multiple_of(got, last, tolerance)
    if alone is not None and alone > 0:
        return (
            f"the gradient of window {window} is its last microbatch's alone (scaled): is "
            "zero_grad() called before every backward, inside the window? Clear the "
            "gradient once a window, after its optimizer.step()"
        )
    if hint := _boundary_hint(got, first or {}, length, tolerance):
        return f"the gradient of window {window} is {hint}"
    averaged = None if means is None else _multiple_of(got, means, tolerance)
    if averaged is not None and averaged > 0:
        times = "" if _near(averaged, 1) else f"{averaged:.2f}x "
        return (
            f"the gradient of window {window} is {times}the mean of its microbatches' means "
            "(mean mode's reference): does the loop average the microbatches' means "
            "instead of dividing the window's summed loss by its items? Item mode "
            "(num_items=) weighs each microbatch by its items; check a loop of means "
            "without num_items"
        )
    carried = ""
    if dropped_before:
        carried = (
            f": it is the first window of an epoch, after the {dropped_before} "
            f"microbatch{'es' * (dropped_before > 1)} that drop_last dropped at the previous "
            f"epoch's end; is {'their' if dropped_before > 1 else 'its'} gradient left in it "
            "(no zero_grad() at the epoch's end), or does the loop's microbatch count run on "
            "across epochs, so that windows span them?"
        )
    return (
        f"the {noun} of window {window} is off the {reference} big-batch reference by "
        f"{gap(got, want):.1e} (tolerance {tolerance:.0e}){carried}"
    )


def _boundary_hint(
    got: torch.Tensor, first: dict[int, torch.Tensor], length: int, tolerance: float
) -> str | None:
    """What an epoch's first window of ``length`` microbatches shows where its gradient
    is a multiple of that of the epoch's first ``m`` (``first``, by ``m``) for an ``m``
    one off ``length``, or 1: a window boundary one microbatch off."""
    hints = {
        1: (
            "its first microbatch's alone (scaled): the optimizer stepped after the epoch's "
            "first microbatch, so each window after it ends with the next one's first; is the "
            "step taken at i % steps == 0 rather than at (i + 1) % steps == 0?"
        ),
        length + 1: (
            f"that of its {length} microbatches and the next one (scaled): the window ended "
            "one microbatch late; is the step taken at i % steps == 0 for i > 0 rather "
            "than at (i + 1) % steps == 0?"
        ),
    }
    if length > 2:  # (for a window of 2, its first microbatch alone is the hint above)
        hints[length - 1] = (
            f"that of its first {length - 1} microbatches (scaled): the window ended one "
            "microbatch early; does the microbatch count start at 1 (enumerate(batches, "
            "1)) while the step is taken at (i + 1) % steps == 0?"
        )
    for m in sorted(hints):
        scale = _multiple_of(got, first[m], tolerance) if m in first else None
        if scale is not None and scale > 0:
            return hints[m]
    return None


def _multiple_of(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> float | None:
    """The factor ``got`` is of ``want``, where it is a multiple of it to ``tolerance``
    (clipping keeps that), else None."""
    squared = float(want @ want)
    scale = float(got @ want) / squared if squared > 0 else math.nan
    return scale if math.isfinite(scale) and gap(got, scale * want) <= tolerance else None


def unclipped_factor(
    scale: float, norm: float, max_norm: float, slack: float = 0.0
) -> float | None:
    """How many times the reference's a gradient that the trainer clipped was before
    clipping, where it is not 1: read from ``scale``, the trainer's clipped gradient over
    the reference's (clipped too where its ``norm`` before clipping is above
    ``max_norm``). ``clip_grad_norm_`` multiplies by ``max_norm / (norm + 1e-6)``, so a
    gradient ``k`` times the reference's comes out ``k max_norm / ((k norm + 1e-6) r)``
    times the reference's, ``r`` the reference's own factor: a hair from 1 where both were
    clipped, ``max_norm / norm`` where the reference's was not, and in float64 precise
    enough to give ``k`` back. None where the trainer's gradient was not clipped, where
    ``k`` is 1, or where it cannot be read: the hair is within ``slack`` (the gradient's
    relative uncertainty, a float32 trainer's) of the clipped norm."""
    own = clip_factor(norm, max_norm)
    if not math.isfinite(scale) or not _near(scale * own * norm, max_norm):
        return None
    below = max_norm - scale * own * norm
    readable = below > 10 * slack * scale * own * norm
    factor = scale * own * _CLIP_EPS / below if readable else math.inf
    return factor if math.isfinite(factor) and not _near(factor, 1) else None


def _times(scale: float) -> str:
    """A factor for a message: two decimals, or two significant digits below 0.01 (a
    gradient a thousandth of the reference's is not "0.00x" it)."""
    return f"{scale:.2f}" if scale == 0 or abs(scale) >= 0.01 else f"{scale:.2g}"


def _near(scale: float, factor: float, slack: float = 0.0) -> bool:
    """A measured gradient ``scale`` is ``factor``: to the rounding of the gradients
    (0.1%), or within ``slack``, what a coarse tolerance cannot tell apart (bfloat16's
    5e-2 over the reference's largest entry), but never past a tenth of ``factor``, so
    that the factors the hints tell apart (1/4 from 1/2, 3/4 from 1) stay apart."""
    return math.isclose(scale, factor, rel_tol=1e-3, abs_tol=min(slack, abs(factor) / 10))


def _items_hint(scale: float, length: int, world: int, slack: float = 0.0) -> str | None:
    """The mistake a gradient ``scale`` times the reference's points to, in item mode (a
    loss normalized by the window's items, as Hugging Face's ``num_items_in_batch``), as
    near as ``slack`` allows (`_near`)."""
    hints = []
    if length > 1 and _near(scale, 1 / length, slack):
        hints.append(
            "is the loss divided by steps as well as by the window's items? A loss "
            "normalized by the window's item count is not divided by steps again"
        )
    if world > 1 and _near(scale, 1 / world, slack):
        hints.append(
            f"is the loss divided by every rank's items but not multiplied by the {world} "
            "ranks? DDP averages the ranks' gradients, so a loss normalized by the items of "
            f"every rank's window must be multiplied by the world size, {world}"
        )
    return "; or ".join(hints) or None


def _factor_hint(
    scale: float, length: int, steps: int, world: int, slack: float = 0.0
) -> str | None:
    """The mistake a gradient ``scale`` times the reference's points to, in mean mode, as
    near as ``slack`` allows (`_near`)."""
    if length > 1 and _near(scale, length, slack):
        return "is the loss divided by steps?"
    if length < steps and _near(scale, length / steps, slack):
        return (
            f"it is the trailing partial window, of {length} microbatch"
            f"{'es' * (length > 1)}; is its loss divided by steps={steps} instead of by {length}?"
        )
    hints = []
    if length > 1 and _near(scale, 1 / length, slack):
        hints.append("is the loss divided by steps twice?")
    if world > 1 and _near(scale, 1 / world, slack):
        hints.append(
            f"is the loss divided by the world size, {world}? DDP (and FSDP) average the "
            "ranks' gradients already"
        )
    if world > 1 and _near(scale, world, slack):
        hints.append(f"are the gradients summed over the {world} ranks instead of averaged?")
    return "; or ".join(hints) or None


def not_per_item_problem(active: dict[str, str]) -> str:
    """The trainer's forwards ran modules whose output the reference cannot reproduce
    (``active``: their names and what they are), so the check cannot compare them: a
    dropout draws masks the reference cannot draw, and a `SyncBatchNorm` over several
    ranks normalizes by statistics over every rank's microbatch, where the reference
    computes each microbatch's loss alone. A plain batch norm is not one of them: it
    normalizes each microbatch by its own statistics, in the trainer as in the
    reference, so it is checked like any other layer."""
    names = [f"{kind} at {name!r}" for name, kind in active.items()]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    synced = any(kind.startswith("SyncBatchNorm") for kind in active.values())
    dropped = any(not kind.startswith("SyncBatchNorm") for kind in active.values())
    why = [
        *(["dropout draws its own masks"] if dropped else []),
        *(
            [
                "a SyncBatchNorm normalizes by the statistics of every rank's microbatch, "
                "which the reference, computing each microbatch alone, never sees"
            ]
            if synced
            else []
        ),
    ]
    fixes = [
        *(["dropout 0"] if dropped else []),
        *(
            [
                "a plain BatchNorm instead of the SyncBatchNorm (it normalizes each "
                "microbatch by its own statistics, as the reference does), or the norm in "
                "eval mode"
            ]
            if synced
            else []
        ),
    ]
    return (
        f"the model's forwards ran {shown} in training mode, whose output the reference "
        f"cannot reproduce ({'; '.join(why)}), so its gradients cannot match the "
        "reference's whatever the loop: build the model for the check (make_model's, and "
        f"what wrap makes of it) without them ({'; '.join(fixes)})"
    )


def random_forward_problem() -> str:
    """The model's forward draws random numbers where no module shows it (a functional
    ``F.dropout``, or a random op of the model's own): two losses of one microbatch at
    the same parameters differ, so no loop can match the reference."""
    return (
        "two losses of the same microbatch at the same parameters differ: the model's "
        "forward draws random numbers (a functional F.dropout with training=True, or "
        "another random op), so its gradients cannot match the reference's whatever the "
        "loop: build make_model's model for the check without them (dropout 0)"
    )


def collective_problem(
    kind: str,
    got: int,
    count: int,
    *,
    outside: int = 0,
    backwards: int = 0,
    steps: int,
    ddp: bool,
    gradient_off: bool = False,
    bypassed: int = 0,
    turned_off: bool | None = None,
) -> str | None:
    """``4 all-reduces per window at steps=4, expected 1``, and why: how many ran in the
    backward and how many (``outside``) outside it, which are the trainer's own (a
    metric's all-reduce), not the gradient's; and for DDP all-reducing in more than one
    of the ``backwards`` of a window, `ddp_problem` (``gradient_off``: a window's
    gradient was off the reference's; ``bypassed``: forwards that ran around DDP's). None
    when the count is the expected one."""
    if got == count:
        return None
    problem = f"{in_words(got, kind)} per window at steps={steps}, expected {count}"
    if outside:
        whose = (
            ": the trainer's own, such as a metric's all-reduce, which expect_collectives "
            "counts too"
            if kind == "all_reduce"
            else ""  # (FSDP's forward all-gathers run outside it too)
        )
        problem += f" ({got - outside} in the backward, {outside} outside it{whose})"
    if (
        kind == "all_reduce"
        and ddp
        and (
            why := ddp_problem(
                backwards, steps, gradient_off, bypassed=bypassed, turned_off=turned_off
            )
        )
    ):
        problem += f": {why}"
    return problem


def bypass_problem(bypassed: int) -> str:
    """Why DDP did not all-reduce: ``bypassed`` training forwards ran around its own."""
    times = "once" if bypassed == 1 else f"{bypassed} times"
    return (
        f"the module inside DDP ran its forward {times} outside DDP's (model.module(x), or "
        "a method of the inner module): DDP prepares each backward's all-reduce in its own "
        "forward, so the backward of such a forward all-reduces nothing. Call the DDP "
        "model itself, model(x) (a loss computed by a method of the inner module belongs "
        "in its forward)"
    )


def ranks_apart_problem(window: int, backwards: int, steps: int, *, ddp: bool) -> str | None:
    """The ranks' parameters differ after ``window``: each stepped with a gradient of its
    own, and why, from the ``backwards`` of a window that all-reduced; None where DDP never
    all-reduced (`ddp_problem` names that)."""
    if ddp and backwards == 0:
        return None
    problem = (
        f"the ranks' parameters differ after window {window}: each rank stepped with a "
        "gradient of its own"
    )
    if ddp and backwards < steps:
        which = "one backward" if backwards == 1 else f"{backwards} backwards"
        return (
            f"{problem}. DDP all-reduced in {which} a window, but not the window's last, "
            "so the microbatches after it stayed on each rank: run the window's last "
            "microbatch (its forward and backward) outside no_sync(), the others inside it"
        )
    return f"{problem}: is the gradient reduced over the ranks before every optimizer.step()?"


def ddp_problem(
    backwards: int,
    steps: int,
    gradient_off: bool,
    *,
    bypassed: int = 0,
    turned_off: bool | None = None,
) -> str | None:
    """Why DDP all-reduced in the backward of ``backwards`` microbatches of a window of
    ``steps``: more than one (the gradient is exact either way, so only this count shows
    it), or none while the gradient is off (each rank stepped with its own: with an exact
    gradient, DDP sent it where the counter does not see, through a comm hook of its
    own), said as `bypass_problem` where ``bypassed`` forwards ran around DDP's; None
    where it did in one, the window's last. ``turned_off``: whether any backward ran with
    DDP's sync off (None where not seen): a loop that never turns it off has no
    ``no_sync()`` to move its forward into."""
    if backwards == 0 and gradient_off and bypassed:
        return bypass_problem(bypassed)
    if backwards == 0 and gradient_off:
        return (
            "DDP never all-reduced the window's gradient, so each rank stepped with its "
            "own: is no_sync() (or require_backward_grad_sync = False) left on for the "
            "window's last microbatch?"
        )
    if steps == 1 or backwards <= 1:
        return None
    which = (
        "every microbatch"
        if backwards >= steps
        else f"{backwards} of a window's {steps} microbatches, not only its last"
    )
    if turned_off is False:
        return (
            f"DDP all-reduced on {which}: no backward ran with its sync off; run every "
            "microbatch but a window's last, its forward and its backward, inside "
            "model.no_sync() (or set require_backward_grad_sync = False before the "
            "forward, or use gradaccum.Accumulator)"
        )
    return (
        f"DDP all-reduced on {which}. It decides during the forward whether the backward "
        "all-reduces, so the forward belongs inside no_sync() with its backward, on every "
        "microbatch but a window's last (or set require_backward_grad_sync before the "
        "forward, or use gradaccum.Accumulator)"
    )


def blind_spots(
    windows: list[range],
    *,
    n_batches: int,
    steps: int,
    items: list[list[int]] | None,
    clip: tuple[float | None, float, float] = (None, 0.0, 0.0),
    scale: tuple[float, float] = (0.0, 0.0),
    epochs: int = 1,
    drop_last: bool = True,
    left_over: bool = False,
) -> list[str]:
    """The mistakes that these batches cannot show, because on them a loop making it
    trains exactly as the right one: ``windows`` (every epoch's, `expected_windows`), of
    ``epochs`` epochs of ``n_batches`` microbatches, with ``items`` each rank's item counts
    in item mode, ``clip`` the clipping asked for and the least and largest window
    gradient norms it met (before clipping), ``scale`` the tolerance and the largest value
    it was compared with (a reference gradient's entry), ``drop_last`` as checked, and
    ``left_over``: forwards after the trainer's last optimizer step left a gradient in
    the parameters when it returned."""
    spots = []
    tolerance, entry = scale
    if entry > 0 and tolerance >= entry / 4:
        share = tolerance / entry
        spots.append(
            f"the tolerance, {tolerance:.0e}, is {share:.0%} of the largest gradient entry "
            f"({entry:.2g}), so a gradient off by a constant factor from "
            f"{max(0.0, 1 - share):.2f} to {1 + share:.2f} passes too: give batches of "
            "larger gradients, or a smaller tolerance="
        )
    max_norm, least, largest = clip
    if max_norm is not None and largest <= max_norm:
        spots.append(
            f"no window's gradient norm (at most {largest:.2g}) reached "
            f"max_grad_norm={max_norm:g}, so a loop that does not clip, or clips each "
            "microbatch, passes too: give a max_grad_norm below some windows' norms"
        )
    elif max_norm is not None and least > max_norm and _CLIP_EPS * entry / (2 * least) <= tolerance:
        # (A gradient twice the reference's comes out of clip_grad_norm_ about
        # 1e-6 / (2 norm) of itself off the reference's clipped one: `unclipped_factor`
        # reads the factor where that is above the tolerance, as in float64.)
        spots.append(
            f"every window's gradient norm (at least {least:.2g}) exceeded "
            f"max_grad_norm={max_norm:g}, so each was clipped to that norm, and a "
            "gradient off by a constant factor (a loss not divided by steps) passes too: "
            "give a max_grad_norm above some windows' norms"
        )
    if steps > 1 and n_batches % steps == 0:
        spots.append(
            f"the epoch's {n_batches} microbatches fill its windows of steps={steps}, so "
            "what the loop does with a trailing partial window is not seen: give an epoch "
            "whose length steps does not divide"
        )
    dropped = n_batches % steps if drop_last else 0
    if epochs == 1 and dropped and left_over:
        spots.append(
            f"one epoch, whose last {dropped} microbatch{'es' * (dropped > 1)} (dropped by "
            "drop_last) left a gradient in the parameters when the loop returned: whether "
            "the next epoch's first window adds it (no zero_grad() at the epoch's end, or a "
            "microbatch count that runs on across epochs) is not seen: give epochs=2"
        )
    if len(windows) < 2:
        spots.append(
            "one window in the run: a gradient left from the previous window (a missing "
            "zero_grad()) is not seen; give at least two"
        )
    if items is not None and windows:
        same = all(len({mine[i] for mine in items for i in window}) == 1 for window in windows)
        if same and max(map(len, windows)) > 1:
            spots.append(
                "every microbatch of a window holds as many items, so a loop that averages "
                "the microbatches' means (instead of dividing by the window's items) passes "
                "too: give microbatches of different item counts"
            )
        elif len(items) > 1 and all(
            len({sum(mine[i] for i in window) for mine in items}) == 1 for window in windows
        ):
            spots.append(
                "every rank's window holds as many items, so a loop that divides by its own "
                "rank's items (instead of every rank's) passes too: give the ranks windows "
                "of different item counts"
            )
    return spots
