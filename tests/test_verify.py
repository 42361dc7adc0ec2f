"""`python -m gradaccum verify`: the table passes here, and its checks can fail."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from gradaccum import verify


def test_verify_passes_and_prints_json() -> None:
    """The main job, as a user runs it, exits 0 with one passing row per steps setting."""
    result = subprocess.run(
        [sys.executable, "-m", "gradaccum", "verify", "--json", "--steps", "4"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["steps"], r["optimizer_steps"], r["expected_steps"]) for r in rows] == [
        (1, 13, 13),
        (4, 3, 3),
    ]
    assert all(r["ok"] and r["max_abs_diff"] <= verify.TOLERANCE for r in rows)
    assert rows[1]["collectives_per_window"] == {"auto": {}, "boundary": {}, "every": {}}


def test_a_wrong_row_fails() -> None:
    """A row with a wrong cadence, gradient or a host sync is reported as failing."""
    row = verify.run_single_process(4, torch.device("cpu"))
    assert row.ok
    for field, bad in (
        ("optimizer_steps", 4),
        ("max_abs_diff", 1e-6),
        ("host_syncs_off_boundary", 1),
    ):
        broken = verify.Row(**(vars(row) | {field: bad}))
        assert not broken.ok


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """No subcommand, or a bad --steps, is a usage error (exit 2)."""
    from gradaccum.__main__ import main

    assert main([]) == 2
    with pytest.raises(SystemExit) as caught:
        main(["verify", "--steps", "0"])
    assert caught.value.code == 2
    assert "--steps" in capsys.readouterr().err
