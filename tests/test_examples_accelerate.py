"""examples/accelerate_loop.py: the Migration page's Accelerate section followed line by
line, ``accelerator.prepare`` kept, on 2 processes against the float64 big batch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import torchrun

pytest.importorskip("accelerate", reason="Accelerate is a test-only dependency (the test extra)")

ROOT = Path(__file__).resolve().parents[1]
RESULT = re.compile(
    r"scheduler steps (\d+) for (\d+) windows on (\d+) processes; "
    r"max \|param - float64 big batch\| (\S+)"
)


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_prepared_loop_is_exact_and_steps_its_schedule_once_per_window(nproc: int) -> None:
    """On 1 and 2 processes: the prepared scheduler steps once per window (Accelerate's
    own would step twice a window on 2), and the parameters match one float64 big batch
    per window of every process's microbatches."""
    result = torchrun(ROOT / "examples" / "accelerate_loop.py", nproc)
    assert result.returncode == 0, result.stderr
    found = RESULT.search(result.stdout)
    assert found is not None, result.stdout
    scheduled, windows, processes, gap = found.groups()
    assert int(processes) == nproc
    assert int(windows) == 2 * (160 // 4 // nproc // 4)  # two epochs of the shard's windows
    assert scheduled == windows
    assert float(gap) < 1e-12
