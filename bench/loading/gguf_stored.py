"""A GGUF file read as stored (formats/ggufcodes.py): load, parity with transformers, one-row products, prefill
GEMM.

    python bench/loading/gguf_stored.py --model ~/.cache/triforce/qwen2.5-coder/qwen-coder-1.5b.gguf --threads 2 \
        --out bench/results/gguf/stored_qwen15b.json

Reports, in one process:
- ``load``: seconds and peak RSS (MiB) of ``load_model`` on the file, and the weight bytes the model holds;
- ``parity``: our logits (prefill, a 7-token block, a decode step over 13 tokens of code) against transformers' model of
  the same file (which dequantizes it with gguf-py): max |diff| and whether every position's argmax agrees;
- ``one_row``: for one matrix of each kind (LM head, layer 0's and 1's MLP down, gate/up, qkv) the median seconds of a
  one-row ``blockcode_linear`` (``--reps``), its GB/s of codes and G weights/s;
- ``gemm``: PyTorch's fp32 GEMM rate (GFLOP/s) for M = 1,024 rows by the model's hidden size, over column tiles of the
  widths prefill multiplies (``blockcode_matmul``), to bound an exact prefill.
JSON on stdout (and to ``--out``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import add_run_options, emit_json, timed_load  # noqa: E402


def _median_seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a .gguf file")
    add_run_options(p, out=None, reps=21, sampling=False)
    args = p.parse_args()
    path = Path(args.model).expanduser()
    if not path.is_file() or path.suffix != ".gguf":
        p.error(f"--model must be a .gguf file, got {args.model!r}")
    torch.set_num_threads(args.threads)

    from triforce.kernels.blockcodes import blockcode_linear
    from triforce.kv.caches import FullKVCache

    lm, load = timed_load(path)
    model = lm.model

    one_row = {}
    layers = model.layers
    for name, lin in (("lm_head", model.lm_head), ("layer0.down", layers[0].mlp.down_proj),
                      ("layer1.down", layers[1].mlp.down_proj), ("layer0.gate_up", layers[0].mlp.gate_up_proj),
                      ("layer0.qkv", layers[0].self_attn.qkv_proj)):
        codes = lin.codes
        if codes is None:
            continue
        x = torch.randn(1, codes.in_features)
        s = _median_seconds(lambda: blockcode_linear(x, codes), args.reps)
        one_row[name] = {"kernel_bits": codes.kernel_bits, "mib": codes.nbytes / 2**20, "ms": s * 1e3,
                         "gb_per_s": codes.nbytes / s / 1e9,
                         "g_weights_per_s": codes.in_features * codes.out_features / s / 1e9}

    hidden = model.cfg.hidden_size
    x = torch.randn(1024, hidden)
    gemm = {}
    for width in (512, 1024, 2048, 4096, 8960):
        w = torch.randn(hidden, width)
        s = _median_seconds(lambda: x @ w, 3)
        gemm[str(width)] = 2 * 1024 * hidden * width / s / 1e9

    ids = lm.tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                       return_tensors="pt").input_ids
    n = ids.shape[1]
    cache = FullKVCache(model.cfg, n + 8)
    with torch.no_grad():
        ours = torch.cat([model(ids[:, :n - 8], torch.arange(n - 8), cache),
                          model(ids[:, n - 8:n - 1], torch.arange(n - 8, n - 1), cache),
                          model(ids[:, n - 1:], torch.tensor([n - 1]), cache)], 1)
    del model, lm
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(ids).logits
    parity = {"tokens": n, "max_abs_diff": (ours - ref).abs().max().item(),
              "argmax_equal": bool((ours.argmax(-1) == ref.argmax(-1)).all())}
    emit_json({"benchmark": "gguf_stored", "model": str(path), "threads": args.threads, "reps": args.reps,
               "load": load, "one_row": one_row, "gemm_gflops_m1024": gemm, "parity": parity}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
