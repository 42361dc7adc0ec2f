"""`python -m gradaccum verify`: the table passes here, and its checks can fail."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from gradaccum import verify
from tests import distributed
from tests.distributed import run


def test_verify_passes_and_prints_json() -> None:
    """The main job, as a user runs it: single-process, DDP x2 and fully_shard x2 rows,
    steps 1 and 4, all passing, with the collectives each policy costs per window."""
    result = subprocess.run(
        [sys.executable, "-m", "gradaccum", "verify", "--json", "--steps", "4"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = {(r["path"], r["steps"]): r for r in json.loads(result.stdout)}
    assert sorted(rows) == [
        ("DDP", 1),
        ("DDP", 4),
        ("fully_shard", 1),
        ("fully_shard", 4),
        ("single-process", 1),
        ("single-process", 4),
    ]
    for (_, steps), row in rows.items():
        assert row["ok"]
        assert row["max_abs_diff"] <= verify.TOLERANCE
        assert (row["optimizer_steps"], row["expected_steps"]) == (
            (13, 13) if steps == 1 else (3, 3)
        )
    assert rows["single-process", 4]["collectives_per_window"] == {
        "auto": {},
        "boundary": {},
        "every": {},
    }
    ddp = rows["DDP", 4]["collectives_per_window"]
    assert [ddp[policy]["ar"] for policy in ("auto", "boundary", "every")] == [1, 1, 4]
    sharded = rows["fully_shard", 4]["collectives_per_window"]
    assert [sharded[policy]["rs"] for policy in ("auto", "boundary", "every")] == [8, 2, 8]


def test_a_wrong_row_fails() -> None:
    """A row with a wrong cadence, gradient or a host sync is reported as failing."""
    row = verify.run_single_process(4, torch.device("cpu"))
    assert row.ok
    for field, bad in (
        ("optimizer_steps", 4),
        ("max_abs_diff", 1e-6),
        ("host_syncs_off_boundary", 1),
        ("deferred_reductions", 1),
    ):
        broken = verify.Row(**(vars(row) | {field: bad}))
        assert not broken.ok


def test_verify_catches_arming_after_the_forward() -> None:
    """Patched to arm in the backward, DDP all-reduces deferred microsteps and skips the
    boundary's: the row fails on deferred reductions and on the gradient."""
    for row in run(distributed.verify_rows_with_late_arming, 2)[0]:
        assert not row.ok
        assert row.deferred_reductions > 0
        assert row.max_abs_diff > 1e-3


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """No subcommand, or a bad --steps, is a usage error (exit 2)."""
    from gradaccum.__main__ import main

    assert main([]) == 2
    with pytest.raises(SystemExit) as caught:
        main(["verify", "--steps", "0"])
    assert caught.value.code == 2
    assert "--steps" in capsys.readouterr().err
    with pytest.raises(SystemExit) as caught:
        main(["verify", "--nproc", "0"])
    assert caught.value.code == 2
    assert "--nproc" in capsys.readouterr().err
