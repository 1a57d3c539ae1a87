#!/usr/bin/env bash
# One H200, tp = 1: the whole benchmark for one hidden size, merged into bench/results/h200_tp1.*.
#
#   bash bench/gpu_tp1.sh HIDDEN [more bench options]      e.g. bash bench/gpu_tp1.sh 5120
#
# Every fused path (auto, triton-local, cute-local), the strong tail, unfused-best and the other
# unfused paths, plain / finalize / quant, M = 1..8192 (powers of two and 3, 100, 1000), 50 calls per
# graph, median of 5 replays (the minimum bench accepts). It starts no new M after 450 s (what was
# measured is written; the note names the Ms left) and `timeout 540` is the hard stop.
# Where the CuTe DSL kit is present (.devkit/b, see ../shared/device/README.md) it is activated first,
# else cute-local is reported as failing to build. Results go to bench/results; with $OUT set (the GPU
# machine), they are also packed into $OUT/h200_tp1.tar.gz with the log: unpack into bench/results
# and run the next hidden size, which merges into them.
set -euo pipefail
cd "$(dirname "$0")/.."
hidden=${1:?usage: bash bench/gpu_tp1.sh HIDDEN [bench options]}
shift
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ -f .devkit/b/activate.sh ]; then
  # shellcheck disable=SC1091
  source .devkit/b/activate.sh || echo "devkit not activated: cute-local will be reported as failing to build"
fi
merge=()
if [ -f bench/results/h200_tp1.csv ]; then merge=(--merge bench/results/h200_tp1.csv); fi
log=${OUT:-bench/results}/h200_tp1_h${hidden}.log
mkdir -p "$(dirname "$log")"
status=0
timeout 540 torchrun --nproc-per-node 1 -m lamport_mhc bench --hidden "$hidden" --out bench/results --time-budget 450 \
  ${merge[@]+"${merge[@]}"} "$@" 2>&1 | tee "$log" || status=$?
results=$(cd bench/results && ls h200_tp1* 2>/dev/null || true)
if [ -n "${OUT:-}" ] && [ -n "$results" ]; then
  # shellcheck disable=SC2086
  tar czf "$OUT/h200_tp1.tar.gz" -C bench/results $results
fi
exit "$status"
