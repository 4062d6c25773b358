"""KV layout for continuous batching: per-sequence contiguous caches sized at admission, against paged blocks.

    OMP_WAIT_POLICY=PASSIVE python bench/kernels/kv_layout.py --threads 2 --out bench/results/kv_layout.json

The server gives each request its own contiguous :class:`~triforce.kv.caches.FullKVCache`, sized when the request
starts for its prompt, its ``max_tokens`` and one verification block (``plan.size_request``), allocated then and
freed when it ends. vLLM's PagedAttention (Kwon et al., SOSP 2023) instead keeps one pool of fixed-size blocks and
a block table per sequence. This script measures what that choice costs on this machine, with SmolLM2-135M's
shapes (30 layers, 9 query heads, 3 KV heads, head dim 64, fp32):

1. ``attention``: one decode step's attention over the 30 layers of one sequence at 2K / 4K / 8K tokens (each
   layer's KV its own, read from memory): our kernel (``csrc/attention.c``) over the contiguous cache, and a paged
   cache read through torch (gather the sequence's 16-token blocks from a shuffled pool, then the same kernel), the
   path a paged layout takes without a dedicated kernel. Per layer, median of interleaved repetitions; GB/s
   counts the K and V bytes the step must read.
2. ``fragmentation``: 200 admissions and departures of caches of random capacities (512 to 8,192 tokens, up to 8
   live, a random one leaving), allocated by ``FullKVCache`` itself: the process's resident memory against the
   bytes live, at the peak and after all are freed (whether the allocator fragments or returns the memory).
3. ``allocation``: seconds to allocate (and zero) a request's cache against the seconds of its prefill (SmolLM2,
   2,048 prompt tokens through the engine's own prefill path).
4. ``reserved``: the KV bytes reserved for a request (our sizes, from ``plan.size_request``) against the bytes a
   16-token paged layout would hold at the request's end, for prompts of 512 / 2K / 8K tokens, ``max_tokens`` 256
   and answers ending after 1 to 256 tokens (uniform, the mean waste); arithmetic over the plan's formula.

Prints JSON (and writes ``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import add_run_options, emit_json  # noqa: E402

BLOCK = 16  # vLLM's default block size, tokens


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def time_attention(cfg, n_keys: int, reps: int) -> dict:
    """One decode step's attention over every layer of one sequence (each layer's KV distinct, so the step reads
    them from memory as a real one does), contiguous against paged; per layer, median of ``reps``."""
    from triforce.kernels.cpu import gqa_attention_kernel

    L, nkv, nh, hs = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    q = torch.randn(1, nh, 1, hs)
    blocks = -(-n_keys // BLOCK)
    k = [torch.randn(1, nkv, blocks * BLOCK, hs) for _ in range(L)]
    v = [torch.randn(1, nkv, blocks * BLOCK, hs) for _ in range(L)]
    # the paged cache: per layer a pool of twice the blocks, the sequence's blocks scattered in it, holding the
    # same keys and values
    tables = [torch.randperm(2 * blocks)[:blocks] for _ in range(L)]
    pool_k = [torch.randn(2 * blocks, nkv, BLOCK, hs) for _ in range(L)]
    pool_v = [torch.randn(2 * blocks, nkv, BLOCK, hs) for _ in range(L)]
    for layer in range(L):
        pool_k[layer][tables[layer]] = k[layer][0].reshape(nkv, blocks, BLOCK, hs).transpose(0, 1)
        pool_v[layer][tables[layer]] = v[layer][0].reshape(nkv, blocks, BLOCK, hs).transpose(0, 1)

    def contiguous(layer):
        return gqa_attention_kernel(q, k[layer], v[layer], n_keys)

    def paged(layer):  # gather the blocks (1, nkv, blocks * 16, hs), then the same kernel
        t = tables[layer]
        pk = pool_k[layer][t].permute(1, 0, 2, 3).reshape(1, nkv, blocks * BLOCK, hs)
        pv = pool_v[layer][t].permute(1, 0, 2, 3).reshape(1, nkv, blocks * BLOCK, hs)
        return gqa_attention_kernel(q, pk, pv, n_keys)

    torch.testing.assert_close(paged(0), contiguous(0))
    times = {"contiguous": [], "paged_gather": []}
    for _ in range(reps):
        for name, fn in (("contiguous", contiguous), ("paged_gather", paged)):
            t0 = time.perf_counter()
            for layer in range(L):
                fn(layer)
            times[name].append((time.perf_counter() - t0) / L)
    kv = 2 * nkv * n_keys * hs * 4
    out = {"keys": n_keys, "kv_bytes_per_layer": kv}
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {"seconds_per_layer": med, "gb_per_s": kv / med / 1e9}
    out["paged_over_contiguous"] = out["paged_gather"]["seconds_per_layer"] / out["contiguous"]["seconds_per_layer"]
    return out


def fragmentation(cfg, ops: int, seed: int, after_leave=None) -> dict:
    """``ops`` admissions (up to 8 live caches, a random one leaving first at random); ``after_leave()`` runs after
    each departure. Resident memory is measured against the live caches' bytes."""
    from triforce.kv.caches import FullKVCache
    from triforce.kv.memory import release_free_memory

    rng = random.Random(seed)
    gc.collect()
    release_free_memory()  # both variants start from a heap without free resident pages (the model's loading)
    base = rss_bytes()
    live, peak_live, peak_rss, excess = [], 0, 0, 0
    for _ in range(ops):
        if len(live) == 8 or (live and rng.random() < 0.4):
            live.pop(rng.randrange(len(live)))  # a random request leaves
            if after_leave is not None:
                after_leave()
        cache = FullKVCache(cfg, rng.randint(512, 8192))
        cache.k.fill_(1.0)  # every page written, as a request that runs to max_tokens would
        cache.v.fill_(1.0)
        live.append(cache)
        live_bytes = sum(c.nbytes for c in live)
        over = rss_bytes() - base
        peak_live, peak_rss = max(peak_live, live_bytes), max(peak_rss, over)
        excess = max(excess, over - live_bytes)
    end_live = sum(c.nbytes for c in live)
    end_rss = rss_bytes() - base
    del cache
    live.clear()
    gc.collect()
    if after_leave is not None:
        after_leave()
    return {"ops": ops, "peak_live_bytes": peak_live, "peak_rss_over_idle_bytes": peak_rss,
            "most_rss_over_live_bytes": excess, "end_live_bytes": end_live, "end_rss_over_idle_bytes": end_rss,
            "after_free_rss_over_idle_bytes": rss_bytes() - base}


