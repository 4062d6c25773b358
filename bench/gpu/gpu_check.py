"""GPU checks in one run (issue: scale out), tiny and synthetic models only (no network, no GGUF reader needed).

Stages (``--stages``, all by default, run in this order):

1. ``parity``: logits of a tiny random model, GPU against CPU: fp32 (max relative difference) and bf16 (cosine;
   the bf16 weights are the fp32 ones cast). On CUDA also where bf16 departs, if it does: the logits' cosine
   under each SDPA backend alone and each module's output, device against CPU.
2. ``greedy``: greedy equality on the GPU for every mode (autoregressive, retrieval, draft, triforce, an n-gram
   hierarchy, int8 lower tiers, the self-drafting tier on the target's own int4 weights, ``auto`` with a three-tier
   plan, the offloaded full cache, retrieval and ``triforce`` with CUDA graphs off): each must give the GPU's
   autoregressive tokens, which must equal the CPU's. The retrieval tier's forwards replay CUDA graphs
   (``--cuda-graphs on``, ``cudagraph.py``); the JSON counts the captures and replays.
3. ``distribution``: exact distribution on the GPU: a 5-token vocabulary, 3 sampled tokens at T = 0.6 / top-p 0.9 /
   top-k 5; the exact distribution of the 125 sequences by enumeration with the same model on the same device,
   against sequences sampled by ``triforce`` and by ``self:2,retrieval:2``; chi-square p > 1e-3 (as
   tests/test_distribution.py).
4. ``attention``: one layer's attention for a 7-token verification block of Llama-2-7B at each context: SDPA with
   the full cache's boolean mask against the lower-right causal bias
   (:func:`triforce.kernels.sdpa.lower_right_attention`).
5. ``compiled``: ``--compile reduce-overhead`` (CUDA graphs of the norms and MLPs): greedy equality of
   autoregressive and ``triforce`` on one prompt (skipped on a CPU, or when the run is past ``--compile-after``
   seconds).
6. ``latency``: per-tier step latency of a Llama-2-7B-shaped synthetic model (random weights, caches filled with
   random KV, no prefill; labelled synthetic) with a synthetic llama-68m draft, in bf16, at 32K, 64K and 120K
   tokens, with the full cache on the GPU, and at ``--offload-contexts`` (32K) offloaded to pinned host memory
   (streamed layer by layer with one layer of prefetch). The retrieval tier's and the draft's forwards with CUDA
   graphs (``--cuda-graphs on``) and eager (off).

The JSON is rewritten after each stage, so a run stopped by its time limit keeps what it finished.

    PYTHONPATH=src python bench/gpu/gpu_check.py --out bench/results/gpu_check.json
    PYTHONPATH=src python bench/gpu/gpu_check.py --device cpu --smoke     # the same code paths on a CPU, small sizes

Prints a markdown summary; writes JSON. Exit status 1 if a parity, equality or distribution check fails. Results
of the H200 runs: bench/results/gpu_h200_2026-12-04/ (docs/history.md, "GPU checks").
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

from triforce.engine import Engine, SpeculationConfig  # noqa: E402
from triforce.kv.caches import FullKVCache  # noqa: E402
from triforce.kv.retrieval import RetrievalCache  # noqa: E402
from triforce.kv.streaming import StreamingCache  # noqa: E402
from triforce.lab.synthetic import (  # noqa: E402
    fill_random_kv,
    random_model,
    random_query,
    synthetic_config,
    synthetic_label,
)
from triforce.model import cudagraph  # noqa: E402
from triforce.speculation.auto import choose_hierarchy  # noqa: E402
from triforce.speculation.sampling import SamplingParams, logits_to_probs  # noqa: E402


class CountingBackend(cudagraph.Backend):
    """CUDA graphs as the library captures them, counted (the greedy stage shows they ran)."""

    def __init__(self) -> None:
        self.captures = self.replays = 0

    def capture(self, fn, device):
        self.captures += 1
        return super().capture(fn, device)

    def replay(self, graph) -> None:
        self.replays += 1
        super().replay(graph)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parity(device: torch.device) -> dict:
    """Logits of the same tiny random model on ``device`` and on the CPU."""
    cfg = synthetic_config("llama-68m", layers=2, vocab_size=512)
    cpu = random_model(cfg, torch.float32, "cpu", seed=1, std=0.2)
    ids = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(48)
    ref = cpu(ids, pos, FullKVCache(cfg, 64, torch.float32, "cpu"))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        # the fp32 weights cast (drawing them in bf16 directly takes another path of the CPU's RNG on some CPUs)
        dev = random_model(cfg, torch.float32, "cpu", seed=1, std=0.2).to(dtype).to(device)
        dev.rope = None  # rebuilt on the device at first use
        got = dev(ids.to(device), pos.to(device), FullKVCache(cfg, 64, dtype, device)).cpu()
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
        same = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        out[str(dtype).removeprefix("torch.")] = {"max_relative_difference": rel, "cosine": cos,
                                                   "argmax_equal_share": same}
    out["ok"] = out["float32"]["max_relative_difference"] < 1e-3 and out["bfloat16"]["cosine"] > 0.99
    if device.type == "cuda":
        out["bfloat16_by_sdpa_backend"], out["bfloat16_by_module"] = _bf16_diagnosis(cfg, ids, pos, device)
    return out


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten().cpu(), b.float().flatten().cpu(), dim=0).item()


def _bf16_diagnosis(cfg, ids, pos, device) -> tuple[dict, dict]:
    """Where bf16 on the device departs from bf16 on the CPU: the logits' cosine under each SDPA backend alone, and
    each module's output cosine (device against CPU, same bf16 weights), in forward order."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cpu = random_model(cfg, torch.bfloat16, "cpu", seed=1, std=0.2)
    dev = random_model(cfg, torch.bfloat16, "cpu", seed=1, std=0.2).to(device)
    dev.rope = None
    outs = {"cpu": {}, "dev": {}}

    def hook(side, name):
        def f(module, args, output):
            if isinstance(output, torch.Tensor):
                outs[side][name] = output.detach().float().cpu()
        return f
    for side, m in (("cpu", cpu), ("dev", dev)):
        for name, module in m.named_modules():
            if name:
                module.register_forward_hook(hook(side, name))
    ref = cpu(ids, pos, FullKVCache(cfg, 64, torch.bfloat16, "cpu"))
    got = dev(ids.to(device), pos.to(device), FullKVCache(cfg, 64, torch.bfloat16, device))
    by_module = {name: round(_cos(outs["dev"][name], t), 5) for name, t in outs["cpu"].items() if name in outs["dev"]}
    by_module["logits"] = round(_cos(got, ref), 5)
    by_backend = {}
    for backend in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                got = dev(ids.to(device), pos.to(device), FullKVCache(cfg, 64, torch.bfloat16, device))
            by_backend[backend.name] = round(_cos(got, ref), 5)
        except RuntimeError as e:
            by_backend[backend.name] = f"{type(e).__name__}: {str(e)[:120]}"
    return by_backend, by_module


