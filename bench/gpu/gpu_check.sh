#!/usr/bin/env bash
# GPU checks (issue: scale out) from a plain checkout, tiny and synthetic models only, under 6 minutes on one GPU:
# logits parity GPU vs CPU, greedy equality of every mode on the GPU, the exact-distribution check on the GPU, per-tier
# step latency of a synthetic Llama-2-7B at 32K / 64K / 120K tokens in bf16 with and without KV offloading, CUDA graphs. JSON to $OUT (or bench/results).
#   bash bench/gpu/gpu_check.sh                      # on a machine with a GPU
#   bash bench/gpu/gpu_check.sh --device cpu --smoke # the same code paths on a CPU, tiny sizes
# It imports the package from src/: the dependencies must be there (on the H200 image greenlet was missing).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=src
exec timeout 330 python3 bench/gpu/gpu_check.py "$@"
