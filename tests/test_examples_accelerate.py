"""examples/accelerate_loop.py: the Migration page's Accelerate section followed line by
line, ``accelerator.prepare`` kept, on 1 and 2 processes against the float64 big batch;
and in the same launch, the Checkpoint page's recipe on the prepared objects, stopped
mid-epoch and resumed bit for bit over a plain and a stateful DataLoader. One process is
``python examples/accelerate_loop.py``, whole; two are its ``main()`` on the launcher's
gloo ranks, which set the variables torchrun sets and Accelerate reads (the torchrun
launch itself is examples/distributed.py's, tests/test_distributed.py)."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import distributed
from tests.distributed import run

pytest.importorskip("accelerate", reason="Accelerate is a test-only dependency (the test extra)")

ROOT = Path(__file__).resolve().parents[1]
RESULT = re.compile(
    r"scheduler steps (\d+) for (\d+) windows on (\d+) processes; "
    r"max \|param - float64 big batch\| (\S+)"
)


@functools.cache
def launched(nproc: int) -> str:
    """What rank 0 printed in one launch of the example per number of processes, shared
    by the tests below: on one, ``python examples/accelerate_loop.py``; on several, its
    ``main()`` on the launcher's ranks."""
    if nproc > 1:
        return run(distributed.example_main, nproc, "accelerate_loop.py")[0]
    script = ROOT / "examples" / "accelerate_loop.py"
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_prepared_loop_is_exact_and_steps_its_schedule_once_per_window(nproc: int) -> None:
    """On 1 and 2 processes: the prepared scheduler steps once per window (Accelerate's
    own would step twice a window on 2), and the parameters match one float64 big batch
    per window of every process's microbatches."""
    printed = launched(nproc)
    found = RESULT.search(printed)
    assert found is not None, printed
    scheduled, windows, processes, gap = found.groups()
    assert int(processes) == nproc
    assert int(windows) == 2 * (160 // 4 // nproc // 4)  # two epochs of the shard's windows
    assert scheduled == windows
    assert float(gap) < 1e-12


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_checkpoint_recipe_resumes_a_prepared_loader_bit_for_bit(nproc: int) -> None:
    """The Checkpoint page's recipe on the migrated script (its loader prepared by
    Accelerate, its state saved through ``gradaccum.loader_state``): over a plain
    DataLoader, whose prepared ``state_dict()`` raised AttributeError, and over a
    StatefulDataLoader, a run stopped after a mid-epoch checkpoint and resumed by fresh
    objects from each process's file ends bit for bit where the uninterrupted run ends.
    It shares the launch of the test above (the results are cached per ``nproc``)."""
    assert "resumed bit for bit: plain DataLoader True, stateful True" in launched(nproc)
