"""Fewer bytes per token, measured: weight and KV dtypes of the verifier and of the tiers below it.

On the embedded SmolLM2-135M-Instruct and a book prompt (default: 8,000 tokens of Pride and Prejudice), for each
configuration: mean time between tokens (decode only), the acceptance rate of each verifying tier, and greedy
agreement with fp32 autoregressive decoding (tokens equal to the fp32 reference before the first difference, and
the share of equal positions). Configurations that change only the tiers below the verifier
(``--lower-weights``, ``--lower-kv-dtype``) must agree fully: the verifier decides every token. Configurations
that change the verifier (``--dtype bfloat16``, ``--quantize int8``, ``--kv-dtype bfloat16``) define a different
output distribution; their agreement says how different.

Every configuration of one engine reuses its prompt KV (prefix reuse), so one prefill per verifier; repetitions are
interleaved across configurations and medians reported. fp32 models get oneDNN-prepacked weights for multi-token
passes, as ``triforce generate`` does by default on a CPU (``--packed-weights auto``). JSON output; ``--markdown``
prints the table.

    OMP_WAIT_POLICY=PASSIVE python bench/e2e/dtypes.py --prompt-tokens 8000 --new-tokens 64 --reps 2 --threads 2 \
        --out bench/results/dtypes.json --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import add_prompt_options  # noqa: E402

BOOKS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "books")

# name -> (verifier: dict(dtype, quantize, kv_dtype), speculation kwargs)
FP32 = dict(dtype="float32", quantize=None, kv_dtype=None)
CONFIGS = {
    "fp32 autoregressive": (FP32, dict(mode="autoregressive")),
    "bf16 weights+KV autoregressive": (dict(dtype="bfloat16", quantize=None, kv_dtype=None),
                                       dict(mode="autoregressive")),
    "int8 weights autoregressive": (dict(dtype="float32", quantize="int8", kv_dtype=None), dict(mode="autoregressive")),
    "bf16 KV autoregressive": (dict(dtype="float32", quantize=None, kv_dtype="bfloat16"), dict(mode="autoregressive")),
    "retrieval": (FP32, dict(mode="retrieval", budget=1024)),
    "retrieval, lower int8": (FP32, dict(mode="retrieval", budget=1024, lower_weights="int8")),
    "retrieval, lower int8 + bf16 KV": (FP32, dict(mode="retrieval", budget=1024, lower_weights="int8",
                                                   lower_kv_dtype="bfloat16")),
    "retrieval, lower bf16": (FP32, dict(mode="retrieval", budget=1024, lower_weights="bfloat16")),
    "ngram": (FP32, dict(tiers="ngram:6")),
    "ngram>retrieval, lower int8": (FP32, dict(tiers="ngram:4,retrieval:6", budget=1024, lower_weights="int8")),
}


def print_table(results: list[dict], new_tokens: int) -> None:
    """The markdown table of the docs from the JSON rows."""
    base = {k: next((r[f"{k}_ms_per_token"] for r in results if r["config"] == "fp32 autoregressive"), None)
            for k in ("greedy", "sampled")}
    print("| configuration | greedy ms/token | T=0.6 ms/token | speedup vs fp32 AR, greedy / T=0.6 | target acceptance "
          "greedy / T=0.6 | greedy tokens equal to fp32 AR (prefix) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        acc = " / ".join("-" if a is None else f"{a:.3f}" for a in (r["greedy_target_acceptance"],
                                                                    r["sampled_target_acceptance"]))
        sp = " / ".join(f"{base[k] / r[f'{k}_ms_per_token']:.2f}x" if base[k] else "-" for k in ("greedy", "sampled"))
        print(f"| {r['config']} | {r['greedy_ms_per_token']:.1f} | {r['sampled_ms_per_token']:.1f} | {sp} | {acc} | "
              f"{r.get('agree_prefix_tokens', '-')}/{new_tokens} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_options(p, prompt_tokens=8000, new_tokens=64, book="pg1342.txt")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--out", default="bench/results/dtypes.json")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--table", metavar="JSON", help="only print the markdown table of an earlier run's JSON")
    args = p.parse_args()
    if args.table:
        with open(args.table) as f:
            data = json.load(f)
        print_table(data["results"], data["meta"]["new_tokens"])
        return 0
    torch.set_num_threads(args.threads)

    from tqdm import tqdm

    from triforce import SamplingParams, SpeculationConfig
    from triforce.engine import Engine
    from triforce.formats.loading import load_model
    from triforce.model.quant import lower_precision_copy
    from triforce.text.prompts import strip_gutenberg

    with open(os.path.join(BOOKS, args.book), encoding="utf-8") as f:
        text = strip_gutenberg(f.read())
    engines: dict[tuple, Engine] = {}
    loaded: dict[str, object] = {}
    prompt = None
    for name in args.configs:
        verifier, _ = CONFIGS[name]
        key = tuple(sorted((k, str(v)) for k, v in verifier.items()))
        if key in engines:
            continue
        if verifier["dtype"] not in loaded:
            loaded[verifier["dtype"]] = load_model(None, verifier["dtype"])
            if loaded[verifier["dtype"]].model.packing_pays():  # as `triforce generate` does by default
                loaded[verifier["dtype"]].model.pack_weights()
        lm = loaded[verifier["dtype"]]
        if prompt is None:
            prompt = lm.tokenizer(text)["input_ids"][:args.prompt_tokens]
        model = lower_precision_copy(lm.model, verifier["quantize"]) if verifier["quantize"] else lm.model
        engines[key] = Engine(model, eos_ids=(), kv_dtype=verifier["kv_dtype"])  # no EOS: every run has N tokens

    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=0.6, top_p=0.9)
    runs: dict[str, list] = {n: [] for n in args.configs}
    tokens: dict[str, list[int]] = {}
    bar = tqdm(total=args.reps * len(args.configs) * 2, desc="runs", file=sys.stderr)
    for rep in range(args.reps):
        for name in args.configs:
            verifier, spec_kw = CONFIGS[name]
            engine = engines[tuple(sorted((k, str(v)) for k, v in verifier.items()))]
            spec = SpeculationConfig(**spec_kw)
            out, st = engine.generate(prompt, max_new_tokens=args.new_tokens, sampling=greedy, spec=spec)
            tokens[name] = out
            _, st2 = engine.generate(prompt, max_new_tokens=args.new_tokens, sampling=sampled, spec=spec, seed=rep)
            runs[name].append({"greedy": st.to_dict(), "sampled": st2.to_dict()})
            bar.update(2)
    bar.close()
    ref = tokens.get("fp32 autoregressive")
    results = []
    for name in args.configs:
        r = runs[name]
        row = {"config": name, "verifier": CONFIGS[name][0], "speculation": CONFIGS[name][1]}
        for kind in ("greedy", "sampled"):
            row[f"{kind}_ms_per_token"] = statistics.median(x[kind]["mean_time_between_tokens_ms"] for x in r)
            row[f"{kind}_ms_per_token_all"] = [x[kind]["mean_time_between_tokens_ms"] for x in r]
            row[f"{kind}_tiers"] = r[-1][kind]["tiers"]
        acc = r[-1]["sampled"]["tiers"].get("target", {}).get("acceptance_rate")
        row["sampled_target_acceptance"] = acc
        row["greedy_target_acceptance"] = r[-1]["greedy"]["tiers"].get("target", {}).get("acceptance_rate")
        if ref is not None:
            out = tokens[name]
            first = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
            row["agree_prefix_tokens"] = first
            row["agree_share"] = sum(a == b for a, b in zip(out, ref)) / len(ref)
        results.append(row)
    meta = {"book": args.book, "prompt_tokens": len(prompt), "new_tokens": args.new_tokens, "reps": args.reps,
            "threads": args.threads, "model": "SmolLM2-135M-Instruct", "interleaved": True}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    if args.markdown:
        print_table(results, args.new_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