def greedy_equality(device: torch.device) -> dict:
    """Every mode's greedy tokens on ``device`` against the device's and the CPU's autoregressive tokens."""
    vocab = 512
    tcfg = synthetic_config("llama-68m", layers=3, vocab_size=vocab)
    dcfg = synthetic_config("llama-68m", layers=1, vocab_size=vocab)
    models = {d: (random_model(tcfg, torch.float32, "cpu", seed=2, std=0.2).to(d),
                  random_model(dcfg, torch.float32, "cpu", seed=3, std=0.2).to(d)) for d in ("cpu", device)}
    for t, dr in models.values():
        t.rope = dr.rope = None
        t.cuda_graphs = dr.cuda_graphs = True  # --cuda-graphs on (nothing changes on the CPU)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (40, 150, 300)]
    greedy = SamplingParams(temperature=0)
    specs = {
        "retrieval": SpeculationConfig(mode="retrieval", budget=64, chunk_size=8, gamma2=4),
        "draft": SpeculationConfig(mode="draft", gamma2=4, draft_sink=4, draft_window=32),
        "triforce": SpeculationConfig(mode="triforce", budget=64, chunk_size=8, gamma1=3, gamma2=5, draft_sink=4,
                                      draft_window=32),
        "ngram:4,draft:2,retrieval:4": SpeculationConfig(tiers="ngram:4,draft:2,retrieval:4", budget=64, chunk_size=8,
                                                         draft_sink=4, draft_window=32),
        "triforce, int8 lower tiers": SpeculationConfig(mode="triforce", budget=64, chunk_size=8, lower_weights="int8",
                                                        lower_kv_dtype="bfloat16", draft_sink=4, draft_window=32),
        "self:3,retrieval:4 (int4 self tier)": SpeculationConfig(tiers="self:3,retrieval:4", budget=64, chunk_size=8),
        "auto (forced three-tier plan)": SpeculationConfig(mode="auto", budget=64, chunk_size=8, draft_sink=4,
                                                           draft_window=32),
    }
    cpu_engine, dev_engine = Engine(*models["cpu"]), Engine(*models[device])
    t = models[device][0]
    # these prompts are below auto's retrieval threshold: plan the draft -> retrieval -> target hierarchy instead
    dev_engine.choose_auto = lambda n, s, sp: choose_hierarchy(t.cfg, 1, torch.float32, n, "draft", s, gamma1=3,
                                                               gamma2=5, chunk_size=8, max_budget=64,
                                                               device_type=device.type)
    off_engine = Engine(*models[device], offload_kv=True, on_chip_layers=1)
    counts = cudagraph.BACKEND
    before = (getattr(counts, "captures", 0), getattr(counts, "replays", 0))
    rows, ok = [], True
    for prompt in prompts:
        ref_cpu = cpu_engine.generate(prompt, max_new_tokens=32, sampling=greedy)[0]
        ref = dev_engine.generate(prompt, max_new_tokens=32, sampling=greedy)[0]
        row = {"prompt_tokens": len(prompt), "autoregressive equals CPU": ref == ref_cpu}
        ok &= ref == ref_cpu
        for name, spec in specs.items():
            out = dev_engine.generate(prompt, max_new_tokens=32, sampling=greedy, spec=spec)[0]
            row[name] = out == ref
            ok &= out == ref
        for name, spec in (("offloaded autoregressive", SpeculationConfig()),
                           ("offloaded triforce", specs["triforce"])):
            out = off_engine.generate(prompt, max_new_tokens=32, sampling=greedy, spec=spec)[0]
            row[name] = out == ref
            ok &= out == ref
        for m in models[device]:  # every tier's forwards eager (--cuda-graphs off)
            m.cuda_graphs = False
        for name in ("retrieval", "triforce"):
            out = dev_engine.generate(prompt, max_new_tokens=32, sampling=greedy, spec=specs[name])[0]
            row[f"{name}, CUDA graphs off"] = out == ref
            ok &= out == ref
        for m in models[device]:
            m.cuda_graphs = True
        rows.append(row)
    graphs = {"captures": getattr(counts, "captures", 0) - before[0],
              "replays": getattr(counts, "replays", 0) - before[1]}
    # bf16 on the device (MHA: verification blocks through sdpa.lower_right_attention on CUDA), reported, not
    # required: a 7-token block and a 1-token step run different bf16 kernels, which may round a near-tie apart
    bf16 = Engine(*(copy.deepcopy(m).to(torch.bfloat16) for m in models[device]))
    bf16_rows = []
    for prompt in prompts:
        ref = bf16.generate(prompt, max_new_tokens=32, sampling=greedy)[0]
        bf16_rows.append({"prompt_tokens": len(prompt), **{
            name: bf16.generate(prompt, max_new_tokens=32, sampling=greedy, spec=specs[name])[0] == ref
            for name in ("retrieval", "triforce")}})
    return {"rows": rows, "ok": ok, "cuda_graphs": graphs, "bfloat16_rows_not_required": bf16_rows}


