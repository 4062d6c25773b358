"""The command line's shared options, generated from one table, and their translation into a hierarchy.

:data:`OPTIONS` describes every option that more than one subcommand (``generate``, ``serve``, ``bench``, ``analyze``)
takes: flags, type, allowed values and help; its default is never written here but read from :mod:`triforce.defaults`
(the help shows it through ``{default}``). :func:`add_options` adds a list of them to an argparse group, with a
subcommand's own default (``bench`` seeds from 0) and help where it differs. :func:`spec_from_args` turns the parsed
speculation options into a :class:`~triforce.speculation.hierarchy.SpeculationConfig` and refuses, with the reason,
options the hierarchy cannot use.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..defaults import (
    COMPILE_MODES,
    CUDA_GRAPHS,
    DEFAULTS,
    DTYPE_ALIASES,
    LOWER_WEIGHTS,
    PACKED_WEIGHTS,
    PRECISIONS,
    ROPE_SCALINGS,
    SELF_WEIGHTS,
    default,
)
from ..kv.retrieval import CHUNK_SCORES
from ..speculation.hierarchy import MODES, SpeculationConfig
from .common import CLIError


@dataclass(frozen=True)
class Option:
    """One command-line option.

    Attributes:
        flag: ``--name``; its ``dest`` is the name with ``_`` for ``-``.
        help: help text; ``{default}`` is replaced by the option's default.
        type: argparse ``type`` (None: a string, or a flag with ``action``).
        choices: allowed values (None: any).
        action: argparse ``action`` (``store_true``, ``append``) or None.
        metavar: argparse ``metavar`` or None.
    """

    flag: str
    help: str
    type: type | None = None
    choices: tuple | None = None
    action: str | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        """The attribute name in the parsed namespace."""
        return self.flag[2:].replace("-", "_")


#: the model group of ``generate`` and ``serve``, in its ``--help`` order
_MODEL = [
    Option("--model", "target model: Hugging Face folder, .gguf file or hub id (default: the embedded "
                      "SmolLM2-135M-Instruct)"),
    Option("--draft", "draft model sharing the target's tokenizer, 'ngram' for the model-free n-gram drafter, or "
                      "'self' for the target's own weights quantized to int4 (--self-weights) over a StreamingLLM "
                      "cache (the bottom tier of the draft/triforce/auto modes)"),
    Option("--dtype", "weights and KV dtype (default {default}; fp32, bf16, fp16 name the same)",
           choices=tuple(DTYPE_ALIASES)),
    Option("--device", "torch device (cpu, cuda, cuda:1; default {default})"),
    Option("--threads", "CPU threads for torch (default: one per physical core that other programs leave idle while "
                        "the model loads)", type=int),
    Option("--kv-dtype", "dtype of every KV cache (default: --dtype); the full cache's dtype is the verifier's",
           choices=tuple(DTYPE_ALIASES)),
    Option("--precision", "the target's arithmetic: file = a GGUF file's block codes times int8 activations, as "
                          "llama.cpp computes; exact = fp32 products over the weights the file stands for "
                          "(transformers' model); default: file for a GGUF file on the CPU in fp32, else exact",
           choices=PRECISIONS),
    Option("--quantize", "weight-only int8 for the target itself (changes its outputs like --dtype does; see "
                         "--lower-weights for a lossless use)", choices=("int8",)),
    Option("--packed-weights", "CPU, fp32: oneDNN-prepacked weights for multi-token passes (verification blocks, "
                               "prefill); one more copy of the weights in memory (auto, the default: only where our "
                               "AVX-512 kernel for a few rows cannot run, and the copy takes at most a quarter of "
                               "the free memory)", choices=PACKED_WEIGHTS),
    Option("--compile", "torch.compile each block's norms and MLP (reduce-overhead: CUDA graphs on GPUs); the first "
                        "steps are slow while kernels compile", choices=COMPILE_MODES),
    Option("--cuda-graphs", "on a GPU, replay the forwards that keep their shapes (the retrieval and draft tiers' "
                            "decode steps and verification blocks) as CUDA graphs: the same kernels, one launch "
                            "(default {default}: not yet run on a GPU)", choices=CUDA_GRAPHS),
    Option("--offload-kv", "keep the full KV cache in (pinned) host memory and stream it to the device layer by "
                           "layer with prefetch; retrieval and draft caches stay on the device", action="store_true"),
    Option("--on-chip-layers", "with --offload-kv: leading layers kept on the device (default: chosen from free "
                               "device memory)", type=int),
    Option("--tp", "tensor-parallel ranks (default {default}); launch with `torchrun --nproc-per-node N -m triforce "
                   "generate ... --tp N` (gloo on CPU, NCCL on GPU)", type=int),
    Option("--rope-scaling", "override the target's RoPE as a config.json rope_scaling would (with --rope-factor): "
                             "it changes the model, past the trained context quality is the scaling's "
                             "(docs/long_documents.md); the draft keeps its own", choices=ROPE_SCALINGS),
    Option("--rope-factor", "with --rope-scaling: the factor F > 1; yarn and linear raise the context to F times the "
                            "trained one (Qwen2.5: yarn 4 for 128K)", type=float, metavar="F"),
]
#: the sampling group of ``generate`` and ``serve``, in its ``--help`` order
_SAMPLING = [
    Option("--max-new-tokens", "tokens to generate (default {default})", type=int),
    Option("--temperature", "0 = greedy (default {default})", type=float),
    Option("--top-p", "nucleus mass in (0, 1] (default {default})", type=float),
    Option("--top-k", "0 = disabled (default {default})", type=int),
    Option("--seed", "seed for every random draw (default: random, reported in --json)", type=int),
    Option("--stop", "stop string (repeatable)", action="append"),
]
#: the speculation group of ``generate`` and ``serve``, in its ``--help`` order
_SPECULATION = [
    Option("--mode", "auto (default: the hierarchy is chosen per request and bypassed while it does not pay), "
                     "autoregressive, retrieval, draft, triforce", choices=MODES),
    Option("--self-weights", "weights of the --draft self tier (default {default})", choices=SELF_WEIGHTS),
    Option("--gamma1", "draft tokens per retrieval-tier verification, --mode triforce (default {default}; capped "
                       "like --gamma2)", type=int),
    Option("--gamma2", "tokens proposed per target verification (default {default}); any integer >= 1, capped at "
                       "--max-new-tokens - 1, the most a request can use (the caches are sized for the cap, and "
                       "--json reports each verifying tier's gamma)", type=int),
    Option("--budget", "retrieval cache slots, at least --chunk-size + gamma + 2 (default {default}; --mode auto "
                       "honours it: its retrieval tier takes at most this many, and a budget below --chunk-size + "
                       "--gamma2 + 2 is refused)", type=int),
    Option("--chunk-size", "retrieval chunk size (default {default})", type=int),
    Option("--chunk-score", "retrieval chunk score: mean (paper: q . mean key), max (best key), bound (Quest upper "
                            "bound), attn (per-head attention mass over recent verifier queries + a recent window; "
                            "GQA models) (default {default})", choices=CHUNK_SCORES),
    Option("--stop-below", "model drafters end a proposal before a token whose confidence is below "
                           "this (default: off)", type=float),
    Option("--adaptive-gamma", "adapt each verifier's gamma from its last block (up to twice the given gamma)",
           action="store_true"),
    Option("--rebuild-below", "re-select retrieval chunks when the retrieval tier's acceptance over its last 16 "
                              "proposed tokens falls below this fraction (default: never)", type=float),
    Option("--rebuild-every", "re-select retrieval chunks every N tokens (default: never)", type=int),
    Option("--draft-sink", "StreamingLLM sink tokens of the draft cache (default {default})", type=int),
    Option("--draft-window", "StreamingLLM window of the draft cache (default {default})", type=int),
    Option("--ngram-n", "longest suffix the n-gram drafter matches (default {default})", type=int),
    Option("--ngram-min", "shortest suffix the n-gram drafter may match (default {default})", type=int),
    Option("--lower-weights", "cheaper weights for the tiers below the verifier (retrieval tier, draft model): "
                              "lossless, the verifier decides every token; codes: a GGUF model's own block codes "
                              "times int8 activations, as llama.cpp (else int8) (default: as loaded; --mode auto: "
                              "codes where the model has them)", choices=LOWER_WEIGHTS),
    Option("--lower-kv-dtype", "dtype of the retrieval and draft caches (lossless; default: as --kv-dtype; "
                               "--mode auto: bfloat16 for its retrieval tier where our attention kernel reads it)",
           choices=tuple(DTYPE_ALIASES)),
    Option("--tiers", "explicit hierarchy under the full-cache target, bottom first, KIND:GAMMA entries with KIND in "
                      "ngram, self, draft, retrieval (e.g. ngram:8,draft:4,retrieval:6); overrides --mode"),
]
#: every shared option by ``dest``
OPTIONS: dict[str, Option] = {o.dest: o for o in (*_MODEL, *_SAMPLING, *_SPECULATION)}
#: the ``dest`` names of each group
MODEL_OPTIONS = tuple(o.dest for o in _MODEL)
SAMPLING_OPTIONS = tuple(o.dest for o in _SAMPLING)
SPECULATION_OPTIONS = tuple(o.dest for o in _SPECULATION)


def add_options(group, names, command: str | None = None, **helps: str) -> None:
    """Add the shared options ``names`` (``dest`` names) to an argparse parser or group.

    Args:
        group: the parser or argument group.
        names: keys of :data:`OPTIONS`.
        command: the subcommand whose own defaults win (:func:`triforce.defaults.default`), or None.
        helps: ``dest=help`` for the options whose help differs in this subcommand (``{default}`` allowed).

    Raises:
        KeyError: an unknown name.
    """
    for name in names:
        opt = OPTIONS[name]
        value = [] if opt.action == "append" else default(name, command)
        kw = dict(default=value, help=helps.get(name, opt.help).format(default=value))
        if opt.action:
            kw["action"] = opt.action
        else:
            kw.update(type=opt.type, choices=opt.choices, metavar=opt.metavar)
        group.add_argument(opt.flag, **kw)


def add_generation_args(p: argparse.ArgumentParser) -> None:
    """The model, sampling and speculation groups of ``generate`` and ``serve``."""
    add_options(p.add_argument_group("model"), MODEL_OPTIONS)
    add_options(p.add_argument_group("sampling"), SAMPLING_OPTIONS)
    add_options(p.add_argument_group("speculation (TriForce)"), SPECULATION_OPTIONS)


def spec_from_args(args: argparse.Namespace, has_draft: bool) -> SpeculationConfig:
    """The speculation settings of the parsed options of ``generate`` or ``serve``.

    Refuses, with the reason, a hierarchy that lacks what an option names: ``--draft`` without a tier that uses it,
    and any speculation option given a non-default value that the hierarchy cannot use
    (:meth:`~triforce.speculation.hierarchy.SpeculationConfig.unused_options`). With ``--mode auto`` (no ``--tiers``)
    every option is kept for the hierarchy chosen per request.

    Raises:
        CLIError: naming the option(s) and the reason.
        ValueError: a value outside its range (from :class:`~triforce.speculation.hierarchy.SpeculationConfig`,
            naming the parameter; :func:`~triforce.cli.common.option_error` turns it into the option's name).
    """
    mode = args.mode or DEFAULTS["mode"]
    if mode in ("draft", "triforce") and not has_draft and not args.tiers:
        raise CLIError(f"--mode {mode} needs --draft MODEL, --draft ngram or --draft self (or use --mode auto, "
                       "autoregressive or retrieval)")
    names = [n for n in SpeculationConfig.option_names() if n not in ("mode", "drafter") and hasattr(args, n)]
    spec = SpeculationConfig(mode=mode, drafter=args.draft if args.draft in ("ngram", "self") else "model",
                             **{n: getattr(args, n) for n in names})
    if spec.uses_draft and (args.draft is None or args.draft in ("ngram", "self")):
        raise CLIError(f"--tiers {args.tiers} has a draft tier: give --draft MODEL")
    kinds = [k for k, _ in spec.chain]
    wanted = {"ngram": "ngram", "self": "self"}.get(args.draft, "draft")
    if args.draft is not None and wanted not in kinds and not spec.chooses_per_request:
        how = (f"add {wanted}:GAMMA at the bottom of --tiers" if args.tiers else
               "--mode auto, --mode triforce (drafter -> retrieval -> target) and --mode draft (drafter -> target) "
               "use it")
        what = {"ngram": "n-gram", "self": "self"}.get(wanted, "draft-model")
        raise CLIError(f"--draft {args.draft}: not used by {spec.name}, whose tiers "
                       f"({' -> '.join(kinds + ['target'])}) have no {what} tier; {how}, or drop --draft")
    given = [n for n in names if getattr(args, n) != default(n)]
    unused = spec.unused_options(given)
    if unused:  # refused before anything loads: the user would believe the option took effect
        flags = ["--" + n.replace("_", "-") for n in unused]
        why = "; ".join(f"--{n.replace('_', '-')} is for {who}" for n, who in unused.items())
        raise CLIError(f"{', '.join(flags)}: not used by {spec.name}, whose tiers are "
                       f"{' -> '.join(kinds + ['target'])} ({why}); choose a --mode or --tiers that uses them, "
                       "or drop them")
    return spec
