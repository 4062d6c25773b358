"""Structured output on a real model: how many answers parse and validate, and what the grammar costs speculation.

    python bench/e2e/structured_output.py --prompt-tokens 4000 --requests 100 --threads 2 \
        --out bench/results/structured_output/smollm2_4000_t0.8.json

One document (the first ``--prompt-tokens`` tokens of a book, pg1342 by default) and a question asking for a JSON
answer, in the model's chat template; ``--requests`` generations with ``response_format`` set to a JSON schema
(``SCHEMA``: the characters named and the place, at most 5 names, strings of at most 40 characters) and as many without
it, interleaved, each with its own seed (T = ``--temperature``, top-p ``--top-p``), the default mode (``auto``),
``--max-new-tokens`` each. The
document's KV cache is computed once and reused by every request (prefix reuse), so the figures are the decode
phase. Reported per setting: answers that parse (``json.loads``) and validate (``jsonschema``) among those that
ended (EOS) and in all, finish reasons, the hierarchy ``auto`` chose, each speculating tier's acceptance (accepted /
proposed over all requests), and the median ms per generated token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import add_run_options, emit_json, positive_int  # noqa: E402

SCHEMA = {"type": "object", "properties": {"characters": {"type": "array", "maxItems": 5,
                                                          "items": {"type": "string", "maxLength": 40}},
                                           "place": {"type": "string", "maxLength": 40}},
          "required": ["characters", "place"], "additionalProperties": False}
QUESTION = ("Which characters are named in this text, and where does it take place? Answer in JSON with the keys "
            "\"characters\" (a list of names) and \"place\".")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--book", default="pg1342")
    p.add_argument("--prompt-tokens", type=positive_int, default=4000)
    p.add_argument("--requests", type=positive_int, default=100)
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    add_run_options(p, out=None, threads=2)
    p.set_defaults(temperature=0.8)
    args = p.parse_args()
    import jsonschema
    import torch

    from triforce import SamplingParams, TriForce
    from triforce.lab.books import resolve_book
    from triforce.text.prompts import strip_gutenberg

    torch.set_num_threads(args.threads)
    tf = TriForce.load(args.model)
    document = strip_gutenberg(resolve_book(args.book).read_text(encoding="utf-8"))
    ids, _ = tf.encode_cut(QUESTION, chat=True, document=document, max_prompt_tokens=args.prompt_tokens)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    tf.generate(ids, max_new_tokens=2, sampling=sampling, seed=0)  # the document's KV, kept for every request
    runs: dict[str, list[dict]] = {"json_schema": [], "text": []}
    for i in range(args.requests):
        for name in (runs if i % 2 == 0 else reversed(list(runs))):  # interleaved
            t0 = time.perf_counter()
            r = tf.generate(ids, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=1000 + i,
                            response_format=fmt if name == "json_schema" else None)
            seconds = time.perf_counter() - t0
            try:
                value, parses = json.loads(r.text), True
            except json.JSONDecodeError:
                value, parses = None, False
            valid = parses and jsonschema.Draft202012Validator(SCHEMA).is_valid(value)
            runs[name].append({"finish": r.finish_reason, "parses": parses, "valid": valid,
                               "tokens": len(r.token_ids), "seconds": seconds, "text": r.text,
                               "hierarchy": (r.stats.auto or {}).get("hierarchy"),
                               "tiers": {k: (t.get("proposed", 0), t.get("accepted", 0))
                                         for k, t in r.stats.tiers.items() if t.get("proposed")}})
    result = {"model": args.model or "SmolLM2-135M-Instruct (embedded)", "book": args.book,
              "prompt_tokens": len(ids), "requests": args.requests, "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "top_p": args.top_p, "threads": args.threads, "schema": SCHEMA,
              "settings": {}}
    for name, rows in runs.items():
        ended = [r for r in rows if r["finish"] == "eos"]
        acceptance = {}
        for r in rows:
            for tier, (proposed, accepted) in r["tiers"].items():
                a = acceptance.setdefault(tier, [0, 0])
                a[0], a[1] = a[0] + proposed, a[1] + accepted
        result["settings"][name] = {
            "ended": len(ended), "ended_parse": sum(r["parses"] for r in ended),
            "ended_valid": sum(r["valid"] for r in ended), "parse": sum(r["parses"] for r in rows),
            "valid": sum(r["valid"] for r in rows),
            "finish_reasons": {f: sum(r["finish"] == f for r in rows) for f in {r["finish"] for r in rows}},
            "hierarchies": {h: sum(r["hierarchy"] == h for r in rows) for h in {str(r["hierarchy"]) for r in rows}},
            "acceptance": {t: round(a / p, 4) if p else None for t, (p, a) in acceptance.items()},
            "ms_per_token_p50": round(statistics.median(1000 * r["seconds"] / max(1, r["tokens"]) for r in rows), 2),
            "examples": [r["text"] for r in rows[:3]], "runs": rows}
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
