"""examples/tiny_lm.py: the variable-length example behind docs/variable-length.md."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
GAP = re.compile(r"\(a\) vs \(([bc])\) .*max loss gap (\S+), max param gap (\S+)")


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tiny_lm", ROOT / "examples" / "tiny_lm.py")
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_tiny_lm_matches_the_big_batch_with_num_items(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A short run writes a PNG and prints gaps from the big batch: float64 rounding for
    num_items, and a real difference for the mean of the microbatch means."""
    out = tmp_path / "curves.png"
    _example().main(["--epochs", "2", "--microbatches", "8", "--out", str(out)])
    printed = capsys.readouterr().out
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    gaps = {mode: (float(loss), float(param)) for mode, loss, param in GAP.findall(printed)}
    assert set(gaps) == {"b", "c"}, printed
    assert max(gaps["b"]) < 1e-10, printed
    assert min(gaps["c"]) > 1e-3, printed
    assert "4 optimizer steps of 16 sequences (4 microbatches of 4)" in printed


def test_tiny_lm_restores_the_thread_count(tmp_path: Path) -> None:
    """The example trains on one thread and gives the caller's thread count back."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _example().main(["--epochs", "1", "--microbatches", "4", "--out", str(tmp_path / "x.png")])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
