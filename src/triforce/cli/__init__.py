"""Command line: ``triforce generate``, ``serve``, ``bench``, ``analyze``, ``download``.

Bad input exits with status 2 and one line on stderr naming the option; nothing is loaded before the
arguments are checked.

==============  ===================================================================================================
``options``     the options shared by the subcommands, generated from one table (defaults: ``triforce.defaults``);
                parsed speculation options -> :class:`~triforce.speculation.hierarchy.SpeculationConfig`, unused ones
                refused
``common``      :class:`CLIError`, the one-line-error parser, ``--threads`` / ``--seed`` checks
``generate``    ``triforce generate`` and ``triforce download``
``serve``       ``triforce serve``: options and start-up (the server is :mod:`triforce.serve`)
``bench``       ``triforce bench`` options (the run: :mod:`triforce.lab.bench`, imported when it runs)
``analyze``     ``triforce analyze`` options (the analyses: :mod:`triforce.lab.analyze`, imported when they run)
``progress``    prefill progress, stdout kept for the ``--json`` object
==============  ===================================================================================================
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from .. import __version__
from .analyze import add_analyze_parser
from .bench import add_bench_parser
from .common import CLIError, Parser, check_seed, check_threads, error_message, option_error
from .generate import add_download_parser, add_generate_parser, cmd_download, cmd_generate
from .options import add_generation_args, spec_from_args
from .progress import LineProgress, prefill_progress, stdout_to_stderr
from .serve import add_serve_parser

__all__ = ["main", "build_parser", "CLIError", "Parser", "check_seed", "check_threads", "option_error",
           "cmd_generate", "cmd_download", "add_generation_args", "spec_from_args", "LineProgress",
           "prefill_progress", "stdout_to_stderr"]


def build_parser() -> argparse.ArgumentParser:
    """The ``triforce`` argument parser with its subcommands (generate, serve, bench, analyze, download)."""
    parser = Parser(prog="triforce", description="Lossless long-context generation with hierarchical "
                                                 "speculative decoding (TriForce).")
    parser.add_argument("--version", action="version", version=f"triforce {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_analyze_parser(sub)
    add_download_parser(sub)
    return parser


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_library_format = warnings.formatwarning


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """triforce's own warnings as one line (``triforce: warning: ...``); other libraries' as Python formats them."""
    if os.path.abspath(filename).startswith(_PACKAGE + os.sep):
        return f"triforce: warning: {message}\n"
    return _library_format(message, category, filename, lineno, line)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``triforce`` console script; returns the exit status."""
    warnings.formatwarning = _format_warning
    from ..formats.download import DownloadError
    from ..formats.loading import ModelLoadError
    from ..kv.caches import CacheError
    from ..kv.memory import InsufficientMemoryError
    from .analyze import cmd_analyze
    from .bench import cmd_bench
    from .serve import cmd_serve

    args = build_parser().parse_args(argv)
    commands = {"generate": cmd_generate, "download": cmd_download, "serve": cmd_serve, "bench": cmd_bench,
                "analyze": cmd_analyze}
    try:
        return commands[args.command](args)
    except (CLIError, ModelLoadError, DownloadError, InsufficientMemoryError, ValueError) as e:
        print(f"triforce: error: {error_message(e)}", file=sys.stderr)
        return 2
    except CacheError as e:  # a bug, but say it in one line
        print(f"triforce: internal cache error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ntriforce: interrupted", file=sys.stderr)
        return 130
