"""The random state a training loop draws from, captured and restored as one value.

A resumed run draws what the uninterrupted run drew (dropout masks, random augmentation,
shuffling by an unseeded sampler) only when the global random generators are where they
were at the checkpoint: torch's on the CPU and on every CUDA device, Python's `random`,
and NumPy's global one. Generators you own (a DataLoader's ``generator=``) are yours to
seed; see the guide's checkpoint recipe.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch

from gradaccum.errors import ConfigError, ConfigTypeError, describe

__all__ = ["random_state", "set_random_state"]


def random_state() -> dict[str, Any]:
    """This process's global random state, to save beside a checkpoint.

    Returns:
        ``"python"`` (`random.getstate`), ``"torch"`` (`torch.get_rng_state`), with CUDA
        ``"cuda"`` (one state per visible device), and with NumPy installed ``"numpy"``
        (its global generator's state as plain values). Every value is a tensor, a
        number, a str or a list or tuple of them, so ``torch.load(weights_only=True)``
        reads it. Under several ranks each rank's state is its own: save one per rank.

    Examples:
        >>> state = random_state()
        >>> first = torch.rand(2)
        >>> set_random_state(state)
        >>> torch.equal(torch.rand(2), first)
        True
    """
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = _numpy()
    if numpy is not None:
        name, keys, position, has_gauss, gauss = numpy.random.get_state(legacy=True)
        state["numpy"] = (name, keys.tolist(), position, has_gauss, gauss)
    return state


def set_random_state(state: Mapping[str, Any]) -> None:
    """Restore what `random_state` captured: the next draws are those that followed it.

    Every part is checked before any is restored; if restoring one still fails, those
    restored already are put back.

    Args:
        state: From `random_state` (in another process too).

    Raises:
        ConfigTypeError: ``state`` is not a mapping, or a part has the wrong type.
        ConfigError: A part cannot be restored here: CUDA states for more devices than
            this process sees, or a NumPy state without NumPy installed.
    """
    if not isinstance(state, Mapping):
        msg = f"state must be a mapping from gradaccum.random_state(), got {describe(state)}"
        raise ConfigTypeError(msg)
    python = state.get("python")
    if not (isinstance(python, tuple) and len(python) == 3):
        msg = f"state['python'] must be a tuple from random.getstate(), got {describe(python)}"
        raise ConfigTypeError(msg)
    cpu = _byte_tensor(state.get("torch"), "state['torch']")
    cuda = state.get("cuda")
    if cuda is not None:
        if not isinstance(cuda, list | tuple):
            msg = f"state['cuda'] must be a list of CUDA random states, got {describe(cuda)}"
            raise ConfigTypeError(msg)
        cuda = [
            _byte_tensor(device, f"state['cuda'][{index}]") for index, device in enumerate(cuda)
        ]
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(cuda) > visible:
            msg = (
                f"state['cuda'] holds the random states of {len(cuda)} CUDA devices, but this "
                f"process sees {visible}; resume where as many are visible, or drop "
                "state['cuda'] to resume without them (not bit for bit on the GPU)"
            )
            raise ConfigError(msg)
    saved_numpy = state.get("numpy")
    numpy = None
    if saved_numpy is not None:
        if not (isinstance(saved_numpy, tuple | list) and len(saved_numpy) == 5):
            msg = (
                "state['numpy'] must be NumPy's random state from gradaccum.random_state(), "
                f"got {describe(saved_numpy)}"
            )
            raise ConfigTypeError(msg)
        numpy = _numpy()
        if numpy is None:
            msg = (
                "state['numpy'] holds NumPy's random state, but NumPy is not installed; "
                "install it, or drop state['numpy'] to resume without it"
            )
            raise ConfigError(msg)
    previous = random_state()
    try:
        random.setstate(python)
        torch.set_rng_state(cpu)
        if cuda is not None:
            for index, device_state in enumerate(cuda):
                torch.cuda.set_rng_state(device_state, index)
        if numpy is not None and saved_numpy is not None:
            name, keys, position, has_gauss, gauss = saved_numpy
            keys = numpy.asarray(keys, dtype=numpy.uint32)
            numpy.random.set_state((name, keys, position, has_gauss, gauss))
    except (TypeError, ValueError, RuntimeError) as error:
        set_random_state(previous)
        msg = f"state is not a random state from gradaccum.random_state(): {error}"
        raise ConfigError(msg) from error


def _byte_tensor(value: object, name: str) -> torch.Tensor:
    """``value``, a generator's state (a uint8 tensor), or a refusal naming it."""
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8):
        msg = f"{name} must be a uint8 tensor from torch.get_rng_state(), got {describe(value)}"
        raise ConfigTypeError(msg)
    return value


def _numpy() -> ModuleType | None:
    """NumPy when it is installed (imported here, not by ``import gradaccum``)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy
