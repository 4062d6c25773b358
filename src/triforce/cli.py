"""Command line: ``triforce generate``, ``triforce download``.

Bad input exits with status 2 and one line on stderr naming the option; nothing is loaded before the
arguments are checked.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time

from . import __version__
from .engine import MAX_SEED, MODES, SpeculationConfig
from .sampling import SamplingParams


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``triforce: error: ...``, exit status 2) instead of the usage block."""

    def error(self, message: str):
        self.exit(2, f"triforce: error: {message} (see `{self.prog} --help`)\n")


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", help="target model: Hugging Face folder, .gguf file or hub id (default: the embedded "
                                   "SmolLM2-135M-Instruct)")
    g.add_argument("--draft", help="draft model sharing the target's tokenizer, 'ngram' for the model-free n-gram "
                                   "drafter, or 'self' for the target's own weights quantized to int4 (--self-weights) "
                                   "over a StreamingLLM cache (the bottom tier of the draft/triforce/auto modes)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights and KV dtype")
    g.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1)")
    g.add_argument("--threads", type=int, help="CPU threads for torch (default: one per physical core that other "
                                                 "programs leave idle while the model loads)")
    g.add_argument("--kv-dtype", choices=["float32", "bfloat16", "float16"],
                   help="dtype of every KV cache (default: --dtype); the full cache's dtype is the verifier's")
    g.add_argument("--quantize", choices=["int8"], help="weight-only int8 for the target itself (changes its outputs "
                                                        "like --dtype does; see --lower-weights for a lossless use)")
    g.add_argument("--packed-weights", choices=["auto", "on", "off"], default="auto",
                   help="CPU, fp32: oneDNN-prepacked weights for multi-token passes (verification blocks, prefill), "
                        "faster than MKL there; one more copy of the weights in memory (auto: when it takes at most "
                        "a quarter of the free memory)")
    g.add_argument("--compile", choices=["default", "reduce-overhead", "max-autotune"],
                   help="torch.compile each block's norms and MLP (reduce-overhead: CUDA graphs on GPUs); the first "
                        "steps are slow while kernels compile")
    g.add_argument("--offload-kv", action="store_true", help="keep the full KV cache in (pinned) host memory and "
                   "stream it to the device layer by layer with prefetch; retrieval and draft caches stay on the device")
    g.add_argument("--on-chip-layers", type=int, help="with --offload-kv: leading layers kept on the device "
                                                      "(default: chosen from free device memory)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks; launch with `torchrun --nproc-per-node N "
                                                      "-m triforce generate ... --tp N` (gloo on CPU, NCCL on GPU)")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=256)
    s.add_argument("--temperature", type=float, default=0.6, help="0 = greedy (default 0.6)")
    s.add_argument("--top-p", type=float, default=0.9, help="nucleus mass in (0, 1] (default 0.9)")
    s.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    s.add_argument("--seed", type=int, help="seed for every random draw (default: random, reported in --json)")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    k = p.add_argument_group("speculation (TriForce)")
    k.add_argument("--mode", choices=MODES, default="auto",
                   help="auto (default: the hierarchy is chosen per request and bypassed while it does not pay), "
                        "autoregressive, retrieval, draft, triforce")
    k.add_argument("--self-weights", choices=["int4", "int8", "bfloat16"], default="int4",
                   help="weights of the --draft self tier (default int4)")
    k.add_argument("--gamma1", type=int, default=4, help="draft tokens per retrieval-tier verification (triforce)")
    k.add_argument("--gamma2", type=int, default=6, help="tokens proposed per target verification")
    k.add_argument("--budget", type=int, default=4096, help="retrieval cache slots (default 4096)")
    k.add_argument("--chunk-size", type=int, default=8, help="retrieval chunk size (default 8)")
    k.add_argument("--chunk-score", default="mean", choices=["mean", "max", "bound", "attn"],
                   help="retrieval chunk score: mean (paper: q . mean key), max (best key), bound (Quest upper bound), "
                        "attn (per-head attention mass over recent verifier queries + a recent window; GQA models)")
    k.add_argument("--stop-below", type=float,
                   help="model drafters end a proposal before a token whose confidence is below this (default: off)")
    k.add_argument("--adaptive-gamma", action="store_true",
                   help="adapt each verifier's gamma from its last block (up to twice the given gamma)")
    k.add_argument("--rebuild-below", type=float,
                   help="re-select retrieval chunks when the retrieval tier's acceptance over its last 16 proposed "
                        "tokens falls below this fraction (default: never)")
    k.add_argument("--rebuild-every", type=int, help="re-select retrieval chunks every N tokens (default: never)")
    k.add_argument("--draft-sink", type=int, default=16, help="StreamingLLM sink tokens of the draft cache")
    k.add_argument("--draft-window", type=int, default=240, help="StreamingLLM window of the draft cache")
    k.add_argument("--ngram-n", type=int, default=4, help="longest suffix the n-gram drafter matches (4)")
    k.add_argument("--ngram-min", type=int, default=3, help="shortest suffix the n-gram drafter may match (3)")
    k.add_argument("--lower-weights", choices=["int8", "bfloat16"],
                   help="cheaper weights for the tiers below the verifier (retrieval tier, draft model): lossless, "
                        "the verifier decides every token (default: as loaded)")
    k.add_argument("--lower-kv-dtype", choices=["bfloat16", "float16"],
                   help="dtype of the retrieval and draft caches (lossless; default: as --kv-dtype)")
    k.add_argument("--tiers", help="explicit hierarchy under the full-cache target, bottom first, KIND:GAMMA entries "
                                   "with KIND in ngram, draft, retrieval (e.g. ngram:8,draft:4,retrieval:6); "
                                   "overrides --mode")


