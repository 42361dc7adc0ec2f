"""The floor: a minimal accumulator with gradaccum's hot-path semantics and nothing else.

What `benchmarks/instructions.py` measures gradaccum against, besides the hand-written
loop: the least a library can do per microstep with the same contract on the hot path.
Per microstep it scales the loss by ``1/steps`` (or keeps a summed loss and its item
count), back-propagates it (through the GradScaler if any), keeps the detached loss, and
counts the window; DDP's flag is armed before the next forward. At the boundary it
normalizes by the items, unscales, clips, checks for inf/NaN (``skip``), steps the
optimizer and the scheduler once and clears the gradients. No validation, no misuse
watch, no checkpoint bookkeeping, no epoch plan: not a library, a yardstick.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Floor:
    """``with floor.microstep(loss, items):`` once per microbatch."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        *,
        steps: int,
        max_grad_norm: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
        skip_nonfinite: bool = False,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.steps, self.max_grad_norm, self.scaler = steps, max_grad_norm, scaler
        self.skip_nonfinite = skip_nonfinite
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.ddp = model if hasattr(model, "require_backward_grad_sync") else None
        self.done = 0
        self.losses: list[torch.Tensor] = []
        self.items = 0
        self.arm()

    def arm(self) -> None:
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = self.done == self.steps - 1

    def microstep(self, loss: torch.Tensor, items: int | None = None) -> Floor:
        scaled = loss if items is not None or self.steps == 1 else loss / self.steps
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        self.losses.append(loss.detach())
        if items is not None:
            self.items += items
        self.done += 1
        if self.done == self.steps:
            self.boundary()
        return self  # the block: entering it costs nothing more

    def __enter__(self) -> Floor:
        return self

    def __exit__(self, *_: object) -> None:
        if self.done == self.steps:
            self.apply()
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = self.done == self.steps - 1

    def boundary(self) -> None:
        if self.items:
            torch._foreach_mul_([p.grad for p in self.params], 1 / self.items)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = None
        if self.max_grad_norm is not None:
            norm = nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.skip = False
        if self.skip_nonfinite:
            if norm is None:
                norm = nn.utils.get_total_norm([p.grad for p in self.params])
            self.skip = not bool(torch.isfinite(norm))

    def apply(self) -> None:
        if not self.skip:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.done, self.items = 0, 0
        self.losses = []
        self.skip = False
