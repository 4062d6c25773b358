"""GPU checks in one run (issue: scale out), tiny and synthetic models only (no network, no GGUF reader needed).

1. Logits parity, GPU against CPU, on a tiny random model: fp32 (max relative difference) and bf16 (cosine).
2. Greedy equality on the GPU for every mode (autoregressive, retrieval, draft, triforce, an n-gram hierarchy,
   int8 lower tiers, the offloaded full cache): each must give the GPU's autoregressive tokens, which must equal
   the CPU's.
3. Per-tier step latency of a Llama-2-7B-shaped synthetic model (random weights, caches filled with random KV, no
   prefill; labelled synthetic) with a synthetic llama-68m draft, in bf16, at 32K, 64K and 120K tokens, with the
   full cache on the GPU and offloaded to pinned host memory (streamed layer by layer with one layer of prefetch).

    PYTHONPATH=src python bench/gpu_check.py --out bench/results/gpu_check.json
    PYTHONPATH=src python bench/gpu_check.py --device cpu --smoke     # the same code paths on a CPU, small sizes

Prints a markdown summary; writes JSON. Exit status 1 if a parity or equality check fails.
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from triforce.caches import FullKVCache, StreamingCache  # noqa: E402
from triforce.retrieval import RetrievalCache  # noqa: E402
from triforce.engine import Engine, SpeculationConfig  # noqa: E402
from triforce.sampling import SamplingParams  # noqa: E402
from triforce.lab.synthetic import fill_random_kv, random_model, random_query, synthetic_config, synthetic_label  # noqa: E402


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
        dev = random_model(cfg, dtype, "cpu", seed=1, std=0.2).to(device)
        dev.rope = None  # rebuilt on the device at first use
        got = dev(ids.to(device), pos.to(device), FullKVCache(cfg, 64, dtype, device)).cpu()
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
        out[str(dtype).removeprefix("torch.")] = {"max_relative_difference": rel, "cosine": cos,
                                                   "argmax_equal_share": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}
    out["ok"] = out["float32"]["max_relative_difference"] < 1e-3 and out["bfloat16"]["cosine"] > 0.99
    return out


def greedy_equality(device: torch.device) -> dict:
    """Every mode's greedy tokens on ``device`` against the device's and the CPU's autoregressive tokens."""
    vocab = 512
    tcfg = synthetic_config("llama-68m", layers=3, vocab_size=vocab)
    dcfg = synthetic_config("llama-68m", layers=1, vocab_size=vocab)
    models = {d: (random_model(tcfg, torch.float32, "cpu", seed=2, std=0.2).to(d),
                  random_model(dcfg, torch.float32, "cpu", seed=3, std=0.2).to(d)) for d in ("cpu", device)}
    for t, dr in models.values():
        t.rope = dr.rope = None
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
    }
    cpu_engine, dev_engine = Engine(*models["cpu"]), Engine(*models[device])
    off_engine = Engine(*models[device], offload_kv=True, on_chip_layers=1)
    rows, ok = [], True
    for i, prompt in enumerate(prompts):
        ref_cpu = cpu_engine.generate(prompt, max_new_tokens=32, sampling=greedy)[0]
        ref = dev_engine.generate(prompt, max_new_tokens=32, sampling=greedy)[0]
        row = {"prompt_tokens": len(prompt), "autoregressive equals CPU": ref == ref_cpu}
        ok &= ref == ref_cpu
        for name, spec in specs.items():
            out = dev_engine.generate(prompt, max_new_tokens=32, sampling=greedy, spec=spec)[0]
            row[name] = out == ref
            ok &= out == ref
        for name, spec in (("offloaded autoregressive", SpeculationConfig()), ("offloaded triforce", specs["triforce"])):
            out = off_engine.generate(prompt, max_new_tokens=32, sampling=greedy, spec=spec)[0]
            row[name] = out == ref
            ok &= out == ref
        rows.append(row)
    return {"rows": rows, "ok": ok}


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
              offload: bool, budget: int = 4096, gamma1: int = 4, gamma2: int = 6) -> dict:
    """Per-tier forward latency of the synthetic llama2-7b (+ llama-68m draft) at each context, seconds."""
    tcfg = synthetic_config("llama2-7b", layers=layers)
    dcfg = synthetic_config("llama-68m")
    target = random_model(tcfg, dtype, device, seed=0)
    draft = random_model(dcfg, dtype, device, seed=1)
    rows = []
    for n in contexts:
        row = {"context": n}
        try:
            kinds = [("full", True)] + ([("full_offloaded", False)] if offload else [])
            for name, on_device in kinds:
                cache = FullKVCache(tcfg, n + gamma2 + 2, dtype, device, offload=not on_device, on_chip_layers=0)
                if on_device:
                    fill_random_kv(cache, n)
                else:  # the host copy of 30-60 GB: zeros (timing does not depend on the values)
                    cache.length = n
                for label, t in (("decode", 1), ("pass", gamma2 + 1)):
                    row[f"{name}_{label}_s"], row[f"{name}_{label}_spread_s"] = _time_forward(target, cache, n, t, reps)
                if name == "full":
                    retr = RetrievalCache(tcfg, cache, budget, 8)
                    retr.build(n, random_query(tcfg, 1, 0, torch.float32, device))
                    for label, t in (("decode", 1), ("pass", gamma1 + 1)):
                        row[f"retrieval_{label}_s"], row[f"retrieval_{label}_spread_s"] = _time_forward(
                            target, retr, n, t, reps)
                    del retr
                del cache
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            sc = StreamingCache(dcfg, 16, 240, 64, draft.rope, dtype, device)
            fill_random_kv(sc, n)
            row["draft_step_s"], row["draft_step_spread_s"] = _time_forward(draft, sc, n, 1, reps)
        except (RuntimeError, MemoryError) as e:  # e.g. out of (pinned) memory at 120K: say so, keep going
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return {"rows": rows, **synthetic_label("llama2-7b", layers, "llama-68m"), "dtype": str(dtype).removeprefix("torch."),
            "budget": budget, "gamma1": gamma1, "gamma2": gamma2}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536, 122880])
    p.add_argument("--layers", type=int, default=32, help="decoder blocks of the synthetic llama2-7b (32 = all)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (to try the script on a CPU)")
    p.add_argument("--no-offload", action="store_true")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "gpu_check.json"))
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; use --device cpu --smoke to try the code paths", file=sys.stderr)
        return 2
    if args.smoke:
        args.contexts, args.layers, args.reps = [1024, 2048], 1, 2
    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    t0 = time.perf_counter()
    result = {"hardware": hw, "torch": torch.__version__, "device": str(device)}
    result["parity"] = parity(device)
    print(f"parity: {json.dumps(result['parity'])}", flush=True)
    result["greedy_equality"] = greedy_equality(device)
    print(f"greedy equality ok: {result['greedy_equality']['ok']}", flush=True)
    dtype = torch.bfloat16
    result["latency"] = latencies(device, args.contexts, args.layers, dtype, args.reps, offload=not args.no_offload)
    result["seconds"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    lat = result["latency"]
    print(f"\n{hw}, synthetic llama2-7b ({lat['layers']} of 32 layers, random weights and KV), {lat['dtype']}, "
          f"ms per forward (median of {args.reps})\n")
    print("| context | full decode | full pass (7) | offloaded decode | offloaded pass (7) | retrieval decode "
          "(4096) | retrieval pass (5) | draft step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in lat["rows"]:
        if "error" in r and "full_decode_s" not in r:
            print(f"| {r['context']} | {r['error']} |")
            continue
        cells = [r.get(k) for k in ("full_decode_s", "full_pass_s", "full_offloaded_decode_s", "full_offloaded_pass_s",
                                    "retrieval_decode_s", "retrieval_pass_s", "draft_step_s")]
        print(f"| {r['context']} | " + " | ".join("-" if c is None else f"{1000 * c:.2f}" for c in cells) + " |")
    ok = result["parity"]["ok"] and result["greedy_equality"]["ok"]
    print(f"\nchecks {'passed' if ok else 'FAILED'}; {result['seconds']:.0f} s; JSON: {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
