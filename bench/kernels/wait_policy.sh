#!/usr/bin/env bash
# OpenMP wait settings against decode-step latency on an idle machine (2 threads, 1K context), and 1 thread:
#   bash bench/kernels/wait_policy.sh   -> bench/results/wait_policy.jsonl
# triforce's default is GOMP_SPINCOUNT=10000 (src/triforce/kernels/threads.py); PASSIVE sleeps at once, 300000 is libgomp's.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=bench/results/wait_policy.jsonl
rm -f "$OUT"
env -u GOMP_SPINCOUNT OMP_WAIT_POLICY=PASSIVE python bench/kernels/tier_latency.py --threads 2 --out "$OUT"
env -u OMP_WAIT_POLICY GOMP_SPINCOUNT=300000 python bench/kernels/tier_latency.py --threads 2 --out "$OUT"
env -u OMP_WAIT_POLICY GOMP_SPINCOUNT=10000 python bench/kernels/tier_latency.py --threads 2 --out "$OUT"
env -u OMP_WAIT_POLICY GOMP_SPINCOUNT=10000 python bench/kernels/tier_latency.py --threads 1 --out "$OUT"
