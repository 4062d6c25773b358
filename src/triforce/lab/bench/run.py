"""``triforce bench``: the interleaved run over the workers and the ``triforce bench`` command."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..books import BOOKS_DIR
from .methods import (
    DEFINITIONS,
    METHODS,
    OUR_SPECULATIVE,
    PAUSE_BETWEEN_RUNS_S,
    SYNTHETIC_DRAFT,
    WARMUP_NEW_TOKENS,
    WARMUP_PROMPT_TOKENS,
    BenchError,
    _costmodel_module,
    plan_methods,
    validate_args,
)
from .report import format_table, write_png
from .stats import _speedups, _summarize, acceptance_inputs, compare_greedy, with_empty_proposals
from .worker import Worker


# ---------------------------------------------------------------------------------------------------- the run
def _prompt_text(args: argparse.Namespace) -> tuple[str, str]:
    """``(text, description of its source)``."""
    from ...text.prompts import strip_gutenberg

    if args.prompt is not None:
        return args.prompt, "--prompt"
    path = Path(args.prompt_file) if args.prompt_file else BOOKS_DIR / (args.book or "pg1342.txt")
    with open(path, encoding="utf-8", errors="replace") as f:
        return strip_gutenberg(f.read()), (str(args.prompt_file) if args.prompt_file else f"book {path.name}")


def _command_line(args: argparse.Namespace) -> str:
    """A ``triforce bench`` command line that reruns this benchmark."""
    parts = ["triforce", "bench"]
    for opt in ("model", "draft", "synthetic", "layers", "prompt", "prompt_file", "book", "prompt_tokens",
                "new_tokens", "temperature", "top_p", "top_k", "seed", "dtype", "threads", "budget", "chunk_size",
                "gamma1", "gamma2", "rope_scaling", "rope_factor", "prompt_cache", "methods", "reps", "json", "png"):
        v = getattr(args, opt)
        if v is not None:
            parts += ["--" + opt.replace("_", "-"), str(v)]
    return shlex.join(parts)


def _model_label(args: argparse.Namespace) -> str:
    if args.synthetic:
        from ..synthetic import SYNTHETIC_SHAPES

        full = SYNTHETIC_SHAPES[args.synthetic]["num_hidden_layers"]
        return f"synthetic {args.synthetic} ({args.layers or full} of {full} layers, random weights)"
    return args.model or "SmolLM2-135M-Instruct (default)"


def _draft_label(args: argparse.Namespace) -> str:
    if args.synthetic and args.draft != "ngram":
        return f"synthetic {SYNTHETIC_DRAFT} (random weights)"
    return args.draft or "ngram"


def _machine() -> dict:
    import torch
    import transformers

    from ...kernels.cpu import cpu
    from ...kernels.status import kernel_status
    from ..provenance import git_commit

    info = {**cpu(), **kernel_status(),
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "load_average_1_5_15min_at_end": [round(x, 2) for x in os.getloadavg()], **git_commit()}
    try:
        from importlib.metadata import version

        info["llama_cpp_python"] = version("llama_cpp_python")
    except Exception:
        info["llama_cpp_python"] = None
    return info


#: the tiers' steps in the run (``step_seconds``) -> the cost model's latency keys they stand for
_RUN_STEP_KEYS = {"target": ("full_pass",), "retrieval": ("retrieval_decode", "retrieval_pass"),
                  "draft": ("draft_step", "draft_pass"), "self": ("draft_step", "draft_pass")}


def _auto_chain(r: dict) -> tuple[list[tuple[str, int]], int, int] | None:
    """``auto``'s hierarchy if every repetition ran the same speculative one without a bypass:
    ``(chain, speculative_tokens, plain_steps)`` summed over the repetitions, where ``plain_steps`` are the decode
    steps of the plain tokens each request opens with (the first of them comes from the prefill); None otherwise
    (the cost model covers one fixed hierarchy) or where the run's record lacks a field."""
    reps = r.get("auto") or []
    try:
        chains = {x["hierarchy"] for x in reps}
        if not reps or len(chains) != 1 or "autoregressive" in chains or any(x["bypasses"] for x in reps):
            return None
        chain = [(kind.strip(), int(gamma)) for kind, _, gamma in (e.partition(":") for e in chains.pop().split(","))]
        spec = sum(x["speculative_tokens"] for x in reps)
        plain_steps = sum(max(0, x["autoregressive_tokens"] - 1) for x in reps)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return (chain, spec, plain_steps) if spec > 0 else None


