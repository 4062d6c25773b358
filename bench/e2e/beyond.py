"""Beyond the paper, measured: n-gram bottom tier, adaptive speculation, chunk scores (retrieval refresh: refresh.py).

On the embedded SmolLM2-135M-Instruct (no draft model shares its tokenizer here, so the bottom tier is the
n-gram drafter) and book prompts, two kinds of prompt (:func:`build_prompt`):

* ``continue``: the first N tokens of a book, continued;
* ``chat``: the first N tokens of a book inside the chat template, followed by a request to summarize it
  (copying from the prompt is common there).

Every configuration runs on the same prompt in one process, interleaved over ``--reps`` repetitions (the order of
the configurations rotates from one repetition to the next), with the same sampling, seed, dtype and threads.
Speed-ups are paired: each run's tokens/s over the autoregressive run of the same book, kind and repetition,
median over books and repetitions. Two clocks: wall time (the engine's ``decode_tokens_per_second``) and the
process's CPU time over the decode (``cpu_tokens_per_second``, :func:`generate_timed`); on a machine shared with
other jobs, CPU time at ``--threads 1`` is the figure that time-sharing does not inflate. JSON output;
``--markdown`` prints the tables.

    # the first, small set (docs/history.md)
    python bench/e2e/beyond.py --books pg1342.txt pg84.txt --prompt-tokens 4000 --new-tokens 128 --threads 2 \
        --out bench/results/beyond.json --markdown
    # minimum n-gram match length (ngram_n 4): --ngram-min sweep
    python bench/e2e/beyond.py --configs autoregressive ngram-min1 ngram-min2 ngram-min3 --books pg1342.txt pg84.txt \
        pg2701.txt --reps 2 --out bench/results/beyond_ngram_min.json --markdown
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
from common import add_run_options  # noqa: E402

BOOKS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "books")
CHAT_REQUEST = "\n\nSummarize the text above, quoting its key sentences."

# name -> SpeculationConfig keyword arguments. Every n-gram drafter matches suffixes of up to ngram_n = 4 tokens;
# its shortest match is ngram_min (the `ngram-minK` configurations fix it, the others take --ngram-min).
CONFIGS = {
    "autoregressive": dict(mode="autoregressive"),
    "retrieval": dict(mode="retrieval", budget=1024),
    "retrieval-max": dict(mode="retrieval", budget=1024, chunk_score="max"),
    "retrieval-bound": dict(mode="retrieval", budget=1024, chunk_score="bound"),
    "retrieval-adaptive": dict(mode="retrieval", budget=1024, adaptive_gamma=True),
    "ngram": dict(tiers="ngram:6"),
    "ngram-min1": dict(tiers="ngram:6", ngram_min=1),
    "ngram-min2": dict(tiers="ngram:6", ngram_min=2),
    "ngram-min3": dict(tiers="ngram:6", ngram_min=3),
    "ngram-adaptive": dict(tiers="ngram:6", adaptive_gamma=True),
    "ngram>retrieval": dict(tiers="ngram:6,retrieval:6", budget=1024),
    "ngram>retrieval-max": dict(tiers="ngram:6,retrieval:6", budget=1024, chunk_score="max"),
    "ngram>retrieval-adaptive": dict(tiers="ngram:6,retrieval:6", budget=1024, adaptive_gamma=True),
}


def config_kwargs(name: str, ngram_min: int = 1, ngram_n: int = 4) -> dict:
    """SpeculationConfig keyword arguments of configuration ``name`` (a key of :data:`CONFIGS`).

    ``ngram_min`` / ``ngram_n`` apply to configurations with an n-gram tier that do not fix them.

    Raises:
        KeyError: ``name`` is not in :data:`CONFIGS`.
    """
    kw = dict(CONFIGS[name])
    if "ngram" in kw.get("tiers", ""):
        kw.setdefault("ngram_min", ngram_min)
        kw.setdefault("ngram_n", ngram_n)
    return kw


def build_prompt(tf, text: str, kind: str, prompt_tokens: int) -> list[int]:
    """Token ids of a benchmark prompt over a book's text (Gutenberg header already stripped).

    ``continue``: the first ``prompt_tokens`` tokens of the text. ``chat``: those tokens decoded back to text,
    followed by :data:`CHAT_REQUEST`, inside the model's chat template (about 20 more tokens).

    Raises:
        ValueError: ``kind`` is not ``continue`` or ``chat``.
    """
    if kind == "continue":
        return tf.encode(text, max_prompt_tokens=prompt_tokens)
    if kind == "chat":
        doc = tf.tokenizer.decode(tf.tokenizer(text)["input_ids"][:prompt_tokens])
        return tf.encode(doc + CHAT_REQUEST, chat=True)
    raise ValueError(f"kind must be 'continue' or 'chat', got {kind!r}")


def load_book(book: str) -> str | None:
    """Text of ``book`` (a file name in the shared books folder) without its Gutenberg header, or None if absent."""
    path = os.path.join(BOOKS, book)
    if not os.path.isfile(path):
        print(f"skipping {book}: not found", file=sys.stderr)
        return None
    from triforce.text.prompts import strip_gutenberg

    with open(path, encoding="utf-8") as f:
        return strip_gutenberg(f.read())


def generate_timed(tf, ids: list[int], **kwargs):
    """``tf.generate(ids, **kwargs)`` plus the process CPU time of its decode, seconds (prefill excluded).

    Returns:
        ``(result, decode_cpu_seconds)``: the :class:`~triforce.api.GenerationResult` and the CPU time
        (``time.process_time``, every thread of the process) from the end of the top tier's prefill to the end.
    """
    engine = tf.engine
    build = engine.build_hierarchy
    mark = {}

    def capture(*args, **kw):  # mark the end of the prefill of the tiers this request builds
        top = build(*args, **kw)
        prefill = top.prefill

        def timed_prefill(*a, **k):
            prefill(*a, **k)
            mark["decode_start"] = time.process_time()

        top.prefill = timed_prefill
        return top

    engine.build_hierarchy = capture
    try:
        result = tf.generate(ids, **kwargs)
    finally:
        engine.build_hierarchy = build
    return result, time.process_time() - mark["decode_start"]


def repeated_ngram_share(context: list[int], generated: list[int], n: int = 4) -> float | None:
    """Share of the generated tokens that complete an n-gram already seen earlier (in ``context`` + ``generated``).

    A measure of copying and looping (what an n-gram drafter can exploit): 0 for text with no repeated n-gram,
    near 1 for a loop. ``None`` when nothing was generated.
    """
    if not generated:
        return None
    seq = list(context) + list(generated)
    seen = {tuple(seq[i - n:i]) for i in range(n, len(context) + 1)}
    hits = 0
    for i in range(len(context) + 1, len(seq) + 1):
        if i >= n:
            gram = tuple(seq[i - n:i])
            hits += gram in seen
            seen.add(gram)
    return round(hits / len(generated), 4)


def _mean(vals):
    vals = [v for v in vals if v is not None]
    return round(statistics.mean(vals), 4) if vals else None


def summarize(records: list[dict], kinds: list[str], configs: list[str], by_book: bool = False) -> list[dict]:
    """One row per (kind, configuration) (and book with ``by_book``): median tokens/s, paired speed-up, mean
    acceptance and tokens per verification of each verifying tier, mean target forward passes."""
    ar = {(r["book"], r["kind"], r["rep"]): r["tokens_per_second"] for r in records if r["config"] == "autoregressive"}
    ar_cpu = {(r["book"], r["kind"], r["rep"]): r["cpu_tokens_per_second"] for r in records
              if r["config"] == "autoregressive"}
    books = sorted({r["book"] for r in records}) if by_book else [None]
    rows = []
    for kind in kinds:
        for book in books:
            for name in configs:
                rs = [r for r in records if r["kind"] == kind and r["config"] == name and book in (None, r["book"])]
                if not rs:
                    continue
                ratios = [r["tokens_per_second"] / ar[k] for r in rs if (k := (r["book"], r["kind"], r["rep"])) in ar]
                cpu_ratios = [r["cpu_tokens_per_second"] / ar_cpu[k] for r in rs
                              if (k := (r["book"], r["kind"], r["rep"])) in ar_cpu]
                row = {"kind": kind, "config": name, "runs": len(rs),
                       "tokens_per_second": round(statistics.median(r["tokens_per_second"] for r in rs), 3),
                       "speedup_vs_autoregressive": round(statistics.median(ratios), 3) if ratios else None,
                       "speedup_min": round(min(ratios), 3) if ratios else None,
                       "speedup_max": round(max(ratios), 3) if ratios else None,
                       "cpu_tokens_per_second": round(statistics.median(r["cpu_tokens_per_second"] for r in rs), 3),
                       "cpu_speedup_vs_autoregressive": round(statistics.median(cpu_ratios), 3) if cpu_ratios else None,
                       "cpu_speedup_min": round(min(cpu_ratios), 3) if cpu_ratios else None,
                       "cpu_speedup_max": round(max(cpu_ratios), 3) if cpu_ratios else None}
                if by_book:
                    row["book"] = book
                for tier in ("retrieval", "target"):
                    acc = _mean(r["tiers"].get(tier, {}).get("acceptance_rate") for r in rs)
                    if acc is not None:
                        row[f"{tier}_acceptance"] = acc
                        row[f"{tier}_tokens_per_verification"] = _mean(
                            r["tiers"][tier].get("mean_tokens_per_verification") for r in rs)
                row["target_forwards"] = round(statistics.mean(r["tiers"]["target"]["forward_passes"] for r in rs), 1)
                row["target_verifications"] = round(statistics.mean(
                    r["tiers"]["target"].get("verifications", 0) for r in rs), 1)
                row["generated"] = round(statistics.mean(r["generated"] for r in rs), 1)
                row["repeated_4gram_share"] = _mean(r.get("repeated_4gram_share") for r in rs)
                rows.append(row)
    return rows


def markdown(rows: list[dict], by_book: bool = False) -> str:
    """The summary rows as a Markdown table."""
    head = "| prompt | " + ("book | " if by_book else "") + ("configuration | tokens/s (CPU time) | vs "
           "autoregressive, CPU time (min–max) | vs autoregressive, wall | target acceptance | tokens per target "
           "verification | retrieval-tier acceptance | target forwards | repeated 4-grams |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"| {r['kind']} | " + (f"{r['book']} | " if by_book else "") +
                     f"`{r['config']}` | {r['cpu_tokens_per_second']:.2f} | {fmt(r['cpu_speedup_vs_autoregressive'])} "
                     f"({fmt(r['cpu_speedup_min'])}–{fmt(r['cpu_speedup_max'])}) "
                     f"| {fmt(r['speedup_vs_autoregressive'])} | {fmt(r.get('target_acceptance'))} "
                     f"| {fmt(r.get('target_tokens_per_verification'))} | {fmt(r.get('retrieval_acceptance'))} "
                     f"| {r['target_forwards']:.0f} | {fmt(r.get('repeated_4gram_share'))} |")
    return "\n".join(lines)


def merge(args) -> int:
    """Summarize the records of several earlier outputs (``--merge``) into ``--out``."""
    parts = [json.load(open(path)) for path in args.merge]
    records = [r for part in parts for r in part["records"]]
    kinds = [k for k in ("continue", "chat") if any(r["kind"] == k for r in records)]
    configs = list(dict.fromkeys(r["config"] for r in records))
    summary = summarize(records, kinds, configs)
    per_book = summarize(records, kinds, configs, by_book=True)
    out = {"command": "python " + " ".join(sys.argv), "merged": [p["command"] for p in parts],
           **{k: parts[0].get(k) for k in ("threads", "temperature", "top_p", "prompt_tokens", "new_tokens", "reps")},
           "records": records, "summary": summary, "summary_by_book": per_book}
    return _write(args, out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--books", nargs="+", default=["pg1342.txt", "pg84.txt"])
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--kinds", nargs="+", default=["continue", "chat"], choices=["continue", "chat"])
    p.add_argument("--configs", nargs="+", default=["autoregressive", "retrieval", "retrieval-max", "retrieval-bound",
                                                    "ngram", "ngram-adaptive", "ngram>retrieval",
                                                    "ngram>retrieval-adaptive"], choices=list(CONFIGS))
    p.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram match of the configurations that do "
                   "not fix it (1)")
    p.add_argument("--ngram-n", type=int, default=4, help="longest n-gram match (4)")
    add_run_options(p, "bench/results/beyond.json")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--by-book", action="store_true", help="with --markdown, also print the table per book")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="run nothing: summarize the records of these earlier "
                   "outputs together (e.g. the same configurations run on different books in two processes)")
    args = p.parse_args()
    if args.merge:
        return merge(args)
    if args.reps < 1:
        p.error(f"--reps must be >= 1, got {args.reps}")
    if not 1 <= args.ngram_min <= args.ngram_n:
        p.error(f"--ngram-min must be in [1, --ngram-n={args.ngram_n}], got {args.ngram_min}")
    torch.set_num_threads(args.threads)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    from tqdm import tqdm

    from triforce import SamplingParams, SpeculationConfig, TriForce

    try:  # bad values are refused before the model loads
        specs = {name: SpeculationConfig(**config_kwargs(name, args.ngram_min, args.ngram_n)) for name in args.configs}
    except ValueError as e:
        p.error(str(e))
    tf = TriForce.load()
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    records = []
    bar = tqdm(total=len(args.books) * len(args.kinds) * args.reps * len(specs), unit="run", file=sys.stderr)
    for book in args.books:
        text = load_book(book)
        if text is None:
            continue
        for kind in args.kinds:
            ids = build_prompt(tf, text, kind, args.prompt_tokens)
            # prefill once (prefix reuse keeps it for every run of this prompt), so no run carries a long prefill
            tf.generate(ids, max_new_tokens=1, sampling=sampling, spec=SpeculationConfig(), seed=0)
            for rep in range(args.reps):
                names = args.configs[rep % len(args.configs):] + args.configs[:rep % len(args.configs)]
                for name in names:
                    t0 = time.perf_counter()
                    result, cpu_s = generate_timed(tf, ids, max_new_tokens=args.new_tokens, sampling=sampling,
                                                   spec=specs[name], seed=rep)
                    s = result.stats
                    records.append({"book": book, "kind": kind, "config": name, "rep": rep, "prompt_tokens": len(ids),
                                    "spec": config_kwargs(name, args.ngram_min, args.ngram_n),
                                                    "generated": s.generated_tokens, "finish_reason": s.finish_reason,
                                    "repeated_4gram_share": repeated_ngram_share(ids, result.token_ids),
                                    "tokens_per_second": s.decode_tokens_per_second,
                                    "tbt_ms": s.mean_time_between_tokens_ms, "decode_cpu_s": round(cpu_s, 4),
                                    "cpu_tokens_per_second": round(s.generated_tokens / cpu_s, 4),
                                    "wall_s": round(time.perf_counter() - t0, 3), "tiers": s.tiers})
                    acc = {t: v.get("acceptance_rate") for t, v in s.tiers.items() if v.get("verifications")}
                    bar.write(f"{book} {kind} rep {rep} {name}: {s.decode_tokens_per_second:.2f} tok/s, "
                              f"{s.generated_tokens / cpu_s:.2f} tok/CPU-s, acceptance {acc}", file=sys.stderr)
                    bar.update(1)
                    with open(args.out + ".partial", "w") as f:  # records so far (for --merge if interrupted)
                        json.dump({"command": "python " + " ".join(sys.argv), "records": records}, f)
    bar.close()
    summary = summarize(records, args.kinds, args.configs)
    per_book = summarize(records, args.kinds, args.configs, by_book=True)
    out = {"command": "python " + " ".join(sys.argv), "threads": args.threads, "temperature": args.temperature,
           "top_p": args.top_p, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
           "reps": args.reps, "records": records, "summary": summary, "summary_by_book": per_book}
    if os.path.exists(args.out + ".partial"):
        os.remove(args.out + ".partial")
    return _write(args, out)


def _write(args, out: dict) -> int:
    """Write the JSON; with --markdown print the summary table (and with --by-book the per-book one)."""
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    if args.markdown:
        print(markdown(out["summary"]))
        if args.by_book:
            print()
            print(markdown(out["summary_by_book"], by_book=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
