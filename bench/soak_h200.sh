#!/usr/bin/env bash
# Soak rows on one H200, appended to a CSV (bench/results/h200_soak.csv by default):
#   bash bench/soak_h200.sh [--out CSV] [--budget SECONDS] [--gpu-lock FILE] BACKEND:TP:HIDDEN:CALLS ...
# e.g. cute:4:1408:10000 triton:8:5120:100000. Every row starts at once: their builds (CPU-bound
# compiles) overlap, and their ranks run one row at a time (soak --gpu-lock). Every row with
# CUDA-graph replays, all under one timeout (a protocol bug is a hang: rc 124 is a row that did
# not finish in the budget, whether it hung or waited its turn), NVLink multicast kept off. --gpu-lock
# names the lock the rows take turns on (default: one of their own), e.g. the GPU tests' lock
# (tests/gpu/test_concurrent_group.py), so that rows and tests started together never share the SMs.
set -u
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=bench/results/h200_soak.csv
budget=560
lock=
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --gpu-lock) lock=$2; shift 2 ;;
    *) break ;;
  esac
done
logs=$(mktemp -d)
lock=${lock:-$logs/gpu.lock}
rows=("$@")
pids=()
for row in "${rows[@]}"; do
  IFS=: read -r backend tp hidden calls <<< "$row"
  timeout "$budget" python3 -m lamport_mhc soak --graphs --tp "$tp" --hidden "$hidden" --calls "$calls" \
    --backend "$backend" --gpu-lock "$lock" --out "$out" > "$logs/${row//:/-}.log" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!rows[@]}"; do
  wait "${pids[$i]}"; rc=$?
  echo "=== ${rows[$i]}: rc=$rc"
  grep -v "^  " "$logs/${rows[$i]//:/-}.log" | cut -c1-400 | tail -n 16
  [ $rc -eq 0 ] || status=1
done
exit $status
