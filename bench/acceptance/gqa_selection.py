"""Issue 15: which retrieval selection rule keeps the attention of the *next* tokens, on any model (GQA shapes).

For each book: one prefill of the first P tokens (queries recorded), then S tokens generated greedily with the full
cache, recording every query. For each rule, the retrieval cache is built at the last prompt token exactly as the
engine builds it (``RetrievalCache.build`` with the rule's query window), with a budget of ``P // budget_div`` (1/6 of
the prompt by default). Recovery at step s (query at position n + s, n = P - 1) = attention mass over keys [0, n + s)
on the kept positions: the generated positions [n, n + s) plus the selected prompt positions still holding a slot
(generated tokens overwrite the lowest-ranked ones, as in the cache). Reported: mean over steps 0..S, per layer and
per query head; also each layer's effective number of keys (exp of the attention entropy) and the oracle (each query
head's best individual tokens at that step, an upper bound for any selection shared by a group).

Then acceptance (mode ``retrieval``, greedy, gamma2 6) for the rules in ``--accept-rules`` on one engine with prefix
reuse (one prefill per book serves every rule).

Usage (from the repository root; single thread)::

    python bench/acceptance/gqa_selection.py --model ~/.cache/triforce/qwen2.5-coder/qwen-coder-1.5b.gguf \\
        --books pg84 pg1342 pg2701 pg1661 --prompt-tokens 1500 --steps 32 --accept-tokens 64 \\
        --out bench/results/gqa_selection_qwen1.5b_1500.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from triforce.kv.retrieval import RetrievalCache  # noqa: E402
from triforce.lab.analyze import prefill_recorded  # noqa: E402
from triforce.lab.books import book_prompt, resolve_book  # noqa: E402

#: name -> (score, recent, query_window)
RULES = {
    "mean": ("mean", 0, 1),          # the paper's rule
    "max": ("max", 0, 1),
    "bound": ("bound", 0, 1),
    "mean+recent": ("mean", 64, 1),
    "attn-w1": ("attn", 0, 1),       # softmax mass, last query only
    "attn-w8": ("attn", 0, 8),       # softmax mass, 8 recent queries
    "attn-w1+recent": ("attn", 64, 1),
    "attn": ("attn", 64, 8),         # the new rule (defaults of score "attn")
}


def rule_cache(model, full, budget, chunk_size, rule):
    score, recent, window = RULES[rule]
    return RetrievalCache(model.cfg, full, budget, chunk_size, score, recent=recent, query_window=window)


def recovery(model, full, prompt_q, steps_q, n, budget, chunk_size, rule):
    """Per-step, per-layer, per-head recovery of a rule's selection made at position n: (S+1, L, nh) float64."""
    cache = rule_cache(model, full, budget, chunk_size, rule)
    W = cache.query_window
    cache.build(n, prompt_q[:, :, :, -W:])
    sel = cache.selected[..., :cache.n_selected]  # (L, 1, nkv, m)
    m = sel.shape[-1]
    out = []
    for s, q in enumerate(steps_q):  # q (L, 1, nh, hs) at position n + s
        length = n + s
        probs = _probs(full, q, length)  # (L, 1, nkv, g, length)
        kept_prompt = m - max(0, s - (budget - m))
        r = torch.gather(probs[..., :n], -1, sel[..., :kept_prompt][:, :, :, None, :].expand(
            *probs.shape[:4], kept_prompt)).sum(-1) + probs[..., n:].sum(-1)
        out.append(r.reshape(r.shape[0], -1))
    return torch.stack(out)


