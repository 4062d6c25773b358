#!/usr/bin/env bash
# Issue 11's targets, measured with `triforce bench` (interleaved repetitions, medians, one worker per method, 2
# threads). Run alone on an idle machine: every timing on this 2-core CPU is distorted by any other CPU-heavy job.
#   bash bench/e2e/speed_default.sh             # SmolLM2 on 3 books (~20 min), then the Qwen pair if present (~25 min)
#   BOOKS="pg1342" QWEN=0 bash bench/e2e/speed_default.sh
#   T06_METHODS=autoregressive,auto,llama.cpp SHORT_METHODS=autoregressive,auto bash bench/e2e/speed_default.sh  # fewer
#   BENCH_ARGS="--packed-weights off" ...     # more `triforce bench` options for every run
# Writes bench/results/speed_default/*.json; `python bench/e2e/speed_default_table.py` turns them into the table and PNG
# of docs/history.md. llama.cpp rows need `pip install -e ".[llamacpp]"` (compiles for minutes).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/speed_default}
BOOKS=${BOOKS:-"pg1342 pg84 pg2701"}
QWEN=${QWEN:-1}
T06_METHODS=${T06_METHODS:-hf-ar,autoregressive,auto,retrieval-int8,self,llama.cpp}
SHORT_METHODS=${SHORT_METHODS:-autoregressive,auto,self,retrieval-int8}
read -r -a EXTRA <<< "${BENCH_ARGS:-}"
QWEN_DIR=${QWEN_DIR:-${TRIFORCE_CACHE:-$HOME/.cache/triforce}/qwen2.5-coder}
mkdir -p "$OUT"
# the product's own OpenMP setting (GOMP_SPINCOUNT=10000, set by `import triforce`), as users get it
bench() { triforce bench --threads 2 --reps 3 --no-progress ${EXTRA[@]+"${EXTRA[@]}"} "$@"; }
for book in $BOOKS; do
  bench --book "$book.txt" --prompt-tokens 8000 --new-tokens 128 --temperature 0.6 \
        --methods "$T06_METHODS" --json "$OUT/${book}_8000_t06.json"
  bench --book "$book.txt" --prompt-tokens 8000 --new-tokens 128 --temperature 0 \
        --methods autoregressive,auto --json "$OUT/${book}_8000_greedy.json"
  for n in 1000 4000; do
    bench --book "$book.txt" --prompt-tokens "$n" --new-tokens 128 --temperature 0.6 \
          --methods "$SHORT_METHODS" --json "$OUT/${book}_${n}_t06.json"
  done
done
if [ "$QWEN" = 1 ] && [ -f "$QWEN_DIR/qwen-coder-1.5b.gguf" ]; then
  # the real target/draft pair: auto with --draft against autoregressive (two 1.5B workers fit in 24 GiB; four do not)
  bench --model "$QWEN_DIR/qwen-coder-1.5b.gguf" --draft "$QWEN_DIR/qwen-coder-0.5b.gguf" --book pg1342.txt \
        --prompt-tokens 3000 --new-tokens 64 --temperature 0.6 --reps 2 \
        --methods autoregressive,auto --json "$OUT/qwen_3000_t06.json"
  # the best lossless hierarchy beside it: the target's own int8 copy (4,096 slots hold the whole prompt)
  bench --model "$QWEN_DIR/qwen-coder-1.5b.gguf" --book pg1342.txt --prompt-tokens 3000 --new-tokens 64 \
        --temperature 0.6 --reps 2 --methods autoregressive,retrieval-int8 --json "$OUT/qwen_3000_t06_retrieval_int8.json"
  # auto without --draft beside the bench's retrieval-int8 in one run: the same tier, auto's own settings (fp32
  # retrieval cache, the governor's probe steps) against bf16 and no governor
  bench --model "$QWEN_DIR/qwen-coder-1.5b.gguf" --book pg1342.txt --prompt-tokens 3000 --new-tokens 64 \
        --temperature 0.6 --reps 2 --methods auto,retrieval-int8 --json "$OUT/qwen_3000_t06_auto_vs_retrieval_int8.json"
fi
