"""What the exactness rule costs (issue 47, ``triforce/exact.py``): each path the verifier now takes against the one it
replaced, timed in one process, interleaved (medians of ``--reps``).

    python bench/kernels/exactness_cost.py --context 8000 --reps 9 --threads 2 --out bench/results/exactness_cost.json

* ``products``: SmolLM2's fp32 matrices (``layer``: one layer's qkv, o, gate/up and down; ``lm_head``: the
  49,152-column LM head; random weights) times 70 and 128 rows (a batch of 10 verifying 7 tokens; 8 verifying 16):
  our kernel in one call (the rule), and in calls of 64 rows (``ms_chunks_of_64``), against MKL's product (before:
  every product of more than 64 rows);
* ``width``: a 32,001-column LM head times 1 row (a decode step) and 7 rows (a block): our kernel with its tail
  columns against MKL's GEMV and GEMM (before);
* ``attention``: one layer's attention of a 17-, 32- and 64-token block over ``--context`` keys: ``csrc/attention.c``
  against SDPA with the block's mask (before: blocks over 16 tokens);
* ``coded_block`` and ``coded_batch``: the embedded SmolLM2 on its GGUF block codes, a forward of a 17-token block and
  a ragged forward of 10 sequences' 7-token blocks over ``--context`` tokens of random KV: one ``csrc/decode_step.c``
  call (two for the batch: 64 + 6 rows) against the layers in Python with SDPA and the dequantized tiles' product
  (before), logits compared;
* ``kernels_off``: with the kernels off, a 7-row product per row (the rule: the call a decode step makes) against one
  product of 7 rows, over SmolLM2's matrices; and the attention of a 7-token block, one SDPA call per row against one
  call with the mask;
* ``avx2_one_row``: where the AVX2 build loads, a decode step's products on it (the rule: the kernel the blocks run on)
  against MKL's GEMV (before, on AVX2 CPUs), over SmolLM2's matrices (on an AVX-512 machine this times the AVX2 build
  on a CPU it was not chosen for).

Each entry: ``ms_rule``, ``ms_before`` and ``ratio`` (rule / before).
"""

from __future__ import annotations

import argparse
import os
import sys

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import _interleaved, add_run_options, emit_json, positive_int  # noqa: E402

#: SmolLM2-135M's fp32 matrices, (in, out): qkv, o, gate/up, down, LM head
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]


def _entry(fns: dict, reps: int) -> dict:
    t = _interleaved(fns, reps)
    return {"ms_rule": round(t["rule"] * 1e3, 3), "ms_before": round(t["before"] * 1e3, 3),
            "ratio": round(t["rule"] / t["before"], 3)}


def _products(rows: int, weights: list, reps: int) -> dict:
    from triforce.kernels.cpu import F32_MAX_ROWS, f32_linear
    from triforce.kernels.linear import _chunks

    out = {}
    for name, ws in (("layer", weights[:4]), ("lm_head", weights[4:])):
        x = [torch.randn(rows, w.shape[0]) for w in ws]
        t = _interleaved({"rule": lambda: [_chunks(f32_linear, a, w, F32_MAX_ROWS) for a, w in zip(x, ws)],
                          "chunks": lambda: [_chunks(f32_linear, a, w) for a, w in zip(x, ws)],
                          "before": lambda: [a @ w for a, w in zip(x, ws)]}, reps)
        out[name] = {"ms_rule": round(t["rule"] * 1e3, 3), "ms_chunks_of_64": round(t["chunks"] * 1e3, 3),
                     "ms_before": round(t["before"] * 1e3, 3), "ratio": round(t["rule"] / t["before"], 3)}
    return out


