"""`Contract`: an independent float64 model of what an `Accumulator` must do.

It is written from the documented semantics (docs/ and the rebuild's spec), never from
the accumulator's internals: its gradients are the analytic ones of a linear
least-squares problem, its optimizer is SGD with momentum written out, and its epochs,
windows and checkpoints are plain integers kept by the rules below.

- A sized epoch of ``n`` microbatches is cut into windows from an *anchor* (the epoch's
  start; after a load, the start of the restored window; after a ``steps`` change, the
  start of the next window; after a failed window, the microbatch after it) with the
  ``steps`` in force; hand-outs stop at ``anchor + trained(n - anchor)``. Without
  ``drop_last`` a window is as long as the epoch still allows (the last one is the
  remainder).
- An unsized epoch hands out everything; without ``drop_last`` the last window ends at
  the last item, with it a trailing partial window is discarded silently. If the whole
  epoch gave no window (it began at its start, closed none, and none fits its length),
  `ConfigError` (its gradient was discarded).
- A window open when a new epoch begins is discarded (with a warning), unless a load
  restored it; a resumed epoch continues the open window.
- A checkpoint's ``position`` is the end of the last window that closed, or with an open
  window (``include_grads``) the microbatches the loop has passed: back-propagated, or
  passed over by a ``continue``. A microbatch handed out but not back-propagated (the top
  of the loop body, or a ``break`` there) is handed out again after a resume.
- Outside an epoch (a bare loop around ``acc.microstep``) every ``steps`` microsteps form
  a window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

LR, LR_EXTRA, GAMMA, MOMENTUM, MAX_NORM = 0.1, 0.05, 0.9, 0.5, 0.5
LR_BIAS, GAMMA_BIAS = 0.2, 0.7  # the second optimizer's, when the bias has one of its own
OVERFLOW = 1e290  # finite, but overflows float64 once scaled by the scaler's 2**100
EXTRA_INIT = 0.25  # the extra scalar parameter of `optimizer.add_param_group`


@lru_cache(maxsize=4096)
def batch(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of microbatch ``seed``: inputs (rows x 3) and targets (rows x 1)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, generator=generator, dtype=torch.float64)
    return x, torch.randn(rows, 1, generator=generator, dtype=torch.float64)


@dataclass(frozen=True)
class Micro:
    """One microbatch: its rows and its fault (None, "body", "backward", "nan", "overflow")."""

    seed: int
    rows: int
    fault: str | None = None

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return batch(self.seed, self.rows)

    def factor(self) -> float:
        return {"nan": math.nan, "overflow": OVERFLOW}.get(self.fault or "", 1.0)


def trained(n: int, steps: int, drop_last: bool) -> int:
    """Microbatches of ``n`` that windows of ``steps`` train on."""
    return n // steps * steps if drop_last else n


@dataclass
class Saved:
    """What the model says ``state_dict()`` holds."""

    steps: int
    position: int
    global_step: int
    skipped_steps: int
    window: tuple[int, int] | None  # (microsteps, size) of a saved open window
    epochs_completed: int = 0
    handed_out: bool = False  # a microbatch handed out awaited its block (the top of the body)


@dataclass
class Contract:
    """What the accumulator must have done, from the documented contract."""

    steps: int
    drop_last: bool
    scaler: bool
    on_nonfinite: str | None
    clip: bool
    params: dict[str, torch.Tensor]
    # Two optimizers: the weight's (SGD, StepLR by GAMMA) and the bias's (SGD at LR_BIAS,
    # its StepLR by GAMMA_BIAS, or none), which an added group joins; else one for all.
    split: bool = False
    bias_scheduled: bool = True
    momentum: dict[str, torch.Tensor] = field(default_factory=dict)
    lrs: dict[str, float] = field(default_factory=dict)  # by parameter
    windows: int = 0
    skipped: int = 0
    window: list[tuple[Micro, bool]] = field(default_factory=list)  # (microbatch, by_items)
    size: int = 0
    wiped: bool = False  # zero_grad() inside the open window
    warnings: list[str] = field(default_factory=list)  # expected, not yet seen
    # The epoch.
    active: bool = False
    length: int | None = None  # a sized epoch's length
    total: int = 0  # the data's length (an unsized epoch's last item is announced)
    handed: int = 0  # microbatches handed out (acc.position)
    pending: bool = False  # the last one handed out has not reached a block
    handed_out: bool = False  # pending, or was when the loop broke off: a state saves it
    passed: int = 0  # microbatches the loop has passed (back-propagated or skipped)
    closed_at: int = 0  # the end of the last window that closed
    anchor: int = 0  # where the current cut into windows starts
    resume_at: int = 0  # a load: the next epoch skips this many
    restored: bool = False  # the open window was restored by a load
    resumed: bool = False  # the epoch began past its start (after a load)
    started_at: int = 0  # windows closed before the epoch began
    epochs: int = 0  # epochs that ran out (acc.epochs_completed)

    def __post_init__(self) -> None:
        self.size = self.steps
        self.lrs = {"weight": LR, "bias": LR_BIAS if self.split else LR}

    def gamma(self, name: str) -> float:
        """How the learning rate of parameter ``name`` decays per applied window."""
        if name == "weight" or not self.split:
            return GAMMA
        return GAMMA_BIAS if self.bias_scheduled else 1.0

    # Gradients and the optimizer ---------------------------------------------------

    def add_extra(self) -> None:
        """``optimizer.add_param_group`` with the extra scalar (lr ``LR_EXTRA``), on the last
        optimizer."""
        self.params["extra"] = torch.tensor(EXTRA_INIT, dtype=torch.float64)
        self.lrs["extra"] = LR_EXTRA

    def grads(self, micro: Micro, by_items: bool) -> dict[str, torch.Tensor]:
        """d loss / d params by hand, for ``(x @ w.T + b + extra * x[:, :1] - y)**2``
        averaged over the rows (summed, with num_items)."""
        x, y = micro.data()
        p = self.params
        residual = x @ p["weight"].T + p["bias"] - y
        if "extra" in p:
            residual = residual + p["extra"] * x[:, :1]
        scale = 2.0 * micro.factor() / (1 if by_items else micro.rows)
        grads = {"weight": scale * residual.T @ x, "bias": scale * residual.sum(0)}
        if "extra" in p:
            grads["extra"] = scale * (residual * x[:, :1]).sum()
        return grads

    def faulty(self) -> bool:
        """The open window's gradient is not finite (once unscaled)."""
        return any(micro.fault in ("nan", "overflow") for micro, _ in self.window)

    def discard(self) -> None:
        """The open window is dropped (discarded, or failed)."""
        self.window = []
        self.size = self.steps
        self.wiped = self.restored = False

    def fail(self) -> None:
        """The open window failed (an exception in its block or backward, NonFiniteError, a
        zero_grad() inside it): discarded, not counted; an epoch's cut restarts after it."""
        self.discard()
        if self.active:
            self.anchor = self.handed

    def boundary(self) -> str:
        """The window's last microstep: apply or skip it; "applied" or "skipped"."""
        window, faulty = self.window, self.faulty()
        self.discard()
        self.windows += 1
        self.closed_at = self.passed
        if faulty:
            self.skipped += 1
            return "skipped"
        divisor = sum(micro.rows for micro, _ in window) if window[0][1] else len(window)
        grads = self.grads(*window[0])
        for micro, by_items in window[1:]:
            for name, grad in self.grads(micro, by_items).items():
                grads[name] = grads[name] + grad
        grads = {name: grad / divisor for name, grad in grads.items()}
        if self.clip:
            norm = torch.cat([g.flatten() for g in grads.values()]).norm()
            coef = min(1.0, MAX_NORM / (norm.item() + 1e-6))
            grads = {name: g * coef for name, g in grads.items()}
        for name, grad in grads.items():
            buf = self.momentum.get(name)
            self.momentum[name] = grad.clone() if buf is None else MOMENTUM * buf + grad
            self.params[name] = self.params[name] - self.lrs[name] * self.momentum[name]
        self.lrs = {name: lr * self.gamma(name) for name, lr in self.lrs.items()}
        return "applied"

    # Epochs -------------------------------------------------------------------------

    def end_of_hand_outs(self) -> int:
        """Where the epoch's hand-outs stop, with windows of ``steps`` cut from the anchor."""
        if self.length is None:
            return self.total
        return self.anchor + trained(self.length - self.anchor, self.steps, self.drop_last)

    def planned_size(self) -> int:
        """The size of the window the microbatch handed out last belongs to."""
        done = len(self.window)
        if self.drop_last:
            return self.steps
        if self.length is None:  # only the last item is known to be last
            return min(self.steps, done + 1) if self.handed == self.total else self.steps
        return min(self.steps, done + 1 + self.length - self.handed)

    def begin(self, length: int | None, total: int) -> str | None:
        """The epoch's first ``next()``: None once it began, or the fragment of the
        `ConfigError` that refuses it (the guard) and leaves everything as it was."""
        skip = self.resume_at
        if length is not None and skip == 0 and trained(length, self.steps, self.drop_last) == 0:
            return "gives no optimizer step"
        if skip > total:
            return "past the end" if length is not None else "ended after"
        if self.window and not skip and not self.restored:
            self.warnings.append(
                f"discarding the {len(self.window)} microsteps of a window left open by the "
                "previous epoch"
            )
            self.discard()
        self.active, self.length, self.total = True, length, total
        self.restored = False  # a load carries a window into the next epoch only
        self.resumed, self.started_at = skip > 0, self.windows
        self.handed = self.passed = skip
        self.pending = self.handed_out = False
        if skip == 0:
            self.closed_at = 0
        self.anchor = self.closed_at
        self.resume_at = 0
        return None

    def hand_out(self) -> int | None:
        """The next ``next()`` of a begun epoch: the index it hands out, or None (the end)."""
        if self.handed >= self.end_of_hand_outs():
            return None
        self.passed = self.handed  # a microbatch not back-propagated was passed over
        self.handed += 1
        self.pending = self.handed_out = True
        self.size = self.planned_size()
        return self.handed - 1

    def end(self) -> tuple[bool, str]:
        """The epoch ran out; return whether the (unsized) guard fires at its end, and what
        became of a window left open."""
        end = self.end_of_hand_outs()
        fate = "no window open"
        if self.window:
            fate = "a trailing partial window dropped silently"
            if not (self.drop_last and (self.length is None or self.handed > end)):
                fate = "an incomplete window discarded"
                self.warnings.append(
                    f"discarding the {len(self.window)} microsteps of an incomplete window at "
                    "the end of the epoch"
                )
        self.discard()
        guard = (
            self.length is None
            and not self.resumed
            and self.windows == self.started_at
            and trained(self.handed, self.steps, self.drop_last) == 0
        )
        self.active = self.pending = self.handed_out = False
        self.length = None
        self.handed = self.passed = self.closed_at = self.anchor = 0
        self.epochs += 1
        return guard, fate

    def break_off(self) -> None:
        """The loop broke out of the epoch (its generator closed): the position stays; a
        microbatch handed out but not back-propagated is not counted (a state saved now
        records it: the loop drew it)."""
        self.active = self.pending = False
        if not self.window:
            self.size = self.steps  # the next window is a bare one, of ``steps``

    def enter(self) -> None:
        """A microstep's block was entered: its microbatch is passed."""
        if self.active:
            self.passed = self.handed
            self.pending = self.handed_out = False

    def set_steps(self, steps: int) -> bool:
        """``acc.steps = steps``; return whether it is accepted (between windows, or the
        value it has: a no-op)."""
        if steps == self.steps:
            return True
        if self.window:
            return False
        self.steps = steps
        if self.active:
            self.anchor = self.handed - self.pending
        self.size = self.planned_size() if self.pending else steps
        return True

    # Checkpoints ----------------------------------------------------------------------

    def state_dict(self, include_grads: bool) -> Saved | None:
        """What ``state_dict(include_grads=...)`` holds; None when it is refused."""
        if self.window and not include_grads:
            return None
        return Saved(
            steps=self.steps,
            position=self.passed if self.window else self.closed_at,
            global_step=self.windows,
            skipped_steps=self.skipped,
            window=(len(self.window), self.size) if self.window else None,
            epochs_completed=self.epochs,
            handed_out=self.handed_out,
        )

    def accepts(self, saved: Saved, steps: int, allow: bool) -> bool:
        """Whether a fresh accumulator with ``steps`` loads ``saved``."""
        return saved.steps == steps or (allow and saved.window is None)

    def load(self, saved: Saved, steps: int) -> None:
        """``load_state_dict(saved)`` into a fresh accumulator with ``steps``; the open
        window, if saved, is the model's own (the load follows its save at once)."""
        self.steps = steps
        self.windows, self.skipped = saved.global_step, saved.skipped_steps
        self.epochs = saved.epochs_completed
        done = 0 if saved.window is None else saved.window[0]
        if saved.window is None:
            self.discard()
        else:
            self.size = saved.window[1]
        self.resume_at = self.handed = self.passed = saved.position
        self.closed_at = self.anchor = max(0, saved.position - done)
        self.active = self.pending = self.handed_out = False
        self.restored = saved.window is not None