def build_parser() -> argparse.ArgumentParser:
    """The ``triforce`` argument parser with its subcommands (generate, serve, download)."""
    parser = _Parser(prog="triforce", description="Lossless long-context generation with hierarchical "
                                     "speculative decoding (TriForce).")
    parser.add_argument("--version", action="version", version=f"triforce {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="generate a continuation of a prompt")
    src = gen.add_argument_group("prompt")
    src.add_argument("--prompt", help="prompt text; with --prompt-file, a question about that document")
    src.add_argument("--prompt-file", help="read the prompt from a file ('-' = stdin); Project Gutenberg header and "
                                           "footer are stripped; with --prompt, the document the question is about "
                                           "(document first, then the question)")
    src.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    src.add_argument("--system", help="system message (with --chat)")
    src.add_argument("--max-prompt-tokens", type=int, help="keep the first N prompt tokens (with --prompt and "
                                                            "--prompt-file: cut the document so the question stays)")
    _add_generation_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object (schema in README) instead of text")
    gen.add_argument("--no-progress", action="store_true", help="no prefill progress (a bar on a terminal, a line "
                                                                 "every 10 s otherwise)")
    from .server import add_serve_parser

    add_serve_parser(sub)
    from .bench import add_bench_parser

    add_bench_parser(sub)
    from .analyze import add_analyze_parser

    add_analyze_parser(sub)
    dl = sub.add_parser("download", help="fetch the embedded default model (SmolLM2-135M-Instruct) into the cache")
    dl.add_argument("--force", action="store_true", help="download and convert again")
    return parser


def spec_from_args(args: argparse.Namespace, has_draft: bool) -> SpeculationConfig:
    """The speculation settings of the parsed options (ValueError names the parameter)."""
    mode = args.mode or "auto"
    if mode in ("draft", "triforce") and not has_draft and not args.tiers:
        raise CLIError(f"--mode {mode} needs --draft MODEL, --draft ngram or --draft self (or use --mode auto, "
                       "autoregressive or retrieval)")
    spec = SpeculationConfig(mode=mode, gamma1=args.gamma1, gamma2=args.gamma2, budget=args.budget,
                             chunk_size=args.chunk_size, rebuild_every=args.rebuild_every,
                             draft_sink=args.draft_sink, draft_window=args.draft_window,
                             drafter=args.draft if args.draft in ("ngram", "self") else "model",
                             self_weights=args.self_weights, ngram_n=args.ngram_n,
                             ngram_min=args.ngram_min,
                             tiers=args.tiers, chunk_score=args.chunk_score,
                             rebuild_below=args.rebuild_below, stop_below=args.stop_below,
                             adaptive_gamma=args.adaptive_gamma, lower_weights=args.lower_weights,
                             lower_kv_dtype=args.lower_kv_dtype)
    if spec.uses_draft and (args.draft is None or args.draft in ("ngram", "self")):
        raise CLIError(f"--tiers {args.tiers} has a draft tier: give --draft MODEL")
    kinds = [k for k, _ in spec.chain]
    wanted = {"ngram": "ngram", "self": "self"}.get(args.draft, "draft")
    auto = spec.mode == "auto" and spec.tiers is None  # auto puts the named drafter at the bottom of what it picks
    if args.draft is not None and wanted not in kinds and not auto:
        how = (f"add {wanted}:GAMMA at the bottom of --tiers" if args.tiers else
               "--mode auto, --mode triforce (drafter -> retrieval -> target) and --mode draft (drafter -> target) use it")
        what = {"ngram": "n-gram", "self": "self"}.get(wanted, "draft-model")
        raise CLIError(f"--draft {args.draft}: not used by {spec.name}, whose tiers ({' -> '.join(kinds + ['target'])}) "
                       f"have no {what} tier; {how}, or drop --draft")
    return spec


def ignored_options(args: argparse.Namespace, spec: SpeculationConfig) -> list[str]:
    """Speculation options given a non-default value that the chosen hierarchy does not use (refused, exit 2)."""
    if spec.mode == "auto" and spec.tiers is None:
        return []  # the hierarchy is chosen per request
    kinds = [k for k, _ in spec.chain]
    uses = {
        "gamma1": spec.tiers is None and spec.mode == "triforce",
        "gamma2": spec.tiers is None and spec.mode != "autoregressive",
        "budget": "retrieval" in kinds, "chunk_size": "retrieval" in kinds, "chunk_score": "retrieval" in kinds,
        "rebuild_every": "retrieval" in kinds, "rebuild_below": "retrieval" in kinds,
        "draft_sink": "draft" in kinds or "self" in kinds, "draft_window": "draft" in kinds or "self" in kinds,
        "self_weights": "self" in kinds,
        "ngram_n": "ngram" in kinds, "ngram_min": "ngram" in kinds,
        "adaptive_gamma": bool(kinds), "stop_below": any(k in ("draft", "self", "retrieval") for k in kinds),
        "lower_weights": any(k in ("draft", "retrieval") for k in kinds),
        "lower_kv_dtype": any(k in ("draft", "retrieval") for k in kinds),
    }
    defaults = SpeculationConfig()
    return ["--" + name.replace("_", "-") for name, used in uses.items()
            if not used and getattr(args, name, None) not in (None, getattr(defaults, name))]


def _option_error(e: ValueError) -> CLIError:
    """Map a library ValueError ('top_p must be ...') to the option name ('--top-p must be ...')."""
    msg = str(e)
    for name in ("max_prompt_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "gamma1", "gamma2", "budget",
                 "chunk_size", "rebuild_every", "draft_sink", "draft_window", "mode", "dtype", "system", "ngram_n", "ngram_min",
                 "tiers", "chunk_score", "rebuild_below", "stop_below", "on_chip_layers"):
        if msg.startswith(name):
            return CLIError("--" + name.replace("_", "-") + msg[len(name):])
    return CLIError(msg)


def _read_prompt(args: argparse.Namespace) -> tuple[str, str | None]:
    """``(text, document)``: the prompt, or with both ``--prompt`` and ``--prompt-file`` the question and the
    document (Gutenberg header and footer stripped, line endings ``\n``)."""
    from .prompts import normalize_newlines, strip_gutenberg

    if args.prompt is None and args.prompt_file is None:
        raise CLIError("give --prompt TEXT, --prompt-file PATH ('-' reads stdin), or both (a question about a document)")
    if args.prompt is not None and not args.prompt.strip() and args.prompt_file is not None:
        raise CLIError("--prompt: the question about --prompt-file is empty")
    document = None
    if args.prompt_file is not None:
        if args.prompt_file == "-":
            document = sys.stdin.read()
        else:
            try:
                with open(args.prompt_file, encoding="utf-8", errors="replace") as f:
                    document = f.read()
            except OSError as e:
                raise CLIError(f"--prompt-file {args.prompt_file!r}: {e.strerror}") from e
        document = strip_gutenberg(document)
    if args.prompt is None:
        return document, None
    return normalize_newlines(args.prompt), document


class LineProgress:
    """Prefill progress as plain lines, for a stderr that is not a terminal (a log file, a pipe).

    Silent for the first ``delay`` seconds, then one line every ``every`` seconds, e.g.
    ``triforce: prefill 2,048/8,000 tokens (26%), 12 s, about 35 s left``, and a last line when it ends.
    Call it with the tokens each prefill chunk processed (the :meth:`~triforce.api.TriForce.stream`
    ``prefill_progress`` callback); :meth:`close` writes the last line (if any was written).

    Args:
        total: prompt tokens to process.
        stream: where lines go (stderr).
        delay, every: seconds.
    """

    def __init__(self, total: int, stream=None, delay: float = 2.0, every: float = 10.0) -> None:
        self.total, self.stream, self.delay, self.every = total, stream or sys.stderr, delay, every
        self.done, self.t0, self.last, self.closed = 0, time.monotonic(), None, False

    def _line(self, now: float, final: bool = False) -> None:
        elapsed = now - self.t0
        pct = 100 * self.done / self.total if self.total else 100.0
        left = "" if final or not self.done else f", about {elapsed * (self.total - self.done) / self.done:.0f} s left"
        print(f"triforce: prefill {self.done:,}/{self.total:,} tokens ({pct:.0f}%), {elapsed:.0f} s{left}",
              file=self.stream, flush=True)
        self.last = now

    def update(self, n: int) -> None:
        """``n`` more prompt tokens processed: write a line when one is due."""
        self.done += n
        now = time.monotonic()
        if now - self.t0 >= self.delay and (self.last is None or now - self.last >= self.every):
            self._line(now)

    __call__ = update

    def close(self) -> None:
        """Write the final line if progress lines were written; idempotent."""
        if not self.closed and self.last is not None:
            self._line(time.monotonic(), final=True)
        self.closed = True


def prefill_progress(total: int, disable: bool = False):
    """The CLI's prefill progress: a tqdm bar on a terminal (shown after 2 s), :class:`LineProgress` otherwise.

    Returns:
        an object with ``update(n)`` (tokens processed) and ``close()``.
    """
    if disable:
        return _NoProgress()
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, unit="tok", desc="prefill", file=sys.stderr, leave=False, delay=2.0)
    return LineProgress(total)


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