def _predict_from_run(results: dict, ok: list[str], cm) -> None:
    """The cost model with the run's own steps: each speculative method's ``predicted_from_run`` speedup (and
    ``measured_over_predicted_from_run``) from :func:`~triforce.lab.costmodel.predict` with the observed acceptance
    run lengths and, as latencies, the seconds per forward its tiers took while generating (``step_seconds``: the
    target's verifications, the lower tiers' steps, re-selections included) and the autoregressive method's decode
    step. The microbenchmark's prediction (``predicted``) times the steps at another moment, which on a machine that
    runs in slow and fast phases moves it by more than the model's own error; this one tests the model (how
    acceptance and step costs make a speedup) on the same steps as the measurement. Forwards only: the token
    selection between them is left out on both sides.

    ``auto`` is predicted too where it ran one speculative hierarchy in every repetition without a bypass
    (:func:`_auto_chain`). Its target steps mix ``V`` verifications with the ``D`` decode steps of the plain tokens
    each request opens with, so the verification's time is taken as ``(t_target (V + D) - D t_decode) / V``; of the
    ``N`` tokens the time between tokens counts (all but each request's first), the ``D`` plain ones cost a decode
    step and the others the model's speedup ``S``: ``N / ((N - D) / S + D)``. Over an n-gram drafter, the steps where it
    proposed nothing count as one-token steps of the tier above
    (:func:`~triforce.lab.bench.stats.with_empty_proposals`)."""
    ar = results.get("autoregressive", {}).get("step_seconds", {}).get("target") if "autoregressive" in ok else None
    if cm is None or not ar:
        return
    for m in ok:
        r = results[m]
        auto = _auto_chain(r) if m == "auto" else None
        if (m not in OUR_SPECULATIVE and auto is None) or not r.get("acceptance") or not r.get("step_seconds"):
            continue
        chain = auto[0] if auto else [tuple(e) for e in r["chain"]]
        lat = {"full_decode": ar, "ngram_propose": 0.0}
        for tier, seconds in r["step_seconds"].items():
            lat.update({key: seconds for key in _RUN_STEP_KEYS.get(tier, ())})
        rates, lengths = acceptance_inputs(r["acceptance"])
        lengths = with_empty_proposals(lengths, r["acceptance"], chain)  # an n-gram drafter's misses: 1-token steps
        if auto and auto[2]:  # the target's steps without auto's plain decode steps
            v = r["acceptance"].get("target", {}).get("verifications") or 0
            if v and "full_pass" in lat:
                lat["full_pass"] = (lat["full_pass"] * (v + auto[2]) - auto[2] * ar) / v
        try:
            speedup = cm.predict(chain, lat, rates, accepted_lengths=lengths)["speedup"]
        except ValueError as e:
            r["predicted_from_run"] = {"status": "failed", "reason": str(e)}
            continue
        if auto:
            spec_tokens, plain = auto[1:]
            speedup = (spec_tokens + plain) / (spec_tokens / speedup + plain)
        r["predicted_from_run"] = {"latencies": lat, "speedup": round(speedup, 4)}
        if auto:
            r["predicted_from_run"]["chain"] = [list(e) for e in chain]
        if r.get("speedup_vs_autoregressive"):
            r["measured_over_predicted_from_run"] = round(r["speedup_vs_autoregressive"] / speedup, 4)


