"""``triforce analyze``: its options (the shared ones from :mod:`triforce.cli.options`); the analyses are
:mod:`triforce.lab.analyze`, imported only when the subcommand runs."""

from __future__ import annotations

import argparse
from typing import Any

from ..defaults import ANALYZE_DEFAULTS
from .options import add_options

#: the analyses ``--analyses`` accepts (:data:`triforce.lab.analyze.ANALYSES`)
ANALYSES = ("recovery", "locality", "acceptance")


def _spaced(values) -> str:
    return " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def add_analyze_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``triforce analyze`` to the ``triforce`` subcommands; returns its parser."""
    d = ANALYZE_DEFAULTS
    p = subparsers.add_parser(
        "analyze", help="the paper's analyses on a model and books: attention recovery, contextual locality, "
                        "acceptance (JSON + PNG)",
        description="TriForce's analyses (arXiv 2404.11912, Sec. 3) on a real model and books: (i) attention "
                    "recovery of the retrieval cache's chunks per layer against budget, (ii) contextual locality "
                    "over the generated tokens, (iii) the retrieval tier's acceptance rate against budget, chunk "
                    "size, temperature and context length. Writes NAME.json and NAME.png per analysis into --out.")
    m = p.add_argument_group("model")
    add_options(m, ("model", "dtype", "device"), "analyze")
    add_options(m, ("threads",), threads="CPU threads for torch (default: torch's choice)")
    m.add_argument("--prompt-cache", metavar="DIR",
                   help="recovery and locality load the longest prefix of each book's prompt that a prompt-cache "
                        "file in DIR holds (generate's and bench's --prompt-cache files, same model and --dtype) "
                        "and prefill only the rest; a prompt that needed a prefill of 64 tokens or more is written "
                        "there")
    g = p.add_argument_group("data")
    g.add_argument("--books", nargs="+", default=list(d["books"]),
                   help=f"book names in --books-dir (pg1342 or pg1342.txt) or paths (default: {_spaced(d['books'])})")
    g.add_argument("--books-dir", help="folder of books (default: ../shared/data/books "
                                                               "beside the repository, or $TRIFORCE_BOOKS)")
    g.add_argument("--prompt-tokens", type=int, default=d["prompt_tokens"],
                   help=f"prompt: the first N tokens of each book (Gutenberg header stripped) ({d['prompt_tokens']})")
    g.add_argument("--new-tokens", type=int, default=d["new_tokens"],
                   help=f"locality: tokens generated per book ({d['new_tokens']})")
    a = p.add_argument_group("analyses")
    a.add_argument("--analyses", nargs="+", choices=ANALYSES, default=list(ANALYSES), help="which analyses (all)")
    a.add_argument("--budgets", type=int, nargs="+", default=list(d["budgets"]),
                   help="retrieval budgets: recovery, locality and the acceptance budget sweep "
                        f"({_spaced(d['budgets'])})")
    add_options(a, ("chunk_size",), "analyze",
                chunk_size="chunk size of recovery and locality, and the acceptance sweeps' base ({default})")
    add_options(a, ("chunk_score",), "analyze",
                chunk_score="chunk score of locality and acceptance (recovery reports every score) ({default})")
    a.add_argument("--reselect-every", type=int, default=d["reselect_every"],
                   help=f"locality: compute the re-chosen reference line every N steps ({d['reselect_every']}; 1 = "
                        "every step)")
    a.add_argument("--chunk-sizes", type=int, nargs="+", default=list(d["chunk_sizes"]),
                   help=f"acceptance: chunk sizes swept ({_spaced(d['chunk_sizes'])})")
    a.add_argument("--temperatures", type=float, nargs="+", default=list(d["temperatures"]),
                   help=f"acceptance: temperatures swept, 0 = greedy ({_spaced(d['temperatures'])})")
    a.add_argument("--lengths", type=int, nargs="+",
                   help="acceptance: context lengths (prompt tokens) swept (default: 2048 and 4096 when below "
                        "--prompt-tokens, and --prompt-tokens)")
    a.add_argument("--base-budget", type=int, default=d["base_budget"],
                   help=f"acceptance: budget of the other sweeps ({d['base_budget']})")
    a.add_argument("--base-temperature", type=float, default=d["base_temperature"],
                   help=f"acceptance: temperature of the other sweeps ({d['base_temperature']:g}); their chunk size is "
                        "--chunk-size and their length --prompt-tokens")
    add_options(a, ("top_p",), "analyze", top_p="acceptance: nucleus mass at temperatures > 0 ({default})")
    add_options(a, ("gamma2",), "analyze",
                gamma2="acceptance: tokens the retrieval tier proposes per verification ({default})")
    a.add_argument("--acceptance-tokens", type=int, default=d["acceptance_tokens"],
                   help=f"acceptance: tokens generated per run ({d['acceptance_tokens']})")
    add_options(a, ("seed",), "analyze", seed="acceptance: seed of every run ({default})")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=d["out"], help=f"output folder for the JSON and PNG files ({d['out']})")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def cmd_analyze(args: argparse.Namespace) -> int:
    """Run ``triforce analyze`` (:func:`triforce.lab.analyze.run.cmd_analyze`); returns the exit status."""
    from ..lab.analyze.run import cmd_analyze as run

    return run(args)