def _probs(full, q, length):
    L, B, nh, hs = q.shape
    nkv = full.k.shape[2]
    qg = q.float().reshape(L, B, nkv, nh // nkv, hs)
    logits = torch.matmul(qg, full.k[:, :, :, :length].float().transpose(-1, -2)) / math.sqrt(hs)
    return torch.softmax(logits.double(), -1)


def table(path):
    """Markdown tables of a result file: recovery per rule and book, acceptance per rule and book, per layer."""
    r = json.loads(Path(path).read_text())
    books = list(r["books"])
    if not books:  # --skip-recovery: acceptance only
        return _acceptance_tables(r)
    rules = list(next(iter(r["books"].values()))["recovery"])
    lines = [f"{r['model']} ({r['heads']} query / {r['kv_heads']} KV heads, {r['layers']} layers), "
             f"{r['prompt_tokens']} prompt tokens, budget {r['budget']}, recovery = mean over steps 0..{r['steps']}",
             "", "| rule | " + " | ".join(books) + " | mean |", "|---|" + "---:|" * (len(books) + 1)]
    for rule in rules:
        v = [r["books"][b]["recovery"][rule]["mean"] for b in books]
        lines.append(f"| {rule} | " + " | ".join(f"{x:.3f}" for x in v) + f" | {sum(v) / len(v):.3f} |")
    lines += ["", _acceptance_tables(r)]
    L = r["layers"]
    lines += ["", "Per layer (mean over books), recovery:", "", "| layer | eff. keys | " + " | ".join(rules) + " |",
              "|---:|---:|" + "---:|" * len(rules)]
    for layer in range(L):
        eff = sum(r["books"][b]["effective_keys_per_layer"][layer] for b in books) / len(books)
        v = [sum(r["books"][b]["recovery"][rule]["per_layer"][layer] for b in books) / len(books) for rule in rules]
        lines.append(f"| {layer} | {eff:.0f} | " + " | ".join(f"{x:.2f}" for x in v) + " |")
    return "\n".join(lines)


def _acceptance(eng, ids, samp, budget, rule, args) -> dict:
    """Target acceptance of the retrieval tier (mode ``retrieval``, gamma2 6) at ``budget`` slots, over seeds."""
    from triforce.engine import SpeculationConfig

    spec = SpeculationConfig(mode="retrieval", budget=budget, chunk_size=args.chunk_size, gamma2=6,
                             chunk_score=RULES[rule][0], rebuild_every=args.rebuild_every)
    t0 = time.time()
    proposed = accepted = 0
    per_seed, tokens = [], []
    for seed in range(args.accept_seeds):
        out, st = eng.generate(list(ids), max_new_tokens=args.accept_tokens, sampling=samp, spec=spec, seed=seed)
        tg = st.tiers["target"]
        proposed += tg.get("proposed") or 0
        accepted += tg.get("accepted") or 0
        per_seed.append(tg.get("acceptance_rate"))
        tokens.append(out)
    return {"acceptance_rate": accepted / proposed if proposed else None, "proposed": proposed, "accepted": accepted,
            "per_seed": per_seed, "budget": budget, "tokens": tokens if len(tokens) > 1 else tokens[0],
            "rebuilds": st.tiers.get("retrieval", {}).get("rebuilds"), "seconds": time.time() - t0}


def _acceptance_tables(r) -> str:
    """Markdown: acceptance per rule and book at the run's budget, then against budget (``--accept-budget-divs``)."""
    a = r.get("acceptance", {})
    acc, lines = a.get("runs", {}), []
    if acc:
        a_rules = list(next(iter(acc.values())))
        lines += [f"Acceptance (T = {a['temperature']}, {a['new_tokens']} new tokens, gamma2 6, budget {r['budget']}, "
                  f"rebuild_every {a['rebuild_every']}):", "",
                  "| rule | " + " | ".join(acc) + " | mean |", "|---|" + "---:|" * (len(acc) + 1)]
        for rule in a_rules:
            v = [acc[b][rule]["acceptance_rate"] for b in acc]
            lines.append(f"| {rule} | " + " | ".join(f"{x:.3f}" for x in v) + f" | {sum(v) / len(v):.3f} |")
    for book, by_rule in a.get("budget_curve", {}).items():
        budgets = sorted({int(b) for c in by_rule.values() for b in c} | {r["budget"]})
        lines += ["", f"Acceptance against budget, {book} ({r['prompt_tokens']} prompt tokens):", "",
                  "| rule | " + " | ".join(str(b) for b in budgets) + " |", "|---|" + "---:|" * len(budgets)]
        for rule, curve in by_rule.items():
            curve = dict(curve, **{str(r["budget"]): acc[book][rule]})
            lines.append(f"| {rule} | " + " | ".join(f"{curve[str(b)]['acceptance_rate']:.3f}" for b in budgets) + " |")
    return "\n".join(lines)


def main(argv=None):
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--table-from":
        print(table(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--books", nargs="+", default=["pg84", "pg1342", "pg2701", "pg1661"])
    p.add_argument("--books-dir", default=str(ROOT.parent / "shared" / "data" / "books"))
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--budget-div", type=int, default=6, help="budget = prompt tokens // this (6)")
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=32, help="generated steps the recovery is averaged over (32)")
    p.add_argument("--rules", nargs="+", default=list(RULES))
    p.add_argument("--accept-rules", nargs="*", default=["mean", "attn"], choices=["mean", "max", "bound", "attn"],
                   help="chunk scores of the acceptance runs, with the engine's defaults (mean attn)")
    p.add_argument("--accept-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rebuild-every", type=int, default=None, help="acceptance runs: re-select every N tokens")
    p.add_argument("--accept-budget-divs", type=int, nargs="*", default=None,
                   help="acceptance against budget: also run each --accept-rules rule at budget = prompt // D for each "
                        "D (one prefill serves all; results under acceptance.budget_curve)")
    p.add_argument("--accept-seeds", type=int, default=1, help="acceptance runs per rule and budget (seeds 0..N-1; "
                   "under sampling the rate is proposed-weighted over the seeds)")
    p.add_argument("--skip-recovery", action="store_true", help="acceptance only (no recovery/oracle analysis)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from triforce.engine import Engine
    from triforce.formats.loading import load_model
    from triforce.speculation.sampling import SamplingParams

    t_all = time.time()
    lm = load_model(args.model)
    model, tok = lm.model, lm.tokenizer
    cfg = model.cfg
    budget = args.prompt_tokens // args.budget_div
    res = {"command": "python bench/acceptance/gqa_selection.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "model": args.model or "SmolLM2-135M-Instruct", "layers": cfg.num_hidden_layers,
           "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "prompt_tokens": args.prompt_tokens,
           "budget": budget, "chunk_size": args.chunk_size, "steps": args.steps,
           "rules": {r: RULES[r] for r in args.rules}, "books": {}}
    for book in args.books:
        ids = book_prompt(tok, resolve_book(book, args.books_dir), args.prompt_tokens)
        P, n = len(ids), len(ids) - 1
        t0 = time.time()
        full, q_last, logits = prefill_recorded(model, ids, extra_capacity=args.steps + args.accept_tokens + 16)
        W = 8
        prompt_q = torch.stack([q[:, :, -W:] for q in full.queries]).clone()  # (L, 1, nh, W, hs) ending at n
        steps_q = [q_last]
        model.set_request_length(full.capacity)
        for i in range(0 if args.skip_recovery else args.steps):
            t = int(logits.argmax())
            logits = model(torch.tensor([[t]]), torch.tensor([P + i]), full)[0, -1]
            steps_q.append(full.query_at(P + i).clone())
        rec = {}
        for rule in ([] if args.skip_recovery else args.rules):
            r = recovery(model, full, prompt_q, steps_q, n, budget, args.chunk_size, rule)  # (S+1, L, nh)
            rec[rule] = {"mean": float(r.mean()), "step0": float(r[0].mean()),
                         "per_layer": r.mean((0, 2)).tolist(), "per_head": r.mean(0).tolist()}
        # oracle (per query head, re-chosen each step, same slot count) and effective keys per layer at step 0
        orc, eff = [], None
        for s, q in enumerate([] if args.skip_recovery else steps_q):
            pr = _probs(full, q, n + s)
            m = min(budget, n) - max(0, s - (budget - min(budget, n)))
            orc.append(pr[..., :n].sort(-1, descending=True).values[..., :m].sum(-1).reshape(pr.shape[0], -1)
                       + pr[..., n:].sum(-1).reshape(pr.shape[0], -1))
            if s == 0:
                ent = -(pr * pr.clamp_min(1e-300).log()).sum(-1)
                eff = ent.exp().reshape(pr.shape[0], -1)
        if orc:
            orc = torch.stack(orc)
            rec["oracle"] = {"mean": float(orc.mean()), "step0": float(orc[0].mean()),
                             "per_layer": orc.mean((0, 2)).tolist(), "per_head": orc.mean(0).tolist()}
            res["books"][book] = {"recovery": rec, "effective_keys_per_layer": eff.mean(1).tolist(),
                                  "effective_keys_per_head": eff.tolist(), "analysis_seconds": time.time() - t0}
        print(book, {k: round(v["mean"], 3) for k, v in rec.items()}, f"{time.time() - t0:.0f}s", flush=True)
        # acceptance: an engine with prefix reuse, handed this prefill (its KV of the prompt is the engine's own)
        if args.accept_rules:
            eng = Engine(model, eos_ids=lm.eos_ids)
            full.rollback(P)  # forget the recovery steps: the engine adopts the prompt's KV only
            eng.adopt_prefix(full, list(ids))
            samp = SamplingParams(temperature=args.temperature, top_p=0.9 if args.temperature > 0 else 1.0)
            res["acceptance"] = {"temperature": args.temperature, "new_tokens": args.accept_tokens, "gamma2": 6,
                                 "rebuild_every": args.rebuild_every, "runs": res.get("acceptance", {}).get("runs", {}),
                                 "budget_curve": res.get("acceptance", {}).get("budget_curve", {})}
            for rule in args.accept_rules:
                runs = _acceptance(eng, ids, samp, budget, rule, args)
                res["acceptance"]["runs"].setdefault(book, {})[rule] = runs
                print(book, rule, budget, round(runs["acceptance_rate"] or 0, 3), f"{runs['seconds']:.0f}s", flush=True)
                for d in args.accept_budget_divs or []:
                    b = max(P // d, args.chunk_size + 8 + 3)
                    runs = _acceptance(eng, ids, samp, b, rule, args)
                    res["acceptance"].setdefault("budget_curve", {}).setdefault(book, {}).setdefault(rule, {})[
                        str(b)] = runs
                    print(book, rule, b, round(runs["acceptance_rate"] or 0, 3), f"{runs['seconds']:.0f}s", flush=True)
            del eng
        del full
        res["seconds_total"] = time.time() - t_all
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))  # after every book: partial results survive


if __name__ == "__main__":
    main()
