"""`python -m gradaccum verify`: the table passes here, and its checks can fail."""

from __future__ import annotations

import io
import json
import re
import runpy
import sys
from contextlib import redirect_stdout
from typing import Any

import pytest
import torch

from gradaccum import verify
from tests import distributed
from tests.distributed import run
from tests.helpers import shown_output


@pytest.fixture(scope="module")
def printed_rows() -> list[dict[str, Any]]:
    """The rows of one ``verify --steps 4 --json`` run, its ``main()`` in this process
    (its ranks forked from the suite's launcher, which imported torch once; CI's setup
    command runs ``python -m gradaccum verify`` whole). The training
    costs most of this module's time: the table's test renders these rows rather than
    training them again."""
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert verify.main(["--steps", "4", "--json"]) == 0
    rows: list[dict[str, Any]] = json.loads(printed.getvalue())
    return rows


def test_verify_passes_and_prints_json(printed_rows: list[dict[str, Any]]) -> None:
    """The main job, as a user runs it: single-process, DDP x2 and fully_shard x2 rows,
    steps 1 and 4, all passing, with the whole number of collectives each policy costs
    per window, and what runs once apart from them."""
    rows = {(r["path"], r["steps"]): r for r in printed_rows}
    assert sorted(rows) == [
        ("DDP", 1),
        ("DDP", 4),
        ("fully_shard", 1),
        ("fully_shard", 4),
        ("single-process", 1),
        ("single-process", 4),
    ]
    for (path, steps), row in rows.items():
        assert row["ok"]
        assert row["problems"] == []
        assert row["max_abs_diff"] <= verify.TOLERANCE
        assert (row["optimizer_steps"], row["expected_steps"]) == (
            (13, 13) if steps == 1 else (3, 3)
        )
        for field in ("collectives_per_window", "collectives_one_time"):
            assert sorted(row[field]) == ["auto", "boundary", "every"]
            for counts in row[field].values():
                assert all(type(n) is int for n in counts.values()), (path, steps, field)
        once = row["collectives_one_time"]
        # The ranks agree on the epoch's length (one all-reduce) and DDP broadcasts its
        # rebuilt buckets once, after the first backward; nothing else runs outside the
        # steady count per window.
        expected = {"DDP": {"ar": 1, "bc": 2}, "fully_shard": {"ar": 1}}.get(path, {})
        assert once == {"auto": expected, "boundary": expected, "every": expected}
    assert rows["single-process", 4]["collectives_per_window"] == {
        "auto": {},
        "boundary": {},
        "every": {},
    }
    ddp = rows["DDP", 4]["collectives_per_window"]
    assert ddp == {"auto": {"ar": 1}, "boundary": {"ar": 1}, "every": {"ar": 4}}
    sharded = rows["fully_shard", 4]["collectives_per_window"]
    assert [sharded[policy]["rs"] for policy in ("auto", "boundary", "every")] == [8, 2, 8]


def test_verify_table_fits_100_columns_and_ends_in_the_verdict(
    printed_rows: list[dict[str, Any]],
) -> None:
    """The default table of those rows: no line over 100 columns, whole collective counts
    per window with the one-time collectives apart, and a last line that says in words
    that all held."""
    fields = set(verify.Row.__dataclass_fields__)
    rows = [verify.Row(**{k: v for k, v in row.items() if k in fields}) for row in printed_rows]
    lines = verify.report(rows, "cpu").splitlines()
    assert max(len(line) for line in lines) <= verify.WIDTH == 100
    assert lines[-1] == (
        "All 6 rows held: exact parameters, 1 step per window, "
        "no deferred reduction or host sync mid-window."
    )
    table = lines[lines.index("collectives per window under each sync policy:") + 1 :]
    assert re.split(" {2,}", table[0]) == ["path", "steps", "auto", "boundary", "every", "one-time"]
    cells = {
        (line[0], line[1]): line[2:]
        for line in (re.split(" {2,}", text) for text in table)
        if line[0] in ("single-process", "DDP", "fully_shard")
    }
    assert len(cells) == 6
    for counts in cells.values():  # auto, boundary, every[, one-time]: whole numbers
        assert 3 <= len(counts) <= 4
        for count in counts:
            assert re.fullmatch(r"0|\d+ [a-z]{2}( \+ \d+ [a-z]{2})*", count), counts
    assert cells["single-process", "4"] == ["0", "0", "0"]
    assert cells["DDP", "4"] == ["1 ar", "1 ar", "4 ar", "1 ar + 2 bc"]
    assert cells["fully_shard", "4"] == ["16 ag + 8 rs", "16 ag + 2 rs", "16 ag + 8 rs", "1 ar"]
    # The Getting started page shows this output: each line it shows is printed (the
    # gaps to the reference, rounding noise, aside; "..." stands for the lines it omits).
    shown = shown_output("index.md", "## What `verify` prints")
    gap = re.compile(r"\d\.\de[-+]\d\d")
    printed = {gap.sub("GAP", line) for line in lines}
    lines_shown = [line for line in shown.splitlines() if line != "..."]
    assert [line for line in lines_shown if gap.sub("GAP", line) not in printed] == []


