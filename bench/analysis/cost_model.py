"""Cost model: step latency of every speculation tier against context length (TriForce Sec. 4.3, Appendix).

For each context length the caches are filled with random keys/values (no prefill, see
``triforce.lab.synthetic.fill_random_kv``) and each tier's forward is timed, interleaved over repetitions, medians:

* ``full_decode`` target + full KV cache, 1 token (autoregressive);   ``full_pass`` the same, gamma2 + 1 tokens;
* ``retrieval_decode`` / ``retrieval_pass`` target + retrieval cache of --budget slots, 1 / gamma1 + 1 tokens;
* ``draft_step`` / ``draft_pass`` draft + StreamingLLM cache, 1 / gamma1 + 1 tokens (none without a draft);
* ``ngram_propose`` one n-gram (prompt-lookup) proposal: the model-free bottom tier.

With ``--acceptance`` it adds the predicted speedup over autoregressive decoding of each ``--chains`` hierarchy
(``triforce.lab.costmodel.predict``). ``--synthetic`` runs paper-shaped random models (timing only; every output says
``synthetic``).

    python bench/analysis/cost_model.py --contexts 1024 4096 16384 65536 --threads 2 \
        --out bench/results/cost_model_smollm2.json --png docs/img/cost_model_smollm2.png
    python bench/analysis/cost_model.py --synthetic llama2-7b --layers 2 --contexts 16384 32768 65536 --threads 2 \
        --out bench/results/cost_model_llama2-7b.json --png docs/img/cost_model_llama2-7b.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

TIER_KEYS = ("full_decode", "full_pass", "retrieval_decode", "retrieval_pass", "draft_step", "draft_pass",
             "ngram_propose")


class _Parser(argparse.ArgumentParser):
    """One-line errors, exit status 2 (as ``triforce generate``)."""

    def error(self, message: str):
        self.exit(2, f"cost_model.py: error: {message} (see --help)\n")


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check the arguments (one-line error, exit status 2, before any model is loaded)."""
    from triforce.lab.synthetic import SYNTHETIC_SHAPES

    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target: Hugging Face folder, .gguf or hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--synthetic", metavar="NAME", help=f"random paper-shaped target instead of --model, one of "
                   f"{', '.join(SYNTHETIC_SHAPES)} (timing only)")
    p.add_argument("--layers", type=int, help="decoder blocks of the synthetic target (default: all of the shape's)")
    p.add_argument("--draft", help="draft model: a folder/.gguf/hub id, or with --synthetic a shape name (default "
                   "llama-68m, with the target's vocabulary); 'none' = the n-gram drafter (default for --model)")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536], help="context lengths")
    p.add_argument("--gamma1", type=int, default=4, help="draft tokens per retrieval-tier verification (4)")
    p.add_argument("--gamma2", type=int, default=6, help="tokens per target verification (6)")
    p.add_argument("--budget", type=int, default=4096, help="retrieval cache slots (4096)")
    p.add_argument("--chunk-size", type=int, default=8, help="retrieval chunk size (8)")
    p.add_argument("--draft-sink", type=int, default=16)
    p.add_argument("--draft-window", type=int, default=240)
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per tier and context (7)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (2)")
    p.add_argument("--acceptance", nargs="*", default=[], metavar="TIER=RATE",
                   help="acceptance rates for predictions, e.g. target=0.8 retrieval=0.9 (tiers: draft, retrieval, "
                        "target)")
    p.add_argument("--chains", nargs="*", default=None, metavar="KIND:G,...",
                   help="hierarchies to predict, bottom first (default: retrieval:G2, BOTTOM:G2, "
                        "BOTTOM:G1,retrieval:G2 with BOTTOM = draft or ngram)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON output path")
    p.add_argument("--png", help="PNG chart path (needs matplotlib: pip install 'triforce[bench]')")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    if a.synthetic is not None and a.synthetic not in SYNTHETIC_SHAPES:
        p.error(f"--synthetic must be one of {', '.join(SYNTHETIC_SHAPES)}, got {a.synthetic!r}")
    if a.synthetic is not None and a.model is not None:
        p.error("--model and --synthetic exclude each other")
    if a.layers is not None and a.synthetic is None:
        p.error("--layers needs --synthetic NAME")
    if a.layers is not None and a.layers < 1:
        p.error(f"--layers must be >= 1, got {a.layers}")
    if a.synthetic is not None and a.draft not in (None, "none") and a.draft not in SYNTHETIC_SHAPES:
        p.error(f"with --synthetic, --draft must be a shape name ({', '.join(SYNTHETIC_SHAPES)}) or none, "
                f"got {a.draft!r}")
    for name in ("gamma1", "gamma2", "budget", "chunk_size", "draft_window", "reps", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.draft_sink < 0:
        p.error(f"--draft-sink must be >= 0, got {a.draft_sink}")
    if any(n < 1 for n in a.contexts):
        p.error(f"--contexts must be >= 1, got {a.contexts}")
    if a.budget < a.chunk_size + max(a.gamma1, a.gamma2) + 2:
        smallest = a.chunk_size + max(a.gamma1, a.gamma2) + 2
        p.error(f"--budget must be >= chunk_size + max(gamma1, gamma2) + 2 = {smallest}")
    acc = {}
    for item in a.acceptance:
        tier, _, rate = item.partition("=")
        try:
            value = float(rate)
        except ValueError:
            value = -1.0
        if tier not in ("draft", "retrieval", "target") or not 0 <= value <= 1:
            p.error(f"--acceptance entries must be TIER=RATE with TIER in draft, retrieval, target and RATE in [0, 1], "
                    f"got {item!r}")
        acc[tier] = value
    a.acceptance = acc
    try:
        from triforce.formats.loading import parse_device, parse_dtype

        a.torch_dtype, a.torch_device = parse_dtype(a.dtype), parse_device(a.device)
    except ValueError as e:
        p.error(str(e))
    has_draft = a.draft != "none" and (a.draft is not None or a.synthetic is not None)
    bottom = "draft" if has_draft else "ngram"
    chains = a.chains if a.chains is not None else [f"retrieval:{a.gamma2}", f"{bottom}:{a.gamma2}",
                                                    f"{bottom}:{a.gamma1},retrieval:{a.gamma2}"]
    a.chain_list = []
    from triforce.engine import SpeculationConfig

    for c in chains:
        try:
            chain = SpeculationConfig(tiers=c, budget=a.budget, chunk_size=a.chunk_size).chain
        except ValueError as e:
            p.error(f"--chains: {e}")
        if any(k == "draft" for k, _ in chain) and not has_draft:
            p.error(f"--chains {c!r} uses a draft model but there is none (--draft)")
        a.chain_list.append((c, chain))
    a.has_draft = has_draft
    return a


def build_models(a):
    """(target, draft or None, label dict) for the arguments."""
    from triforce.kv.memory import check_fits

    if a.synthetic:
        from triforce.lab.synthetic import random_model, synthetic_config, synthetic_label

        cfg = synthetic_config(a.synthetic, a.layers)
        d_name = (a.draft or "llama-68m") if a.has_draft else None
        d_cfg = synthetic_config(d_name, vocab_size=cfg.vocab_size) if d_name else None
        itemsize = torch.empty((), dtype=a.torch_dtype).element_size()
        n_params = lambda c: (c.num_hidden_layers * (c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads)  # noqa: E731
                                                     * c.head_dim + c.num_attention_heads * c.head_dim * c.hidden_size
                                                     + 3 * c.hidden_size * c.intermediate_size)
                              + 2 * c.vocab_size * c.hidden_size)
        check_fits({"synthetic weights": itemsize * (n_params(cfg) + (n_params(d_cfg) if d_cfg else 0))},
                   a.torch_device, "the synthetic models")
        target = random_model(cfg, a.torch_dtype, a.torch_device, seed=a.seed)
        draft = random_model(d_cfg, a.torch_dtype, a.torch_device, seed=a.seed + 1) if d_cfg else None
        label = synthetic_label(a.synthetic, cfg.num_hidden_layers, d_name)
        label.update(model=target.name, draft=draft.name if draft else "ngram")
        return target, draft, label
    from triforce.formats.loading import load_model

    target = load_model(a.model, a.torch_dtype, a.torch_device).model
    draft = load_model(a.draft, a.torch_dtype, a.torch_device).model if a.has_draft else None
    label = {"synthetic": False, "model": a.model or "SmolLM2-135M-Instruct",
             "draft": a.draft if a.has_draft else "ngram"}
    return target, draft, label


