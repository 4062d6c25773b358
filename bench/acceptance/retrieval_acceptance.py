"""Tier-1 acceptance on real text: the target over a retrieval KV cache drafting for the target over its full cache.

Mode ``retrieval`` (TriForce, arXiv 2404.11912, Sec. 4.1): the target model with a retrieval cache of ``budget``
slots per layer and KV head (chunk 0 + the chunks whose mean key scores highest against the last prompt token's
query + generated tokens) proposes ``gamma2`` tokens; the same model with its full KV cache verifies them. How
many it accepts measures how well the retrieval cache stands in for the full one.

Runs: books x prompt lengths x budgets x {greedy, T=0.6 / top-p 0.9}, plus one autoregressive greedy reference
per (book, length). Every greedy retrieval run must reproduce the autoregressive greedy tokens (the lossless
property); a mismatch is reported loudly and recorded.

Also measured, once per (book, length) and budget, with a separate prefill: the *attention recovery* of the
selection, i.e. the fraction of the last prompt token's attention mass over the prompt positions [0, P-1)
that falls on the positions the retrieval cache selects (mean over layers and query heads).

Usage (from the repository root)::

    python bench/acceptance/retrieval_acceptance.py            # the full measurement (20-40 min on 2 CPU cores)
    python bench/acceptance/retrieval_acceptance.py --quick    # a smoke run (one book, short prompt, few tokens)
    python bench/acceptance/retrieval_acceptance.py --table-from bench/results/retrieval_acceptance.json  # table

Books come from ``../shared/data/books/pgNNNN.txt`` (Project Gutenberg headers stripped); without that
folder the script prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BOOKS_DIR = ROOT.parent / "shared" / "data" / "books"
DEFAULT_BOOKS = ["pg1342", "pg2701", "pg84", "pg98", "pg1661"]
DEFAULT_LENGTHS = [2048, 4096, 7500]
DEFAULT_BUDGETS = [256, 512, 1024, 2048]
DEFAULT_OUT = ROOT / "bench" / "results" / "retrieval_acceptance.json"
QUICK_OUT = ROOT / "bench" / "results" / "retrieval_acceptance_quick.json"
SAMPLINGS = {"greedy": dict(temperature=0.0, top_p=1.0), "t0.6_p0.9": dict(temperature=0.6, top_p=0.9)}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _strs(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--books", type=_strs, default=None,
                   help=f"comma-separated book ids (default {','.join(DEFAULT_BOOKS)})")
    p.add_argument("--books-dir", type=Path, default=DEFAULT_BOOKS_DIR,
                   help=f"folder of pgNNNN.txt (default {DEFAULT_BOOKS_DIR})")
    p.add_argument("--lengths", type=_ints, default=None, help=f"prompt lengths in tokens (default {DEFAULT_LENGTHS})")
    p.add_argument("--budgets", type=_ints, default=None, help=f"retrieval budgets (default {DEFAULT_BUDGETS})")
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--gamma2", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per run (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of every run (the same for all, so budgets are paired)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--no-recovery", action="store_true", help="skip the attention-recovery measurement")
    p.add_argument("--out", type=Path, default=None, help=f"JSON output (default {DEFAULT_OUT.relative_to(ROOT)})")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 book, 1024-token prompt, budgets 256,512, 16 tokens")
    p.add_argument("--table-from", type=Path, default=None, help="print the markdown summary table of a JSON and exit")
    a = p.parse_args(argv)
    if a.quick:
        a.books = a.books or DEFAULT_BOOKS[:1]
        a.lengths = a.lengths or [1024]
        a.budgets = a.budgets or [256, 512]
        a.new_tokens = a.new_tokens or 16
        a.out = a.out or QUICK_OUT
    a.books = a.books or DEFAULT_BOOKS
    a.lengths = a.lengths or DEFAULT_LENGTHS
    a.budgets = a.budgets or DEFAULT_BUDGETS
    a.new_tokens = a.new_tokens or 128
    a.out = a.out or DEFAULT_OUT
    return a


# ---------------------------------------------------------------------------------------------------- provenance
def provenance() -> dict:
    import torch

    import triforce

    src = Path(triforce.__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(src.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:
            return None

    return {"git_commit": git("rev-parse", "HEAD"),
            "src_dirty_files": (git("status", "--porcelain", "src") or "").splitlines(),
            "src_sha256": h.hexdigest(), "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads()}


def command_line(argv) -> str:
    """The command as run from the repository root."""
    script = Path(sys.argv[0]).resolve()
    script = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return " ".join(["python", str(script)] + list(sys.argv[1:] if argv is None else argv))


# ---------------------------------------------------------------------------------------------------- prompts
def book_prompt(tokenizer, path: Path, n: int) -> list[int]:
    """The first ``n`` tokens of the book with its Project Gutenberg header and footer removed (no chat template)."""
    from triforce.lab.books import book_prompt as _book_prompt

    return _book_prompt(tokenizer, path, n)


# ---------------------------------------------------------------------------------------------------- recovery
def attention_recovery(model, ids: list[int], budgets: list[int], chunk_size: int) -> dict[int, float]:
    """Fraction of the last prompt token's attention mass over positions [0, P-1) on the retrieval selection.

    A separate prefill into a fresh full cache (recording queries); the selection is ``RetrievalCache.build`` at P-1
    with the query of position P-1, exactly as the engine builds it (mean over layers and query heads; the
    computation is :func:`triforce.lab.analyze.recovery_at_query`, also behind ``triforce analyze``).
    """
    from triforce.lab.analyze import prefill_recorded, recovery_at_query

    full, query, _ = prefill_recorded(model, ids)  # restores the model's RoPE afterwards
    rec = recovery_at_query(model, full, query, len(ids) - 1, budgets, chunk_size, scores=("mean",))["mean"]
    del full
    return {b: sum(v) / len(v) for b, v in rec.items()}


# ---------------------------------------------------------------------------------------------------- summary
def summarize(records: list[dict], recovery: list[dict]) -> list[dict]:
    """Mean over books per (prompt length, budget, sampling), with pooled figures and the greedy checks."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["mode"] == "retrieval":
            groups.setdefault((r["prompt_tokens"], r["budget"], r["sampling"]), []).append(r)
    rec: dict[tuple, list[float]] = {}
    for r in recovery:
        rec.setdefault((r["prompt_tokens"], r["budget"]), []).append(r["attention_recovery"])
    rows = []
    for (n, b, s), rs in sorted(groups.items()):
        acc = [r["acceptance_rate"] for r in rs if r["acceptance_rate"] is not None]
        mtv = [r["mean_tokens_per_verification"] for r in rs if r["mean_tokens_per_verification"] is not None]
        row = {
            "prompt_tokens": n, "budget": b, "sampling": s, "books": len(rs),
            "acceptance_rate_mean": round(sum(acc) / len(acc), 4) if acc else None,
            "acceptance_rate_min": round(min(acc), 4) if acc else None,
            "acceptance_rate_max": round(max(acc), 4) if acc else None,
            "acceptance_rate_pooled": round(sum(r["accepted"] for r in rs) / max(1, sum(r["proposed"] for r in rs)), 4),
            "mean_tokens_per_verification_mean": round(sum(mtv) / len(mtv), 4) if mtv else None,
            "generated_tokens_total": sum(r["generated_tokens"] for r in rs),
        }
        if s == "greedy":
            checked = [r for r in rs if r.get("matches_autoregressive") is not None]
            row["greedy_matches_autoregressive"] = f"{sum(r['matches_autoregressive'] for r in checked)}/{len(checked)}"
        if (n, b) in rec:
            row["attention_recovery_mean"] = round(sum(rec[(n, b)]) / len(rec[(n, b)]), 4)
        rows.append(row)
    return rows


