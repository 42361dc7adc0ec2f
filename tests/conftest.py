"""Hypothesis profiles: the default one runs in CI; ``--hypothesis-profile=long`` runs
many more examples (hours, for a soak before a release), ``--hypothesis-profile=quick``
fewer, with the quick tier (``-m "not slow"``, tests/tiers.py). None has a deadline or the
``too_slow`` health check: on a loaded 2-core machine generating an input can take a
second, and a test must not fail for load alone. A test's time limit (pytest-timeout's)
that fires says that the machine was too slow and how long the test waited, and is never
taken by hypothesis for a failure of the example it was running. A one-rank process
group for the tests that build real DDP and fully_shard modules in this process."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, settings

from gradaccum.testing import ranks
from tests.tiers import QUICK, SLOW
from tests.timeouts import pytest_timeout_set_timer  # noqa: F401  (a hook: pytest finds it here)

# What the rank launcher's server imports once rather than each rank of each launch:
# torch._dynamo costs a rank about 0.7 s of CPU, paid again by every launch that compiles,
# and what the first compiled call imports (inductor's compile_fx for the default backend,
# the optimizer's cudagraph check, dynamo's backends and repro hooks, DTensor's
# experimental API) cost the ranks 10 s of CPU in all; the server imports them in 0.7 s.
ranks._PRELOAD.extend(
    [
        "torch._dynamo",
        "torch._dynamo.backends.common",
        "torch._dynamo.repro.after_dynamo",
        "torch._inductor.compile_fx",
        "torch._inductor.cudagraph_trees",
        "torch.distributed.tensor.experimental",
        "tests.distributed",
    ]
)

_UNHURRIED = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("default", **_UNHURRIED)
settings.register_profile("long", max_examples=50_000, **_UNHURRIED)
settings.register_profile("quick", max_examples=10, **_UNHURRIED)
settings.load_profile("default")


@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[None]:
    """A real one-rank gloo group, so real DDP and fully_shard modules can be built."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``slow`` the tests `tests.tiers.SLOW` names but those it keeps quick: the
    quick tier leaves them out."""
    for item in items:
        if item.nodeid.startswith(SLOW) and not item.nodeid.startswith(QUICK):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module", autouse=True)
def _frozen_before_each_module() -> None:
    """At each module's first test: collect, then freeze what survives (imports, earlier
    modules' fixtures) out of the garbage collector's reach. The suite's process holds
    about 2 million objects once torch, transformers and the rest are in, and every full
    collection walked them all: 69 of them cost 13.4 s of CPU in one run, against 5.7 s
    with this. What a test makes is still collected; only what was alive when the
    module began, and is dropped in a cycle later, stays to the end of the run."""
    gc.collect()
    gc.freeze()
