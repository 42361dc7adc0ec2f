"""`Step`: what a microstep reports to the body of its ``with`` block."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Step", "at_boundary"]


class Step:
    """What a microstep reports; the window fields are filled on the boundary only.

    Attributes:
        boundary: This microstep completes the window: the body of its ``with`` block
            sees the window's full gradient, clipped, not yet applied.
        global_step: The optimizer step this window becomes (``acc.global_step`` after
            the block exits); on other microsteps, the steps completed so far.
        loss: The window's loss on this rank, a detached 0-dim tensor, computed on first
            read; ``None`` off the boundary.
        global_loss: The window's loss over every rank, the same on each (see the
            property); ``None`` off the boundary.
        num_items: This rank's items in the window with ``num_items``; ``None`` in mean
            mode and off the boundary.
        grad_norm: The total gradient norm before clipping, a 0-dim tensor; ``None``
            without ``max_grad_norm``.
        lr: The learning rate of the first optimizer's first parameter group for this
            update, as it was at the boundary (a copy when it is a tensor); ``None``
            when that group has no ``"lr"``. The scheduler steps after the block, so
            ``scheduler.get_last_lr()`` read after it is the next window's.
        lrs: The same for each optimizer, in the order given: one entry per optimizer
            (``lrs[0]`` is ``lr``); ``()`` off the boundary.
        microbatch: The rows per microbatch the window ran with, in `Accumulator.step`
            (after any out-of-memory retries); ``None`` in the ``with`` form.
        skipped: The window was not applied (no optimizer or scheduler step) because
            its gradient held inf/NaN: known in the block under ``on_nonfinite="skip"``
            (and with a GradScaler and several optimizers), and once the block has exited
            when a GradScaler skipped the step.
    """

    # No __slots__ and no __init__: a Step is made bare (``Step()``, the C constructor) and
    # given only the fields that differ from these class defaults, one store each, on the
    # hot path: the one `Step` each window hands its other microsteps costs one store.
    boundary: bool = False
    global_step: int = 0
    grad_norm: torch.Tensor | None = None
    lrs: tuple[float | torch.Tensor | None, ...] = ()
    microbatch: int | None = None
    skipped: bool = False
    _losses: Sequence[torch.Tensor] = ()
    _divisor: int | torch.Tensor = 1
    _by_items = False
    _alone = True
    _global: torch.Tensor | None = None
    _loss: torch.Tensor | None = None

    @property
    def lr(self) -> float | torch.Tensor | None:
        """The learning rate of the first optimizer's first parameter group for this
        update (``lrs[0]``); ``None`` off the boundary."""
        return self.lrs[0] if self.lrs else None

    @property
    def loss(self) -> torch.Tensor | None:
        """The window's loss on this rank, a detached 0-dim tensor; ``None`` off the
        boundary.

        The mean of the microbatch losses, or with ``num_items`` the summed losses over
        the window's items. Computed on first read, so an unread loss costs nothing.
        """
        if self._loss is None and self._losses:
            total = torch.stack(list(self._losses)).sum()
            self._loss = total / self._divisor
        return self._loss

    @property
    def num_items(self) -> int | torch.Tensor | None:
        """This rank's items in the window (the sum of its ``num_items``, as passed: an
        int, or a 0-dim tensor); ``None`` in mean mode and off the boundary."""
        return self._divisor if self._by_items and self._losses else None

    @property
    def global_loss(self) -> torch.Tensor | None:
        """The window's loss over every rank, the same on each, a detached 0-dim tensor.

        With ``num_items``: the summed losses of every rank's items over their total,
        which rides on the item total's all-reduce (no extra collective or host sync).
        In mean mode: the mean of the ranks' window losses, all-reduced at the boundary
        when the accumulator was built with ``global_loss=True``, and ``None`` without it
        (on one process too, so that a loop behaves alike on any number of ranks). On
        one process it is `loss`. Reading it never launches a collective; ``None`` off
        the boundary.
        """
        if not self._losses:
            return None
        if self._alone:
            return self.loss
        totals = self._global
        if totals is None or totals.ndim == 0:
            return totals
        # items mode: (items, summed losses) over the ranks, in float64.
        self._global = (totals[1] / totals[0]).to(self._losses[0].dtype)
        return self._global

    def __repr__(self) -> str:
        fields = (
            "boundary",
            "global_step",
            "loss",
            "global_loss",
            "num_items",
            "grad_norm",
            "lr",
            "skipped",
        )
        shown = [f"{name}={getattr(self, name)!r}" for name in fields]
        if len(self.lrs) > 1:
            shown.insert(-1, f"lrs={self.lrs!r}")
        if self.microbatch is not None:
            shown.insert(-1, f"microbatch={self.microbatch!r}")
        return f"Step({', '.join(shown)})"


def at_boundary(
    global_step: int,
    losses: Sequence[torch.Tensor],
    divisor: int | torch.Tensor,
    by_items: bool,
    alone: bool,
    totals: torch.Tensor | None,
) -> Step:
    """The boundary's `Step` of window ``global_step``: its ``losses`` (detached), what
    their sum is divided by (``divisor``: their count, or this rank's items with
    ``by_items``), whether ``global_loss`` is this rank's loss (``alone``), and the ranks'
    loss or their (items, summed losses) pair (``totals``), when known."""
    step = Step()
    step.boundary, step.global_step = True, global_step
    step._losses, step._divisor, step._by_items = losses, divisor, by_items
    step._alone, step._global = alone, totals
    return step
