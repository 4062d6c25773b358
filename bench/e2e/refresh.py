"""Retrieval refresh over long generations: tier-1 acceptance along the text, with and without re-selection.

TriForce (arXiv 2404.11912, Sec. 4.1, "contextual locality") builds the retrieval cache once after prefill and
suggests rebuilding it when acceptance falls. This measures, on book prompts continued for ``--new-tokens``
tokens at T = 0.6 / top-p 0.9, the acceptance of the retrieval tier's proposals by the full-cache target
(mode ``retrieval``) per window of ``--window`` generated tokens, for:

* ``never``: the paper's policy (re-selection only when the generated tokens fill the budget);
* ``below-A``: ``rebuild_below=A``, re-select when the acceptance over the tier's last 16 proposed tokens < A;
* ``every-N``: ``rebuild_every=N``, re-select every N generated tokens.

A verification is counted in the window where its block starts; rebuilds in the window where they happen.
The policies of one prompt run back to back in one process with the same seed (their texts differ after the
first rejection: speculative decoding consumes the random draws differently), interleaved over ``--reps``.
Prompts use the ``continue`` kind of bench/e2e/beyond.py. JSON output; ``--markdown`` prints the tables.

    python bench/e2e/refresh.py --books pg1342.txt pg84.txt --prompt-tokens 4000 --new-tokens 1536 --budget 1024 \
        --threads 2 --out bench/results/refresh.json --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from beyond import build_prompt, load_book, repeated_ngram_share  # noqa: E402

from common import add_run_options  # noqa: E402


def parse_policy(name: str) -> dict:
    """``never`` | ``below-A`` | ``every-N`` -> SpeculationConfig keyword arguments.

    Raises:
        ValueError: any other name.
    """
    if name == "never":
        return {}
    kind, _, value = name.partition("-")
    try:
        if kind == "below":
            return {"rebuild_below": float(value)}
        if kind == "every":
            return {"rebuild_every": int(value)}
    except ValueError:
        pass
    raise ValueError(f"policy must be 'never', 'below-A' (0 < A <= 1) or 'every-N' (N >= 1), got {name!r}")


def _mean_or_none(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return round(statistics.mean(vals), 4) if vals else None


def run_one(tf, ids: list[int], spec, sampling, new_tokens: int, window: int, seed: int) -> dict:
    """Generate with ``spec`` and count, per window of ``window`` generated tokens, the target's verifications,
    proposed and accepted tokens, the retrieval tier's rebuilds (the first, after prefill, is not counted) and the
    share of the window's tokens that repeat an earlier 4-gram (loops make acceptance trivially high).

    Returns:
        ``{"stats": GenerationStats, "windows": [...], "token_ids": [...]}``.
    """
    engine = tf.engine
    captured = {}
    build = engine.build_hierarchy

    def capture(*args, **kwargs):  # keep a handle on the tiers to read their counters while streaming
        captured["top"] = build(*args, **kwargs)
        return captured["top"]

    engine.build_hierarchy = capture
    try:
        gen = engine.stream(ids, max_new_tokens=new_tokens, sampling=sampling, spec=spec, seed=seed)
        windows: list[dict] = []
        last = (0, 0, 0, 1)
        n = 0
        tokens: list[int] = []
        while True:
            try:
                tokens.append(next(gen))
            except StopIteration as stop:
                stats = stop.value
                break
            top = captured["top"]
            now = (top.stats.verifications, top.stats.proposed, top.stats.accepted, top.drafter.stats.rebuilds)
            w = n // window  # the token just yielded is number n (0-based); a new block's counters appear here
            while len(windows) <= w:
                windows.append({"start": len(windows) * window, "tokens": 0, "verifications": 0, "proposed": 0,
                                "accepted": 0, "rebuilds": 0})
            win = windows[w]
            win["tokens"] += 1
            for key, a, b in zip(("verifications", "proposed", "accepted", "rebuilds"), now, last):
                win[key] += a - b
            last = now
            n += 1
    finally:
        engine.build_hierarchy = build
    for win in windows:
        win["acceptance"] = round(win["accepted"] / win["proposed"], 4) if win["proposed"] else None
        a, b = win["start"], win["start"] + win["tokens"]
        win["repeated_4gram_share"] = repeated_ngram_share(ids + tokens[:a], tokens[a:b])
    return {"stats": stats, "windows": windows, "token_ids": tokens}


LOOP_SHARE = 0.5  # a window where at least this share of tokens repeats an earlier 4-gram counts as looping


def summarize(records: list[dict], policies: list[str]) -> list[dict]:
    """One row per policy: acceptance overall, per window and over the windows that are not looping (fewer than
    :data:`LOOP_SHARE` of their tokens repeat an earlier 4-gram), rebuilds, tokens/s (median) and its paired ratio to
    ``never`` (same book and repetition)."""
    n_win = max((len(r["windows"]) for r in records), default=0)
    base = {(r["book"], r["rep"]): r["tokens_per_second"] for r in records if r["policy"] == "never"}
    rows = []
    for name in policies:
        rs = [r for r in records if r["policy"] == name]
        if not rs:
            continue
        ratios = [r["tokens_per_second"] / base[(r["book"], r["rep"])] for r in rs if (r["book"], r["rep"]) in base]
        per_window, rep_window = [], []
        for w in range(n_win):
            wins = [r["windows"][w] for r in rs if w < len(r["windows"])]
            rep_window.append(_mean_or_none([x["repeated_4gram_share"] for x in wins]))
            prop, acc = sum(x["proposed"] for x in wins), sum(x["accepted"] for x in wins)
            per_window.append(round(acc / prop, 4) if prop else None)
        calm = [x for r in rs for x in r["windows"] if (x["repeated_4gram_share"] or 0) < LOOP_SHARE]
        calm_prop = sum(x["proposed"] for x in calm)
        rows.append({
            "policy": name, "runs": len(rs),
            "acceptance": round(sum(r["tiers"]["target"]["accepted"] for r in rs)
                                / sum(r["tiers"]["target"]["proposed"] for r in rs), 4),
            "acceptance_per_window": per_window,
            "repeated_4gram_share_per_window": rep_window,
            "repeated_4gram_share": _mean_or_none([r["repeated_4gram_share"] for r in rs]),
            "non_looping_windows": len(calm),
            "windows": sum(len(r["windows"]) for r in rs),
            "acceptance_non_looping": round(sum(x["accepted"] for x in calm) / calm_prop, 4) if calm_prop else None,
            "tokens_per_verification": round(statistics.mean(r["tokens_per_verification"] for r in rs), 3),
            "rebuilds": round(statistics.mean(r["rebuilds"] for r in rs), 2),
            "acceptance_rebuilds": round(statistics.mean(r["acceptance_rebuilds"] for r in rs), 2),
            "generated": round(statistics.mean(r["generated"] for r in rs), 1),
            "finish_reasons": sorted({r["finish_reason"] for r in rs}),
            "tokens_per_second": round(statistics.median(r["tokens_per_second"] for r in rs), 3),
            "tokens_per_second_vs_never": round(statistics.median(ratios), 3) if ratios else None,
        })
    return rows


def markdown(summary: list[dict], window: int) -> str:
    """The summary as a Markdown table, one column per window of generated tokens."""
    n_win = max((len(r["acceptance_per_window"]) for r in summary), default=0)
    fmt = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    lines = ["| policy | acceptance | acceptance, non-looping windows (count) | repeated 4-grams "
             "| rebuilds (by acceptance) | tokens/verification | tokens/s | vs never | "
             + " | ".join(f"{w * window}–" for w in range(n_win)) + " |",
             "|---|" + "---:|" * (7 + n_win)]
    for r in summary:
        lines.append(f"| `{r['policy']}` | {r['acceptance']:.3f} | {fmt(r['acceptance_non_looping'])} "
                     f"({r['non_looping_windows']}/{r['windows']}) | {fmt(r['repeated_4gram_share'])} "
                     f"| {r['rebuilds']:.1f} ({r['acceptance_rebuilds']:.1f}) "
                     f"| {r['tokens_per_verification']:.2f} | {r['tokens_per_second']:.2f} "
                     f"| {fmt(r['tokens_per_second_vs_never'])} | "
                     + " | ".join(fmt(a) for a in r["acceptance_per_window"]) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--books", nargs="+", default=["pg1342.txt", "pg84.txt"])
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--new-tokens", type=int, default=1536)
    p.add_argument("--window", type=int, default=128, help="generated tokens per reported window (128)")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--gamma", type=int, default=6, help="tokens the retrieval tier proposes per verification (6)")
    p.add_argument("--chunk-score", default="mean")
    p.add_argument("--policies", nargs="+", default=["never", "below-0.5", "below-0.7", "every-128"])
    add_run_options(p, "bench/results/refresh.json")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="run nothing: summarize the records of these earlier "
                   "outputs together (e.g. one process per book)")
    args = p.parse_args()
    if args.merge:
        parts = [json.load(open(path)) for path in args.merge]
        records = [r for part in parts for r in part["records"]]
        summary = summarize(records, list(dict.fromkeys(r["policy"] for r in records)))
        keys = ("threads", "temperature", "top_p", "budget", "gamma", "chunk_score", "window", "prompt_tokens",
                "new_tokens")
        with open(args.out, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "merged": [q["command"] for q in parts],
                       **{k: parts[0].get(k) for k in keys}, "records": records, "summary": summary}, f, indent=2)
        if args.markdown:
            print(markdown(summary, parts[0].get("window", args.window)))
        return 0
    try:
        policies = {name: parse_policy(name) for name in args.policies}
    except ValueError as e:
        p.error(f"--policies: {e}")
    if args.window < 1 or args.reps < 1:
        p.error("--window and --reps must be >= 1")
    torch.set_num_threads(args.threads)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    from tqdm import tqdm

    from triforce import SamplingParams, SpeculationConfig, TriForce

    try:  # bad values (budget, gamma, chunk score, thresholds) are refused before the model loads
        specs = {name: SpeculationConfig(mode="retrieval", budget=args.budget, gamma2=args.gamma,
                                         chunk_score=args.chunk_score, **kw) for name, kw in policies.items()}
    except ValueError as e:
        p.error(str(e))
    tf = TriForce.load()
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    records = []
    bar = tqdm(total=len(args.books) * args.reps * len(specs), unit="run", file=sys.stderr)
    for book in args.books:
        text = load_book(book)
        if text is None:
            continue
        ids = build_prompt(tf, text, "continue", args.prompt_tokens)
        for rep in range(args.reps):
            names = list(specs)
            names = names[rep % len(names):] + names[:rep % len(names)]
            for name in names:
                t0 = time.perf_counter()
                r = run_one(tf, ids, specs[name], sampling, args.new_tokens, args.window, seed=rep)
                s = r["stats"]
                ret = s.tiers["retrieval"]
                rec = {"book": book, "policy": name, "rep": rep, "prompt_tokens": len(ids),
                       "generated": s.generated_tokens, "finish_reason": s.finish_reason,
                       "tokens_per_second": s.decode_tokens_per_second, "wall_s": round(time.perf_counter() - t0, 3),
                       "acceptance": s.tiers["target"].get("acceptance_rate"),
                       "tokens_per_verification": s.tiers["target"].get("mean_tokens_per_verification"),
                       "rebuilds": ret.get("rebuilds", 0), "acceptance_rebuilds": ret.get("acceptance_rebuilds", 0),
                       "retrieval_forward_seconds": ret["forward_seconds"],
                       "repeated_4gram_share": repeated_ngram_share(ids, r["token_ids"]),
                       "windows": r["windows"], "tiers": s.tiers, "token_ids": r["token_ids"]}
                records.append(rec)
                bar.write(f"{book} rep {rep} {name}: {s.generated_tokens} tokens ({s.finish_reason}), "
                          f"{s.decode_tokens_per_second:.2f} tok/s, acceptance {rec['acceptance']}, "
                          f"rebuilds {rec['rebuilds']}, repeated 4-grams {rec['repeated_4gram_share']}, per window "
                          f"{[w['acceptance'] for w in r['windows']]}", file=sys.stderr)
                bar.update(1)
                with open(args.out + ".partial", "w") as f:  # records so far, if interrupted
                    json.dump({"command": "python " + " ".join(sys.argv), "records": records}, f)
    bar.close()

    summary = summarize(records, list(specs))
    out = {"command": "python " + " ".join(sys.argv), "threads": args.threads, "temperature": args.temperature,
           "top_p": args.top_p, "budget": args.budget, "gamma": args.gamma, "chunk_score": args.chunk_score,
           "window": args.window, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
           "records": records, "summary": summary}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    if os.path.exists(args.out + ".partial"):
        os.remove(args.out + ".partial")
    if args.markdown:
        print(markdown(summary, args.window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