def sampled_distribution(device: torch.device, n: int) -> dict:
    """Sequences sampled on ``device`` by two speculative hierarchies against the exact distribution there."""
    from scipy.stats import chisquare

    V, NEW, P = 5, 3, 20
    params = SamplingParams(0.6, 0.9, 5)
    tcfg = synthetic_config("llama-68m", layers=2, vocab_size=V)
    dcfg = synthetic_config("llama-68m", layers=1, vocab_size=V)
    target = random_model(tcfg, torch.float32, device, seed=21, std=0.02)
    draft = random_model(dcfg, torch.float32, device, seed=22, std=0.2)  # sharp: frequent rejections
    target.cuda_graphs = True  # --cuda-graphs on
    prompt = torch.randint(0, V, (P,), generator=torch.Generator().manual_seed(5)).tolist()
    conts = list(itertools.product(range(V), repeat=NEW - 1))
    exact = torch.zeros((V,) * NEW, dtype=torch.float64)
    for a, b in conts:  # P(x1, x2, x3 | prompt) = p1(a) p2(b | a) p3(. | a, b), by enumeration on the device
        ids = torch.tensor([prompt + [a, b]], device=device)
        logits = target(ids, torch.arange(P + 2, device=device), FullKVCache(tcfg, P + 8, torch.float32, device),
                        num_logits=NEW)
        p = logits_to_probs(logits[0], params).double().cpu()  # (3, V)
        exact[a, b] = p[0, a] * p[1, b] * p[2]
    exact = exact.flatten()
    engine = Engine(target, draft)
    specs = {"triforce": SpeculationConfig(mode="triforce", budget=8, chunk_size=2, gamma1=2, gamma2=2, draft_sink=2,
                                           draft_window=4),
             "self:2,retrieval:2": SpeculationConfig(tiers="self:2,retrieval:2", budget=8, chunk_size=2)}
    out = {"samples": n, "setting": "T=0.6 top-p=0.9 top-k=5", "rows": {}}
    for name, spec in specs.items():
        counts = torch.zeros(V**NEW, dtype=torch.float64)
        t0 = time.perf_counter()
        for i in range(n):
            toks, _ = engine.generate(prompt, max_new_tokens=NEW, sampling=params, spec=spec, seed=7_000_003 + i)
            counts[toks[0] * V * V + toks[1] * V + toks[2]] += 1
        expected = exact / exact.sum() * n
        big = expected >= 5  # cells with expected count < 5 pooled
        obs = torch.cat([counts[big], counts[~big].sum()[None]])
        exp = torch.cat([expected[big], expected[~big].sum()[None]])
        pvalue = float(chisquare(obs.numpy(), exp.numpy()).pvalue)
        out["rows"][name] = {"pvalue": pvalue, "cells": int(big.sum()) + 1, "seconds": time.perf_counter() - t0,
                             "zero_probability_samples": int(counts[exact == 0].sum())}
    out["ok"] = all(r["pvalue"] > 1e-3 and r["zero_probability_samples"] == 0 for r in out["rows"].values())
    return out


