"""``triforce bench``: side-by-side decode speed of triforce and its peers, in one run (issue 4, item 1).

Every method decodes the same prompt token ids with the same model, sampling, dtype and threads:

==================  ====================================================================================
``hf-ar``           transformers ``generate``, autoregressive (dynamic cache)
``hf-assisted``     transformers assisted generation with the draft model (``assistant_model=``; needs
                    ``--draft MODEL``)
``hf-lookup``       transformers prompt lookup decoding (``prompt_lookup_num_tokens=gamma2``)
``auto``            ours, the default mode: hierarchy chosen per request, bypassed while it does not pay
``autoregressive``  ours, one token per target forward
``self``            ours, the target's int4 copy over a StreamingLLM cache under the target (``--draft self``)
``draft``           ours, the draft tier (draft model + StreamingLLM cache, or the n-gram drafter) under the target
``retrieval``       ours, target + retrieval cache under target + full cache (TriForce Sec. 4.1)
``triforce``        ours, draft (or n-gram) -> retrieval -> full (TriForce Sec. 4.2)
``retrieval-int8``  ours, ``retrieval`` with int8 weights and a bf16 cache in the retrieval tier (``quant.py``)
``triforce-int8``   ours, ``triforce`` with int8 weights and bf16 caches in every tier below the verifier
``llama.cpp``       llama-cpp-python on the model's GGUF file (its own weights, Q4_1 for the default model, and
                    f16 KV cache); only when ``llama_cpp`` is importable
==================  ====================================================================================

Without ``--draft MODEL`` the bottom tier of ``draft`` and ``triforce`` is the model-free n-gram drafter
(``SpeculationConfig(drafter="ngram")``).

How it measures (the definitions are also written into the JSON, field ``definitions``):

* One long-lived worker subprocess per method (``python -m triforce.bench --worker METHOD --config JSON``) loads
  its model once and answers one JSON line per request on stdin/stdout. The parent runs the repetitions
  round-robin over the workers, one worker at a time, so background load hits every method alike; each worker
  reports its own peak resident set size (``ru_maxrss``) when it exits: that is the method's peak memory.
* Every worker first runs a short warm-up generation (the first 16 prompt tokens, 2 new tokens), not counted.
* Each token is timestamped when the method hands it out: our ``Engine.stream`` yields it; transformers calls
  its streamer's ``put()``; the llama.cpp loop samples it. Time to first token (TTFT) is from the call to the
  first token (prefill + the first decode step). **Mean time between tokens** (TBT) is
  ``(t_last - t_first) / (n - 1)`` and **tokens/s** is ``1000 / TBT``: the same definitions for every method, prefill
  excluded. Our engine keeps the prompt's KV cache between requests (prefix reuse), so its repetitions after the
  first skip most of the prefill. ``hf-ar`` gets the same treatment: its worker computes the prompt's KV cache
  (all but the last token) once, passes it to ``generate`` as ``past_key_values`` and crops it back after each run
  (``hf-assisted`` and ``hf-lookup`` produce other greedy tokens with a given cache, so they prefill every run). TTFT is reported separately for that reason and TBT never includes it.
* End-of-sequence tokens are ignored by every method, so each generates exactly ``--new-tokens`` tokens.
* Under greedy decoding (``--temperature 0``) every repetition of every method is compared token for token
  with the reference (``hf-ar``, else ``autoregressive``, else the first method that ran); a method that differs
  is flagged in the JSON (``greedy.same_tokens`` false, ``greedy_mismatches``) and by a warning line on stderr.
* When ``triforce.costmodel`` is importable, each of our speculative methods also reports the cost model's
  predicted speedup (tier latencies measured in that method's worker at the bench's context length, acceptance
  from the run) next to the measured one (issue 4, item 2).

Bad options exit with status 2 and one line naming the option, before any model is loaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BOOKS_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "books"

# method -> (family, description)
METHODS: dict[str, tuple[str, str]] = {
    "hf-ar": ("hf", "transformers generate, autoregressive (dynamic cache)"),
    "hf-assisted": ("hf", "transformers assisted generation with the draft model (assistant_model=)"),
    "hf-lookup": ("hf", "transformers prompt lookup decoding (prompt_lookup_num_tokens=gamma2)"),
    "auto": ("ours", "triforce mode auto (the default): hierarchy chosen per request, bypassed while it does not pay"),
    "autoregressive": ("ours", "triforce, autoregressive (target + full KV cache)"),
    "self": ("ours", "triforce --draft self: the target's int4 copy over a StreamingLLM cache, verified by the target"),
    "draft": ("ours", "triforce mode draft: bottom tier (draft model or n-gram) verified by the target"),
    "retrieval": ("ours", "triforce mode retrieval: target + retrieval cache verified by target + full cache"),
    "triforce": ("ours", "triforce mode triforce: bottom tier -> target + retrieval cache -> target + full cache"),
    "retrieval-int8": ("ours", "retrieval with int8 weights and bf16 cache in the retrieval tier (lossless: the "
                               "fp32 verifier decides every token)"),
    "triforce-int8": ("ours", "triforce with int8 weights and bf16 caches below the verifier (lossless)"),
    "llama.cpp": ("llama", "llama.cpp through llama-cpp-python on the GGUF file (its weights as stored, f16 KV; "
                           "sampling applies top-k and top-p before the temperature)"),
}
OUR_SPECULATIVE = ("draft", "self", "retrieval", "triforce", "retrieval-int8", "triforce-int8")
SYNTHETIC_METHODS = ("hf-ar", "autoregressive", "draft", "retrieval", "triforce")
SYNTHETIC_DRAFT = "llama-68m"  # the paper's draft shape (TriForce Sec. 5.1), used by --synthetic without --draft ngram
WARMUP_PROMPT_TOKENS, WARMUP_NEW_TOKENS = 16, 2
PAUSE_BETWEEN_RUNS_S = 0.3  # lets the previous worker's OpenMP threads stop spinning before the next one starts

DEFINITIONS = {
    "mean_time_between_tokens_ms": "1000 * (t_last - t_first) / (n - 1) over the timestamps at which the method "
                                   "handed out its n tokens (streamer put() for transformers, Engine.stream for "
                                   "ours, the sampling loop for llama.cpp); prefill excluded",
    "tokens_per_second": "1000 / mean_time_between_tokens_ms (decode only)",
    "time_to_first_token_s": "from the call to the first token: prefill plus the first decode step; our engine "
                             "reuses the prompt's KV cache from its previous request (prefix reuse), and the "
                             "hf-ar worker computes the prompt's KV cache once and passes it to generate as "
                             "past_key_values, so only their first timed run pays the prefill; hf-assisted and "
                             "hf-lookup prefill on every run",
    "median/min/max": "over the timed repetitions, which ran round-robin over the methods (interleaved)",
    "speedup_vs_hf_ar": "median TBT of hf-ar / median TBT of the method",
    "speedup_vs_autoregressive": "median TBT of our autoregressive / median TBT of the method",
    "peak_memory_bytes": "ru_maxrss of the method's own worker process (model loading included)",
    "acceptance": "per verifying tier of our engine, summed over the timed repetitions: accepted / proposed, and "
                  "tokens emitted per verification (recovered or bonus token included)",
    "eos": "ignored by every method: each generates exactly new_tokens tokens",
}


class BenchError(ValueError):
    """A bad ``triforce bench`` option or a run that cannot go on; the message names the option."""


# ---------------------------------------------------------------------------------------------------- parser
def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to the ``triforce`` parser's subparsers; returns its parser."""
    p = subparsers.add_parser(
        "bench", help="side-by-side decode speed: transformers, llama.cpp and our modes, interleaved, in one run",
        description="Compare decode speed, acceptance and peak memory of transformers generate (autoregressive, "
                    "assisted, prompt lookup), our modes and llama.cpp on one prompt, with interleaved repetitions. "
                    "JSON to stdout (or --json PATH), a table on stderr, an optional PNG chart.")
    m = p.add_argument_group("model")
    m.add_argument("--model", help="target model: Hugging Face folder, .gguf file or hub id (default: the embedded "
                                   "SmolLM2-135M-Instruct)")
    m.add_argument("--draft", help="draft model sharing the target's tokenizer (enables hf-assisted), or 'ngram' "
                                   "(the default: the n-gram drafter is the bottom tier of draft and triforce)")
    m.add_argument("--dtype", default="float32", help="weights and KV dtype: float32, bfloat16, float16 (float32)")
    m.add_argument("--threads", type=int, help="CPU threads of every method (default: all CPUs)")
    m.add_argument("--synthetic", metavar="NAME", help="timing only: a random-weight model of a paper shape "
                                                       "(triforce.synthetic), random KV instead of a real prefill")
    m.add_argument("--layers", type=int, help="layers of the --synthetic model (default: all of the shape)")
    s = p.add_argument_group("prompt")
    s.add_argument("--prompt", help="prompt text")
    s.add_argument("--prompt-file", help="prompt file (Project Gutenberg header/footer stripped)")
    s.add_argument("--book", help="a book of ../shared/data/books by file name (default: pg1342.txt when no prompt "
                                  "is given)")
    s.add_argument("--prompt-tokens", type=int, default=8000, help="keep the first N prompt tokens (8000)")
    g = p.add_argument_group("generation")
    g.add_argument("--new-tokens", type=int, default=128, help="tokens generated per run (128)")
    g.add_argument("--temperature", type=float, default=0.6, help="0 = greedy (default 0.6)")
    g.add_argument("--top-p", type=float, default=0.9, help="nucleus mass in (0, 1] (0.9)")
    g.add_argument("--top-k", type=int, default=0, help="0 = disabled (0)")
    g.add_argument("--seed", type=int, default=0, help="repetition r of every method uses seed + r (0)")
    m.add_argument("--packed-weights", choices=["auto", "on", "off"], default="auto",
                   help="our methods: oneDNN-prepacked weights for multi-token passes (CPU, fp32; as in generate)")
    k = p.add_argument_group("speculation")
    k.add_argument("--budget", type=int, default=4096, help="retrieval cache slots (4096)")
    k.add_argument("--chunk-size", type=int, default=8, help="retrieval chunk size (8)")
    k.add_argument("--gamma1", type=int, default=4, help="bottom-tier tokens per retrieval verification (4)")
    k.add_argument("--gamma2", type=int, default=6, help="tokens proposed per target verification (6); also "
                                                         "hf-lookup's prompt_lookup_num_tokens")
    r = p.add_argument_group("run")
    r.add_argument("--methods", help="comma-separated, among " + ", ".join(METHODS) + " (default: every one that "
                                     "can run)")
    r.add_argument("--reps", type=int, default=3, help="timed repetitions per method, interleaved (3)")
    r.add_argument("--json", metavar="PATH", help="write the JSON there ('-' or absent: stdout)")
    r.add_argument("--png", metavar="PATH", help="write a chart (needs matplotlib: pip install 'triforce[bench]')")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