@contextlib.contextmanager
def stdout_to_stderr():
    """Send everything written to stdout meanwhile to stderr: Python prints, C libraries and child processes
    (pip fetching the default model), so that ``--json`` leaves exactly one JSON object on stdout."""
    real = sys.stdout
    real.flush()
    try:
        saved = os.dup(1)  # the process's stdout, whatever sys.stdout is
    except OSError:  # fd 1 closed: Python-level only
        saved = None
    try:
        if saved is not None:
            os.dup2(2, 1)
        sys.stdout = sys.stderr
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = real
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def check_threads(threads: int | None) -> None:
    """``--threads`` of ``generate`` and ``serve``: None (the load-aware default, ``threads.py``) or 1 .. 4x the CPUs.

    Raises:
        CLIError: outside that range (the limit is in the message).
    """
    from .threads import max_threads

    if threads is not None and not 1 <= threads <= max_threads():
        raise CLIError(f"--threads must be between 1 and {max_threads()} (4x this machine's {os.cpu_count()} CPUs), "
                       f"got {threads}")


def check_seed(seed: int | None) -> None:
    """``--seed`` of ``generate`` and ``serve``: None (random) or an integer in [0, :data:`~triforce.engine.MAX_SEED`].

    Raises:
        CLIError: outside that range.
    """
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise CLIError(f"--seed must be an integer in [0, 2**63 - 1], got {seed}")


