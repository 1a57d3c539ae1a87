#!/usr/bin/env bash
# One GPU, tp = 1: the whole benchmark for one or more hidden sizes, each a run of its own, merged
# into bench/results/<gpu>_tp1.* (h200_tp1 on an H200; the stem is the one bench gives the GPU).
#
#   bash bench/gpu_tp1.sh HIDDEN... [-- more bench options]      e.g. bash bench/gpu_tp1.sh 4096 5120
#
# Every fused path (auto, triton-local, cute-local), the strong tail, unfused-best and the other
# unfused paths, plain / finalize / quant, M = 1..8192 (powers of two and 3, 100, 1000), 50 calls per
# graph, median of 9 replays, a row's paths replayed in turns. The hidden sizes share one deadline,
# $DEADLINE_S seconds (default 575, inside a device call of 600): a run starts no new M 70 s before it
# (what was measured is written; the note names the Ms left), is killed 10 s before it, and a hidden
# size with under 150 s left is not started. One H200 took about 260 s at H 7168 and 120-130 s at
# 4096 and 5120: two device calls, 7168, then 4096 5120. Where the CuTe DSL kit is present
# (.devkit/b, see ../shared/device/README.md) it is activated first, else cute-local is reported as
# failing to build. Results go to bench/results; with $OUT set (the GPU machine), they are also
# packed into $OUT/<gpu>_tp1.tar.gz after each hidden size (the logs beside it): unpack into
# bench/results.
set -euo pipefail
cd "$(dirname "$0")/.."
hiddens=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do hiddens+=("$1"); shift; done
[ $# -gt 0 ] && shift
if [ ${#hiddens[@]} -eq 0 ]; then
  echo "usage: bash bench/gpu_tp1.sh HIDDEN... [-- bench options]" >&2
  exit 2
fi
deadline=${DEADLINE_S:-575}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ -f .devkit/b/activate.sh ]; then
  # shellcheck disable=SC1091
  source .devkit/b/activate.sh || echo "devkit not activated: cute-local will be reported as failing to build"
fi
# bench names its results after the GPU (report.gpu_slug): merge into and pack that table only
stem=$(python -c "import torch; from lamport_mhc.bench.report import gpu_slug; print(gpu_slug(torch.cuda.get_device_name(0)))")_tp1
status=0
for hidden in "${hiddens[@]}"; do
  left=$((deadline - SECONDS))
  if [ "$left" -lt 150 ]; then
    echo "H=$hidden not started: ${left}s left of the ${deadline}s deadline" >&2
    status=1
    break
  fi
  merge=()
  if [ -f "bench/results/$stem.csv" ]; then merge=(--merge "bench/results/$stem.csv"); fi
  log=${OUT:-bench/results}/${stem}_h${hidden}.log
  mkdir -p "$(dirname "$log")"
  timeout $((left - 10)) torchrun --nproc-per-node 1 -m lamport_mhc bench --hidden "$hidden" --out bench/results \
    --replays 9 --time-budget $((left - 70)) ${merge[@]+"${merge[@]}"} "$@" 2>&1 | tee "$log" || status=$?
  results=$(cd bench/results && ls "$stem"* 2>/dev/null || true)
  if [ -n "${OUT:-}" ] && [ -n "$results" ]; then
    # shellcheck disable=SC2086
    tar czf "$OUT/$stem.tar.gz" -C bench/results $results
  fi
done
exit "$status"