def fragmentation_variants(ops: int, seed: int, threads: int) -> dict:
    """:func:`fragmentation` with the C allocator as it is, and with ``triforce.kv.memory.release_free_memory`` after
    each departure (what the server does), each in a fresh process (the heap's history is the point)."""
    import subprocess
    import sys

    out = {}
    for variant in ("default", "release_after_each_request"):
        run = subprocess.run([sys.executable, __file__, "--fragmentation-only", variant, "--ops", str(ops),
                              "--seed", str(seed), "--threads", str(threads)],
                             capture_output=True, text=True, check=True)
        out[variant] = json.loads(run.stdout)
    return out


def allocation_against_prefill(tf, prompt_tokens: int, reps: int) -> dict:
    from triforce import SamplingParams, SpeculationConfig
    from triforce.kv.caches import FullKVCache
    from triforce.plan import size_request

    spec = SpeculationConfig()
    capacity = size_request(prompt_tokens, 256, spec)[0]
    alloc, prefill = [], []
    ids = [int(t) for t in torch.randint(100, 20000, (prompt_tokens,))]
    tf.engine.reuse_prefix = False
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        cache = FullKVCache(tf.target.model.cfg, capacity)
        alloc.append(time.perf_counter() - t0)
        del cache
        r = tf.generate(ids, max_new_tokens=1, sampling=SamplingParams(temperature=0), spec=spec)
        prefill.append(r.stats.prefill_seconds)
    a, p = statistics.median(alloc), statistics.median(prefill)
    return {"prompt_tokens": prompt_tokens, "capacity": capacity, "allocate_seconds": a, "prefill_seconds": p,
            "allocate_over_prefill": a / p}


def reserved(cfg, prompts=(512, 2048, 8192), max_tokens: int = 256) -> list[dict]:
    from triforce import SpeculationConfig
    from triforce.kv.caches import kv_bytes
    from triforce.plan import size_request

    rows = []
    for mode in ("autoregressive", "retrieval"):
        spec = SpeculationConfig(mode=mode)
        for n in prompts:
            cap = size_request(n, max_tokens, spec)[0]
            ours = paged = live = 0
            for generated in range(1, max_tokens + 1):  # answers ending after 1 .. max_tokens tokens, uniform
                length = n + generated
                ours += cap
                paged += -(-length // BLOCK) * BLOCK
                live += length
            rows.append({"mode": mode, "prompt_tokens": n, "max_tokens": max_tokens, "capacity": cap,
                         "reserved_over_live": ours / live, "paged_over_live": paged / live,
                         "reserved_bytes": kv_bytes(cfg, cap, torch.float32)})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=2048, help="prefill length for the allocation figure")
    p.add_argument("--ops", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fragmentation-only", choices=["default", "release_after_each_request"],
                   help="(internal) print only the fragmentation figures of this allocator variant")
    add_run_options(p, None, reps=7, sampling=False)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from triforce import TriForce
    from triforce.kv.memory import release_free_memory

    if args.fragmentation_only:
        cfg = TriForce.load(None, threads=args.threads).target.model.cfg  # the server's state: the model loaded
        hook = release_free_memory if args.fragmentation_only == "release_after_each_request" else None
        print(json.dumps(fragmentation(cfg, args.ops, args.seed, hook)))
        return 0

    tf = TriForce.load(None, threads=args.threads)
    cfg = tf.target.model.cfg
    result = {
        "machine": {"threads": args.threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")},
        "model": "SmolLM2-135M-Instruct", "block": BLOCK,
        "attention": [time_attention(cfg, n, args.reps) for n in (2048, 4096, 8192)],
        "fragmentation": fragmentation_variants(args.ops, args.seed, args.threads),
        "allocation": allocation_against_prefill(tf, args.prompt_tokens, max(3, args.reps // 2)),
        "reserved": reserved(cfg),
    }
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