def cmd_generate(args: argparse.Namespace) -> int:
    """``triforce generate``: check options, load, stream text (or print JSON); returns the exit status.

    With ``--json``, everything but the final JSON object (download and conversion messages, warnings, progress)
    goes to stderr, C libraries and child processes included (:func:`stdout_to_stderr`).

    Raises:
        CLIError, ValueError, ModelLoadError, InsufficientMemoryError: reported by :func:`main` as one line, exit 2.
    """
    if not args.json:
        return _generate(args, sys.stdout)
    buf = io.StringIO()
    with stdout_to_stderr():
        code = _generate(args, buf)
    sys.stdout.write(buf.getvalue())
    sys.stdout.flush()
    return code


def _generate(args: argparse.Namespace, out) -> int:
    """:func:`cmd_generate` writing text or the JSON object to ``out``."""
    from .memory import fmt_bytes

    check_threads(args.threads)
    from .api import TriForce
    from .loading import parse_device

    check_seed(args.seed)
    try:
        parse_device(args.device)
    except ValueError as e:
        raise CLIError("--" + str(e)) from e
    try:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
        spec = spec_from_args(args, has_draft=args.draft is not None)
        unused = ignored_options(args, spec)
        if unused:  # refused before anything loads: the user would believe the option took effect
            raise CLIError(f"{', '.join(unused)}: not used by {spec.name}, whose tiers are "
                           f"{' -> '.join([k for k, _ in spec.chain] + ['target'])}; choose a --mode or --tiers that "
                           "uses them, or drop them")
        if args.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {args.max_new_tokens}")
        if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be an integer >= 1, got {args.max_prompt_tokens}")
        if args.system is not None and not args.chat:
            raise ValueError("system is only used with --chat")
        if any(not s for s in args.stop):
            raise CLIError("--stop strings must not be empty")
    except ValueError as e:
        raise _option_error(e) from e
    text, document = _read_prompt(args)
    from .parallel import init_tensor_parallel

    try:
        tp = init_tensor_parallel(args.tp, args.device)
    except ValueError as e:
        raise CLIError("--" + str(e)) from e
    if tp is not None and tp.rank != 0:  # only rank 0 prints
        out = open(os.devnull, "w")
        args.no_progress = True
    if args.on_chip_layers is not None and not args.offload_kv:
        raise CLIError("--on-chip-layers needs --offload-kv")
    if args.on_chip_layers is not None and args.on_chip_layers < 0:
        raise CLIError(f"--on-chip-layers must be >= 0, got {args.on_chip_layers}")
    try:
        tf = TriForce.load(args.model, args.draft, dtype=args.dtype, device=args.device, tp=tp,
                           offload_kv=args.offload_kv, on_chip_layers=args.on_chip_layers, kv_dtype=args.kv_dtype,
                           quantize=args.quantize,
                           packed_weights={"auto": None, "on": True, "off": False}[args.packed_weights],
                           threads="auto" if args.threads is None else args.threads)
        if args.compile:
            tf.compile(args.compile)
    except ValueError as e:
        raise _option_error(e) from e
    try:
        ids = tf.encode(text, chat=args.chat, system=args.system, max_prompt_tokens=args.max_prompt_tokens,
                        document=document)
        if args.offload_kv:  # the memory planner's choice, reported before the prefill
            print(tf.engine.validate(ids, args.max_new_tokens, spec).summary(), file=sys.stderr)
    except ValueError as e:
        raise _option_error(e) from e
    bar = prefill_progress(len(ids), disable=args.no_progress)
    gen = tf.stream(ids, max_new_tokens=args.max_new_tokens, sampling=sampling, spec=spec, seed=args.seed,
                    stop=args.stop, prefill_progress=bar.update)
    result = None
    try:
        while True:
            try:
                event = next(gen)
            except StopIteration as stop:
                result = stop.value
                break
            if bar is not None:
                bar.close()
                bar = None
            if not args.json:
                out.write(event.text)
                out.flush()
    except ValueError as e:
        raise _option_error(e) from e
    finally:
        if bar is not None:
            bar.close()
    import torch

    from .kernels import status as kernel_status

    threads = torch.get_num_threads()
    if args.json:
        out.write(json.dumps(dict(result.to_dict(), threads=threads, attention_kernel=kernel_status()), indent=2) + "\n")
        out.flush()
    else:
        out.write("\n")
        out.flush()
        s = result.stats
        print(f"[{result.finish_reason}] {s.summary()}; peak memory {fmt_bytes(s.peak_memory_bytes)}; "
              f"{threads} thread{'' if threads == 1 else 's'}; attention kernel {kernel_status()}", file=sys.stderr)
    return 130 if result.finish_reason == "interrupted" else 0


def cmd_download(args: argparse.Namespace) -> int:
    """``triforce download``: fetch and convert the default model; prints its folder."""
    from .download import download_default_model

    path = download_default_model(force=args.force)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``triforce`` console script; returns the exit status."""
    from .caches import CacheError
    from .download import DownloadError
    from .loading import ModelLoadError
    from .memory import InsufficientMemoryError

    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "download":
            return cmd_download(args)
        if args.command == "serve":
            from .server import cmd_serve

            return cmd_serve(args)
        if args.command == "bench":
            from .bench import cmd_bench

            return cmd_bench(args)
        if args.command == "analyze":
            from .analyze import cmd_analyze

            return cmd_analyze(args)
    except (CLIError, ModelLoadError, DownloadError, InsufficientMemoryError, ValueError) as e:
        print(f"triforce: error: {e}", file=sys.stderr)
        return 2
    except CacheError as e:  # a bug, but say it in one line
        print(f"triforce: internal cache error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ntriforce: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
