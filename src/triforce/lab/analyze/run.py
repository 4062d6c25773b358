"""``triforce analyze``: check the options, load the model and books, run the analyses, write JSON + PNG."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from ...kv.retrieval import CHUNK_SCORES
from ...model.transformer import Transformer
from ..books import BOOKS_DIR, book_prompt, resolve_book
from .acceptance import acceptance_points, run_acceptance
from .attention import ANALYSES, ORACLE, locality_after_prompt, prefill_recorded, recovery_at_query
from .plots import PlotUnavailable, plot_acceptance, plot_locality, plot_recovery
from .summaries import (
    acceptance_table,
    locality_table,
    recovery_table,
    summarize_acceptance,
    summarize_locality,
    summarize_recovery,
)


class AnalyzeError(ValueError):
    """A bad ``triforce analyze`` option (the message names it); the command line exits with status 2."""


def _command_line(args: argparse.Namespace) -> str:
    """A ``triforce analyze`` command line that reruns with the same settings."""
    parts = ["triforce analyze"]
    if args.model:
        parts.append(f"--model {args.model}")
    parts += [f"--books {' '.join(args.books)}", f"--prompt-tokens {args.prompt_tokens}",
              f"--new-tokens {args.new_tokens}", f"--analyses {' '.join(args.analyses)}",
              f"--budgets {' '.join(map(str, args.budgets))}", f"--chunk-size {args.chunk_size}"]
    if args.chunk_score != "mean":
        parts.append(f"--chunk-score {args.chunk_score}")
    if "locality" in args.analyses:
        parts.append(f"--reselect-every {args.reselect_every}")
    if "acceptance" in args.analyses:
        parts += [f"--chunk-sizes {' '.join(map(str, args.chunk_sizes))}",
                  f"--temperatures {' '.join(f'{t:g}' for t in args.temperatures)}",
                  f"--lengths {' '.join(map(str, args.lengths))}", f"--base-budget {args.base_budget}",
                  f"--base-temperature {args.base_temperature:g}", f"--top-p {args.top_p:g}",
                  f"--gamma2 {args.gamma2}", f"--acceptance-tokens {args.acceptance_tokens}", f"--seed {args.seed}"]
    if args.dtype != "float32":
        parts.append(f"--dtype {args.dtype}")
    if args.threads is not None:
        parts.append(f"--threads {args.threads}")
    if args.prompt_cache is not None:
        parts.append(f"--prompt-cache {args.prompt_cache}")
    parts.append(f"--out {args.out}")
    return " ".join(parts)


def check_analyze_args(args: argparse.Namespace) -> tuple[list[Path], list[dict]]:
    """Check every ``triforce analyze`` option before anything is loaded; fills defaults (``--lengths``).

    Returns:
        (the book files, the acceptance points (empty without the acceptance analysis)).

    Raises:
        AnalyzeError: the first bad option, named, with the allowed values.
    """
    from ...engine import SpeculationConfig
    from ...formats.loading import parse_device
    from ...speculation.sampling import SamplingParams

    if args.threads is not None:
        limit = 4 * (os.cpu_count() or 1)
        if not 1 <= args.threads <= limit:
            raise AnalyzeError(f"--threads must be between 1 and {limit} (4x this machine's {os.cpu_count()} CPUs), "
                           f"got {args.threads}")
    try:
        parse_device(args.device)
    except ValueError as e:
        raise AnalyzeError("--" + str(e)) from e
    if args.prompt_tokens < 2:
        raise AnalyzeError("--prompt-tokens must be an integer >= 2 (a query and at least one key), "
                           f"got {args.prompt_tokens}")
    if args.new_tokens < 1:
        raise AnalyzeError(f"--new-tokens must be an integer >= 1, got {args.new_tokens}")
    if args.chunk_size < 1:
        raise AnalyzeError(f"--chunk-size must be an integer >= 1, got {args.chunk_size}")
    if args.reselect_every < 1:
        raise AnalyzeError(f"--reselect-every must be an integer >= 1, got {args.reselect_every}")
    args.analyses = [x for x in ANALYSES if x in args.analyses]
    args.budgets = sorted(set(args.budgets))
    if args.budgets[0] < args.chunk_size:
        raise AnalyzeError(f"--budgets must each be >= --chunk-size ({args.chunk_size}), got {args.budgets[0]}")
    books = []
    for name in args.books:
        try:
            books.append(resolve_book(name, args.books_dir or BOOKS_DIR))
        except FileNotFoundError as e:
            raise AnalyzeError(f"--books: {e}") from e
    points: list[dict] = []
    if args.lengths is None:
        args.lengths = [n for n in (2048, 4096) if n < args.prompt_tokens] + [args.prompt_tokens]
    args.lengths = sorted(set(args.lengths))
    args.chunk_sizes = sorted(set(args.chunk_sizes))
    args.temperatures = sorted(set(args.temperatures))
    if "acceptance" in args.analyses:
        if args.acceptance_tokens < 1:
            raise AnalyzeError(f"--acceptance-tokens must be an integer >= 1, got {args.acceptance_tokens}")
        if args.lengths[0] < 2:
            raise AnalyzeError(f"--lengths must each be an integer >= 2, got {args.lengths[0]}")
        if not 0 < args.top_p <= 1:
            raise AnalyzeError(f"--top-p must be in (0, 1], got {args.top_p}")
        if not 0 <= args.seed < 2**63:
            raise AnalyzeError(f"--seed must be an integer in [0, 2**63), got {args.seed}")
        for opt, values in (("--temperatures", args.temperatures), ("--base-temperature", [args.base_temperature])):
            for t in values:
                try:
                    SamplingParams(temperature=t, top_p=args.top_p)
                except ValueError as e:
                    raise AnalyzeError(f"{opt}: {e}") from e
        base = {"budget": args.base_budget, "chunk_size": args.chunk_size, "temperature": args.base_temperature,
                "prompt_tokens": args.prompt_tokens}
        points = acceptance_points(args.budgets, args.chunk_sizes, args.temperatures, args.lengths, base)
        for pt in points:
            try:
                SpeculationConfig(mode="retrieval", budget=pt["budget"], chunk_size=pt["chunk_size"],
                                  gamma2=args.gamma2, chunk_score=args.chunk_score)
            except ValueError as e:
                opt = {"budget": "--budgets" if "budget" in pt["sweeps"] else "--base-budget",
                       "chunk_size": "--chunk-sizes", "gamma2": "--gamma2"}
                name = next((k for k in opt if str(e).startswith(k)), None)
                where = opt[name] if name else "--budgets/--chunk-sizes/--gamma2"
                if name == "budget" and "chunk_size" in pt["sweeps"] and "budget" not in pt["sweeps"]:
                    where = "--chunk-sizes"  # a large chunk size against the base budget
                raise AnalyzeError(f"{where}: at budget {pt['budget']}, chunk size {pt['chunk_size']}: {e}") from e
    if args.prompt_cache is not None:
        from ...kv.promptcache import check_options

        try:
            check_options(args.prompt_cache)
        except ValueError as e:
            raise AnalyzeError(f"--{str(e).replace('_', '-', 1)}") from e
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise AnalyzeError(f"--out {args.out!r}: {e.strerror}") from e
    return books, points


def _provenance(model: Transformer, source: str) -> dict:
    from ..provenance import git_commit

    cfg = model.cfg
    return {"model": source, "layers": cfg.num_hidden_layers, "query_heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "dtype": str(model.dtype).split(".")[-1],
            "device": str(model.device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), **git_commit()}


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def cmd_analyze(args: argparse.Namespace) -> int:
    """``triforce analyze``: check the options, load the model and books, run the analyses, write JSON + PNG.

    Returns:
        0 (PNG charts skipped with a message when matplotlib is missing).

    Raises:
        AnalyzeError, ModelLoadError, ValueError: reported by :func:`triforce.cli.main` as one line, exit status 2.
    """
    from tqdm import tqdm

    from ...formats.loading import load_model

    books, points = check_analyze_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    out = Path(args.out)
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    model, cfg = lm.model, lm.model.cfg
    context = cfg.max_position_embeddings
    if cfg.rope_type != "dynamic":
        if "locality" in args.analyses and args.prompt_tokens + args.new_tokens > context:
            raise AnalyzeError(f"--prompt-tokens {args.prompt_tokens} + --new-tokens {args.new_tokens} exceeds the "
                               f"model's context of {context} tokens")
        if args.prompt_tokens > context:
            raise AnalyzeError(f"--prompt-tokens {args.prompt_tokens} exceeds the model's context of {context} tokens")
        if points and max(args.lengths) + args.acceptance_tokens > context:
            raise AnalyzeError(f"--lengths {max(args.lengths)} + --acceptance-tokens {args.acceptance_tokens} "
                               f"exceeds the model's context of {context} tokens")
    need = max([args.prompt_tokens] + (args.lengths if points else []))
    prompts = {}
    for path in books:
        try:
            prompts[path.stem] = book_prompt(lm.tokenizer, path, need)
        except ValueError as e:
            raise AnalyzeError(f"--books: {e} (--prompt-tokens / --lengths)") from e
    meta = dict(command=_command_line(args), books=list(prompts), prompt_tokens=args.prompt_tokens,
                chunk_size=args.chunk_size, provenance=_provenance(model, lm.source))
    title = f"{Path(lm.source).name}, {len(prompts)} books"
    quiet = args.no_progress
    written: list[str] = []

    def save(name: str, data: dict, plot: Callable[[], None]) -> None:
        _write_json(out / f"{name}.json", data)
        written.append(str(out / f"{name}.json"))
        try:
            plot()
            written.append(str(out / f"{name}.png"))
        except PlotUnavailable as e:
            print(f"triforce: {name}.png skipped: {e}", file=sys.stderr)

    stored = None
    if args.prompt_cache is not None:
        from ...defaults import DEFAULTS
        from ...kv.promptcache import PromptCache, model_key

        stored = PromptCache(args.prompt_cache, model_key(lm.source, cfg, model.dtype, model.dtype),
                             min_new_tokens=DEFAULTS["prompt_cache_min_tokens"])
        meta["prompt_cache"] = {}
    if {"recovery", "locality"} & set(args.analyses):
        rec_books: dict[str, dict] = {}
        loc_books: dict[str, dict] = {}
        for book, ids in prompts.items():
            ids = ids[:args.prompt_tokens]
            t0 = time.perf_counter()
            extra = args.new_tokens if "locality" in args.analyses else 0
            hit = None if stored is None else stored.lookup(ids[:-1], cfg, model.device, capacity=len(ids) + extra)
            with tqdm(total=len(ids), unit="tok", desc=f"{book} prefill", disable=quiet, file=sys.stderr,
                      leave=False) as bar:
                bar.update(0 if hit is None else len(hit.tokens))
                full, query, logits = prefill_recorded(model, ids, extra, bar.update, hit and hit.cache)
            if stored is not None:  # what was loaded; a prompt that needed a prefill is kept for the next run
                loaded = 0 if hit is None else len(hit.tokens)
                meta["prompt_cache"][book] = {"loaded_tokens": loaded,
                                              "loaded_from": None if hit is None else str(hit.path),
                                              "seconds": round(time.perf_counter() - t0, 1)}
                if stored.should_store(list(ids), loaded):
                    stored.store(full, list(ids))
            n = len(ids) - 1
            if "recovery" in args.analyses:
                rec_books[book] = recovery_at_query(model, full, query, n, args.budgets, args.chunk_size)
            if "locality" in args.analyses:
                with tqdm(total=args.new_tokens + 1, unit="step", desc=f"{book} locality", disable=quiet,
                          file=sys.stderr, leave=False) as bar:
                    loc_books[book] = locality_after_prompt(model, full, query, logits, ids, args.budgets,
                                                            args.new_tokens, args.chunk_size, args.chunk_score,
                                                            lm.eos_ids, bar.update, args.reselect_every)
            del full
            if not quiet:
                tqdm.write(f"{book}: recovery/locality done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        sub = f"{title}, {args.prompt_tokens}-token prompts, chunk size {args.chunk_size}"
        if rec_books:
            summary = summarize_recovery(rec_books)
            data = dict(meta, analysis="attention recovery (TriForce Sec. 3.1, Fig. 2)", budgets=args.budgets,
                        scores=list(CHUNK_SCORES) + [ORACLE],
                        definition="share of the last prompt token's attention mass over positions [0, P-1) on the "
                                   "positions kept: the first min(budget, P-1) of RetrievalCache.build's ranking "
                                   "(chunk scores) or each query head's most attended positions (oracle); mean over "
                                   "query heads, then layers and books",
                        **summary, per_book=rec_books)
            save("recovery", data, lambda: plot_recovery(summary, out / "recovery.png", sub))
            print("attention recovery (mean over books, layers, heads)\n" + recovery_table(summary) + "\n")
        if loc_books:
            lsum = summarize_locality(loc_books)
            data = dict(meta, analysis="contextual locality (TriForce Sec. 3.2)", budgets=args.budgets,
                        chunk_score=args.chunk_score, new_tokens=args.new_tokens,
                        reselect_every=args.reselect_every,
                        definition="step s = query at position P-1+s (step 0: last prompt token, steps >= 1: the "
                                   "greedy tokens generated with the full cache); recovery = its attention mass over "
                                   "[0, P-1+s) on the positions generated since P-1 plus the ranked prompt positions "
                                   "that still have a slot (generated tokens take slots from the end of the budget); "
                                   "fixed: ranking chosen at step 0, reselected: re-ranked with step s's own query "
                                   "(every reselect_every steps, None between); "
                                   "None past the cache's generation capacity (the engine would rebuild)",
                        **lsum, per_book=loc_books)
            save("locality", data, lambda: plot_locality(lsum, out / "locality.png",
                                                         f"{sub}, chunk score {args.chunk_score}",
                                                         args.reselect_every))
            print("contextual locality: recovery fixed at the prompt / re-chosen each step (mean over books)\n"
                  + locality_table(lsum) + "\n")
    if points:
        from ...engine import Engine

        engine = Engine(model, eos_ids=lm.eos_ids)
        records: list[dict] = []
        with tqdm(total=len(points) * len(prompts), unit="run", desc="acceptance", disable=quiet,
                  file=sys.stderr) as bar:
            for book, ids in prompts.items():
                for r in run_acceptance(engine, ids, points, args.acceptance_tokens, args.gamma2, args.top_p,
                                        args.chunk_score, args.seed, bar.update):
                    records.append(dict(book=book, **r))
        base = {"budget": args.base_budget, "chunk_size": args.chunk_size, "temperature": args.base_temperature,
                "prompt_tokens": args.prompt_tokens}
        asum = summarize_acceptance(records, base)
        data = dict(meta, analysis="tier-1 acceptance (mode retrieval, TriForce Sec. 4.1)", base=base,
                    gamma2=args.gamma2, top_p=args.top_p, chunk_score=args.chunk_score, seed=args.seed,
                    new_tokens=args.acceptance_tokens,
                    definition="acceptance rate = accepted / proposed tokens at the full-cache target's "
                               "verifications of the retrieval tier's gamma2-token proposals (recovered and bonus "
                               "tokens not counted); each sweep varies one factor, the others at the base",
                    summary=asum, records=records)
        save("acceptance", data, lambda: plot_acceptance(asum, records, out / "acceptance.png",
                                                         f"{title}, mode retrieval, gamma2 {args.gamma2}; base: "
                                                         f"budget {args.base_budget}, chunk size {args.chunk_size}, "
                                                         f"T {args.base_temperature:g}, {args.prompt_tokens} tokens"))
        print("acceptance of the retrieval tier (mean over books)\n" + acceptance_table(asum) + "\n")
    print(f"wrote {', '.join(written)} in {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return 0