# ---------------------------------------------------------------------------------------------------- validation
def _synthetic_module():
    try:
        from . import synthetic
    except ImportError:
        return None
    return synthetic


def _costmodel_module():
    try:
        from . import costmodel
    except ImportError:
        return None
    return costmodel


def validate_args(args: argparse.Namespace) -> None:
    """Check every option before anything is loaded.

    Raises:
        BenchError: one line naming the option and the allowed values.
    """
    from .engine import SpeculationConfig
    from .sampling import SamplingParams

    def positive(name: str, value, minimum: int = 1):
        if value is not None and value < minimum:
            raise BenchError(f"--{name} must be an integer >= {minimum}, got {value}")

    if args.dtype not in ("float32", "bfloat16", "float16"):
        raise BenchError(f"--dtype must be one of float32, bfloat16, float16, got {args.dtype!r}")
    if args.threads is not None:
        limit = 4 * (os.cpu_count() or 1)
        if not 1 <= args.threads <= limit:
            raise BenchError(f"--threads must be between 1 and {limit} (4x this machine's {os.cpu_count()} CPUs), "
                             f"got {args.threads}")
    for name in ("prompt_tokens", "new_tokens", "reps", "budget", "chunk_size", "gamma1", "gamma2"):
        positive(name.replace("_", "-"), getattr(args, name))
    positive("layers", args.layers)
    if not 0 <= args.seed < 2**62:
        raise BenchError(f"--seed must be an integer in [0, 2**62), got {args.seed}")
    try:
        SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    except ValueError as e:
        msg = str(e)
        for name in ("temperature", "top_p", "top_k"):
            if msg.startswith(name):
                raise BenchError("--" + name.replace("_", "-") + msg[len(name):]) from e
        raise BenchError(msg) from e
    try:
        SpeculationConfig(mode="triforce", drafter="ngram", budget=args.budget, chunk_size=args.chunk_size,
                          gamma1=args.gamma1, gamma2=args.gamma2)
    except ValueError as e:
        msg = str(e)
        for name in ("budget", "chunk_size", "gamma1", "gamma2"):
            if msg.startswith(name):
                raise BenchError("--" + name.replace("_", "-") + msg[len(name):]) from e
        raise BenchError(msg) from e
    given = [o for o, v in (("--prompt", args.prompt), ("--prompt-file", args.prompt_file), ("--book", args.book))
             if v is not None]
    if len(given) > 1:
        raise BenchError(f"give at most one of --prompt, --prompt-file, --book (got {', '.join(given)})")
    if args.prompt is not None and not args.prompt:
        raise BenchError("--prompt must not be empty")
    if args.prompt_file is not None and not os.path.isfile(args.prompt_file):
        raise BenchError(f"--prompt-file {args.prompt_file!r}: no such file")
    if args.synthetic is not None and given:
        raise BenchError(f"{given[0]} cannot be combined with --synthetic (its prompt is --prompt-tokens random "
                         "token ids)")
    for name, value in (("model", args.model), ("draft", args.draft)):
        if value is None or value == "ngram" and name == "draft":
            continue
        p = Path(value).expanduser()
        looks_local = value.startswith((".", "/", "~")) or value.endswith(".gguf") or len(value.split("/")) != 2
        if looks_local and not p.exists():
            raise BenchError(f"--{name} {value!r}: no such file or folder (give a Hugging Face folder, a .gguf file "
                             "or a hub id org/name)")
    if args.methods is not None:
        names = [m.strip() for m in args.methods.split(",") if m.strip()]
        bad = [m for m in names if m not in METHODS]
        if not names or bad:
            raise BenchError(f"--methods must be a comma-separated list among {', '.join(METHODS)}, got "
                             f"{args.methods!r}")
        if len(set(names)) != len(names):
            raise BenchError(f"--methods lists a method twice: {args.methods!r}")
    if args.layers is not None and args.synthetic is None:
        raise BenchError("--layers is only used with --synthetic NAME")
    if args.synthetic is not None:
        syn = _synthetic_module()
        if syn is None:
            raise BenchError("--synthetic needs the module triforce.synthetic, which this installation lacks")
        names = list(syn.SYNTHETIC_SHAPES)
        if args.synthetic not in names:
            raise BenchError(f"--synthetic must be one of {', '.join(names)}, got {args.synthetic!r}")
        if args.draft not in (None, "ngram"):
            raise BenchError("--draft with --synthetic must be 'ngram' or absent (absent: a random-weight "
                             f"{SYNTHETIC_DRAFT} draft)")
    if args.png is not None and not args.png.lower().endswith(".png"):
        raise BenchError(f"--png must name a .png file, got {args.png!r}")
    for opt, path in (("--json", args.json), ("--png", args.png)):
        if path not in (None, "-"):
            parent = Path(path).expanduser().resolve().parent
            if not parent.is_dir():
                raise BenchError(f"{opt} {path!r}: folder {parent} does not exist")
    # last: the default book is needed only when every other option is right (and no prompt was given)
    if args.synthetic is None and (args.book is not None or not given):
        book = BOOKS_DIR / (args.book or "pg1342.txt")
        if not book.is_file():
            have = sorted(p.name for p in BOOKS_DIR.glob("*.txt")) if BOOKS_DIR.is_dir() else []
            raise BenchError(f"--book {book.name!r} not in {BOOKS_DIR.resolve()}" +
                             (f"; available: {', '.join(have)}" if have else " (folder missing); use --prompt-file"))


