"""``triforce bench``: the methods compared, the checks of its options, and which methods can run."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

from ...defaults import DTYPE_ALIASES
from ..books import BOOKS_DIR

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
    "retrieval-codes": ("ours", "retrieval with the GGUF model's own block codes times int8 activations in the "
                                "retrieval tier (llama.cpp's integer dot products; lossless)"),
    "autoregressive-exact": ("ours", "autoregressive with --precision exact: fp32 products over the weights the GGUF "
                                     "file stands for (the default for a GGUF file is its own arithmetic, file)"),
    "auto-exact": ("ours", "auto with --precision exact"),
    "llama.cpp": ("llama", "llama.cpp through llama-cpp-python on the GGUF file (its weights as stored, f16 KV; "
                           "sampling applies top-k and top-p before the temperature)"),
}
OUR_SPECULATIVE = ("draft", "self", "retrieval", "triforce", "retrieval-int8", "triforce-int8", "retrieval-codes")
SYNTHETIC_METHODS = ("hf-ar", "autoregressive", "draft", "retrieval", "triforce")
SYNTHETIC_DRAFT = "llama-68m"  # the paper's draft shape (TriForce Sec. 5.1), used by --synthetic without --draft ngram
WARMUP_PROMPT_TOKENS, WARMUP_NEW_TOKENS = 16, 2
#: prompt tokens whose logits the cost model's token selection is timed on (costmodel.text_logits)
PREDICT_TEXT_TOKENS = 64
PAUSE_BETWEEN_RUNS_S = 0.3  # lets the previous worker's OpenMP threads stop spinning before the next one starts

DEFINITIONS = {
    "mean_time_between_tokens_ms": "1000 * (t_last - t_first) / (n - 1) over the timestamps at which the method "
                                   "handed out its n tokens (streamer put() for transformers, Engine.stream for "
                                   "ours, the sampling loop for llama.cpp); prefill excluded",
    "tokens_per_second": "1000 / mean_time_between_tokens_ms (decode only)",
    "time_to_first_token_s": "from the call to the first token: prefill plus the first decode step; our engine "
                             "reuses the prompt's KV cache from its previous request (prefix reuse), and the "
                             "hf-ar worker computes the prompt's KV cache once and passes it to generate as "
                             "past_key_values, and llama.cpp keeps its KV from the previous run (all but the last "
                             "prompt token), so only their first timed run pays the prefill; hf-assisted and "
                             "hf-lookup prefill on every run",
    "prompt_cache": "with --prompt-cache, per timed run of our methods and llama.cpp: prompt tokens whose KV was "
                    "loaded from a file (loaded_tokens, loaded_from; the load counts in time_to_first_token_s) and "
                    "the file written after the run (stored); ours as generate's --prompt-cache (safetensors), "
                    "llama.cpp's with its own llama_state_save_file / llama_state_load_file",
    "median/min/max": "over the timed repetitions, which ran round-robin over the methods (interleaved)",
    "speedup_vs_hf_ar": "median TBT of hf-ar / median TBT of the method",
    "speedup_vs_autoregressive": "median TBT of our autoregressive / median TBT of the method",
    "peak_memory_bytes": "ru_maxrss of the method's own worker process (model loading included)",
    "acceptance": "per verifying tier of our engine, summed over the timed repetitions: accepted / proposed, and "
                  "tokens emitted per verification (recovered or bonus token included)",
    "eos": "ignored by every method: each generates exactly new_tokens tokens",
    "step_seconds": "per tier of our engine, over the timed repetitions: (forward_seconds - prefill_seconds) / "
                    "(forward_passes - prefill_passes), the seconds per forward while generating",
    "predicted": "the cost model (triforce.lab.costmodel.predict) with tier latencies timed in the method's worker "
                 "after the runs (forward and token selection, one interleaved loop) and the run's acceptance",
    "predicted_from_run": "the same model with the run's own step_seconds (and our autoregressive method's) as the "
                          "latencies; for auto where every repetition ran one speculative hierarchy without a bypass, "
                          "its plain tokens p of N at the decode step's cost: N / ((N - p) / S + p)",
}


class BenchError(ValueError):
    """A bad ``triforce bench`` option or a run that cannot go on; the message names the option."""


# ---------------------------------------------------------------------------------------------------- validation
def _synthetic_module():
    try:
        from .. import synthetic
    except ImportError:
        return None
    return synthetic


def _costmodel_module():
    try:
        from .. import costmodel
    except ImportError:
        return None
    return costmodel


def validate_args(args: argparse.Namespace) -> None:
    """Check every option before anything is loaded.

    Raises:
        BenchError: one line naming the option and the allowed values.
    """
    from ...engine import SpeculationConfig
    from ...speculation.sampling import SamplingParams

    def positive(name: str, value, minimum: int = 1):
        if value is not None and value < minimum:
            raise BenchError(f"--{name} must be an integer >= {minimum}, got {value}")

    if args.dtype not in DTYPE_ALIASES:
        raise BenchError(f"--dtype must be one of {', '.join(DTYPE_ALIASES)}, got {args.dtype!r}")
    args.dtype = DTYPE_ALIASES[args.dtype]  # the full name: the workers, the JSON and the table use it
    if args.threads is not None:
        limit = 4 * (os.cpu_count() or 1)
        if not 1 <= args.threads <= limit:
            raise BenchError(f"--threads must be between 1 and {limit} (4x this machine's {os.cpu_count()} CPUs), "
                             f"got {args.threads}")
    for name in ("prompt_tokens", "new_tokens", "reps", "budget", "chunk_size", "gamma1", "gamma2"):
        positive(name.replace("_", "-"), getattr(args, name))
    positive("layers", args.layers)
    if getattr(args, "png", None):
        try:  # imported, not only found: a broken install would otherwise fail after the whole run
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise BenchError(f"--png needs matplotlib, which cannot be imported ({e}): pip install matplotlib "
                             "(or leave out --png)") from e
    if getattr(args, "prompt_cache", None) is not None:
        from ...kv.promptcache import check_options

        if args.synthetic:
            raise BenchError("--prompt-cache keeps a real prompt's KV: leave it out with --synthetic (its KV is "
                             "random)")
        try:
            check_options(args.prompt_cache)
        except ValueError as e:
            raise BenchError(f"--prompt-cache: {e}") from e
    if args.rope_scaling is not None or args.rope_factor is not None:
        from ...errors import spelled
        from ...model.config import check_rope_scaling

        try:
            check_rope_scaling(args.rope_scaling, args.rope_factor)
        except ValueError as e:
            raise BenchError(spelled(e, lambda name: "--" + name.replace("_", "-"))) from e
        if args.synthetic:
            raise BenchError("--rope-scaling scales a checkpoint's RoPE: leave it out with --synthetic")
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
            raise BenchError("--synthetic needs the module triforce.lab.synthetic, which this installation lacks")
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
        from ...formats.download import default_gguf_path

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
        elif m == "retrieval-codes" and args.model is not None and _gguf_for(args.model)[0] is None:
            reason = "needs a GGUF model (its block codes): --model is not a .gguf file"
        elif m.endswith("-exact") and (args.model is None or _gguf_for(args.model)[0] is None):
            reason = ("a Hugging Face folder (the embedded model's too) computes exactly by default: the method "
                      "without -exact is the same")
        elif m.startswith("hf-") and args.rope_scaling is not None:
            reason = ("transformers runs the checkpoint as saved: --rope-scaling overrides ours and llama.cpp's RoPE "
                      "(edit config.json's rope_scaling to compare transformers)")
        elif m == "llama.cpp" and args.rope_scaling == "dynamic":
            reason = "llama.cpp has no dynamic NTK scaling (its --rope-scaling takes linear and yarn)"
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
