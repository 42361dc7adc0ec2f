"""gradaccum.testing: prove in a trainer's own tests that its accumulation is exact and
communicates once per window, whether or not it uses the `Accumulator`.

- Counting: `CollectiveCounter` counts collectives by kind and host syncs at the
  dispatcher, per microstep, per window or per run; `DDPBucketCounter` is the fallback.
- Ranks: `run_ranks` runs a function on N local ranks and returns every rank's result,
  or raises `LaunchError` with every rank's traceback.
- Equivalence: `check_accumulation` trains with the user's loop and compares it with
  one big float64 batch per window, its step counts with `total_steps` and its
  collectives per window with what is expected; `expected_windows` cuts an epoch.
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