def _gguf_for(model: str | None) -> tuple[str | None, str | None]:
    """The GGUF file llama.cpp would run for ``--model``: ``(path, None)`` or ``(None, reason it cannot)``."""
    if model is None:
        from .download import default_gguf_path

        p = default_gguf_path()
        return (str(p), None) if p.is_file() else (None, f"the default model's GGUF is not in {p.parent}: run "
                                                           "`triforce download`")
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return str(p), None
    if p.is_dir() and not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(ggufs[0]), None
    return None, "llama.cpp needs a GGUF file and --model is not one"


def plan_methods(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """Which methods run and why the others do not.

    Returns:
        ``(to_run, skipped)``: method names in :data:`METHODS` order, and ``{method: reason}``.
    """
    wanted = [m.strip() for m in args.methods.split(",")] if args.methods else list(METHODS)
    draft_model = args.draft not in (None, "ngram")
    run, skipped = [], {}
    for m in METHODS:
        if m not in wanted:
            continue
        reason = None
        if args.synthetic is not None and m not in SYNTHETIC_METHODS:
            reason = "not meaningful with --synthetic (random weights, no GGUF or real draft model)"
        elif m == "hf-assisted" and not draft_model:
            reason = "needs --draft MODEL (a draft model sharing the target's tokenizer)"
        elif m == "llama.cpp":
            if importlib.util.find_spec("llama_cpp") is None:
                reason = ("llama-cpp-python is not installed (optional extra: pip install 'triforce[llamacpp]'; it "
                          "compiles llama.cpp from source)")
            else:
                reason = _gguf_for(args.model)[1]
        if reason:
            skipped[m] = reason
        else:
            run.append(m)
    return run, skipped


# ---------------------------------------------------------------------------------------------------- analysis
def compare_greedy(tokens: dict[str, list[list[int]]], reference: str) -> dict[str, dict]:
    """Compare every method's greedy tokens with the reference method's first repetition.

    Args:
        tokens: method -> one token-id list per repetition.
        reference: the method whose first repetition is the reference (a key of ``tokens``).

    Returns:
        method -> ``{"same_tokens": bool, "first_difference": int | None, "reps_identical": bool}``:
        ``same_tokens`` is True when every repetition equals the reference; ``first_difference`` is the first
        position (0-based, in generated tokens) where some repetition differs, a length difference counting at
        the shorter length; ``reps_identical`` tells whether the method's own repetitions agree.

    Raises:
        KeyError: ``reference`` is not in ``tokens`` or has no repetition.
    """
    if reference not in tokens or not tokens[reference]:
        raise KeyError(f"reference method {reference!r} has no tokens")
    ref = list(tokens[reference][0])
    out = {}
    for method, reps in tokens.items():
        first = None
        for rep in reps:
            rep = list(rep)
            if rep != ref:
                i = next((j for j, (a, b) in enumerate(zip(rep, ref)) if a != b), min(len(rep), len(ref)))
                first = i if first is None else min(first, i)
        out[method] = {"same_tokens": first is None, "first_difference": first,
                       "reps_identical": all(list(r) == list(reps[0]) for r in reps)}
    return out


def rep_metrics(times: list[float]) -> dict[str, float | None]:
    """Metrics of one run from its token timestamps (seconds since the call, one per token, non-decreasing).

    Returns:
        ``time_to_first_token_s``, ``mean_time_between_tokens_ms`` (``1000 (t_last - t_first) / (n - 1)``),
        ``tokens_per_second`` (``1000 / TBT``) and ``total_seconds``; TBT and tokens/s are None for fewer than
        two tokens.
    """
    if not times:
        return {"time_to_first_token_s": None, "mean_time_between_tokens_ms": None, "tokens_per_second": None,
                "total_seconds": None}
    span = times[-1] - times[0]
    tbt = 1000 * span / (len(times) - 1) if len(times) > 1 else None
    return {"time_to_first_token_s": round(times[0], 6),
            "mean_time_between_tokens_ms": round(tbt, 4) if tbt is not None else None,
            "tokens_per_second": round(1000 / tbt, 4) if tbt else None,
            "total_seconds": round(times[-1], 6)}


def spread(values: list[float | None]) -> dict[str, float | None]:
    """Median, min, max and interquartile range of the non-None values (None when there are none)."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return {"median": None, "min": None, "max": None, "iqr": None}
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0], v[0], v[0]]
    return {"median": round(statistics.median(v), 6), "min": round(v[0], 6), "max": round(v[-1], 6),
            "iqr": round(q[2] - q[0], 6)}


def aggregate_tiers(per_rep: list[dict]) -> dict[str, dict]:
    """Sum our engine's per-tier counters over repetitions (``GenerationStats.tiers`` dicts).

    Returns:
        tier -> ``{"verifications", "proposed", "accepted", "acceptance_rate", "mean_tokens_per_verification",
        "forward_passes", "forward_seconds", "accepted_lengths"}`` for every verifying tier (acceptance_rate None when nothing was
        proposed).
    """
    out: dict[str, dict] = {}
    for tiers in per_rep:
        for name, t in tiers.items():
            if not t.get("verifications"):
                continue
            a = out.setdefault(name, {"verifications": 0, "proposed": 0, "accepted": 0, "emitted": 0.0,
                                      "forward_passes": 0, "forward_seconds": 0.0})
            a["verifications"] += t["verifications"]
            a["proposed"] += t["proposed"]
            a["accepted"] += t["accepted"]
            a["emitted"] += t["mean_tokens_per_verification"] * t["verifications"]
            a["forward_passes"] += t.get("forward_passes", 0)
            a["forward_seconds"] += t.get("forward_seconds", 0.0)
            hist = a.setdefault("accepted_lengths", [])
            for j, n in enumerate(t.get("accepted_lengths") or []):
                hist.extend([0] * (j + 1 - len(hist)))
                hist[j] += n
    for a in out.values():
        a["acceptance_rate"] = round(a["accepted"] / a["proposed"], 6) if a["proposed"] else None
        a["mean_tokens_per_verification"] = round(a.pop("emitted") / a["verifications"], 6)
        a["forward_seconds"] = round(a["forward_seconds"], 6)
    return out


# ---------------------------------------------------------------------------------------------------- workers
class Worker:
    """The parent's handle on one method's worker subprocess (line-based JSON over stdin/stdout).

    Its stderr goes to a log file, whose tail is quoted when the worker fails.
    """

    def __init__(self, method: str, config: dict, log_dir: str) -> None:
        self.method = method
        self.log_path = os.path.join(log_dir, f"{method}.log")
        self._log = open(self.log_path, "w")
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "triforce.bench", "--worker", method, "--config",
                                      json.dumps(config)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=env)

    def log_tail(self, lines: int = 3) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                tail = [x.strip() for x in f.read().strip().splitlines() if x.strip()][-lines:]
        except OSError:
            tail = []
        return " | ".join(tail)

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"worker exited with status {self.proc.returncode}: {self.log_tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def request(self, **msg) -> dict:
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # receive() reports the exit
        return self.receive()

    def close(self) -> dict:
        """Ask the worker to exit; returns its final report (peak memory), or ``{}`` if it is gone."""
        try:
            reply = self.request(cmd="exit")
        except (RuntimeError, ValueError):
            reply = {}
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()
        return reply

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def _hf_source(model: str | None) -> tuple[str, dict]:
    """``(path or hub id, extra from_pretrained kwargs)`` for transformers from a ``--model`` value."""
    if model is None:
        from .download import download_default_model

        return str(download_default_model(quiet=True)), {}
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return str(p.parent), {"gguf_file": p.name}
    if p.is_dir() and not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(p), {"gguf_file": ggufs[0].name}
    return model, {}


class _Clock:
    """A transformers streamer (``BaseStreamer`` protocol: ``put``, ``end``) that timestamps generated tokens.

    transformers' first ``put()`` carries the prompt; every later one carries one token (or an accepted block of
    tokens in assisted generation), all given the same timestamp.
    """

    def __init__(self, t0: float) -> None:
        self.t0, self.first = t0, True
        self.times: list[float] = []
        self.tokens: list[int] = []

    def put(self, value) -> None:
        if self.first:
            self.first = False
            return
        now = time.perf_counter() - self.t0
        ids = value.reshape(-1).tolist()
        self.tokens.extend(int(i) for i in ids)
        self.times.extend([now] * len(ids))

    def end(self) -> None:
        pass


class _OursRunner:
    """Worker side of our methods: an :class:`~triforce.engine.Engine` that ignores EOS."""

    def __init__(self, method: str, cfg: dict) -> None:
        import torch

        from .engine import Engine, SpeculationConfig
        from .sampling import SamplingParams

        self.method, self.cfg = method, cfg
        self.synthetic = cfg.get("synthetic")
        draft_src = cfg.get("draft")
        uses_bottom = method in ("draft", "triforce", "triforce-int8", "auto")
        drafter = "ngram" if draft_src in (None, "ngram") else "model"
        if self.synthetic:
            syn = _synthetic_module()
            scfg = syn.synthetic_config(self.synthetic, layers=cfg.get("layers"))
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg["dtype"]]
            target = syn.random_model(scfg, dtype, "cpu", cfg["seed"])
            self.tokenizer, self.context, self.rope_dynamic = None, None, False
            draft = None
            if uses_bottom and draft_src != "ngram":  # the paper's draft shape, sharing the target's vocabulary
                dcfg = syn.synthetic_config(SYNTHETIC_DRAFT, vocab_size=scfg.vocab_size)
                draft, drafter = syn.random_model(dcfg, dtype, "cpu", cfg["seed"] + 1), "model"
        else:
            from .loading import ModelLoadError, load_model

            lm = load_model(cfg.get("model"), cfg["dtype"])
            target = lm.model
            self.tokenizer, self.context = lm.tokenizer, lm.model.cfg.max_position_embeddings
            self.rope_dynamic = lm.model.cfg.rope_type == "dynamic"
            draft = None
            if uses_bottom and drafter == "model":
                try:
                    draft_lm = load_model(draft_src, cfg["dtype"])
                except ModelLoadError as e:
                    raise ModelLoadError(f"draft: {e}") from e
                from .api import check_same_tokenizer

                check_same_tokenizer(lm.tokenizer, draft_lm.tokenizer)
                draft = draft_lm.model
        packed = cfg.get("packed_weights", "auto")
        if packed == "on" or (packed == "auto" and target.packing_fits()):
            for model in (target, draft):
                if model is not None:
                    model.pack_weights()
        self.target, self.draft = target, draft
        self.engine = Engine(target, draft, eos_ids=())
        self.sampling = SamplingParams(temperature=cfg["temperature"], top_p=cfg["top_p"], top_k=cfg["top_k"])
        mode = method.removesuffix("-int8")
        lower = dict(lower_weights="int8", lower_kv_dtype="bfloat16") if method.endswith("-int8") else {}
        if method == "self":
            mode, drafter = "draft", "self"
        elif method == "auto" and drafter == "ngram" and draft_src is None:
            drafter = "model"  # auto's own choice of bottom tier, as `triforce generate` without --draft
        self.spec = SpeculationConfig(mode=mode, drafter=drafter, budget=cfg["budget"], chunk_size=cfg["chunk_size"],
                                      gamma1=cfg["gamma1"], gamma2=cfg["gamma2"], **lower)

    def describe(self) -> dict:
        return {"chain": [list(x) for x in self.spec.chain], "drafter": self.spec.drafter,
                "spec": {"mode": self.spec.mode, "budget": self.spec.budget, "chunk_size": self.spec.chunk_size,
                         "gamma1": self.spec.gamma1, "gamma2": self.spec.gamma2, "drafter": self.spec.drafter,
                         "lower_weights": self.spec.lower_weights, "lower_kv_dtype": self.spec.lower_kv_dtype}}

    def _fill_prefix(self, ids: list[int], new_tokens: int) -> None:
        """Synthetic models: make the engine's full KV cache hold random KV for ``ids[:-1]`` (no prefill), so the
        engine's prefix reuse feeds only the last prompt token (which also records the query the retrieval cache
        selects chunks with)."""
        from .caches import FullKVCache
        from .plan import size_request

        n = len(ids) - 1
        eng = self.engine
        held = eng.prefix_tokens
        if n < 1 or (len(held) >= n and held[:n] == ids[:n]):
            return
        total = size_request(len(ids), new_tokens, self.spec)[0]
        self.target.set_request_length(total)
        eng.forget_prefix()
        full = FullKVCache(self.target.cfg, total, self.target.dtype, self.target.device)
        _synthetic_module().fill_random_kv(full, n, self.cfg["seed"])
        eng.adopt_prefix(full, list(ids[:n]))

    def run(self, ids: list[int], new_tokens: int, seed: int) -> dict:
        if self.synthetic:
            self._fill_prefix(ids, new_tokens)
        t0 = time.perf_counter()
        gen = self.engine.stream(ids, max_new_tokens=new_tokens, sampling=self.sampling, spec=self.spec, seed=seed)
        tokens, times = [], []
        for tok in gen:
            times.append(time.perf_counter() - t0)
            tokens.append(int(tok))
        stats = self.engine.last_stats
        return {"tokens": tokens, "times": times, "stats": stats.to_dict() if stats else None}

    def predict(self, context: int, acceptance: dict, reps: int) -> dict:
        """The cost model's prediction for this method at ``context`` tokens (issue 4, item 2)."""
        cm = _costmodel_module()
        s = self.spec
        draft = self.draft
        if any(k == "self" for k, _ in s.chain):  # the self tier is timed as a draft model: the target's copy
            draft = self.engine.lower_model(self.target, s.self_weights)
        lat = cm.measure_tier_latencies(self.target, draft, [context], gamma1=s.gamma1, gamma2=s.gamma2,
                                        budget=s.budget, chunk_size=s.chunk_size, draft_sink=s.draft_sink,
                                        draft_window=s.draft_window, reps=reps, progress=None)
        latencies = lat[0]
        if s.lower_weights:  # the tiers below the verifier run the cheaper copies: time those
            lower = self.engine.lower_model(self.target, s.lower_weights)
            low = cm.measure_tier_latencies(lower, draft, [context], gamma1=s.gamma1, gamma2=s.gamma2,
                                            budget=s.budget, chunk_size=s.chunk_size, draft_sink=s.draft_sink,
                                            draft_window=s.draft_window, reps=reps, progress=None)[0]
            for key in ("retrieval_decode", "retrieval_pass", "draft_step", "draft_pass"):
                if key in low:
                    latencies[key] = low[key]
        rates = {name: t["acceptance_rate"] for name, t in acceptance.items() if t.get("acceptance_rate") is not None}
        lengths = {name: t["accepted_lengths"] for name, t in acceptance.items() if t.get("accepted_lengths")}
        pred = cm.predict(s.chain, latencies, rates, accepted_lengths=lengths)
        return {"latencies": latencies, "prediction": pred}


