"""Two result JSONs side by side: every numeric metric they share, with the ratio B / A.

    python bench/compare.py bench/results/speed_default_avx2/pg1342_8000_t06.json \
        bench/results/speed_default/pg1342_8000_t06.json
    python bench/compare.py --commits 1a9b339 HEAD --result bench/results/qlinear.json

The first form reads two files; the second reads one file as two commits hold it (``git show C:PATH``). A
``triforce bench`` JSON (``"benchmark": "triforce bench"``, what ``bench/e2e/speed_default.sh`` writes) is compared by
method: the median ms per token (mean time between tokens, prefill excluded), the median time to first token and
the speedup over our autoregressive decoding. Any other JSON is flattened to its numeric leaves (``a.b[0].c``; lists
of more than ``--max-list`` numbers, such as token ids, and the ``machine`` entry left out); ``--all`` adds those to a
bench JSON's table. Each side is labelled with the commit it records (``machine.git_commit``, ``provenance.git_commit``,
or ``commit_added``: the commit that added a file measured before results recorded their commit) and its CPU.
Reads only JSON (no torch, no triforce): fast anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys

BENCH = "triforce bench"


def flatten(obj, prefix: str = "", max_list: int = 20) -> dict[str, float]:
    """Numeric leaves of ``obj`` (bools excluded) by path: dict keys joined by ``.``, list items as ``[i]``; a list of
    more than ``max_list`` items is left out, and so is a top-level ``machine`` entry."""
    out: dict[str, float] = {}
    if isinstance(obj, bool) or obj is None:
        return out
    if isinstance(obj, (int, float)):
        if math.isfinite(obj):
            out[prefix] = float(obj)
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not prefix and k == "machine":
                continue
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k), max_list))
    elif isinstance(obj, list) and len(obj) <= max_list:
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}[{i}]", max_list))
    return out


def _median(value):
    """A ``{"median": ...}`` spread's median, or a bare number; None otherwise."""
    if isinstance(value, dict):
        value = value.get("median")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def bench_metrics(result: dict) -> dict[str, float]:
    """Per method of a ``triforce bench`` JSON that ran: ``METHOD ms/token``, ``METHOD ttft s`` and
    ``METHOD speedup vs autoregressive``."""
    out = {}
    for name, m in (result.get("methods") or {}).items():
        if not isinstance(m, dict) or m.get("status", "ok") != "ok":
            continue
        for label, key in (("ms/token", "mean_time_between_tokens_ms"), ("ttft s", "time_to_first_token_s"),
                           ("speedup vs autoregressive", "speedup_vs_autoregressive")):
            v = _median(m.get(key))
            if v is not None:
                out[f"{name} {label}"] = v
    return out


def metrics(result, all_leaves: bool = False, max_list: int = 20) -> dict[str, float]:
    """What :func:`compare` compares: :func:`bench_metrics` for a ``triforce bench`` JSON (plus :func:`flatten`'s
    leaves with ``all_leaves``), :func:`flatten` for anything else."""
    if isinstance(result, dict) and result.get("benchmark") == BENCH:
        out = bench_metrics(result)
        if all_leaves:
            out.update(flatten(result, max_list=max_list))
        return out
    return flatten(result, max_list=max_list)


def label(result) -> str:
    """The commit and CPU a result records, as one line."""
    if not isinstance(result, dict):
        return "no commit recorded"
    machine = result.get("machine") if isinstance(result.get("machine"), dict) else {}
    prov = result.get("provenance") if isinstance(result.get("provenance"), dict) else {}
    commit = machine.get("git_commit") or prov.get("git_commit") or result.get("commit")
    dirty = machine.get("git_dirty") or prov.get("git_dirty")
    if commit:
        text = f"commit {commit[:12]}" + (" (uncommitted changes)" if dirty else "")
    elif result.get("commit_added"):
        text = f"added in commit {result['commit_added'][:12]}"
    else:
        text = "no commit recorded"
    cpu = machine.get("cpu") or machine.get("processor")
    return text + (f", {cpu}" if cpu else "")


def compare(a, b, all_leaves: bool = False, max_list: int = 20) -> list[tuple[str, float, float, float | None]]:
    """``(metric, A, B, B / A)`` for every metric both results have (the ratio None where A is 0), in A's order."""
    ma, mb = metrics(a, all_leaves, max_list), metrics(b, all_leaves, max_list)
    return [(k, va, mb[k], mb[k] / va if va else None) for k, va in ma.items() if k in mb]


def format_rows(rows) -> str:
    """The rows of :func:`compare` as an aligned text table."""
    if not rows:
        return "no numeric metric in common"
    width = max(len("metric"), *(len(r[0]) for r in rows))
    lines = [f"{'metric':<{width}}  {'A':>12}  {'B':>12}  {'B/A':>7}"]
    for k, va, vb, ratio in rows:
        lines.append(f"{k:<{width}}  {va:>12.6g}  {vb:>12.6g}  {'-' if ratio is None else f'{ratio:.3f}':>7}")
    return "\n".join(lines)


def open_text(path: str) -> str:
    """The text of the file at ``path``."""
    with open(path, encoding="utf-8") as f:
        return f.read()


def read_at(commit: str, path: str):
    """The JSON at ``path`` (a path in this checkout) as ``commit`` holds it (``git show``). Raises
    ``subprocess.CalledProcessError`` where the commit or the file at it does not exist."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=folder, capture_output=True, text=True,
                          check=True).stdout.strip()
    rel = os.path.relpath(os.path.abspath(path), root).replace(os.sep, "/")
    text = subprocess.run(["git", "show", f"{commit}:{rel}"], cwd=root, capture_output=True, text=True,
                          check=True).stdout
    return json.loads(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", metavar="JSON", help="two result JSONs: A then B")
    p.add_argument("--commits", nargs=2, metavar=("C1", "C2"), help="compare --result as commits C1 (A) and C2 (B)")
    p.add_argument("--result", help="with --commits: the result JSON's path")
    p.add_argument("--all", action="store_true", help="a triforce bench JSON: every numeric leaf too")
    p.add_argument("--match", help="only metrics whose name matches this regular expression")
    p.add_argument("--max-list", type=int, default=20, help="leave out lists longer than this (default 20)")
    args = p.parse_args(argv)
    if args.commits:
        if args.files or not args.result:
            p.error("--commits takes --result PATH and no JSON arguments")
        try:
            a, b = (read_at(c, args.result) for c in args.commits)
        except subprocess.CalledProcessError as e:
            print(f"error: {e.stderr.strip() or e}", file=sys.stderr)
            return 1
        names = [f"{args.result} at {c}" for c in args.commits]
    else:
        if len(args.files) != 2 or args.result:
            p.error("give two result JSONs, or --commits C1 C2 --result PATH")
        a, b = (json.loads(open_text(f)) for f in args.files)
        names = args.files
    rows = compare(a, b, args.all, args.max_list)
    if args.match:
        rows = [r for r in rows if re.search(args.match, r[0])]
    print(f"A: {names[0]} ({label(a)})")
    print(f"B: {names[1]} ({label(b)})")
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
