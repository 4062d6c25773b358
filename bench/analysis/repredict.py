"""The cost model's prediction from a saved `triforce bench` JSON's own step times, for runs made before a method had
one (issue 11, item 5: predicted and measured speedups within 15%).

``triforce bench`` writes ``predicted_from_run`` for each speculative method (``triforce.lab.bench.run``); ``auto``
got one later (where it ran one hierarchy in every repetition without a bypass). This script runs the same function
on saved JSONs, changing nothing in them, and prints per file and method the measured speedup over our
autoregressive method, the prediction and their ratio:

    python bench/analysis/repredict.py bench/results/cost_model_2026-12-04/*_8000_t06*.json \
        bench/results/qwen_2026-12-04/*.json \
        --out bench/results/repredict_2026-12-04.json

JSON on stdout (and to ``--out``): one row per file and method with ``measured``, ``predicted_from_run``,
``measured_over_predicted`` and, for ``auto``, the hierarchy the prediction used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import emit_json  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="triforce bench JSON files")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()

    from triforce.lab import costmodel
    from triforce.lab.bench.methods import METHODS
    from triforce.lab.bench.run import _predict_from_run

    rows = []
    for path in args.files:
        with open(path) as f:
            results = json.load(f)["methods"]
        ok = [m for m in METHODS if results.get(m, {}).get("status") == "ok"]
        for r in results.values():
            r.pop("predicted_from_run", None)
        _predict_from_run(results, ok, costmodel)
        for m in ok:
            pred = results[m].get("predicted_from_run") or {}
            if "speedup" not in pred:
                continue
            rows.append({"file": os.path.relpath(path), "method": m,
                         "measured": results[m].get("speedup_vs_autoregressive"), "predicted_from_run": pred["speedup"],
                         "measured_over_predicted": results[m].get("measured_over_predicted_from_run"),
                         **({"chain": pred["chain"]} if "chain" in pred else {})})
    emit_json({"rows": rows, "within_15_percent": sum(abs(r["measured_over_predicted"] - 1) <= 0.15 for r in rows
                                                      if r["measured_over_predicted"] is not None),
               "rows_with_a_ratio": sum(r["measured_over_predicted"] is not None for r in rows)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