class _HFRunner:
    """Worker side of the transformers methods (``generate`` with a timestamping streamer)."""

    def __init__(self, method: str, cfg: dict) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.method, self.cfg = method, cfg
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg["dtype"]]
        self.cache, self._cache_ids = None, None  # the prompt's KV but its last token, kept between runs
        if cfg.get("synthetic"):
            from transformers import LlamaConfig

            fields = dict(_synthetic_module().SYNTHETIC_SHAPES[cfg["synthetic"]])
            fields.pop("architectures", None)
            fields.pop("model_type", None)
            if cfg.get("layers"):
                fields["num_hidden_layers"] = cfg["layers"]
            torch.manual_seed(cfg["seed"])
            self.model = AutoModelForCausalLM.from_config(LlamaConfig(**fields), dtype=dtype).eval()
            self.tokenizer = None
        else:
            src, kw = _hf_source(cfg.get("model"))
            self.model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kw).eval()
            self.tokenizer = AutoTokenizer.from_pretrained(src, **kw)
        self.context = self.model.config.max_position_embeddings
        self.assistant = None
        if method == "hf-assisted":
            dsrc, dkw = _hf_source(cfg["draft"])
            self.assistant = AutoModelForCausalLM.from_pretrained(dsrc, dtype=dtype, **dkw).eval()

    def describe(self) -> dict:
        return {}

    def run(self, ids: list[int], new_tokens: int, seed: int) -> dict:
        import torch
        from transformers import GenerationConfig

        cfg = self.cfg
        greedy = cfg["temperature"] == 0
        gc = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=not greedy,
                              eos_token_id=None, pad_token_id=0,
                              **({} if greedy else dict(temperature=cfg["temperature"], top_p=cfg["top_p"],
                                                         top_k=cfg["top_k"] or None)))
        extra: dict[str, Any] = {}
        if self.method == "hf-assisted":
            extra["assistant_model"] = self.assistant
        elif self.method == "hf-lookup":
            gc.prompt_lookup_num_tokens = cfg["gamma2"]
        x = torch.tensor([ids])
        t0 = time.perf_counter()  # a prefill of the prompt's KV (first run only) counts in the time to first token
        if cfg.get("synthetic"):
            extra["past_key_values"] = self._random_prefix(ids)
        elif self.method == "hf-ar":  # assisted and prompt-lookup generation mishandle a given cache (their greedy
            extra["past_key_values"] = self._prefix(ids)  # tokens then differ): they prefill on every run
        torch.manual_seed(seed)
        clock = _Clock(t0)
        with torch.no_grad():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc, streamer=clock,
                                      **extra)
        tokens = out[0, len(ids):].tolist()
        if self.cache is not None:  # back to the prompt minus its last token, for the next run
            extra_len = self.cache.get_seq_length() - (len(ids) - 1)
            if extra_len > 0:
                self.cache.crop(-extra_len)
        return {"tokens": tokens, "times": clock.times[:len(tokens)], "stats": None}


    def _prefix(self, ids: list[int]):
        """The prompt's KV cache but its last token (a DynamicCache), computed by one forward the first time and
        kept between runs, as our engine's prefix reuse does; ``generate`` then feeds only the last prompt token.
        Returns None (a plain prefill) for a one-token prompt."""
        import torch
        from transformers import DynamicCache

        n = len(ids) - 1
        if n < 1:
            return None
        if self.cache is not None and self.cache.get_seq_length() == n and self._cache_ids == ids[:n]:
            return self.cache
        self.cache = None
        cache = DynamicCache(config=self.model.config)
        with torch.no_grad():
            self.model(torch.tensor([ids[:n]]), past_key_values=cache, use_cache=True)
        self.cache, self._cache_ids = cache, list(ids[:n])
        return cache

    def _random_prefix(self, ids: list[int]):
        """Synthetic models: a DynamicCache holding random KV for ``ids[:-1]`` (kept and reused across runs)."""
        import torch
        from transformers import DynamicCache

        n = len(ids) - 1
        if self.cache is not None and self.cache.get_seq_length() == n and getattr(self, "_cache_ids", None) == ids[:n]:
            return self.cache
        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        gen = torch.Generator().manual_seed(self.cfg["seed"])
        cache = DynamicCache(config=c)
        for layer in range(c.num_hidden_layers):
            shape = (1, c.num_key_value_heads, n, head_dim)
            cache.update(torch.randn(shape, generator=gen).to(self.model.dtype),
                         torch.randn(shape, generator=gen).to(self.model.dtype), layer)
        self.cache, self._cache_ids = cache, list(ids[:n])
        return cache


