"""examples/muon.py: torch.optim.Muon on the matrices and AdamW on the rest, under one
accumulator, against the hand-written loop over the same windows."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

import gradaccum

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def muon() -> ModuleType:
    spec = importlib.util.spec_from_file_location("muon_example", ROOT / "examples" / "muon.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("steps", [1, 4, 5])
def test_it_is_bit_for_bit_the_hand_written_loop(
    muon: ModuleType, steps: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both optimizers and both schedulers step once per window, after one clip of the
    total norm over the model's parameters: the hand loop's parameters exactly (Muon's
    bfloat16 orthogonalization included), at any ``steps`` (5: a remainder dropped)."""
    assert muon.main(["--gradient-accumulation-steps", str(steps)]) == 0.0
    lines = capsys.readouterr().out.splitlines()
    horizon = gradaccum.total_steps(34, steps, 2)
    assert lines[-1] == "max |param - hand-written loop| 0.0e+00"
    assert lines[-2].startswith(f"epoch 1 step {horizon // 4 * 4}/{horizon} loss ")
    assert " lr muon " in lines[-2]
    assert " adamw " in lines[-2]
