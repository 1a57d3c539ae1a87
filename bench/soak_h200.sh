#!/usr/bin/env bash
# Soak rows on one H200, appended to a CSV (bench/results/h200_soak.csv by default):
#   bash bench/soak_h200.sh [--out CSV] [--budget SECONDS] [--jobs N] [--gpu-lock FILE] BACKEND:TP:HIDDEN:CALLS ...
# e.g. cute:4:1408:10000 triton:8:5120:100000. Up to --jobs rows (default 8) are alive at once: their
# builds (CPU-bound compiles) overlap, and their ranks run one row at a time (soak --gpu-lock); each
# process holds GPU memory from its build on (every module loaded eagerly), so more at once may run
# the GPU out of memory. Every row with CUDA-graph replays, all within one deadline (a protocol bug
# is a hang: rc 124 is a row that did not finish in the budget, whether it hung or waited its turn),
# NVLink multicast kept off. --gpu-lock names the lock the rows take turns on (default: one of their
# own), e.g. the GPU tests' (tests/gpu/test_concurrent_group.py), so that rows and tests started
# together never share the SMs.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=bench/results/h200_soak.csv
budget=560
jobs=8
lock=
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --gpu-lock) lock=$2; shift 2 ;;
    *) break ;;
  esac
done
logs=$(mktemp -d)
lock=${lock:-$logs/gpu.lock}
deadline=$(( $(date +%s) + budget ))
rows=("$@")
for row in "${rows[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 1; done
  left=$(( deadline - $(date +%s) ))
  name=${row//:/-}
  IFS=: read -r backend tp hidden calls <<< "$row"
  if [ "$left" -le 0 ]; then echo 124 > "$logs/$name.rc"; echo "not started: budget spent" > "$logs/$name.log"; continue; fi
  ( timeout "$left" python3 -m lamport_mhc soak --graphs --tp "$tp" --hidden "$hidden" --calls "$calls" \
      --backend "$backend" --gpu-lock "$lock" --out "$out" > "$logs/$name.log" 2>&1
    echo $? > "$logs/$name.rc" ) &
done
wait
status=0
for row in "${rows[@]}"; do
  name=${row//:/-}
  rc=$(cat "$logs/$name.rc" 2>/dev/null || echo "?")
  echo "=== $row: rc=$rc"
  grep -v "^  " "$logs/$name.log" | cut -c1-400 | tail -n 16
  [ "$rc" = 0 ] || status=1
done
exit $status