class _LlamaRunner:
    """Worker side of llama.cpp (llama-cpp-python): prefill with ``eval``, then sample/eval token by token."""

    def __init__(self, method: str, cfg: dict) -> None:
        import llama_cpp  # noqa: F401  (fails here, reported as the method's skip reason)

        self.cfg = cfg
        self.path = _gguf_for(cfg.get("model"))[0]
        self.llm = None
        self.n_ctx = 0
        self.context = None

    def describe(self) -> dict:
        import llama_cpp

        return {"gguf": self.path, "llama_cpp_python": getattr(llama_cpp, "__version__", None)}

    def _ensure(self, n_ctx: int) -> None:
        if self.llm is not None and self.n_ctx >= n_ctx:
            return
        from llama_cpp import Llama

        self.llm = None
        threads = self.cfg.get("threads") or os.cpu_count()
        self.n_ctx = 256 * math.ceil(n_ctx / 256)
        self.llm = Llama(model_path=self.path, n_ctx=self.n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, seed=self.cfg["seed"], verbose=False)

    def run(self, ids: list[int], new_tokens: int, seed: int) -> dict:
        cfg = self.cfg
        self._ensure(len(ids) + new_tokens + 8)
        llm = self.llm
        llm.reset()
        llm.set_seed(seed)
        greedy = cfg["temperature"] == 0
        tokens, times = [], []
        # one sampler chain for the whole run, so its random state advances from token to token (Llama.sample()
        # alone builds a fresh chain, re-seeded, for every token); llama.cpp's chain applies top-k, top-p, then
        # the temperature (transformers and triforce apply the temperature first)
        llm._sampler = llm._init_sampler(temp=0.0 if greedy else cfg["temperature"], top_k=cfg["top_k"],
                                         top_p=cfg["top_p"], min_p=0.0, typical_p=1.0, repeat_penalty=1.0,
                                         frequency_penalty=0.0, presence_penalty=0.0)
        try:
            t0 = time.perf_counter()
            llm.eval(ids)
            for i in range(new_tokens):
                tok = llm.sample()
                times.append(time.perf_counter() - t0)
                tokens.append(int(tok))
                if i + 1 < new_tokens:
                    llm.eval([tok])
        finally:
            llm._sampler = None
        return {"tokens": tokens, "times": times, "stats": None}


