"""`gradaccum.memory`: what counts as running out of memory, the gradients kept before a
window, and a real allocation failure (RLIMIT_AS) recovered by microbatch="auto"."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import gradaccum
from gradaccum.memory import Kept, out_of_memory
from tests import out_of_memory as out_of_memory_script
from tests.distributed import run

ROOT = Path(__file__).resolve().parent.parent


def test_what_counts_as_out_of_memory() -> None:
    """torch.OutOfMemoryError and the CPU allocator's RuntimeError count; another
    RuntimeError, a MemoryError of Python's own or a KeyError does not."""
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    cpu = "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory"
    assert out_of_memory(RuntimeError(cpu))
    assert not out_of_memory(RuntimeError("size mismatch"))
    assert not out_of_memory(KeyError("can't allocate memory"))


def test_kept_gradients_come_back_as_they_were_each_time() -> None:
    """None stays None; an existing gradient is put back with its values, also after a
    re-run added to it in place, and as often as asked."""
    a, b = torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)
    b.grad = torch.ones(2)
    kept = Kept([a, b])
    for _ in range(2):
        a.grad = torch.full((3,), 5.0)
        b.grad.add_(7.0)
        kept.restore()
        assert a.grad is None
        assert torch.equal(b.grad, torch.ones(2))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc: Linux")
def test_a_real_allocation_failure_re_runs_the_window_at_half() -> None:
    """Under an address-space limit that 2048 rows' activations do not fit in and 1024
    rows' do, the first window tries 2048 rows, the CPU allocator fails, and it is re-run
    smaller (1024, as a rule: the heap's own overhead may take it lower): bit for bit the
    run with the microbatch found from the start, within 1e-12 of the float64 big batch."""
    found = run(out_of_memory_script.on_a_rank, 1, 3)[0]  # a process of its own
    assert found["tried"][:2] == [2048, 1024]
    assert found["microbatch"] == found["step_microbatch"] <= 1024
    assert found["equal_to_fixed"]
    assert found["off_reference"] < 1e-12


def test_the_gpu_script_imports_and_says_without_cuda_that_it_checks_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """benchmarks/gpu_oom.py (run by benchmarks/run_gpu_checks.sh on a GPU) imports on the
    CPU, parses its arguments and exits 0 saying it checked nothing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_oom", ROOT / "benchmarks" / "gpu_oom.py")
    assert spec is not None
    assert spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: benchmarks/run_gpu_checks.sh runs the script")
    assert script.main(["--rows", "64", "--width", "32"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_auto_is_refused_on_several_ranks_where_torch_has_no_reducer_reset(
    process_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A discarded window under DDP resets its reducer through torch's private
    ``Reducer._reset_state``; a torch without it gets ``microbatch="auto"`` refused up
    front on several ranks (naming the reset and the fix), not a window run wrong. With
    it, the same DDP model is accepted."""
    from torch._C._distributed_c10d import Reducer
    from torch.nn.parallel import DistributedDataParallel

    from gradaccum import checks, sync

    model = DistributedDataParallel(torch.nn.Linear(4, 1), broadcast_buffers=False)
    strategy = sync.strategy_for(model)
    checks.refuse_auto(strategy, 2, "auto")  # this torch has it: accepted
    monkeypatch.delattr(Reducer, "_reset_state")
    with pytest.raises(gradaccum.ConfigError, match=r"no reducer reset \(Reducer._reset_state\)"):
        checks.refuse_auto(strategy, 2, "auto")
