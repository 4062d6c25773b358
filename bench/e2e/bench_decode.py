"""Autoregressive decode speed: triforce against transformers `generate` (dynamic and static cache).

For each prompt length (first N tokens of a book), greedy, same dtype and threads, it measures the mean time
between tokens of decode (prefill excluded) for:

* ``triforce``            our autoregressive loop (static full KV cache);
* ``hf_dynamic``          transformers ``generate`` with its default dynamic cache;
* ``hf_static``           transformers ``generate(cache_implementation="static")``;

checks that all three produced the same greedy tokens, and prints the bandwidth floor: bytes moved per token
(weights + KV cache at that context) over this machine's measured read bandwidth.

    python bench/e2e/bench_decode.py --lengths 1024 4096 8000 --new-tokens 32 --threads 2 \
        --out bench/results/decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

BOOKS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "books")


def best_seconds(fn, reps: int) -> float:
    """Fastest of ``reps`` timed calls of ``fn`` after one warm-up call, in seconds."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def read_bandwidth_gbs(size_mb: int = 1024, reps: int = 7) -> dict[str, float]:
    """Best-of-``reps`` read bandwidth (GB/s) with the current threads, two ways, over ``size_mb`` MB of fp32:

    ``sum``: summing a vector (a pure streaming read); ``gemv``: a matrix-vector product (what a decode step's
    linear layers do). The floor uses ``gemv``: the rate at which this machine's kernels can read weights.
    """
    out = {}
    x = torch.ones(size_mb * 1024 * 1024 // 4)
    w = x.view(-1, 4096)
    v = torch.ones(4096)
    for name, fn in (("sum", lambda: x.sum()), ("gemv", lambda: torch.mv(w, v))):
        out[name] = x.numel() * 4 / best_seconds(fn, reps) / 1e9
    return out


def layout_bandwidth_gbs(shapes: list[tuple[int, int]], copies: int = 8, reps: int = 5) -> dict[str, float]:
    """GB/s of one-row matrix products over fresh copies of the given (out, in) weight shapes, in the two layouts:
    ``out_in`` (``nn.Linear``'s W, computed as x @ W.T) and ``in_out`` (W^T contiguous, as triforce stores it)."""
    res = {}
    for layout in ("out_in", "in_out"):
        mats = [torch.randn(o, i) if layout == "out_in" else torch.randn(i, o)
                for o, i in shapes for _ in range(copies)]
        xs = {i: torch.randn(1, i) for _, i in shapes}

        def run():
            for w in mats:
                if layout == "out_in":
                    xs[w.shape[1]] @ w.T
                else:
                    xs[w.shape[0]] @ w
        res[layout] = sum(m.numel() * 4 for m in mats) / best_seconds(run, reps) / 1e9
    return res


class _Clock:
    """A transformers streamer that timestamps every generated token (the first put() is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.first = True

    def put(self, value):
        if self.first:
            self.first = False
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def hf_decode(model, ids: list[int], new_tokens: int, static: bool) -> tuple[list[int], float]:
    """transformers greedy generate; returns (tokens, mean ms between tokens after the first)."""
    x = torch.tensor([ids])
    clock = _Clock()
    kw = {"cache_implementation": "static"} if static else {}
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, streamer=clock, **kw)
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    return out[0, len(ids):].tolist(), 1000 * statistics.mean(gaps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--book", default="pg1342.txt")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8000])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--skip-hf", action="store_true", help="only time triforce")
    p.add_argument("--layouts", action="store_true", help="also time the model's matrix shapes in both weight layouts")
    p.add_argument("--out", default="bench/results/decode.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from triforce import Engine, SamplingParams, SpeculationConfig, load_model
    from triforce.kv.caches import kv_bytes
    from triforce.text.prompts import strip_gutenberg

    book = os.path.join(BOOKS, args.book)
    if not os.path.isfile(book):
        print(f"book {book} not found; nothing measured", file=sys.stderr)
        return 1
    lm = load_model(args.model, dtype=args.dtype)
    folder = lm.source
    hf = None if args.skip_hf else AutoModelForCausalLM.from_pretrained(folder, dtype=lm.model.dtype).eval()
    text = strip_gutenberg(open(book, encoding="utf-8").read())
    all_ids = lm.tokenizer(text)["input_ids"]
    bandwidths = read_bandwidth_gbs()
    bandwidth = bandwidths["gemv"]
    if args.layouts:
        c = lm.model.cfg
        shapes = [((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size),
                  (c.hidden_size, c.num_attention_heads * c.head_dim), (2 * c.intermediate_size, c.hidden_size),
                  (c.hidden_size, c.intermediate_size)]
        for layout, gbs in layout_bandwidth_gbs(shapes).items():
            bandwidths[f"model_shapes_{layout}"] = gbs
    engine = Engine(lm.model, eos_ids=(), reuse_prefix=False)
    rows = []
    for n in args.lengths:
        ids = all_ids[:n]
        tokens, stats = engine.generate(ids, max_new_tokens=args.new_tokens, sampling=SamplingParams(temperature=0),
                                        spec=SpeculationConfig())
        row = {"prompt_tokens": n, "new_tokens": args.new_tokens, "triforce_ms": stats.mean_time_between_tokens_ms,
               "triforce_prefill_s": stats.prefill_seconds}
        weights = lm.model.weight_bytes()
        kv = kv_bytes(lm.model.cfg, n + args.new_tokens // 2, lm.model.dtype)
        row.update(weight_bytes=weights, kv_bytes=kv, floor_ms=round(1000 * (weights + kv) / (bandwidth * 1e9), 3))
        if hf is not None:
            for name, static in (("hf_dynamic", False), ("hf_static", True)):
                hf_tokens, ms = hf_decode(hf, ids, args.new_tokens, static)
                row[f"{name}_ms"] = round(ms, 3)
                row[f"{name}_same_tokens"] = hf_tokens == tokens
        row["triforce_vs_floor"] = round(row["triforce_ms"] / row["floor_ms"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "threads": args.threads,
                          "read_bandwidth_gbs": {k: round(v, 2) for k, v in bandwidths.items()},
                          "floor_bandwidth": "gemv"},
              "model": folder, "dtype": args.dtype, "book": args.book, "rows": rows,
              "command": "python " + " ".join(sys.argv)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nread bandwidth: gemv {bandwidths['gemv']:.1f} GB/s (floor), sum {bandwidths['sum']:.1f} GB/s; "
          f"{args.threads} threads, {args.dtype}")
    print(f"{'prompt':>7} {'triforce ms':>12} {'hf dynamic':>11} {'hf static':>10} {'floor ms':>9} {'x floor':>8} same")
    for r in rows:
        same = all(r.get(f"{k}_same_tokens", True) for k in ("hf_dynamic", "hf_static"))
        print(f"{r['prompt_tokens']:>7} {r['triforce_ms']:>12.1f} {r.get('hf_dynamic_ms', float('nan')):>11.1f} "
              f"{r.get('hf_static_ms', float('nan')):>10.1f} {r['floor_ms']:>9.1f} "
              f"{r['triforce_vs_floor']:>8.2f} {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
