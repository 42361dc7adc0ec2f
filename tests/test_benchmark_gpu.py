"""benchmarks/gpu.py on the CPU: its two loops do the same training, and the script runs
end to end, reports a row that fails and goes on, and without CUDA says so and exits 0.

The figures themselves need a GPU (benchmarks/run_gpu_checks.sh); these tests hold what
makes them mean something, on a tiny model in float32 without autocast.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmark_gpu", ROOT / "benchmarks" / "gpu.py")
    assert spec is not None
    assert spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its dataclasses look their module up
    spec.loader.exec_module(script)
    return script


gpu: Any = _script()
TINY = gpu.Shape(layers=2, width=32, heads=2, context=16, vocab=64, batch=2)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One thread: on a loaded machine the tiny model's ops wait on the others for tens of
    milliseconds each."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_the_two_loops_train_identically(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three windows of the hand loop and of the gradaccum loop on twin models end in
    the same parameters, bit for bit, with the same window losses: the benchmark times
    equal work (variable lengths, summed losses over num_items, clipping, fused AdamW)."""
    monkeypatch.setattr(gpu, "MAX_GRAD_NORM", 0.5)  # the tiny model's norms are near 1
    base = gpu.build_model(TINY)
    hand = gpu.make_twin(base, CPU, use_gradaccum=False)
    ours = gpu.make_twin(base, CPU, use_gradaccum=True)
    windows = gpu.make_windows(TINY, CPU, count=3)
    autocast = gpu.autocast_for(CPU)
    lengths = {counted for window in windows for _, _, counted in window}
    assert len(lengths) > 1  # the token counts vary
    for window in windows:
        losses = gpu.hand_window(hand, window, autocast)
        step = gpu.gradaccum_window(ours, window, autocast)
        assert step is not None
        want = torch.stack(losses).sum() / sum(counted for _, _, counted in window)
        assert torch.equal(step.loss, want)
        assert step.grad_norm is not None
        assert step.grad_norm > gpu.MAX_GRAD_NORM  # the clipping acts
    assert ours.acc.global_step == 3
    assert hand.scheduler.last_epoch == ours.scheduler.last_epoch == 3
    for (name, p), q in zip(hand.module.named_parameters(), ours.module.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert gpu.max_param_diff(hand.module, ours.module) == 0.0
    ours.acc.close()


def test_labels_past_each_length_are_ignored() -> None:
    """A microbatch's token count is the labels left in, and its padding is ignored."""
    (window,) = gpu.make_windows(TINY, CPU, count=1)
    for ids, labels, counted in window:
        assert ids.shape == labels.shape == (TINY.batch, TINY.context)
        assert counted == int((labels != -100).sum())
        assert TINY.batch * (TINY.context // 4 - 1) <= counted < TINY.batch * TINY.context


def test_runs_end_to_end_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--device cpu``: the table and the verdicts are printed and the JSON written, the
    twins equal at the end; the memory and sync columns say n/a."""
    monkeypatch.setattr(gpu, "QUICK", TINY)
    out = tmp_path / "gpu.json"
    argv = ["--device", "cpu", "--quick", "--modes", "eager", "--rounds", "2", "--warmup", "1"]
    assert gpu.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text(encoding="utf-8"))
    (row,) = report["rows"]
    assert row["error"] is None
    assert row["max_param_diff"] == 0.0
    assert row["hand_ms"] > 0
    assert row["gradaccum_ms"] > 0
    assert "peak_hand_bytes" not in row
    assert "syncs_gradaccum" not in row
    assert report["setup"]["steps"] == gpu.STEPS
    assert "eager: window time ratio" in printed
    assert "n/a" in printed


def test_a_failing_row_is_reported_and_the_next_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``torch.compile`` failing (or missing on this machine) fails its row only."""

    def unavailable(*_: object, **__: object) -> None:
        msg = "no compiler on this machine"
        raise RuntimeError(msg)

    monkeypatch.setattr(gpu, "QUICK", TINY)
    monkeypatch.setattr(torch, "compile", unavailable)
    out = tmp_path / "gpu.json"
    argv = ["--device", "cpu", "--quick", "--modes", "compile", "eager", "--rounds", "2"]
    assert gpu.main([*argv, "--warmup", "1", "--json", str(out)]) == 0
    compiled, eager = json.loads(out.read_text(encoding="utf-8"))["rows"]
    assert compiled == {"mode": "compile", "error": "RuntimeError: no compiler on this machine"}
    assert eager["error"] is None
    printed = capsys.readouterr().out
    assert "compile  failed: RuntimeError: no compiler on this machine" in printed
    assert "compile: not measured" in printed


def test_without_cuda_it_says_why_and_exits_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default device is the GPU: without one nothing is built, the reason is printed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
