"""gradaccum: exact, cheap gradient accumulation for PyTorch training loops."""

from gradaccum.accumulator import Accumulator, Step
from gradaccum.cli import add_arguments
from gradaccum.errors import (
    ConfigError,
    ConfigTypeError,
    GradaccumError,
    GradaccumWarning,
    NonFiniteError,
    OutOfMemoryError,
    RankFailedError,
    UsageError,
)
from gradaccum.order import GlobalOrder
from gradaccum.resuming import loader_state
from gradaccum.rng import random_state, set_random_state
from gradaccum.schedule import (
    interval,
    steps_at_epoch,
    steps_for,
    steps_per_epoch,
    total_steps,
)
from gradaccum.sync import SyncPolicy, SyncStrategy, no_sync, register_sync_strategy

__version__ = "0.1.0"

__all__ = [
    "Accumulator",
    "ConfigError",
    "ConfigTypeError",
    "GlobalOrder",
    "GradaccumError",
    "GradaccumWarning",
    "NonFiniteError",
    "OutOfMemoryError",
    "RankFailedError",
    "Step",
    "SyncPolicy",
    "SyncStrategy",
    "UsageError",
    "__version__",
    "add_arguments",
    "interval",
    "loader_state",
    "no_sync",
    "random_state",
    "register_sync_strategy",
    "set_random_state",
    "steps_at_epoch",
    "steps_for",
    "steps_per_epoch",
    "total_steps",
]