def compiled_equality(device: torch.device) -> dict:
    """Greedy tokens with the blocks compiled (``reduce-overhead``: CUDA graphs) against the eager model's."""
    vocab = 512
    tcfg = synthetic_config("llama-68m", layers=3, vocab_size=vocab)
    dcfg = synthetic_config("llama-68m", layers=1, vocab_size=vocab)
    eager = Engine(random_model(tcfg, torch.float32, device, seed=2, std=0.2),
                   random_model(dcfg, torch.float32, device, seed=3, std=0.2))
    target, draft = random_model(tcfg, torch.float32, device, seed=2, std=0.2), random_model(dcfg, torch.float32,
                                                                                             device, seed=3, std=0.2)
    target.compile_blocks("reduce-overhead")
    draft.compile_blocks("reduce-overhead")
    compiled = Engine(target, draft)
    prompt = torch.randint(0, vocab, (150,), generator=torch.Generator().manual_seed(4)).tolist()
    greedy = SamplingParams(temperature=0)
    row, t0 = {}, time.perf_counter()
    for name, spec in (("autoregressive", SpeculationConfig()),
                       ("triforce", SpeculationConfig(mode="triforce", budget=64, chunk_size=8, gamma1=3, gamma2=5,
                                                      draft_sink=4, draft_window=32))):
        ref = eager.generate(prompt, max_new_tokens=32, sampling=greedy, spec=spec)[0]
        row[name] = compiled.generate(prompt, max_new_tokens=32, sampling=greedy, spec=spec)[0] == ref
    return {"rows": row, "seconds": time.perf_counter() - t0, "ok": all(row.values())}


def block_attention(device: torch.device, contexts: list[int], reps: int) -> dict:
    """Seconds of one layer's attention for a verification block of 7 tokens of Llama-2-7B (32 heads of 128, bf16)
    over ``n`` cached keys in a cache with room for more (as the full KV cache holds them): SDPA with the full
    cache's boolean block mask (``sdpa.gqa_attention``, what the cache ran before), through
    :func:`triforce.kernels.sdpa.lower_right_attention` (PyTorch's lower-right causal bias: the same visibility, no
    materialised mask), and one query without a mask (a decode step). The block's two outputs must agree."""
    from triforce.kernels.sdpa import gqa_attention, lower_right_attention
    from triforce.kv.caches import _causal_offset_mask

    out = {"rows": []}
    for n in contexts:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, 32, 7, 128, device=device, dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, 32, n + 64, 128, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
        mask = _causal_offset_mask(n - 7, 7, n, device)
        a = gqa_attention(q, k[:, :, :n], v[:, :, :n], mask)
        b = lower_right_attention(q, k, v, n)
        row = {"context": n, "lower_right_applies": b is not None,
               "max_abs_difference": None if b is None else (a.float() - b.float()).abs().max().item()}
        fns = {"bool_mask_s": lambda: gqa_attention(q, k[:, :, :n], v[:, :, :n], mask),
               "decode_no_mask_s": lambda: gqa_attention(q[:, :, :1], k[:, :, :n], v[:, :, :n], None)}
        if b is not None:
            fns["lower_right_bias_s"] = lambda: lower_right_attention(q, k, v, n)
        for name, fn in fns.items():
            row[name] = _time(fn, device, reps)[0]
        out["rows"].append(row)
    out["ok"] = all(r["max_abs_difference"] is None or r["max_abs_difference"] < 1e-2 for r in out["rows"])
    return out


