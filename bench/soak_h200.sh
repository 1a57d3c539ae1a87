#!/usr/bin/env bash
# Soak rows on one H200, appended to a CSV (bench/results/h200_soak.csv by default):
#   bash bench/soak_h200.sh [--out CSV] BACKEND:TP:HIDDEN:CALLS ...
# e.g. cute:4:1408:10000 triton:8:5120:100000. Every row with CUDA-graph replays; each under a
# timeout (a protocol bug is a hang), with NVLink multicast kept off.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=bench/results/h200_soak.csv
if [ "${1:-}" = "--out" ]; then out=$2; shift 2; fi
status=0
for row in "$@"; do
  IFS=: read -r backend tp hidden calls <<< "$row"
  echo "=== $backend tp=$tp H=$hidden calls=$calls"
  timeout $(( 240 + calls / 200 )) python3 -m lamport_mhc soak --graphs --tp "$tp" --hidden "$hidden" \
    --calls "$calls" --backend "$backend" --out "$out" || status=1
done
exit $status
