"""``triforce bench``: its options (the shared ones from :mod:`triforce.cli.options`); the run is
:mod:`triforce.lab.bench`, imported only when the subcommand runs."""

from __future__ import annotations

import argparse

from ..defaults import BENCH_DEFAULTS
from .options import add_options

#: the methods ``--methods`` accepts (kept here so that ``triforce --help`` does not import the lab)
METHOD_NAMES = ("hf-ar", "hf-assisted", "hf-lookup", "auto", "autoregressive", "self", "draft", "retrieval", "triforce",
                "retrieval-int8", "triforce-int8", "retrieval-codes", "autoregressive-exact", "auto-exact", "llama.cpp")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to the ``triforce`` parser's subparsers; returns its parser."""
    d = BENCH_DEFAULTS
    p = subparsers.add_parser(
        "bench", help="side-by-side decode speed: transformers, llama.cpp and our modes, interleaved, in one run",
        description="Compare decode speed, acceptance and peak memory of transformers generate (autoregressive, "
                    "assisted, prompt lookup), our modes and llama.cpp on one prompt, with interleaved repetitions. "
                    "A table on stdout that ends with the fastest method; the JSON only with --json; an optional "
                    "PNG chart.")
    m = p.add_argument_group("model")
    add_options(m, ("model",))
    add_options(m, ("draft",), draft="draft model sharing the target's tokenizer (enables hf-assisted), or 'ngram' "
                                     "(the default: the n-gram drafter is the bottom tier of draft and triforce)")
    add_options(m, ("dtype",), "bench")
    add_options(m, ("threads",), threads="CPU threads of every method, llama.cpp's included (default: every logical "
                                         "CPU, os.cpu_count(), whatever the load: unlike generate's default, it does "
                                         "not count the cores other programs leave idle)")
    add_options(m, ("rope_scaling", "rope_factor"), "bench",
                rope_scaling="override the target's RoPE in our methods and llama.cpp (its --rope-scaling), with "
                             "--rope-factor: it changes the model (docs/long_documents.md); the transformers rows "
                             "are skipped (they could only run the checkpoint as saved), and so is llama.cpp with "
                             "dynamic (it has no dynamic NTK)")
    m.add_argument("--synthetic", metavar="NAME", help="timing only: a random-weight model of a paper shape "
                                                       "(triforce.lab.synthetic), random KV instead of a real prefill")
    m.add_argument("--layers", type=int, help="layers of the --synthetic model (default: all of the shape)")
    s = p.add_argument_group("prompt")
    s.add_argument("--prompt", help="prompt text")
    s.add_argument("--prompt-file", help="prompt file (Project Gutenberg header/footer stripped)")
    s.add_argument("--book", help="a book of ../shared/data/books by file name (default: pg1342.txt when no prompt "
                                  "is given)")
    s.add_argument("--prompt-tokens", type=int, default=d["prompt_tokens"],
                   help=f"keep the first N prompt tokens ({d['prompt_tokens']})")
    g = p.add_argument_group("generation")
    g.add_argument("--new-tokens", type=int, default=d["new_tokens"],
                   help=f"tokens generated per run ({d['new_tokens']})")
    add_options(g, ("temperature", "top_p", "top_k"), "bench")
    add_options(g, ("seed",), "bench", seed="repetition r of every method uses seed + r ({default})")
    add_options(m, ("precision",), "bench",
                precision="our methods' arithmetic (as in generate; the -exact methods: exact): file = a GGUF file's "
                          "codes times int8 activations, exact = fp32 products; default: file for a GGUF file")
    add_options(m, ("packed_weights",), "bench",
                packed_weights="our methods: oneDNN-prepacked weights for multi-token passes (CPU, fp32; as in "
                               "generate; default {default})")
    k = p.add_argument_group("speculation")
    add_options(k, ("budget",), "bench", budget="retrieval cache slots of the retrieval methods, at least "
                                                "--chunk-size + gamma + 2 ({default}); the auto method's retrieval "
                                                "tier takes at most this many")
    add_options(k, ("chunk_size",), "bench")
    add_options(k, ("gamma1",), "bench", gamma1="bottom-tier tokens per retrieval verification ({default})")
    add_options(k, ("gamma2",), "bench", gamma2="tokens proposed per target verification ({default}); also "
                                                "hf-lookup's prompt_lookup_num_tokens")
    s.add_argument("--prompt-cache", metavar="DIR",
                   help="our methods load the prompt's KV from a file in DIR where one holds it, and write it after "
                        "their first run (as generate's --prompt-cache): a long prompt is prefilled once across "
                        "methods and runs; their time to first token then counts the file's load")
    r = p.add_argument_group("run")
    r.add_argument("--methods", help="comma-separated, among " + ", ".join(METHOD_NAMES) + " (default: every one "
                                     "that can run)")
    r.add_argument("--reps", type=int, default=d["reps"],
                   help=f"timed repetitions per method, interleaved ({d['reps']})")
    r.add_argument("--json", metavar="PATH", help="write the result as JSON to PATH; '-': to stdout, and the table to "
                                                  "stderr (default: no JSON)")
    r.add_argument("--png", metavar="PATH", help="write a chart (needs matplotlib, checked before the run: pip install "
                                                 "matplotlib)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``triforce bench`` (:func:`triforce.lab.bench.cmd_bench`); returns the exit status."""
    from ..lab.bench import cmd_bench as run

    return run(args)