def rows_of(row: verify.Row, n: int, **broken: Any) -> list[verify.Row]:
    """``n`` copies of ``row`` with paths path0, path1, ... and ``broken``'s fields."""
    return [verify.Row(**(vars(row) | {"path": f"path{i}"} | broken)) for i in range(n)]


def test_report_names_the_failed_rows_and_why() -> None:
    """A failing table ends in which rows failed and why, and still fits 100 columns,
    even when every promise of 8 rows is broken."""
    row = verify.run_single_process(4, torch.device("cpu"))
    rows = [row, *rows_of(row, 1, deferred_reductions=3, max_abs_diff=1.5e-3)]
    lines = verify.report(rows, "cpu").splitlines()
    assert lines[-3:-1] == [
        "FAIL path0 (python), steps 4: parameters off the reference by 1.5e-03 (> 1e-10)",
        "FAIL path0 (python), steps 4: 3 deferred reductions ran",
    ]
    assert lines[-1] == "1 of 2 rows FAILED (parameters, deferred reductions): path0 steps 4."
    everything = {
        "optimizer_steps": -1,
        "max_abs_diff": float("nan"),
        "host_syncs_off_boundary": 1,
        "deferred_reductions": 1,
    }
    lines = verify.report(rows_of(row, 8, **everything), "cpu").splitlines()
    assert max(len(line) for line in lines) <= verify.WIDTH
    assert lines[-1] == (
        "8 of 8 rows FAILED (step count, parameters, deferred reductions, host syncs): "
        "see FAIL above."
    )
    assert sum(line.startswith("FAIL path") for line in lines) == 8 * 4


def test_wide_report_puts_each_row_on_one_line() -> None:
    """--wide: one line per row with the collectives, the one-time ones and peak memory."""
    row = verify.run_single_process(4, torch.device("cpu"))
    ddp = verify.Row(
        **(
            vars(row)
            | {
                "path": "DDP",
                "collectives_per_window": {
                    "auto": {"ar": 1},
                    "boundary": {"ar": 1},
                    "every": {"ar": 4},
                },
                "collectives_one_time": {p: {"bc": 2} for p in ("auto", "boundary", "every")},
                "peak_memory_bytes": 4096,
            }
        )
    )
    lines = verify.report([row, ddp], "cuda", wide=True).splitlines()
    assert lines[1].split("  ")[0] == "path"
    assert "peak memory" in lines[1]
    assert lines[2].startswith("single-process")
    assert lines[3].startswith("DDP")
    assert re.split(" {2,}", lines[3])[-4:] == ["1 ar | 1 ar | 4 ar", "2 bc", "4096 B", "ok"]
    assert lines[-1].startswith("All 2 rows held:")


def test_a_wrong_row_fails() -> None:
    """A row with a wrong cadence, parameters or a host sync is reported as failing."""
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
    boundary's: the row fails on deferred reductions and on the parameters."""
    for row in run(distributed.verify_rows_with_late_arming, 2)[0]:
        assert not row.ok
        assert row.deferred_reductions > 0
        assert row.max_abs_diff > 1e-3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["verify", "--wide", "--json"], "argument --json: not allowed with argument --wide"),
        (
            ["verify", "--steps", "0"],
            "argument --steps: must be a positive int, got 0; pass 1 for no accumulation",
        ),
        (
            ["verify", "--steps", "14"],
            "argument --steps: 14 is more than the 13 microbatches of verify's epoch, which "
            "would give no optimizer step; pass --steps 13 or less",
        ),
        (
            ["verify", "--nproc", "0"],
            "argument --nproc: must be 2 or more, got 0: the DDP and fully_shard rows need "
            "ranks that communicate; pass --nproc 2 (the default)",
        ),
        (["verify", "--nproc", "1"], "argument --nproc: must be 2 or more, got 1"),
        (["verify", "--device", "tpu"], "argument --device: invalid choice: 'tpu' (choose from"),
        (["verify", "--device", "cuda:0"], "argument --device: invalid choice: 'cuda:0'"),
        (
            ["verify", "--device", "cuda"],
            "argument --device: 'cuda' is not available on this machine "
            "(torch.cuda.is_available() is False); pass --device cpu",
        ),
    ],
)
def test_usage_errors(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What verify cannot run as its help promises is a usage error (exit 2) that names
    the option, the value and the fix, before any row runs; never a traceback, never a
    table with rows silently left out (--nproc 1 used to drop every distributed row)."""
    from gradaccum.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # --device cuda: none here
    monkeypatch.setattr(verify, "run_single_process", None)  # a row that runs fails the test
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"error: {message}" in " ".join(captured.err.split())


def test_a_usage_error_from_the_command_line_has_no_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m gradaccum verify --steps 20``, the package run as ``__main__`` (here in
    this process; the interpreter's own start is tested by --help's test and by CI's
    setup): --steps past the epoch exits 2 with the usage and a message, and nothing
    else escapes."""
    monkeypatch.setattr(sys, "argv", ["gradaccum", "verify", "--steps", "20"])
    monkeypatch.delitem(sys.modules, "gradaccum.__main__", raising=False)  # run, not reused
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("gradaccum", run_name="__main__", alter_sys=True)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("usage: python -m gradaccum verify")
    assert "argument --steps: 20 is more than the 13 microbatches" in err