def worker_main(method: str, config: str) -> int:
    """Body of ``python -m triforce.bench --worker METHOD --config JSON``: load once, answer requests, exit.

    Protocol (one JSON object per line; replies on the original stdout, everything else printed goes to stderr):
    the worker first sends ``{"ready": true, "load_seconds", "describe"}`` (or ``{"error"}``); then answers
    ``{"cmd": "encode", "text", "max_prompt_tokens"}`` with ``{"ids", "context"}``; ``{"cmd": "run", "ids",
    "new_tokens", "seed"}`` with ``{"tokens", "times", "stats"}`` (``times``: seconds since the call, one per
    token); ``{"cmd": "predict", "context", "acceptance", "reps"}`` with the cost model's figures; and
    ``{"cmd": "exit"}`` with ``{"peak_memory_bytes"}`` (``ru_maxrss``) before exiting. Any failure answers
    ``{"error": "..."}``.
    """
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints of libraries (C or Python) must not corrupt the protocol
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    cfg = json.loads(config)
    try:
        import torch

        if cfg.get("threads"):
            torch.set_num_threads(cfg["threads"])
        t = time.perf_counter()
        family = METHODS[method][0]
        runner = {"ours": _OursRunner, "hf": _HFRunner, "llama": _LlamaRunner}[family](method, cfg)
        send({"ready": True, "load_seconds": round(time.perf_counter() - t, 3), "describe": runner.describe()})
    except Exception as e:  # reported to the parent as the method's failure reason
        send({"error": f"{type(e).__name__}: {e}"})
        return 1
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        try:
            if msg["cmd"] == "exit":
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                send({"peak_memory_bytes": int(peak if sys.platform == "darwin" else peak * 1024)})
                return 0
            if msg["cmd"] == "encode":
                from .prompts import encode_prompt

                if runner.tokenizer is None:
                    raise ValueError("this worker has no tokenizer")
                ids = encode_prompt(runner.tokenizer, msg["text"], max_prompt_tokens=msg.get("max_prompt_tokens"))
                send({"ids": ids, "context": runner.context,
                      "dynamic_rope": bool(getattr(runner, "rope_dynamic", False))})
            elif msg["cmd"] == "run":
                send(runner.run(msg["ids"], msg["new_tokens"], msg["seed"]))
            elif msg["cmd"] == "predict":
                send(runner.predict(msg["context"], msg["acceptance"], msg.get("reps", 3)))
            else:
                send({"error": f"unknown command {msg['cmd']!r}"})
        except Exception as e:  # the parent records it as the method's failure
            send({"error": f"{type(e).__name__}: {e}"})
    return 0