def markdown_table(summary: list[dict]) -> str:
    """Rows: prompt length x budget; columns: acceptance and tokens/verification, greedy and T=0.6."""
    by = {(r["prompt_tokens"], r["budget"], r["sampling"]): r for r in summary}
    keys = sorted({(r["prompt_tokens"], r["budget"]) for r in summary})
    has_rec = any("attention_recovery_mean" in r for r in summary)

    def f(x, d=3):
        return "n/a" if x is None else f"{x:.{d}f}"

    head = ["prompt tokens", "budget", "greedy acceptance", "T=0.6 acceptance", "greedy tokens/verif.",
            "T=0.6 tokens/verif.", "greedy = AR"]
    if has_rec:
        head.insert(2, "attn. recovery")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for n, b in keys:
        g, t = by.get((n, b, "greedy"), {}), by.get((n, b, "t0.6_p0.9"), {})
        cells = [str(n), str(b), f(g.get("acceptance_rate_mean")), f(t.get("acceptance_rate_mean")),
                 f(g.get("mean_tokens_per_verification_mean"), 2), f(t.get("mean_tokens_per_verification_mean"), 2),
                 g.get("greedy_matches_autoregressive", "n/a")]
        if has_rec:
            cells.insert(2, f((g or t).get("attention_recovery_mean")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    a = parse_args(argv)
    if a.table_from is not None:
        data = json.loads(a.table_from.read_text())
        print(markdown_table(data["summary"]))
        return 0
    if not a.books_dir.is_dir():
        print(f"books folder {a.books_dir} not found; nothing to measure (skipping)")
        return 0
    paths = {b: a.books_dir / f"{b}.txt" for b in a.books}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        print(f"book files not found: {', '.join(missing)}; skipping")
        return 0

    import torch
    from tqdm import tqdm

    torch.set_num_threads(a.threads)
    from triforce import Engine, SamplingParams, SpeculationConfig, load_model

    t_all = time.perf_counter()
    lm = load_model(None)
    eng = Engine(lm.model, eos_ids=lm.eos_ids)  # prefix reuse on (the default): one prefill per prompt
    ref_eng = Engine(lm.model, eos_ids=lm.eos_ids, reuse_prefix=False)  # autoregressive greedy references
    samplings = {k: SamplingParams(**v) for k, v in SAMPLINGS.items()}
    meta = {
        "script": "bench/acceptance/retrieval_acceptance.py",
        "command": command_line(argv),
        "model": lm.source, "target_mode": "retrieval", "books": a.books, "prompt_lengths": a.lengths,
        "budgets": a.budgets, "chunk_size": a.chunk_size, "gamma2": a.gamma2, "new_tokens": a.new_tokens,
        "seed": a.seed, "samplings": SAMPLINGS, "provenance": provenance(),
        "greedy_reference": "mode autoregressive, greedy, on a separate Engine(reuse_prefix=False) (fresh prefill); "
                            "retrieval runs use one Engine with prefix reuse",
        "definitions": {
            "acceptance_rate": "accepted drafted tokens / drafted (proposed) tokens at the target's verifications; "
                               "recovered and bonus tokens are not counted",
            "mean_tokens_per_verification": "tokens emitted per target verification (accepted + the recovered or "
                                            "bonus token), before truncation to max_new_tokens",
            "attention_recovery": "fraction of the last prompt token's softmax attention mass over positions "
                                  "[0, P-1) that lies on the retrieval selection built at P-1, mean over layers and "
                                  "query heads",
        },
    }
    records: list[dict] = []
    recovery: list[dict] = []
    mismatches: list[str] = []
    errors: list[str] = []
    a.out.parent.mkdir(parents=True, exist_ok=True)

    def save(done: bool) -> None:
        data = dict(meta, complete=done, seconds_total=round(time.perf_counter() - t_all, 1),
                    greedy_mismatches=mismatches, errors=errors, summary=summarize(records, recovery),
                    records=records, attention_recovery=recovery)
        tmp = a.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(a.out)

    per_prompt = len(a.budgets) * len(samplings) + 1
    bar = tqdm(total=len(a.books) * len(a.lengths) * per_prompt, desc="runs", unit="run", dynamic_ncols=True)
    for book in a.books:
        for n in a.lengths:
            try:
                ids = book_prompt(lm.tokenizer, paths[book], n)
            except ValueError as e:
                errors.append(str(e))
                tqdm.write(f"SKIP {book} @ {n}: {e}")
                bar.update(per_prompt)
                continue

            def run(mode: str, sampling: str, budget: int | None) -> tuple[list[int], dict]:
                spec = (SpeculationConfig(mode="retrieval", budget=budget, chunk_size=a.chunk_size, gamma2=a.gamma2)
                        if mode == "retrieval" else SpeculationConfig(mode="autoregressive"))
                t0 = time.perf_counter()
                if mode == "retrieval":
                    toks, st = eng.generate(ids, max_new_tokens=a.new_tokens, sampling=samplings[sampling], spec=spec,
                                            seed=a.seed)
                else:  # the reference: its own engine, no prefix reuse, so it never shares a cache with the runs
                    saved_rope = lm.model.rope  # the engines share the model; keep the main engine's RoPE
                    try:
                        toks, st = ref_eng.generate(ids, max_new_tokens=a.new_tokens, sampling=samplings[sampling],
                                                    spec=spec, seed=a.seed)
                    finally:
                        lm.model.rope = saved_rope
                secs = time.perf_counter() - t0
                tgt = st.to_dict()["tiers"]["target"]
                rec = {
                    "book": book, "prompt_tokens": n, "mode": mode, "budget": budget, "chunk_size": a.chunk_size,
                    "gamma2": a.gamma2 if mode == "retrieval" else None, "sampling": sampling, "seed": a.seed,
                    "acceptance_rate": tgt.get("acceptance_rate"),
                    "mean_tokens_per_verification": tgt.get("mean_tokens_per_verification"),
                    "verifications": tgt.get("verifications", 0), "proposed": tgt.get("proposed", 0),
                    "accepted": tgt.get("accepted", 0), "rebuilds": st.tiers.get("retrieval", {}).get("rebuilds"),
                    "generated_tokens": st.generated_tokens, "finish_reason": st.finish_reason,
                    "reused_prefix_tokens": tgt.get("reused_prefix_tokens"),
                    "prefill_seconds": st.prefill_seconds, "decode_seconds": st.decode_seconds,
                    "seconds": round(secs, 3), "tokens": toks,
                }
                records.append(rec)
                bar.update(1)
                return toks, rec

            try:
                # the autoregressive reference: a fresh prefill on a separate engine. The retrieval runs share the
                # main engine, whose full cache is reused across requests (the first run of a prompt reuses what it
                # has in common with the previous request, the others all but the last prompt token), so the greedy
                # check covers prefix reuse as well as the lossless verification.
                ref, _ = run("autoregressive", "greedy", None)
                for budget in a.budgets:
                    for s in samplings:
                        toks, rec = run("retrieval", s, budget)
                        if s == "greedy":
                            rec["matches_autoregressive"] = toks == ref
                            if toks != ref:
                                i = next((j for j, (x, y) in enumerate(zip(toks, ref)) if x != y),
                                         min(len(toks), len(ref)))
                                rec["first_mismatch"] = i
                                msg = (f"GREEDY MISMATCH: {book} prompt {n} budget {budget}: retrieval differs from "
                                       f"autoregressive at generated token {i} ({toks[i:i+1]} vs {ref[i:i+1]})")
                                mismatches.append(msg)
                                tqdm.write("!" * 100 + "\n" + msg + "\n" + "!" * 100)
                        bar.set_postfix_str(f"{book} {n} b{budget} {s} acc={rec['acceptance_rate']}")
                if not a.no_recovery:
                    for b, v in attention_recovery(lm.model, ids, a.budgets, a.chunk_size).items():
                        recovery.append({"book": book, "prompt_tokens": n, "budget": b, "chunk_size": a.chunk_size,
                                         "attention_recovery": round(v, 6)})
            except Exception as e:  # record and go on: one failing prompt should not lose the others
                import traceback

                msg = f"ERROR {book} @ {n}: {type(e).__name__}: {e}"
                errors.append(msg + "\n" + traceback.format_exc())
                tqdm.write(msg)
            save(False)
    bar.close()
    save(True)
    print(markdown_table(summarize(records, recovery)))
    print(f"\nwrote {a.out} ({len(records)} runs, {time.perf_counter() - t_all:.0f} s)")
    if mismatches:
        print("\n" + "!" * 100)
        print(f"{len(mismatches)} GREEDY MISMATCH(ES) WITH AUTOREGRESSIVE DECODING (lossless property violated?):")
        for m in mismatches:
            print("  " + m)
        print("!" * 100)
    if errors:
        print(f"{len(errors)} error(s):\n" + "\n".join(errors))
    return 1 if (mismatches or errors) else 0


if __name__ == "__main__":
    sys.exit(main())
