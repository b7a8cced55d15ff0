#!/usr/bin/env bash
# The one GPU check of this repo, for a lent GPU (the `device` tool) or any CUDA machine:
#   tests: 1. kernel tests compiled for the device (not the interpreter), few hypothesis examples;
#          2. the attention tests twice, with host-side and with device-side TMA descriptors
#             (AUTOPAR_ATTENTION_DESC, see autopar/kernels/attention.py); the later steps use the mode
#             that passed (host when both did); then ring attention's blocks on CUDA's flash op,
#             and one-GPU training (meta model vs eager; offload of every class vs none);
#   bench: 3. the kernel benchmark (Triton vs eager vs torch.compile, % of measured ceilings, the
#             config the autotuner picked per kernel);
#          4. fused-kernel substitution in a training step, GPT and LLaMA (fused_step_gpu.py);
#          5. `autopar calibrate` on the GPU (CUDA GEMM/attention/copy efficiencies, the NCCL path with
#             one rank per visible GPU) -> $OUT/cluster.toml;
#          6. `autopar profile` of a GPT with 2048-wide layers on one GPU, predicted with that file
#             (benchmarks/results/calibrate_h200.toml when step 5 did not run); then in bf16 at the
#             layer shapes of Megatron's 1.7B H100 row (seq 4096, vocab 131072);
#          7. offload's copies (activations; ZeRO-3's host parameter rows) on the side stream vs the
#             compute stream, and the host step (in host memory, and with the NVMe tier's files)
#             at once vs beside the next forward (offload_overlap.py).
#   runtime: the one-GPU training tests and steps 6-7 alone (what a runtime change needs confirmed).
# Usage: bash benchmarks/gpu_check.sh [all|tests|bench|runtime]   (default all; the device tool allows
# 10 minutes a command: run "tests" and "bench" as two calls there). Logs and JSON go under $OUT
# (default ./out); "bench" reads the descriptor mode "tests" chose from $OUT/attention_desc.txt.
# DRY_RUN=1 rehearses the plumbing on a CPU (tests collected, not run; the scripts' --dry-run):
# tests/kernels/test_kernel_benchmark.py runs it, so the lent GPU's minutes go to the check.
# BENCH_ARGS and FUSED_ARGS (default empty) append options to step 3's and step 4's command lines
# (e.g. BENCH_ARGS="--only adamw" FUSED_ARGS="--batch 1": the rehearsal's shorter dry runs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-out}; mkdir -p "$OUT"
STAGE=${1:-all}
case "$STAGE" in all|tests|bench|runtime) ;; *) echo "usage: $0 [all|tests|bench|runtime]" >&2; exit 2 ;; esac
EXAMPLES=${KERNEL_EXAMPLES:-6}
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  DEVICE=cpu; PYTEST_DRY=(--collect-only); SCRIPT_DRY=(--dry-run)
  export TRITON_INTERPRET=1
  nvidia-smi() { echo "dry run: no nvidia-smi"; }
else
  DEVICE=cuda; PYTEST_DRY=(); SCRIPT_DRY=()
fi

runtime_tests() {
  # one-GPU training: a meta model against eager, offload (pinned copies, host step) against none, the
  # side stream's copies against the compute stream's
  timeout "${RUNTIME_TIMEOUT:-120}" python3 -m pytest tests/runtime/test_gpu.py -q -m gpu \
    -p no:cacheprovider --tb=short "${PYTEST_DRY[@]}" 2>&1 | tee "$OUT/runtime_gpu.log"
  echo "one-GPU runtime tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/runtime_gpu.log"
}

measured_vs_predicted() {
  # 6. measured vs predicted on the GPU: a GPT of realistic layer shapes, one rank
  local cluster="$OUT/cluster.toml"
  [[ -s "$cluster" ]] || cluster=benchmarks/results/calibrate_h200.toml
  if [[ "${DRY_RUN:-0}" == 1 ]]; then PROFILE=(--help); else
    PROFILE=("${PROFILE_MODEL:-gpt:hidden=2048,layers=8,heads=16,vocab=50304}" --seq-len 1024 --batch 8 --nproc 1
             --steps 3 --cluster "$cluster" --json "$OUT/profile.json"); fi
  timeout "${PROFILE_TIMEOUT:-90}" python3 -m autopar.cli profile "${PROFILE[@]}" 2>&1 | tee "$OUT/profile.log"
  echo "profile exit: ${PIPESTATUS[0]}"
  # 6b. the same in bf16 at the layer shapes of Megatron's smallest H100 row (1.7B: hidden 2048, 16
  # heads, seq 4096, vocab 131072; 4 of its 24 layers): per operator class, whether the compute model
  # is what predicts those rows fast (benchmarks/megatron_fidelity.py --mbs free)
  if [[ "${DRY_RUN:-0}" == 1 ]]; then PROFILE=(--help); else
    PROFILE=(gpt:hidden=2048,layers=4,heads=16,vocab=131072,seq=4096 --batch 2 --nproc 1 --steps 3 --dtype bf16
             --cluster "$cluster" --json "$OUT/profile_bf16_megatron_shapes.json"); fi
  timeout "${PROFILE_BF16_TIMEOUT:-60}" python3 -m autopar.cli profile "${PROFILE[@]}" 2>&1 | tee "$OUT/profile_bf16.log"
  echo "profile bf16 exit: ${PIPESTATUS[0]}"
  # 7. activation offload: side stream vs compute stream vs none, measured and predicted
  timeout "${OFFLOAD_TIMEOUT:-240}" python3 benchmarks/offload_overlap.py --cluster "$cluster" "${SCRIPT_DRY[@]}" \
    --groups activations,params,step ${OFFLOAD_ARGS:-} 2>&1 | tee "$OUT/offload_overlap.log"
  echo "offload overlap exit: ${PIPESTATUS[0]}"
  # the NVMe tier's step at once vs beside the next forward, on a model whose state the local disk
  # streams in seconds (222M parameters: 2.7 GB of fp32 master + moments, read and written a step)
  local nvme_spec=()
  [[ "${DRY_RUN:-0}" == 1 ]] || nvme_spec=(--spec gpt:hidden=2048,layers=4,heads=16,vocab=8192,seq=2048)
  timeout "${NVME_TIMEOUT:-150}" python3 benchmarks/offload_overlap.py --cluster "$cluster" "${SCRIPT_DRY[@]}" \
    --groups nvme "${nvme_spec[@]}" --nvme-dir "${NVME_DIR:-/tmp}" 2>&1 | tee "$OUT/offload_nvme.log"
  echo "offload nvme exit: ${PIPESTATUS[0]}"
}