# ---------------------------------------------------------------------------------------------------- the run
def _prompt_text(args: argparse.Namespace) -> tuple[str, str]:
    """``(text, description of its source)``."""
    from .prompts import strip_gutenberg

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
                "gamma1", "gamma2", "methods", "reps", "json", "png"):
        v = getattr(args, opt)
        if v is not None:
            parts += ["--" + opt.replace("_", "-"), str(v)]
    return shlex.join(parts)


def _model_label(args: argparse.Namespace) -> str:
    if args.synthetic:
        from .synthetic import SYNTHETIC_SHAPES

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

    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "load_average_1_5_15min_at_end": [round(x, 2) for x in os.getloadavg()]}
    try:
        from importlib.metadata import version

        info["llama_cpp_python"] = version("llama_cpp_python")
    except Exception:
        info["llama_cpp_python"] = None
    return info


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
              "synthetic": args.synthetic, "layers": args.layers, "packed_weights": args.packed_weights}
    results: dict[str, dict] = {m: {"status": "skipped", "reason": r, "description": METHODS[m][1]}
                                for m, r in skipped.items()}
    bar_off = args.no_progress or None
    workers: dict[str, Worker] = {}
    log_dir = tempfile.mkdtemp(prefix="triforce-bench-")
    log = (lambda msg: print(msg, file=sys.stderr)) if not args.no_progress else (lambda msg: None)
    try:
        log(f"bench: starting {len(to_run)} workers ({', '.join(to_run)}); skipped: "
            f"{', '.join(skipped) or 'none'}")
        for m in to_run:
            workers[m] = Worker(m, config, log_dir)
        for m in list(workers):
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
        for m, w in workers.items():
            _summarize(results[m], runs[m])
        predictions = {}
        cm = _costmodel_module()
        specs = [m for m in workers if m in OUR_SPECULATIVE and results[m].get("acceptance")]
        if cm is None:
            for m in specs:
                results[m]["predicted"] = {"status": "skipped", "reason": "triforce.costmodel is not installed"}
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
    for m in ok:
        pred = results[m].get("predicted", {}).get("prediction") if isinstance(results[m].get("predicted"), dict) else None
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
        if comparable:
            reference = next((m for m in ("hf-ar", "autoregressive") if m in comparable), comparable[0])
            cmp = compare_greedy({m: results[m]["token_ids"] for m in comparable}, reference)
            for m in comparable:
                results[m]["greedy"] = cmp[m]
            mismatches = [m for m in comparable if not cmp[m]["same_tokens"]]
            greedy_report = {"reference": reference, "all_same": not mismatches, "compared": comparable}
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


def _summarize(res: dict, runs: list[dict]) -> None:
    """Fill one method's result from its timed runs (metrics, spread, tokens, acceptance)."""
    per = [rep_metrics(r["times"]) for r in runs]
    res["reps"] = per
    for key in ("mean_time_between_tokens_ms", "tokens_per_second", "time_to_first_token_s"):
        res[key] = spread([p[key] for p in per])
    res["generated_tokens"] = [len(r["tokens"]) for r in runs]
    res["token_ids"] = [r["tokens"] for r in runs]
    stats = [r["stats"] for r in runs if r.get("stats")]
    if stats:
        res["acceptance"] = aggregate_tiers([s["tiers"] for s in stats]) or None
        res["engine_prefill_seconds"] = [s["prefill_seconds"] for s in stats]
        res["engine_mean_time_between_tokens_ms"] = [s["mean_time_between_tokens_ms"] for s in stats]
        autos = [s["auto"] for s in stats if s.get("auto")]
        if autos:  # mode auto: the hierarchy it chose and how many tokens it decoded with it, per repetition
            res["auto"] = autos
        holds = [s.get("retrieval_holds_full_cache") for s in stats]
        if any(h is not None for h in holds):
            res["retrieval_holds_full_cache"] = holds


def _speedups(results: dict, ok: list[str]) -> None:
    for base, key in (("hf-ar", "speedup_vs_hf_ar"), ("autoregressive", "speedup_vs_autoregressive")):
        ref = results.get(base, {}).get("mean_time_between_tokens_ms", {}).get("median") if base in ok else None
        for m in ok:
            mine = results[m]["mean_time_between_tokens_ms"]["median"]
            results[m][key] = round(ref / mine, 4) if ref and mine else None