def _save(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def _time(fn, device, reps: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), [min(times), max(times)]


def _time_forward(model, cache, n: int, t: int, reps: int) -> tuple[float, list[float]]:
    """Median seconds of a forward of t random tokens at positions n.. over ``cache``, rolled back after each."""
    device = model.device
    ids = torch.randint(0, model.cfg.vocab_size, (1, t), device=device)
    pos = torch.arange(n, n + t, device=device)

    def fwd():
        model(ids, pos, cache, num_logits=t)
        cache.rollback(n)

    return _time(fwd, device, reps)


def latencies(device: torch.device, contexts: list[int], layers: int, dtype: torch.dtype, reps: int,
              offload_contexts: list[int], budget: int = 4096, gamma1: int = 4, gamma2: int = 6, save=None) -> dict:
    """Per-tier forward latency of the synthetic llama2-7b (+ llama-68m draft) at each context, seconds; the
    offloaded full cache at ``offload_contexts`` only (a forward streams the whole cache from host memory)."""
    tcfg = synthetic_config("llama2-7b", layers=layers)
    dcfg = synthetic_config("llama-68m")
    t0 = time.perf_counter()
    target = random_model(tcfg, dtype, device, seed=0)
    draft = random_model(dcfg, dtype, device, seed=1)
    print(f"latency: models ready in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    meta = {**synthetic_label("llama2-7b", layers, "llama-68m"), "dtype": str(dtype).removeprefix("torch."),
            "budget": budget, "gamma1": gamma1, "gamma2": gamma2}
    for n in contexts:
        row = {"context": n, "stage_seconds": {}}
        try:
            kinds = [("full", True)] + ([("full_offloaded", False)] if n in offload_contexts else [])
            for name, on_device in kinds:
                cache = FullKVCache(tcfg, n + gamma2 + 2, dtype, device, offload=not on_device, on_chip_layers=0)
                if on_device:
                    fill_random_kv(cache, n)
                else:  # the host copy of 30-60 GB: zeros (timing does not depend on the values)
                    cache.length = n
                row["stage_seconds"][f"{name}_cache_ready"] = round(time.perf_counter() - t0, 2)
                for label, t in (("decode", 1), ("pass", gamma2 + 1)):  # offloaded: seconds each, 2 repetitions
                    row[f"{name}_{label}_s"], row[f"{name}_{label}_spread_s"] = _time_forward(
                        target, cache, n, t, reps if on_device else min(reps, 2))
                if name == "full":
                    retr = RetrievalCache(tcfg, cache, budget, 8)
                    retr.build(n, random_query(tcfg, 1, 0, torch.float32, device))
                    for graphs, suffix in ((True, ""), (False, "_eager")):  # --cuda-graphs on, then off
                        target.cuda_graphs = graphs
                        for label, t in (("decode", 1), ("pass", gamma1 + 1)):
                            row[f"retrieval_{label}{suffix}_s"], row[f"retrieval_{label}{suffix}_spread_s"] = \
                                _time_forward(target, retr, n, t, reps)
                    del retr
                row["stage_seconds"][f"{name}_timed"] = round(time.perf_counter() - t0, 2)
                del cache
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            for graphs, suffix in ((True, ""), (False, "_eager")):  # --cuda-graphs on (fixed-shape cache), then off
                draft.cuda_graphs = graphs
                sc = StreamingCache(dcfg, 16, 240, 64, draft.rope, dtype, device, fixed_shape=graphs)
                fill_random_kv(sc, n)
                row[f"draft_step{suffix}_s"], row[f"draft_step{suffix}_spread_s"] = _time_forward(draft, sc, n, 1, reps)
        except (RuntimeError, MemoryError) as e:  # e.g. out of (pinned) memory at 120K: say so, keep going
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(f"latency: {json.dumps(row)}", flush=True)
        if save is not None:
            save({"rows": rows, **meta})
    return {"rows": rows, **meta}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536, 122880])
    p.add_argument("--layers", type=int, default=32, help="decoder blocks of the synthetic llama2-7b (32 = all)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (to try the script on a CPU)")
    p.add_argument("--offload-contexts", type=int, nargs="*", default=[32768],
                   help="contexts at which the offloaded full cache is timed too (none: --offload-contexts)")
    p.add_argument("--samples", type=int, default=1500,
                   help="sampled sequences per hierarchy in the distribution check")
    p.add_argument("--stages", default="parity,greedy,distribution,attention,compiled,latency",
                   help="comma-separated stages to run (default: all)")
    p.add_argument("--compile-after", type=float, default=240.0,
                   help="skip the compiled check when the run is already past this many seconds")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "gpu_check.json"))
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; use --device cpu --smoke to try the code paths", file=sys.stderr)
        return 2
    if args.smoke:
        args.contexts, args.layers, args.reps, args.samples, args.offload_contexts = [1024, 2048], 1, 2, 300, [1024]
    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    cudagraph.BACKEND = CountingBackend()
    t0 = time.perf_counter()
    result = {"hardware": hw, "torch": torch.__version__, "device": str(device)}
    stages = args.stages.split(",")
    if "parity" in stages:
        result["parity"] = parity(device)
        print(f"parity: {json.dumps(result['parity'])}", flush=True)
    if "greedy" in stages:
        result["greedy_equality"] = greedy_equality(device)
        print(f"greedy equality ok: {result['greedy_equality']['ok']}", flush=True)
        _save(result, args.out)
    if "distribution" in stages:
        result["distribution"] = sampled_distribution(device, args.samples)
        print(f"distribution: {json.dumps(result['distribution'])}", flush=True)
        _save(result, args.out)
    if "attention" in stages:
        result["block_attention"] = block_attention(device, args.contexts, 20)
        print(f"block attention: {json.dumps(result['block_attention'])}", flush=True)
        _save(result, args.out)
    if "compiled" in stages and device.type == "cuda" and time.perf_counter() - t0 < args.compile_after:
        try:
            result["compiled"] = compiled_equality(device)
        except Exception as e:  # noqa: BLE001 - a compiler failure is a finding, reported, not a crash of the checks
            result["compiled"] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "ok": False}
        print(f"compiled: {json.dumps(result['compiled'])}", flush=True)
    if "latency" in stages:
        result["latency"] = latencies(device, args.contexts, args.layers, torch.bfloat16, args.reps,
                                      offload_contexts=args.offload_contexts,
                                      save=lambda lat: _save({**result, "latency": lat}, args.out))
        result["seconds"] = time.perf_counter() - t0
        _save(result, args.out)
    result["seconds"] = time.perf_counter() - t0
    _save(result, args.out)
    ok = all(result[k]["ok"] for k in ("parity", "greedy_equality", "distribution", "block_attention", "compiled")
             if k in result)
    lat = result.get("latency", {"rows": []})
    if lat["rows"]:
        print(f"\n{hw}, synthetic llama2-7b ({lat['layers']} of 32 layers, random weights and KV), {lat['dtype']}, "
              f"ms per forward (median of {args.reps})\n")
        print("| context | full decode | full pass (7) | offloaded decode | offloaded pass (7) | retrieval decode "
              "(4096) | retrieval pass (5) | retrieval decode, eager | retrieval pass, eager | draft step | "
              "draft step, eager |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in lat["rows"]:
        if "error" in r and "full_decode_s" not in r:
            print(f"| {r['context']} | {r['error']} |")
            continue
        cells = [r.get(k) for k in ("full_decode_s", "full_pass_s", "full_offloaded_decode_s", "full_offloaded_pass_s",
                                    "retrieval_decode_s", "retrieval_pass_s", "retrieval_decode_eager_s",
                                    "retrieval_pass_eager_s", "draft_step_s", "draft_step_eager_s")]
        print(f"| {r['context']} | " + " | ".join("-" if c is None else f"{1000 * c:.2f}" for c in cells) + " |")
    print(f"\nchecks {'passed' if ok else 'FAILED'}; {result['seconds']:.0f} s; JSON: {args.out}")
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