if [[ "$STAGE" == runtime ]]; then
  runtime_tests
  measured_vs_predicted
  exit 0
fi

if [[ "$STAGE" != bench ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/device.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
  AUTOPAR_TEST_DEVICE=$DEVICE AUTOPAR_KERNEL_EXAMPLES=$EXAMPLES timeout "${TEST_TIMEOUT:-200}" \
    python3 -m pytest tests/kernels -q -p no:cacheprovider --maxfail=8 --tb=short "${PYTEST_DRY[@]}" \
    --ignore=tests/kernels/test_kernel_sm90_build.py --ignore=tests/kernels/test_kernel_benchmark.py \
    --ignore=tests/kernels/test_kernel_attention.py 2>&1 | tee "$OUT/kernel_tests.log"
  echo "kernel tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/kernel_tests.log"
  declare -A attn_rc
  for mode in host device; do
    AUTOPAR_ATTENTION_DESC=$mode AUTOPAR_TEST_DEVICE=$DEVICE AUTOPAR_KERNEL_EXAMPLES=$EXAMPLES \
      timeout "${ATTN_TIMEOUT:-150}" python3 -m pytest tests/kernels/test_kernel_attention.py -q \
      -p no:cacheprovider --maxfail=8 --tb=short "${PYTEST_DRY[@]}" 2>&1 | tee "$OUT/attention_$mode.log"
    attn_rc[$mode]=${PIPESTATUS[0]}
    echo "attention tests ($mode descriptors) exit: ${attn_rc[$mode]}" | tee -a "$OUT/attention_$mode.log"
  done
  if [[ ${attn_rc[host]} -ne 0 && ${attn_rc[device]} -eq 0 ]]; then echo device; else echo host; fi > "$OUT/attention_desc.txt"
  # ring attention's blocks on the CUDA flash op with global statistics (one process)
  timeout "${CP_TIMEOUT:-60}" python3 -m pytest tests/runtime/test_context_attention.py -q -m gpu \
    -p no:cacheprovider --tb=short "${PYTEST_DRY[@]}" 2>&1 | tee "$OUT/context_attention.log"
  echo "context-parallel attention tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/context_attention.log"
  runtime_tests
fi

if [[ "$STAGE" != tests ]]; then
  export AUTOPAR_ATTENTION_DESC=$(cat "$OUT/attention_desc.txt" 2>/dev/null || echo host)
  echo "attention descriptors: $AUTOPAR_ATTENTION_DESC"
  timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/kernel_speed.py --quick --budget-s "${BENCH_BUDGET:-240}" \
    --json "$OUT/kernels.json" "${SCRIPT_DRY[@]}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/kernels_bench.log"
  echo "benchmark exit: ${PIPESTATUS[0]}"
  # not yet run on a GPU: the first lent GPU confirms it before kernels="auto" becomes the default
  timeout "${FUSED_TIMEOUT:-200}" python3 benchmarks/fused_step_gpu.py "${SCRIPT_DRY[@]}" ${FUSED_ARGS:-} 2>&1 | tee "$OUT/fused_step.log"
  echo "fused step exit: ${PIPESTATUS[0]}"
  if [[ "${DRY_RUN:-0}" == 1 ]]; then CALIBRATE=(--help); else CALIBRATE=(--budget-s "${CAL_BUDGET:-90}" --out "$OUT/cluster.toml"); fi
  timeout "${CAL_TIMEOUT:-150}" python3 -m autopar.cli calibrate "${CALIBRATE[@]}" 2>&1 | tee "$OUT/calibrate.log"
  echo "calibrate exit: ${PIPESTATUS[0]}"
  measured_vs_predicted
fi