def check_memory(a, target, draft) -> None:
    """Refuse, before allocating, a largest context whose caches do not fit."""
    from triforce.kv.caches import kv_bytes
    from triforce.kv.memory import check_fits

    n = max(a.contexts) + max(a.gamma1, a.gamma2) + 2
    needed = {"full KV cache": kv_bytes(target.cfg, n, target.dtype),
              "retrieval cache": kv_bytes(target.cfg, a.budget, target.dtype)}
    if draft is not None:
        needed["draft cache"] = kv_bytes(draft.cfg, a.draft_sink + a.draft_window + 64, draft.dtype)
    check_fits(needed, target.device, f"context {max(a.contexts)}", already={"weights": target.weight_bytes()})


def table(result: dict) -> str:
    """Markdown table: ms per tier forward and bytes per context, then the predictions."""
    cols = [k for k in TIER_KEYS if any(r.get(k) is not None for r in result["rows"])]
    head = ["context"] + [f"{k} ms" for k in cols] + ["full KV MB", "target weights MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in result["rows"]:
        cells = [str(r["context"])] + [f"{1000 * r[k]:.3f}" if r[k] is not None else "–" for k in cols]
        cells += [f"{r['bytes']['full_kv'] / 1e6:.0f}", f"{r['bytes']['target_weights'] / 1e6:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if result["predictions"]:
        names = [c["config"] for c in result["predictions"][0]["chains"]]
        lines += ["", "| context | " + " | ".join(f"`{n}` predicted speedup (engine schedule)" for n in names) + " |",
                  "|" + "---:|" * (len(names) + 1)]
        for p in result["predictions"]:
            lines.append(f"| {p['context']} | " + " | ".join(f"{c['speedup']:.2f} ({c['engine_speedup']:.2f})"
                                                             for c in p["chains"]) + " |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Step latency (ms) against context, log-x, one line per tier forward."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("cost_model.py: error: --png needs matplotlib: pip install 'triforce[bench]'") from None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    xs = [r["context"] for r in result["rows"]]
    for k in TIER_KEYS:
        ys = [r.get(k) for r in result["rows"]]
        if all(y is not None for y in ys) and k != "ngram_propose":
            block = result["rows"][0]["blocks"][k]
            ax.plot(xs, [1000 * y for y in ys], marker="o", label=f"{k} ({block} token{'s' if block > 1 else ''})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x // 1024}K" if x >= 1024 else str(x) for x in xs])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("latency per forward (ms, median)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    title = result["model"]
    if result["synthetic"]:
        title = f"SYNTHETIC (random weights, random KV): {title}"
    ax.set_title(f"{title}\n{result['dtype']}, {result['threads']} threads, budget {result['budget']}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    """Run the measurement; returns the exit status (2 on bad input or insufficient memory)."""
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    from tqdm import tqdm

    from triforce.kv.memory import InsufficientMemoryError
    from triforce.lab.costmodel import measure_tier_latencies, predict

    try:
        target, draft = None, None
        target, draft, label = build_models(a)
        check_memory(a, target, draft)
    except (InsufficientMemoryError, ValueError) as e:
        print(f"cost_model.py: error: {e}", file=sys.stderr)
        return 2
    kinds = 4 + (2 if draft is not None else 0) + 1
    bar = tqdm(total=len(a.contexts) * a.reps * kinds, desc="timed forwards", file=sys.stderr, disable=a.no_progress)
    t0 = time.time()
    rows = measure_tier_latencies(target, draft, a.contexts, gamma1=a.gamma1, gamma2=a.gamma2, budget=a.budget,
                                  chunk_size=a.chunk_size, draft_sink=a.draft_sink, draft_window=a.draft_window,
                                  reps=a.reps, progress=bar.update, seed=a.seed)
    bar.close()
    predictions = []
    if a.acceptance:
        for r in rows:
            entry = {"context": r["context"], "acceptance": a.acceptance, "chains": []}
            for text, chain in a.chain_list:
                try:
                    p = predict(chain, r, a.acceptance)
                except ValueError as e:
                    print(f"cost_model.py: no prediction for {text}: {e}", file=sys.stderr)
                    continue
                entry["chains"].append({"config": text, **p})
            predictions.append(entry)
    result = {
        **label,
        "dtype": a.dtype, "device": str(a.torch_device), "threads": a.threads, "gamma1": a.gamma1, "gamma2": a.gamma2,
        "budget": a.budget, "chunk_size": a.chunk_size, "draft_sink": a.draft_sink, "draft_window": a.draft_window,
        "reps": a.reps, "interleaved": True, "kv": "random (fill_random_kv), no prefill",
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "torch": torch.__version__},
        "command": "python bench/analysis/cost_model.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "seconds": round(time.time() - t0, 1),
        "rows": rows, "predictions": predictions,
    }
    if result["synthetic"]:
        print(f"SYNTHETIC model (random weights, random KV; timing only): {result['model']}, draft {result['draft']}")
    else:
        print(f"model {result['model']}, draft {result['draft']}")
    print(table(result))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    if a.png:
        plot(result, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
