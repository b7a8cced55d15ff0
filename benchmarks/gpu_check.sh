#!/usr/bin/env bash
# The one GPU check of this repo, for a lent GPU (the `device` tool) or any CUDA machine:
#   1. kernel tests compiled for the device (not the interpreter), few hypothesis examples;
#   2. the kernel benchmark (Triton vs eager vs torch.compile, % of measured ceilings);
#   3. fused-kernel substitution in a training step (benchmarks/fused_step_gpu.py).
# Writes logs and JSON under $OUT (default ./out). Usage: bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
AUTOPAR_TEST_DEVICE=cuda AUTOPAR_KERNEL_EXAMPLES=${KERNEL_EXAMPLES:-6} timeout "${TEST_TIMEOUT:-170}" \
  python3 -m pytest tests/kernels -q -p no:cacheprovider --maxfail=8 --tb=short \
  --ignore=tests/kernels/test_kernel_sm90_build.py --ignore=tests/kernels/test_kernel_benchmark.py 2>&1 | tee "$OUT/kernel_tests.log"
echo "kernel tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/kernel_tests.log"
timeout "${BENCH_TIMEOUT:-280}" python3 benchmarks/kernels.py --quick --budget-s "${BENCH_BUDGET:-220}" --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels_bench.log"
echo "benchmark exit: ${PIPESTATUS[0]}"
# 3. fused-kernel substitution in a real training step (kernels="auto" vs "off", one rank);
#    not yet run on a GPU: the first lent GPU should confirm it before "auto" becomes the default.
timeout "${FUSED_TIMEOUT:-150}" python3 benchmarks/fused_step_gpu.py 2>&1 | tee "$OUT/fused_step.log"
echo "fused step exit: ${PIPESTATUS[0]}"
