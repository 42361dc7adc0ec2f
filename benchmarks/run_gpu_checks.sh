#!/usr/bin/env bash
# The GPU evidence in one short run (issue 21, item 6): the CUDA tests, then the benchmark,
# its figures written to $OUT (or ./gpu-results). Needs one CUDA GPU; on a machine without
# one, both say so and exit 0. About 5 minutes on an H100-class GPU.
#   bash benchmarks/run_gpu_checks.sh            # GPT-2 small, eager and torch.compile
#   QUICK=1 bash benchmarks/run_gpu_checks.sh    # a smaller model, a first look
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
python -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/test_cuda.txt"
tests=${PIPESTATUS[0]}
python benchmarks/gpu.py ${QUICK:+--quick} --json "$out/gpu.json" 2>&1 | tee "$out/gpu.txt"
bench=${PIPESTATUS[0]}
python benchmarks/gpu_oom.py 2>&1 | tee "$out/gpu_oom.txt"  # a real CUDA OOM, recovered (issue 44)
oom=${PIPESTATUS[0]}
echo "tests/test_cuda.py exit $tests; benchmarks/gpu.py exit $bench; benchmarks/gpu_oom.py exit $oom"
exit $((tests || bench || oom))
