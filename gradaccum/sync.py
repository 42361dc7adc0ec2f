"""How a model is wrapped, and the strategy that turns its gradient communication on and off."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from torch import nn

from gradaccum.errors import ConfigTypeError

__all__ = ["LocalSync", "SyncStrategy", "no_sync", "strategy_for", "unwrap"]


class SyncStrategy(Protocol):
    """Turns a wrapped model's gradient communication on and off.

    The accumulator calls `arm` before each microstep's forward, because some
    wrappers (DDP) decide during the forward whether the backward communicates.
    """

    def arm(self, sync: bool) -> None:
        """Make the next backward communicate gradients (``True``) or keep them local."""

    def restore(self) -> None:
        """Put back the communication state the strategy found."""


class LocalSync:
    """A module that is not wrapped: its gradients live on this process, nothing to sync."""

    def arm(self, sync: bool) -> None:
        """Nothing to arm: there is no communication."""

    def restore(self) -> None:
        """Nothing was changed."""


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside any ``torch.compile`` wrappers (they keep it as ``_orig_mod``)."""
    inner = getattr(model, "_orig_mod", None)
    while isinstance(inner, nn.Module):
        model = inner
        inner = getattr(model, "_orig_mod", None)
    return model


_SYNC_METHODS = ("no_sync", "set_requires_gradient_sync")


def _distributed_wrapper(model: nn.Module) -> str | None:
    """The class name of the first module in ``model`` that communicates gradients.

    Duck-typed, so that detection imports nothing: DDP and FSDP1 have ``no_sync``,
    ``fully_shard`` modules have ``set_requires_gradient_sync``.
    """
    for module in model.modules():
        if any(callable(getattr(module, name, None)) for name in _SYNC_METHODS):
            return type(module).__name__
    return None


def strategy_for(model: nn.Module) -> SyncStrategy:
    """Detect how ``model`` is wrapped, through ``torch.compile``, and return its strategy.

    Raises:
        ConfigTypeError: ``model`` communicates gradients itself (DDP, FSDP,
            ``fully_shard``, or any module with a ``no_sync`` method); this release
            accumulates on unwrapped modules only.
    """
    wrapper = _distributed_wrapper(unwrap(model))
    if wrapper is not None:
        msg = (
            f"model contains a {wrapper}, which communicates gradients; this release of "
            "gradaccum accumulates on unwrapped modules only (DDP, FSDP and fully_shard "
            "support is planned). Pass the unwrapped module, or accumulate by hand with "
            "the wrapper's own no_sync()"
        )
        raise ConfigTypeError(msg)
    return LocalSync()


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Keep the gradients of the backwards run inside the block local to this process.

    Use it around both the forward and the backward of a non-boundary microstep;
    the state found on entry is restored on exit. An unwrapped module has nothing
    to sync, so the block is a no-op.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> with no_sync(model):
        ...     model(torch.ones(1, 2)).sum().backward()
    """
    strategy = strategy_for(model)
    strategy.arm(False)
    try:
        yield
    finally:
        strategy.restore()