# ---------------------------------------------------------------------------------------------------- output
def format_table(result: dict) -> str:
    """The human-readable table of a result (one line per method)."""
    s = result["settings"]
    head = (f"{'SYNTHETIC (timing only): ' if result['synthetic'] else ''}{s['model']}, {s['prompt_tokens']}-token prompt ({s['prompt_source']}), {s['new_tokens']} new tokens, "
            f"T={s['temperature']} top-p={s['top_p']} top-k={s['top_k']}, {s['dtype']}, {s['threads']} threads, "
            f"{s['reps']} interleaved reps (median [min-max])")
    lines = [head, f"{'method':<15} {'TBT ms':>22} {'tok/s':>7} {'vs hf-ar':>8} {'vs ar':>6} {'TTFT s':>7} "
                   f"{'peak MiB':>8}  acceptance / note"]
    for m, r in result["methods"].items():
        if r["status"] != "ok":
            lines.append(f"{m:<15} {r['status']}: {r['reason']}")
            continue
        t = r["mean_time_between_tokens_ms"]
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        tbt = f"{fmt(t['median'], '.1f')} [{fmt(t['min'], '.1f')}-{fmt(t['max'], '.1f')}]"
        acc = ", ".join(f"{k} {v['acceptance_rate']:.2f} ({v['mean_tokens_per_verification']:.2f}/verif)"
                        for k, v in (r.get("acceptance") or {}).items() if v.get("acceptance_rate") is not None)
        if r.get("predicted_speedup_vs_autoregressive"):
            sp = r.get("speedup_vs_autoregressive")
            acc += (f"; measured {sp:.2f}x vs ar" if sp else "") + \
                f" (cost-model prediction {r['predicted_speedup_vs_autoregressive']:.2f}x)"
        if r.get("greedy") and not r["greedy"]["same_tokens"]:
            acc += f"; GREEDY TOKENS DIFFER from {result['greedy']['reference']} at {r['greedy']['first_difference']}"
        mem = r.get("peak_memory_bytes")
        lines.append(f"{m:<15} {tbt:>22} {fmt(r['tokens_per_second']['median'], '7.2f'):>7} "
                     f"{fmt(r.get('speedup_vs_hf_ar'), '.2f'):>8} {fmt(r.get('speedup_vs_autoregressive'), '.2f'):>6} "
                     f"{fmt(r['time_to_first_token_s']['median'], '.2f'):>7} "
                     f"{fmt(mem / 2**20 if mem else None, '.0f'):>8}  {acc}")
    if any(r.get("predicted_speedup_vs_autoregressive") for r in result["methods"].values()):
        lines.append("measured figures are what this machine did; a cost-model prediction is an estimate from tier "
                     "latencies and acceptance, not a measurement (docs/benchmarks.md)")
    if result["greedy"]:
        lines.append("greedy: every method produced the reference's tokens" if result["greedy"]["all_same"] else
                     f"greedy: tokens differ from {result['greedy']['reference']}: "
                     f"{', '.join(result['greedy_mismatches'])}")
    return "\n".join(lines)


def write_png(result: dict, path: str) -> str | None:
    """Draw median TBT (with min-max bars) and peak memory per method; returns None, or why nothing was drawn.

    Needs matplotlib (``pip install 'triforce[bench]'``), imported here only.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'triforce[bench]'); no chart written"
    ok = [(m, r) for m, r in result["methods"].items() if r["status"] == "ok"
          and r["mean_time_between_tokens_ms"]["median"] is not None]
    if not ok:
        return "no method ran; no chart written"
    names = [m for m, _ in ok]
    med = [r["mean_time_between_tokens_ms"]["median"] for _, r in ok]
    lo = [r["mean_time_between_tokens_ms"]["median"] - r["mean_time_between_tokens_ms"]["min"] for _, r in ok]
    hi = [r["mean_time_between_tokens_ms"]["max"] - r["mean_time_between_tokens_ms"]["median"] for _, r in ok]
    mem = [(r.get("peak_memory_bytes") or 0) / 2**20 for _, r in ok]
    colors = ["tab:gray" if m.startswith("hf") else "tab:purple" if m == "llama.cpp" else "tab:blue" for m in names]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.5 * len(names) + 2.2), gridspec_kw={"width_ratios": [3, 1.3]})
    y = list(range(len(names)))
    a1.barh(y, med, xerr=[lo, hi], color=colors, capsize=3)
    for i, (m, r) in enumerate(ok):
        sp = r.get("speedup_vs_autoregressive")
        label = f"{med[i]:.1f} ms" + (f"  (measured {sp:.2f}x ours ar)" if sp else "")
        if r.get("predicted_speedup_vs_autoregressive"):
            label += f", cost-model prediction {r['predicted_speedup_vs_autoregressive']:.2f}x"
        a1.text(med[i] + hi[i], i, " " + label, va="center", fontsize=8)
    a1.set_yticks(y, names)
    a1.invert_yaxis()
    a1.set_xlabel("mean time between tokens, ms (median, min-max bars; lower is better)")
    a1.set_xlim(0, max(m + h for m, h in zip(med, hi)) * 1.45)
    a2.barh(y, mem, color=colors)
    a2.set_yticks(y, [""] * len(names))
    a2.invert_yaxis()
    a2.set_xlabel("peak RSS of the method's process, MiB")
    s = result["settings"]
    title = (f"{'SYNTHETIC, timing only: ' if result['synthetic'] else ''}{s['model']}: {s['prompt_tokens']}-token prompt, {s['new_tokens']} new tokens, T={s['temperature']}"
             f"{'' if s['temperature'] == 0 else ' top-p=' + str(s['top_p'])}, {s['dtype']}, {s['threads']} threads, "
             f"{s['reps']} interleaved reps")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def cmd_bench(args: argparse.Namespace) -> int:
    """``triforce bench``: validate, run, print/write the JSON, the table (stderr) and the PNG; exit status.

    Raises:
        BenchError (a ValueError): bad options, reported by ``triforce``'s ``main`` as one line, exit status 2.
    """
    validate_args(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result = run_bench(args)
    text = json.dumps(result, indent=2)
    if args.json in (None, "-"):
        sys.stdout.write(text + "\n")
    else:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(format_table(result), file=sys.stderr)
    for m in result["greedy_mismatches"]:
        g = result["methods"][m]["greedy"]
        print(f"triforce: warning: {m} produced different greedy tokens from {result['greedy']['reference']} "
              f"(first difference at generated token {g['first_difference']})", file=sys.stderr)
    if args.png:
        why = write_png(result, args.png)
        if why:
            print(f"triforce: {why}", file=sys.stderr)
    return 0


def _worker_entry(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m triforce.bench")
    p.add_argument("--worker", required=True, choices=list(METHODS))
    p.add_argument("--config", required=True)
    a = p.parse_args(argv)
    return worker_main(a.worker, a.config)


if __name__ == "__main__":
    sys.exit(_worker_entry(sys.argv[1:]))
