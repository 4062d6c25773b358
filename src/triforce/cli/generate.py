"""``triforce generate`` and ``triforce download``: their parsers and commands."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys

from ..defaults import DEFAULTS
from ..speculation.sampling import SamplingParams
from .common import CLIError, check_seed, check_threads, option_error
from .options import add_generation_args, spec_from_args
from .progress import prefill_progress, stdout_to_stderr


def add_generate_parser(sub) -> argparse.ArgumentParser:
    """Add ``generate`` (the prompt group, the shared model, sampling and speculation groups, output flags)."""
    gen = sub.add_parser("generate", help="generate a continuation of a prompt")
    src = gen.add_argument_group("prompt")
    src.add_argument("--prompt", help="prompt text; with --prompt-file, a question about that document")
    src.add_argument("--prompt-file", help="read the prompt from a file ('-' = stdin); Project Gutenberg header and "
                                           "footer are stripped; with --prompt, the document the question is about "
                                           "(document first, then the question)")
    src.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    src.add_argument("--system", help="system message (with --chat)")
    src.add_argument("--max-prompt-tokens", type=int, help="keep the first N prompt tokens, N at most the model's "
                                                            "context less the tokens to generate (with --prompt and "
                                                            "--prompt-file: cut the document so the question stays)")
    add_prompt_cache_args(src)
    add_generation_args(gen)
    # --max-new-tokens not given: the default, lowered to what the context leaves (_fit_new_tokens)
    gen.set_defaults(max_new_tokens=None)
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (schema: docs/usage.md) instead of text")
    gen.add_argument("--logprobs", type=int, metavar="N", help="with --json: each generated token's log-probability "
                                                               "under the target model and its N (0-20) most likely "
                                                               "alternatives, field logprobs")
    gen.add_argument("--json-schema", metavar="FILE", help="structured output: the text is JSON valid under the "
                                                            "JSON schema in FILE, every tier sampling from its "
                                                            "distribution masked by the grammar (needs llguidance)")
    gen.add_argument("--regex", metavar="PATTERN", help="structured output: the text matches PATTERN (as "
                                                         "--json-schema)")
    gen.add_argument("--no-progress", action="store_true", help="no prefill progress (a bar on a terminal, a line "
                                                                 "every 10 s otherwise)")
    return gen


def add_download_parser(sub) -> argparse.ArgumentParser:
    """Add ``download``."""
    dl = sub.add_parser("download", help="fetch the embedded default model (SmolLM2-135M-Instruct) into the cache")
    dl.add_argument("--force", action="store_true", help="download and convert again")
    return dl


def add_prompt_cache_args(group) -> None:
    """``--prompt-cache`` and ``--prompt-cache-max-gib`` (``generate`` and ``serve``; ``kv/promptcache.py``)."""
    group.add_argument("--prompt-cache", metavar="DIR", help="keep prompts' KV caches in files in DIR: a later run "
                                                              "whose prompt starts with a kept prompt (the same "
                                                              "document, a new question) loads it instead of "
                                                              "prefilling it")
    group.add_argument("--prompt-cache-max-gib", type=float, metavar="GIB",
                       help="with --prompt-cache: GiB the directory may hold; the least recently used files are "
                            "deleted first (default: no cap)")


def check_prompt_cache(args: argparse.Namespace) -> None:
    """``--prompt-cache`` names a directory (or nothing yet), ``--prompt-cache-max-gib`` a number >= 0.

    Raises:
        CLIError: naming the option.
    """
    from ..kv.promptcache import check_options

    gib = args.prompt_cache_max_gib
    if gib is not None and args.prompt_cache is None:
        raise CLIError("--prompt-cache-max-gib caps the --prompt-cache directory: give --prompt-cache DIR too")
    if gib is not None and not (gib >= 0 and math.isfinite(gib)):
        raise CLIError(f"--prompt-cache-max-gib must be a number of GiB >= 0, got {gib}")
    if args.prompt_cache is not None:
        try:
            check_options(args.prompt_cache)
        except ValueError as e:
            raise CLIError("--" + str(e).replace("prompt_cache", "prompt-cache", 1)) from None


def check_offload(args: argparse.Namespace) -> None:
    """``--on-chip-layers`` of ``generate`` and ``serve``: only with ``--offload-kv``, and >= 0.

    Raises:
        CLIError: naming the option.
    """
    if args.on_chip_layers is not None and not args.offload_kv:
        raise CLIError("--on-chip-layers needs --offload-kv")
    if args.on_chip_layers is not None and args.on_chip_layers < 0:
        raise CLIError(f"--on-chip-layers must be >= 0, got {args.on_chip_layers}")


def check_rope_args(args: argparse.Namespace) -> None:
    """``--rope-scaling`` and ``--rope-factor`` of ``generate`` and ``serve``: both or neither, a factor > 1
    (:func:`~triforce.model.config.check_rope_scaling`), before the model loads.

    Raises:
        CLIError: naming the options.
    """
    from ..model.config import check_rope_scaling

    try:
        check_rope_scaling(args.rope_scaling, args.rope_factor)
    except ValueError as e:
        raise option_error(e) from e


def load_from_args(args: argparse.Namespace, tp=None):
    """The :class:`~triforce.api.TriForce` that the model options of ``generate`` or ``serve`` describe (compiled
    with ``--compile``); ``tp``: this rank's :class:`~triforce.model.parallel.TensorParallel` or None.

    Raises:
        ValueError, ModelLoadError, InsufficientMemoryError: from :meth:`~triforce.api.TriForce.load`.
    """
    from ..api import TriForce

    tf = TriForce.load(args.model, args.draft, dtype=args.dtype, device=args.device, tp=tp,
                       offload_kv=args.offload_kv, on_chip_layers=args.on_chip_layers, kv_dtype=args.kv_dtype,
                       quantize=args.quantize,
                       packed_weights={"auto": None, "on": True, "off": False}[args.packed_weights],
                       threads="auto" if args.threads is None else args.threads,
                       prompt_cache=getattr(args, "prompt_cache", None),
                       prompt_cache_max_bytes=None if getattr(args, "prompt_cache_max_gib", None) is None
                       else int(args.prompt_cache_max_gib * 2**30),
                       rope_scaling=args.rope_scaling, rope_factor=args.rope_factor, precision=args.precision)
    if args.compile:
        tf.compile(args.compile)
    tf.set_cuda_graphs(args.cuda_graphs == "on")
    return tf


def _text_of(raw: bytes, name: str) -> str:
    """A prompt file's bytes as text: UTF-8 (a few undecodable bytes replaced).

    Raises:
        CLIError: a binary file (a NUL byte in its first 64 KiB) or one that is not UTF-8 text (more than 1% of its
            characters undecodable).
    """
    if b"\x00" in raw[:65536]:
        raise CLIError(f"--prompt-file {name!r} is not a text file (it holds binary data); give a UTF-8 text file")
    text = raw.decode("utf-8", errors="replace")
    if text.count("\ufffd") > 0.01 * max(1, len(text)):
        raise CLIError(f"--prompt-file {name!r} is not UTF-8 text; convert it to UTF-8 (for example with iconv)")
    return text


def _read_prompt(args: argparse.Namespace) -> tuple[str, str | None]:
    """``(text, document)``: the prompt, or with both ``--prompt`` and ``--prompt-file`` the question and the
    document (Gutenberg header and footer stripped, line endings ``\n``)."""
    from ..text.prompts import normalize_newlines, strip_gutenberg

    if args.prompt is None and args.prompt_file is None:
        raise CLIError("give --prompt TEXT, --prompt-file PATH ('-' reads stdin), or both (a question about a "
                       "document)")
    if args.prompt is not None and not args.prompt.strip() and args.prompt_file is not None:
        raise CLIError("--prompt: the question about --prompt-file is empty")
    document = None
    if args.prompt_file is not None:
        if args.prompt_file == "-":
            raw = sys.stdin.buffer.read()
        else:
            try:
                with open(args.prompt_file, "rb") as f:
                    raw = f.read()
            except OSError as e:
                raise CLIError(f"--prompt-file {args.prompt_file!r}: {e.strerror}") from e
        document = _text_of(raw, args.prompt_file)
        document = strip_gutenberg(document)
        if not document.strip():
            raise CLIError(f"--prompt-file {args.prompt_file!r} holds no text (empty or only whitespace)")
    if args.prompt is None:
        return document, None
    return normalize_newlines(args.prompt), document


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


def _fit_new_tokens(args: argparse.Namespace, prompt_tokens: int, cfg) -> None:
    """Lower the default ``--max-new-tokens`` (not given) to the positions the model's context leaves after the
    prompt, with a note on stderr: ``--prompt-file book.txt --max-prompt-tokens 8000`` on an 8,192-token model then
    generates 192 tokens rather than failing. A value the user gave is kept (the engine refuses it with the reason),
    and so is a prompt that fills the context. Models with dynamic RoPE scaling have no such limit."""
    room = cfg.max_position_embeddings - prompt_tokens
    if cfg.rope_type != "dynamic" and 1 <= room < args.max_new_tokens:
        print(f"triforce: generating at most {room} tokens (--max-new-tokens defaults to {args.max_new_tokens}): the "
              f"{prompt_tokens}-token prompt leaves {room} of the model's {cfg.max_position_embeddings}-token "
              "context", file=sys.stderr)
        args.max_new_tokens = room


def _generate(args: argparse.Namespace, out) -> int:
    """:func:`cmd_generate` writing text or the JSON object to ``out``."""
    from ..kv.memory import fmt_bytes

    check_threads(args.threads)
    from ..formats.loading import parse_device

    check_seed(args.seed)
    check_rope_args(args)
    given_new_tokens = args.max_new_tokens is not None
    if not given_new_tokens:
        args.max_new_tokens = DEFAULTS["max_new_tokens"]
    try:
        parse_device(args.device)
    except ValueError as e:
        raise CLIError("--" + str(e)) from e
    try:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                  logprobs=args.logprobs)
        if args.logprobs is not None and not args.json:
            raise CLIError("--logprobs is reported in the --json object: add --json")
        spec = spec_from_args(args, has_draft=args.draft is not None)
        if args.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {args.max_new_tokens}")
        if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be an integer >= 1, got {args.max_prompt_tokens}")
        check_prompt_cache(args)
        if args.system is not None and not args.chat:
            raise ValueError("system is only used with --chat")
        if any(not s for s in args.stop):
            raise CLIError("--stop strings must not be empty")
    except ValueError as e:
        raise option_error(e) from e
    response_format = _response_format(args)
    text, document = _read_prompt(args)
    from ..model.parallel import init_tensor_parallel

    try:
        tp = init_tensor_parallel(args.tp, args.device)
    except ValueError as e:
        raise option_error(e) from e
    if tp is not None and tp.rank != 0:  # only rank 0 prints
        out = open(os.devnull, "w")
        args.no_progress = True
    check_offload(args)
    try:
        tf = load_from_args(args, tp)
    except ValueError as e:
        raise option_error(e) from e
    try:
        cfg = tf.engine.target.cfg
        if args.max_prompt_tokens is not None and cfg.rope_type != "dynamic":
            limit = cfg.max_position_embeddings - (args.max_new_tokens if given_new_tokens else 1)
            if args.max_prompt_tokens > limit:
                raise CLIError(f"--max-prompt-tokens must be at most {limit}: the model's context of "
                               f"{cfg.max_position_embeddings} tokens less "
                               + (f"--max-new-tokens {args.max_new_tokens}" if given_new_tokens else
                                  "1 token to generate") + f", got {args.max_prompt_tokens}")
        ids, cut = tf.encode_cut(text, chat=args.chat, system=args.system, max_prompt_tokens=args.max_prompt_tokens,
                                 document=document)
        if cut is not None:
            print(f"triforce: {cut.summary()}", file=sys.stderr)
        if not given_new_tokens:
            _fit_new_tokens(args, len(ids), tf.engine.target.cfg)
        if args.offload_kv:  # the memory planner's choice, reported before the prefill
            plan = tf.engine.plan(ids, args.max_new_tokens, spec, choose_auto=False)
            print(plan.placement.summary(), file=sys.stderr)
    except ValueError as e:
        raise option_error(e) from e
    bar = prefill_progress(len(ids), disable=args.no_progress)
    gen = tf.stream(ids, max_new_tokens=args.max_new_tokens, sampling=sampling, spec=spec, seed=args.seed,
                    stop=args.stop, prefill_progress=bar.update, response_format=response_format)
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
        raise option_error(e) from e
    finally:
        if bar is not None:
            bar.close()
    import torch

    from ..kernels.cpu import status as attention_status
    from ..kernels.status import kernel_status

    threads = torch.get_num_threads()
    if args.json:
        kernels = kernel_status()
        cut_info = None if cut is None else dict(kept_tokens=cut.kept_tokens, dropped_tokens=cut.dropped_tokens,
                                                 kept=cut.kept)
        out.write(json.dumps(dict(result.to_dict(), prompt_cut=cut_info, threads=threads,
                                  precision=tf.engine.target.precision, **kernels), indent=2) + "\n")
        out.flush()
    else:
        out.write("\n")
        out.flush()
        s = result.stats
        if cut is not None:
            print(f"triforce: {cut.summary()}", file=sys.stderr)
        if s.prompt_cache and s.prompt_cache["loaded_tokens"]:
            print(f"triforce: {s.prompt_cache['loaded_tokens']} prompt tokens loaded from "
                  f"{s.prompt_cache['loaded_from']}", file=sys.stderr)
        if s.prompt_cache and s.prompt_cache["stored"]:
            print(f"triforce: prompt cache written to {s.prompt_cache['stored']} "
                  f"({fmt_bytes(os.path.getsize(s.prompt_cache['stored']))})", file=sys.stderr)
        print(f"[{result.finish_reason}] {s.summary()}; peak memory {fmt_bytes(s.peak_memory_bytes)}; "
              f"{threads} thread{'' if threads == 1 else 's'}; precision {tf.engine.target.precision}; "
              f"attention kernel {attention_status()}", file=sys.stderr)
    return 130 if result.finish_reason == "interrupted" else 0


def _response_format(args: argparse.Namespace) -> dict | None:
    """``--json-schema`` / ``--regex`` as a ``response_format`` (``speculation/grammar.py``),
    checked before the model loads.

    Raises:
        CLIError: both given, an unreadable or non-JSON schema file, a malformed format, llguidance missing.
    """
    if args.json_schema is not None and args.regex is not None:
        raise CLIError("give --json-schema or --regex, not both")
    if args.json_schema is not None:
        try:
            with open(args.json_schema, encoding="utf-8") as f:
                schema = json.load(f)
        except OSError as e:
            raise CLIError(f"--json-schema: cannot read {args.json_schema}: {e.strerror}") from e
        except ValueError as e:
            raise CLIError(f"--json-schema: {args.json_schema} is not JSON: {e}") from e
        if not isinstance(schema, dict):
            raise CLIError(f"--json-schema: {args.json_schema} must hold a JSON schema object ({{\"type\": ...}}), "
                           f"got {type(schema).__name__}")
        fmt, flag = {"type": "json_schema", "json_schema": {"schema": schema}}, "--json-schema"
    elif args.regex is not None:
        if not args.regex:
            raise CLIError("--regex must be a non-empty pattern")
        fmt, flag = {"type": "regex", "regex": args.regex}, "--regex"
    else:
        return None
    from ..speculation.grammar import grammar_from_response_format

    try:
        grammar_from_response_format(fmt, flag)
    except ImportError as e:
        raise CLIError(f"{flag} needs llguidance: pip install 'triforce[grammar]'") from e
    except ValueError as e:
        raise CLIError(str(e)) from e
    return fmt


def cmd_download(args: argparse.Namespace) -> int:
    """``triforce download``: fetch and convert the default model; prints its folder."""
    from ..formats.download import download_default_model

    path = download_default_model(force=args.force)
    print(path)
    return 0
