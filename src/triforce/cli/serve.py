"""``triforce serve``: its options, their checks, and start-up (bind the port, load the model, run the app).

The server itself (schema, worker, metrics, app) is :mod:`triforce.serve`; ``python -m triforce.serve`` runs
:func:`main_for_tests`, this subcommand without the rest of the command line.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from ..defaults import DEFAULTS, SERVE_DEFAULTS
from ..serve.settings import API_KEY_ENV, ServerDefaults, check_api_key, model_id_for
from .common import CLIError, Parser, check_seed, check_threads, option_error
from .generate import add_prompt_cache_args, check_offload, check_prompt_cache, check_rope_args, load_from_args
from .options import add_generation_args, spec_from_args


def add_serve_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand (the generation options plus ``--host``, ``--port``, ``--queue-size``,
    ``--max-batch``, ``--prefix-cache-gib``, ``--prompt-cache``, ``--prompt-cache-max-gib``, ``--request-timeout``,
    ``--log-level``, ``--api-key``) to ``subparsers``; returns its parser. Dispatch to :func:`cmd_serve`."""
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                              description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
                                          "/v1/models, /health, /metrics); concurrent requests are decoded together "
                                          "(continuous batching, --max-batch). The sampling options are the defaults "
                                          "of requests that omit them.")
    add_generation_args(p)
    d = SERVE_DEFAULTS
    s = p.add_argument_group("server")
    s.add_argument("--host", default=d["host"], help=f"address to listen on (default {d['host']})")
    s.add_argument("--port", type=int, default=d["port"],
                   help=f"port (default {d['port']}; 0 = any free port, printed)")
    s.add_argument("--queue-size", type=int, default=d["queue_size"],
                   help=f"requests that may wait for the engine besides the running one; more get 503 (default "
                        f"{d['queue_size']})")
    s.add_argument("--max-batch", type=int, default=DEFAULTS["max_batch"],
                   help="requests decoded at once, their forwards batched (continuous batching; 1 = one at a time "
                        f"in arrival order) (default {DEFAULTS['max_batch']})")
    s.add_argument("--prefix-cache-gib", type=float, default=d["prefix_cache_gib"],
                   help="GiB of KV cache that finished requests keep for prefix reuse, in all; the least recently "
                        "used are dropped first, and the last request's cache is kept even when larger (0 = only "
                        f"it) (default {d['prefix_cache_gib']:g})")
    add_prompt_cache_args(s)
    s.add_argument("--request-timeout", type=float, default=d["request_timeout"],
                   help="seconds from a request's arrival after which its generation ends with finish_reason "
                        f"'length' (default {d['request_timeout']:g})")
    s.add_argument("--log-level", default=d["log_level"], choices=["critical", "error", "warning", "info", "debug"],
                   help=f"uvicorn log level (default {d['log_level']})")
    s.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on every request but /health (401 "
                                     f"otherwise); default: ${API_KEY_ENV} if set, else no key. The variable keeps "
                                     "the key out of the process list")
    return p


def defaults_from_args(args: argparse.Namespace) -> ServerDefaults:
    """Check the options (before anything is loaded) and turn them into :class:`~triforce.serve.ServerDefaults`.

    Raises:
        CLIError: a bad option, named.
    """
    from ..speculation.sampling import SamplingParams

    check_threads(args.threads)
    if args.tp != 1:
        raise CLIError("--tp: triforce serve runs in one process; tensor parallelism is for `torchrun ... -m triforce "
                       "generate --tp N`")
    check_offload(args)
    check_rope_args(args)
    check_prompt_cache(args)
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in [0, 65535], got {args.port}")
    if args.queue_size < 1:
        raise CLIError(f"--queue-size must be >= 1, got {args.queue_size}")
    if args.max_batch < 1:
        raise CLIError(f"--max-batch must be >= 1, got {args.max_batch}")
    if not (args.prefix_cache_gib >= 0 and math.isfinite(args.prefix_cache_gib)):
        raise CLIError(f"--prefix-cache-gib must be a number of GiB >= 0, got {args.prefix_cache_gib}")
    if not (args.request_timeout > 0 and math.isfinite(args.request_timeout)):
        raise CLIError(f"--request-timeout must be a number of seconds > 0, got {args.request_timeout}")
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be an integer >= 1, got {args.max_new_tokens}")
    if any(not s for s in args.stop):
        raise CLIError("--stop strings must not be empty")
    check_seed(args.seed)
    try:
        SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
        spec = spec_from_args(args, has_draft=args.draft is not None)
    except ValueError as e:
        raise option_error(e) from e
    if args.temperature > 2:
        raise CLIError(f"--temperature must be in [0, 2] for the server, got {args.temperature}")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None:
        try:
            check_api_key(api_key, "--api-key" if args.api_key is not None else "$" + API_KEY_ENV)
        except ValueError as e:
            raise CLIError(str(e)) from e
    return ServerDefaults(model_id=model_id_for(args.model), model_aliases=(args.model,) if args.model else (),
                          max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), spec=spec,
                          queue_size=args.queue_size, max_batch=args.max_batch,
                          prefix_cache_gib=args.prefix_cache_gib, request_timeout=args.request_timeout,
                          api_key=api_key)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run ``triforce serve`` until interrupted; returns the exit status (0 after Ctrl-C / SIGTERM).

    Options are checked before the model is loaded; the port is bound before the model is loaded too, so a port
    in use fails at once.

    Raises:
        CLIError: a bad option, a missing ``serve`` extra, or an address that cannot be bound.
        ModelLoadError, InsufficientMemoryError: from loading the model.
    """
    import socket

    defaults = defaults_from_args(args)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CLIError(f"triforce serve needs the 'serve' extra ({e.name} is missing): "
                       "pip install 'triforce[serve]'") from e
    try:
        info = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(2048)
    except OSError as e:
        raise CLIError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from e
    from ..serve.app import create_app, run_app

    try:
        tf = load_from_args(args)
        app = create_app(tf, defaults)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"triforce serve: {defaults.model_id} ({defaults.spec.name if defaults.spec else tf.default_mode}) on "
              f"http://{shown}:{port}/v1{' (API key required)' if defaults.api_key else ''}", file=sys.stderr,
              flush=True)
        run_app(app, sock, args.log_level)
    finally:
        sock.close()
    return 0


def main_for_tests(argv: list[str] | None = None) -> int:
    """``python -m triforce.serve [serve options]``: the ``serve`` subcommand without the main CLI; returns the
    exit status (2 and one line on stderr for bad input)."""
    from ..formats.loading import ModelLoadError
    from ..kv.memory import InsufficientMemoryError

    parser = Parser(prog="python -m triforce.serve")
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        argv = ["serve", *argv]
    args = parser.parse_args(argv)
    try:
        return cmd_serve(args)
    except (CLIError, ModelLoadError, InsufficientMemoryError, ValueError) as e:
        print(f"triforce: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