def _coded(context: int, reps: int) -> dict:
    from triforce.formats.loading import load_model
    from triforce.kv.caches import FullKVCache
    from triforce.lab.synthetic import fill_random_kv

    model = load_model(None).model
    model.set_request_length(context + 32)
    gen = torch.Generator().manual_seed(0)
    full = FullKVCache(model.cfg, context + 32)
    fill_random_kv(full, context, 0)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 17), generator=gen)
    pos = torch.arange(context, context + 17)
    batch = []
    for i in range(10):
        cache = FullKVCache(model.cfg, 512 + 8)
        fill_random_kv(cache, 512, i + 1)
        batch.append((torch.randint(0, model.cfg.vocab_size, (1, 7), generator=gen), torch.arange(512, 519), cache, 7))
    step = model.decode_step

    def before(fn):  # the layers in Python, SDPA past 16 tokens, the rule off: the paths before issue 47
        import triforce.kernels.rows as exact

        model.decode_step, exact.ROW_INVARIANT = None, False
        for c in [full] + [b[2] for b in batch]:
            c.kernel_max_block = 16
        try:
            return fn()
        finally:
            model.decode_step, exact.ROW_INVARIANT = step, True
            for c in [full] + [b[2] for b in batch]:
                c.kernel_max_block = 64

    def block():
        try:
            return model(ids, pos, full)
        finally:
            full.rollback(context)

    def ragged():
        try:
            return model.forward_ragged(batch)
        finally:
            for b in batch:
                b[2].rollback(512)

    diff_block = (block() - before(block)).abs().max().item()
    diff_batch = max((a - b).abs().max().item() for a, b in zip(ragged(), before(ragged)))
    return {"coded_block": {**_entry({"rule": block, "before": lambda: before(block)}, reps),
                            "logits_max_diff": diff_block},
            "coded_batch": {**_entry({"rule": ragged, "before": lambda: before(ragged)}, reps),
                            "logits_max_diff": diff_batch}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=positive_int, default=8000)
    add_run_options(p, None, reps=9, sampling=False)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from triforce.kernels import cpu as kernels
    from triforce.kernels.linear import _rowwise
    from triforce.kernels.rows import rowwise_attention
    from triforce.kernels.sdpa import gqa_attention
    from triforce.kv.caches import _causal_offset_mask

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(i, o, generator=gen) * 0.05 for i, o in SHAPES]
    out = {"command": " ".join(["python", *sys.argv]), "context": args.context, "threads": args.threads,
           "reps": args.reps, "linear_kernel": kernels.linear_status(), "attention_kernel": kernels.status()}
    out["products"] = {rows: _products(rows, weights, args.reps) for rows in (70, 128)}
    head = torch.randn(576, 32001, generator=gen) * 0.05
    out["width"] = {}
    for rows in (1, 7):
        x = torch.randn(rows, 576, generator=gen)
        out["width"][rows] = _entry({"rule": lambda: kernels.f32_linear(x, head), "before": lambda: x @ head},
                                    args.reps)
    nh, nkv, hs, n = 9, 3, 64, args.context
    k, v = torch.randn(1, nkv, n + 64, hs, generator=gen), torch.randn(1, nkv, n + 64, hs, generator=gen)
    out["attention"] = {}
    for t in (17, 32, 64):
        q = torch.randn(1, nh, t, hs, generator=gen)
        mask = _causal_offset_mask(n - t, t, n, "cpu")
        out["attention"][t] = _entry({"rule": lambda: kernels.gqa_attention_kernel(q, k, v, n),
                                      "before": lambda: gqa_attention(q, k[:, :, :n], v[:, :, :n], mask)}, args.reps)
    x7 = [torch.randn(7, w.shape[0], generator=gen) for w in weights]
    q7 = torch.randn(1, nh, 7, hs, generator=gen)
    mask7 = _causal_offset_mask(n - 7, 7, n, "cpu")
    out["kernels_off"] = {
        "products_7_rows": _entry({"rule": lambda: [_rowwise(torch.matmul, a, w) for a, w in zip(x7, weights)],
                                   "before": lambda: [a @ w for a, w in zip(x7, weights)]}, args.reps),
        "attention_7_rows": _entry({"rule": lambda: rowwise_attention(q7, k, v, n),
                                    "before": lambda: gqa_attention(q7, k[:, :, :n], v[:, :, :n], mask7)}, args.reps)}
    avx2 = kernels.linear_build("AVX2")
    if avx2.load() is not None:
        fn = avx2.fns["triforce_f32_linear"]
        x1 = [torch.randn(1, w.shape[0], generator=gen) for w in weights]
        y1 = [torch.empty(1, w.shape[1]) for w in weights]

        def on_avx2():
            for a, w, y in zip(x1, weights, y1):
                fn(a.data_ptr(), w.data_ptr(), y.data_ptr(), 1, w.shape[0], w.shape[1], args.threads)

        out["avx2_one_row"] = _entry({"rule": on_avx2, "before": lambda: [a @ w for a, w in zip(x1, weights)]},
                                     args.reps)
    out.update(_coded(args.context, args.reps))
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