def run_bench(args: argparse.Namespace) -> dict:
    """Run the benchmark described by validated ``args``; returns the JSON-ready result.

    Raises:
        BenchError: the prompt does not fit the model's context (naming the option), or no method could run.
    """
    from tqdm import tqdm

    to_run, skipped = plan_methods(args)
    greedy = args.temperature == 0
    threads = args.threads or os.cpu_count()
    config = {"model": args.model, "draft": args.draft, "dtype": args.dtype, "threads": threads,
              "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
              "budget": args.budget, "chunk_size": args.chunk_size, "gamma1": args.gamma1, "gamma2": args.gamma2,
              "synthetic": args.synthetic, "layers": args.layers, "packed_weights": args.packed_weights,
              "precision": args.precision, "prompt_cache": args.prompt_cache, "rope_scaling": args.rope_scaling,
              "rope_factor": args.rope_factor}
    results: dict[str, dict] = {m: {"status": "skipped", "reason": r, "description": METHODS[m][1]}
                                for m, r in skipped.items()}
    bar_off = args.no_progress or None
    workers: dict[str, Worker] = {}
    log_dir = tempfile.mkdtemp(prefix="triforce-bench-")
    log = (lambda msg: print(msg, file=sys.stderr)) if not args.no_progress else (lambda msg: None)
    try:
        log(f"bench: starting {len(to_run)} workers ({', '.join(to_run)}); skipped: "
            f"{', '.join(skipped) or 'none'}")
        for m in to_run:  # one after another: loading peaks (GGUF dequantisation) must not add up in memory
            workers[m] = Worker(m, config, log_dir)
            try:
                ready = workers[m].receive()
                results[m] = {"status": "ok", "description": METHODS[m][1], "load_seconds": ready["load_seconds"],
                              **ready.get("describe", {})}
            except (RuntimeError, ValueError) as e:
                results[m] = {"status": "failed", "reason": f"could not load: {e}", "description": METHODS[m][1]}
                workers.pop(m).kill()
        if not workers:
            raise BenchError("no method could run: " + "; ".join(f"{m}: {r['reason']}" for m, r in results.items()))
        # the prompt: token ids from the first worker with a tokenizer (synthetic: random ids)
        if args.synthetic:
            import random

            rng = random.Random(args.seed)
            ids = [rng.randrange(1, 1000) for _ in range(args.prompt_tokens)]
            context, dynamic, source = None, False, f"random token ids (synthetic {args.synthetic})"
        else:
            text, source = _prompt_text(args)
            enc = next((w for m, w in workers.items() if METHODS[m][0] in ("ours", "hf")), None)
            if enc is None:
                raise BenchError("--methods: at least one transformers or triforce method is needed to tokenize the "
                                 "prompt")
            reply = enc.request(cmd="encode", text=text, max_prompt_tokens=args.prompt_tokens)
            ids, context, dynamic = reply["ids"], reply["context"], reply.get("dynamic_rope", False)
        if context and not dynamic and len(ids) + args.new_tokens + 2 * args.gamma2 + 2 > context:
            raise BenchError(f"--prompt-tokens {len(ids)} plus --new-tokens {args.new_tokens} (and a speculation "
                             f"block of --gamma2) exceed the model's context of {context} tokens: lower them")
        runs: dict[str, list[dict]] = {m: [] for m in workers}
        total = len(workers) * (args.reps + 1)
        with tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=bar_off, leave=False) as bar:
            for rep in range(-1, args.reps):  # rep -1: the warm-up
                for m in list(workers):
                    bar.set_description(f"{'warm-up' if rep < 0 else f'rep {rep + 1}/{args.reps}'} {m}")
                    w = workers[m]
                    try:
                        if rep < 0:
                            w.request(cmd="run", ids=ids[:WARMUP_PROMPT_TOKENS], new_tokens=WARMUP_NEW_TOKENS,
                                      seed=args.seed)
                        else:
                            runs[m].append(w.request(cmd="run", ids=ids, new_tokens=args.new_tokens,
                                                     seed=args.seed + rep))
                    except (RuntimeError, ValueError) as e:
                        results[m].update(status="failed", reason=f"{'warm-up' if rep < 0 else f'rep {rep + 1}'}: {e}")
                        workers.pop(m).kill()
                        bar.update(args.reps - max(rep, 0))
                        continue
                    bar.update(1)
                    time.sleep(PAUSE_BETWEEN_RUNS_S)
        for m in workers:
            _summarize(results[m], runs[m])
        predictions = {}
        cm = _costmodel_module()
        specs = [m for m in workers if m in OUR_SPECULATIVE and results[m].get("acceptance")]
        if cm is None:
            for m in specs:
                results[m]["predicted"] = {"status": "skipped", "reason": "triforce.lab.costmodel is not installed"}
        else:
            for m in tqdm(specs, desc="cost model", file=sys.stderr, disable=bar_off, leave=False):
                try:
                    predictions[m] = workers[m].request(cmd="predict", context=len(ids),
                                                        acceptance=results[m]["acceptance"], reps=args.reps)
                    results[m]["predicted"] = predictions[m]
                except (RuntimeError, ValueError) as e:
                    results[m]["predicted"] = {"status": "failed", "reason": str(e)}
        for m in list(workers):
            results[m]["peak_memory_bytes"] = workers.pop(m).close().get("peak_memory_bytes")
    finally:
        for w in workers.values():
            w.kill()
        shutil.rmtree(log_dir, ignore_errors=True)  # failures quote the log's tail in the JSON already
    ok = [m for m in METHODS if results.get(m, {}).get("status") == "ok"]
    _speedups(results, ok)
    _predict_from_run(results, ok, _costmodel_module())
    for m in ok:
        predicted = results[m].get("predicted")
        pred = predicted.get("prediction") if isinstance(predicted, dict) else None
        if pred:
            ps = pred.get("speedup") or pred.get("speedup_vs_autoregressive")
            results[m]["predicted_speedup_vs_autoregressive"] = ps
            meas = results[m].get("speedup_vs_autoregressive")
            if ps and meas:
                results[m]["measured_over_predicted"] = round(meas / ps, 4)
    greedy_report = None
    mismatches: list[str] = []
    if greedy and ok:
        # synthetic: transformers' random weights and random KV are not ours, so only our methods are comparable
        comparable = [m for m in ok if not args.synthetic or METHODS[m][0] == "ours"]
        # one model per arithmetic: transformers and --precision exact compute the fp32 model, our other methods
        # the GGUF file's own arithmetic where the target computes on it (results' "precision")
        exact = [m for m in comparable if METHODS[m][0] == "hf" or results[m].get("precision", "exact") == "exact"]
        groups = [g for g in (exact, [m for m in comparable if m not in exact]) if g]
        references = []
        for group in groups:
            reference = next((m for m in ("hf-ar", "autoregressive", "autoregressive-exact") if m in group),
                             group[0])
            references.append(reference)
            cmp = compare_greedy({m: results[m]["token_ids"] for m in group}, reference)
            for m in group:
                results[m]["greedy"] = cmp[m]
            mismatches += [m for m in group if not cmp[m]["same_tokens"]]
        if groups:
            greedy_report = {"reference": references[0] if len(references) == 1 else references,
                             "all_same": not mismatches, "compared": comparable}
            if args.synthetic:
                greedy_report["note"] = ("synthetic: transformers has other random weights and KV, so only our "
                                         "methods are compared")
    return {
        "benchmark": "triforce bench", "synthetic": bool(args.synthetic),
        "label": f"synthetic {args.synthetic} (random weights, timing only)" if args.synthetic else None,
        "command": _command_line(args),
        "settings": {"model": _model_label(args), "draft": _draft_label(args),
                     "synthetic": args.synthetic, "layers": args.layers, "prompt_source": source,
                     "prompt_tokens": len(ids), "new_tokens": args.new_tokens, "temperature": args.temperature,
                     "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "dtype": args.dtype,
                     "threads": threads, "reps": args.reps, "budget": args.budget, "chunk_size": args.chunk_size,
                     "gamma1": args.gamma1, "gamma2": args.gamma2, "packed_weights": args.packed_weights,
                     "interleaved": True,
                     "warmup": f"{WARMUP_NEW_TOKENS} tokens after the first {WARMUP_PROMPT_TOKENS} prompt tokens"},
        "machine": _machine(), "definitions": DEFINITIONS,
        "greedy": greedy_report, "greedy_mismatches": mismatches,
        "methods": {m: results[m] for m in METHODS if m in results},
    }



def cmd_bench(args: argparse.Namespace) -> int:
    """``triforce bench``: validate, run, write the table, the JSON and the PNG; exit status.

    The table goes to stdout, or to stderr with ``--json -`` (the JSON then has stdout to itself); the JSON is
    written only when ``--json`` asks for it. Progress and warnings go to stderr.

    Raises:
        BenchError (a ValueError): bad options, reported by ``triforce``'s ``main`` as one line, exit status 2.
    """
    validate_args(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result = run_bench(args)
    text = json.dumps(result, indent=2)
    if args.json == "-":
        sys.stdout.write(text + "\n")
    elif args.json is not None:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(format_table(result), file=sys.stderr if args.json == "-" else sys.stdout)
    for m in result["greedy_mismatches"]:
        g = result["methods"][m]["greedy"]
        print(f"triforce: warning: {m} produced different greedy tokens from {result['greedy']['reference']} "
              f"(first difference at generated token {g['first_difference']})", file=sys.stderr)
    if args.png:
        why = write_png(result, args.png)
        if why:
            print(f"triforce: {why}", file=sys.stderr)
    return 0
