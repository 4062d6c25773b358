"""Tables and a chart from the `triforce bench` runs of ``bench/e2e/speed_default.sh`` (issue 11's targets).

    python bench/e2e/speed_default_table.py [--dir bench/results/speed_default] [--png docs/img/speed_default.png]

Prints one markdown table per run kind to stdout: median mean time between tokens (ms) per method, the speedup of
``auto`` over our autoregressive decoding, over transformers ``generate`` and over llama.cpp, and the hierarchy
``auto`` chose (with how many tokens it produced speculatively and while bypassing the drafters). Every figure is a
median over the run's interleaved repetitions, as ``triforce bench`` reports it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

METHODS = ("hf-ar", "llama.cpp", "autoregressive", "retrieval-int8", "self", "draft", "auto")


def load(directory: Path) -> list[dict]:
    """Every run's JSON in ``directory`` with its file stem; runs that failed to parse are skipped."""
    runs = []
    for path in sorted(directory.glob("*.json")):
        try:
            runs.append(dict(json.loads(path.read_text()), file=path.stem))
        except json.JSONDecodeError:
            continue
    return runs


def _ms(run: dict, method: str) -> float | None:
    m = run["methods"].get(method) or {}
    return (m.get("mean_time_between_tokens_ms") or {}).get("median") if m.get("status") == "ok" else None


def row(run: dict) -> dict:
    """One run's figures: ms/token per method, auto's speedups and choice."""
    s = run["settings"]
    out = {"run": run["file"], "book": Path(str(s.get("prompt_source"))).name, "tokens": s["prompt_tokens"],
           "temperature": s["temperature"], "ms": {m: _ms(run, m) for m in METHODS}}
    auto = _ms(run, "auto")
    for base in ("autoregressive", "hf-ar", "llama.cpp"):
        ref = _ms(run, base)
        out[f"auto_vs_{base}"] = round(ref / auto, 2) if ref and auto else None
    reps = (run["methods"].get("auto") or {}).get("auto") or []
    if reps:
        out["hierarchy"] = sorted({r["hierarchy"] for r in reps})
        out["speculative_tokens"] = sum(r["speculative_tokens"] for r in reps)
        out["autoregressive_tokens"] = sum(r["autoregressive_tokens"] for r in reps)
    acc = ((run["methods"].get("auto") or {}).get("acceptance") or {}).get("target") or {}
    out["auto_acceptance"] = acc.get("acceptance_rate")
    out["greedy_same"] = (run.get("greedy") or {}).get("all_same")
    return out


def markdown(rows: list[dict]) -> str:
    """The rows as one markdown table."""
    head = ["run", "prompt", "T"] + [f"{m} ms" for m in METHODS] + \
        ["auto / ours AR", "auto / transformers", "auto / llama.cpp", "auto's hierarchy (spec / plain tokens)",
         "auto acceptance", "greedy same tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["run"], f"{r['book']} {r['tokens']}", f"{r['temperature']:g}"]
        cells += [f"{r['ms'][m]:.1f}" if r["ms"][m] else "" for m in METHODS]
        cells += [f"{r[k]:.2f}x" if r[k] else ""
                  for k in ("auto_vs_autoregressive", "auto_vs_hf-ar", "auto_vs_llama.cpp")]
        cells.append(f"{', '.join(r.get('hierarchy', []))} ({r.get('speculative_tokens', 0)} / "
                     f"{r.get('autoregressive_tokens', 0)})" if r.get("hierarchy") else "")
        cells.append(f"{r['auto_acceptance']:.2f}" if r.get("auto_acceptance") is not None else "")
        cells.append("" if r["greedy_same"] is None else ("yes" if r["greedy_same"] else "NO"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(rows: list[dict], path: str) -> None:
    """Bars of ms/token per method for each run (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rows)), 4.5))
    methods = [m for m in METHODS if any(r["ms"][m] for r in rows)]  # the methods these runs measured
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r["ms"][m] or 0 for r in rows], width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['book'].removesuffix('.txt')}\n{r['tokens']} T={r['temperature']:g}" for r in rows],
                       fontsize=7)
    ax.set_ylabel("mean time between tokens (ms, median)")
    ax.set_title("triforce bench, SmolLM2-135M fp32 / Qwen2.5-Coder-1.5B, 2 threads, this project's CPU")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="bench/results/speed_default")
    p.add_argument("--png", help="also write a chart there")
    args = p.parse_args()
    rows = [row(r) for r in load(Path(args.dir))]
    print(markdown(rows))
    if args.png:
        chart(rows, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
