"""Variants of the retrieval tier's weights that did not pay, and a vocabulary subset for its LM head: measured.

    python bench/e2e/lower_tier_variants.py --book pg1342.txt --prompt-tokens 8000 --new-tokens 128 --seeds 3 \
        --out bench/results/lower_tier_variants_2026-12-05.json

``auto``'s retrieval tier under sampling (``retrieval:3``: the target's own block codes with int8 activations, a
1,000-slot bf16 retrieval cache) generates ``--new-tokens`` after the book's first ``--prompt-tokens``, once per seed,
with each variant of the tier's weights (a fresh model per variant, its prompt prefilled anew; the verifier is the same
fp32 model in every run, so the output distribution is too; only the proposals change):

* ``codes_q8``: as ``auto`` runs it;
* ``codes_exact``: the target's exact products (fp32 activations) in every projection of the tier;
* ``head_4bit``: the tier's LM head (the Q8_0 embedding, 30 MB) requantized to 4-bit blocks of 32 (Q4_1's rule:
  scale (max - min) / 15 and minimum as fp16), 17.7 MB.

Per variant and seed: the verifier's acceptance, tokens per verification and the time between tokens. Then, for
the vocabulary subset of FR-Spec (Zhao et al., arXiv 2502.14856: the drafter's head restricted to frequent tokens)
built without a corpus, from the prompt's own tokens and the ``N`` lowest ids (a BPE vocabulary's merge order as the
frequency proxy): how often the book's next 4,000 tokens fall outside it (each such token a sure rejection), for the
three books and N in ``--subset-lowest``. JSON on stdout (and to ``--out``).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import add_prompt_options, add_run_options, emit_json  # noqa: E402

VARIANTS = ("codes_q8", "codes_exact", "head_4bit")


def _head_4bit(lin):
    """A copy of the Linear ``lin`` (block codes) whose codes are its weights requantized to Q4_1-style 4-bit blocks."""
    from triforce.kernels.blockcodes import GROUP
    from triforce.kernels.codes import find_block_codes

    w = lin.codes.dequantize()  # (in, out)
    n_in, n_out = w.shape
    b = w.T.reshape(n_out, n_in // GROUP, GROUP)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d, m = ((hi - lo) / 15).half().float(), lo.half().float()
    q = torch.where(d > 0, ((b - m) / torch.where(d > 0, d, torch.ones_like(d))).round().clamp(0, 15), 0)
    codes = find_block_codes((d * q + m).reshape(n_out, n_in).T.contiguous())
    if codes is None or codes.bits != 4:
        raise SystemExit("head_4bit: the requantized head has no exact 4-bit codes (bug)")
    out = copy.copy(lin)
    out._parameters = dict(lin._parameters)
    out.codes, out.q8 = codes, True
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_options(p, prompt_tokens=8000, new_tokens=128, book="pg1342.txt")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--subset-lowest", type=int, nargs="+", default=[0, 2048, 4096, 8192, 16384])
    add_run_options(p, None, reps=1)
    args = p.parse_args()

    from triforce.api import TriForce
    from triforce.kernels.decode_step import DecodeStep
    from triforce.lab.books import BOOKS_DIR
    from triforce.model import quant
    from triforce.speculation.hierarchy import SpeculationConfig
    from triforce.speculation.sampling import SamplingParams

    with open(f"{BOOKS_DIR}/{args.book}") as f:
        text = f.read()
    spec = SpeculationConfig(mode="retrieval", gamma2=3, budget=1000, lower_weights="codes",
                             lower_kv_dtype="bfloat16")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    as_auto = quant._int8_activations_copy

    def variant_copy(name):
        def make(model):
            out = as_auto(model)
            if name == "codes_exact":
                for m in out.modules():
                    if getattr(m, "q8", False):
                        m.q8 = False
                out.decode_step = DecodeStep(out)
            elif name == "head_4bit":
                out.lm_head = _head_4bit(out.lm_head)
            return out
        return make

    runs = {}
    try:
        for name in args.variants:
            quant._int8_activations_copy = variant_copy(name)
            tf = TriForce.load(threads=args.threads)  # an engine keeps its lower copy: a fresh one per variant
            ids = tf.encode(text)[:args.prompt_tokens]
            runs[name] = []
            for seed in range(args.seeds):
                stats = tf.generate(ids, max_new_tokens=args.new_tokens, sampling=params, spec=spec, seed=seed).stats
                target = stats.tiers["target"]
                runs[name].append({"seed": seed, "acceptance": round(target["acceptance_rate"], 3),
                                   "tokens_per_verification": round(target["mean_tokens_per_verification"], 2),
                                   "time_between_tokens_ms": round(stats.mean_time_between_tokens_ms, 2)})
    finally:
        quant._int8_activations_copy = as_auto

    subset = {}
    for book in ("pg1342.txt", "pg84.txt", "pg2701.txt"):
        with open(f"{BOOKS_DIR}/{book}") as f:
            toks = tf.encode(f.read())
        prompt, nxt = set(toks[:args.prompt_tokens]), toks[args.prompt_tokens:args.prompt_tokens + 4000]
        subset[book] = [{"lowest_ids": n, "subset_tokens": len(prompt | set(range(n))),
                         "outside_rate": round(sum(t not in prompt and t >= n for t in nxt) / max(len(nxt), 1), 4)}
                        for n in args.subset_lowest]
    emit_json({"book": args.book, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
               "temperature": args.temperature, "top_p": args.top_p, "threads": args.threads,
               "hierarchy": "retrieval:3", "runs": runs, "vocabulary_subset": subset}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
