"""gradaccum.testing: prove in a trainer's own tests that its accumulation is exact and
communicates once per window, whether or not it uses the `Accumulator`.

- Counting: `CollectiveCounter` counts collectives by kind and the host syncs that would
  stall a device, at the dispatcher, per microstep, per window or per run;
  `DDPBucketCounter` is the fallback.
- Ranks: `run_ranks` runs a function on N local ranks and returns every rank's result,
  or raises `LaunchError` with every rank's traceback; nothing a rank started is left.
- Equivalence: `check_accumulation` trains with the user's loop (one optimizer or
  several), reads at each step the hyperparameters its optimizers held and the gradient
  they saw, and compares both the gradient and the parameters after it with one big
  float64 batch per window stepped at those hyperparameters; it checks its step counts
  with `total_steps` and its collectives per window with what is expected, and names
  the likely mistake behind what broke. `expected_windows` cuts an epoch.
- Strategies: `gradaccum.testing.strategies` (needs hypothesis, imported only there).

Nothing here is imported by ``import gradaccum``.
"""

from gradaccum.testing.counting import CollectiveCounter, Counts, DDPBucketCounter
from gradaccum.testing.equivalence import (
    AccumulationReport,
    check_accumulation,
    expected_windows,
)
from gradaccum.testing.ranks import LaunchError, run_ranks

__all__ = [
    "AccumulationReport",
    "CollectiveCounter",
    "Counts",
    "DDPBucketCounter",
    "LaunchError",
    "check_accumulation",
    "expected_windows",
    "run_ranks",
]
