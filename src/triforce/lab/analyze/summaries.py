"""``triforce analyze``: means over books, and the text tables printed after each analysis."""

from __future__ import annotations

from typing import Iterable, Sequence

from .attention import ACCEPTANCE_FACTORS


# ---------------------------------------------------------------------------------------------------- summaries
def _mean(xs: Iterable[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _r(x: float | None, d: int = 4) -> float | None:
    return None if x is None else round(x, d)


def summarize_recovery(per_book: dict[str, dict[str, dict[int, list[float]]]]) -> dict:
    """Means over books of :func:`recovery_at_query` results ``{book: {score: {budget: per-layer}}}``.

    Returns:
        ``{"mean_recovery": {score: {budget: mean over books, layers and heads}}, "per_layer": {score: {budget:
        [mean over books, per layer]}}}``.
    """
    books = list(per_book.values())
    scores = list(books[0])
    budgets = list(books[0][scores[0]])
    mean = {s: {b: _r(_mean(sum(bk[s][b]) / len(bk[s][b]) for bk in books)) for b in budgets} for s in scores}
    layers = len(books[0][scores[0]][budgets[0]])
    per_layer = {s: {b: [_r(_mean(bk[s][b][i] for bk in books)) for i in range(layers)] for b in budgets}
                 for s in scores}
    return {"mean_recovery": mean, "per_layer": per_layer}


def summarize_locality(per_book: dict[str, dict]) -> dict:
    """Means over books of :func:`locality_after_prompt` results, per step (books that stopped early at an EOS
    count only for the steps they reached; None where a step is past the cache's generation capacity)."""
    books = list(per_book.values())
    steps = max(r["steps"] for r in books)
    budgets = list(books[0]["fixed"])

    def step_mean(key: str, b: int | None) -> list[float | None]:
        rows = [r[key] if b is None else r[key][b] for r in books]
        return [_r(_mean(row[s] for row in rows if s < len(row))) for s in range(steps)]

    def layer_mean(key: str, b: int) -> list[float] | None:
        rows = [r[key][b] for r in books if r[key][b] is not None]
        return [_r(_mean(row[i] for row in rows)) for i in range(len(rows[0]))] if rows else None

    return {"steps": steps, "generated_share": step_mean("generated_share", None),
            "fixed": {b: step_mean("fixed", b) for b in budgets},
            "reselected": {b: step_mean("reselected", b) for b in budgets},
            "fixed_per_layer": {b: layer_mean("fixed_per_layer", b) for b in budgets},
            "reselected_per_layer": {b: layer_mean("reselected_per_layer", b) for b in budgets}}


def summarize_acceptance(records: Sequence[dict], base: dict) -> dict:
    """Per sweep (factor), per value: mean over books of the acceptance rate and tokens per verification.

    Returns:
        ``{factor: [{"value", "acceptance_rate_mean", "acceptance_rate_min", "acceptance_rate_max",
        "acceptance_rate_pooled" (sum accepted / sum proposed), "mean_tokens_per_verification_mean", "books"}]}``.
    """
    out: dict[str, list[dict]] = {}
    for factor in ACCEPTANCE_FACTORS:
        rows = [r for r in records if factor in r["sweeps"]]
        for v in sorted({r[factor] for r in rows}):
            rs = [r for r in rows if r[factor] == v]
            acc = [r["acceptance_rate"] for r in rs if r["acceptance_rate"] is not None]
            out.setdefault(factor, []).append({
                "value": v, "books": len(rs),
                "acceptance_rate_mean": _r(_mean(acc)),
                "acceptance_rate_min": _r(min(acc)) if acc else None,
                "acceptance_rate_max": _r(max(acc)) if acc else None,
                "acceptance_rate_pooled": _r(sum(r["accepted"] or 0 for r in rs) / max(1, sum(r["proposed"] or 0
                                                                                              for r in rs))),
                "mean_tokens_per_verification_mean": _r(_mean(r["mean_tokens_per_verification"] for r in rs), 3)})
    return out


# ---------------------------------------------------------------------------------------------------- tables
LOCALITY_STEPS = (0, 8, 16, 32, 64, 128, 256)


def recovery_table(summary: dict) -> str:
    """Markdown table: rows budgets, columns chunk scores, cells mean recovery over books, layers and heads."""
    mean = summary["mean_recovery"]
    scores = list(mean)
    budgets = sorted(mean[scores[0]], key=int)
    lines = ["| budget | " + " | ".join(scores) + " |", "|---:|" + "---:|" * len(scores)]
    lines += [f"| {b} | " + " | ".join(f"{mean[s][b]:.3f}" for s in scores) + " |" for b in budgets]
    return "\n".join(lines)


def locality_table(summary: dict) -> str:
    """Markdown table: rows budgets, columns steps, cells ``fixed / re-chosen`` recovery (n/a past capacity)."""
    steps = [s for s in LOCALITY_STEPS if s < summary["steps"]]
    lines = ["| budget | " + " | ".join(f"step {s}" for s in steps) + " |", "|---:|" + "---:|" * len(steps)]
    for b in sorted(summary["fixed"], key=int):
        cells = []
        for s in steps:
            f, r = summary["fixed"][b][s], summary["reselected"][b][s]
            cells.append("n/a" if f is None else f"{f:.3f} / " + ("n/a" if r is None else f"{r:.3f}"))
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    g = summary["generated_share"]
    lines.append("| generated share | " + " | ".join(f"{g[s]:.3f}" for s in steps) + " |")
    return "\n".join(lines)


def acceptance_table(summary: dict) -> str:
    """Markdown table: one row per (factor, value): mean, min and max acceptance over books, tokens/verification."""
    lines = ["| factor | value | acceptance (mean) | min | max | tokens/verification |",
             "|---|---:|---:|---:|---:|---:|"]
    for f, rows in summary.items():
        for r in rows:
            lines.append(f"| {f} | {r['value']} | {r['acceptance_rate_mean']:.3f} | {r['acceptance_rate_min']:.3f} | "
                         f"{r['acceptance_rate_max']:.3f} | {r['mean_tokens_per_verification_mean']:.2f} |")
    return "\n".join(lines)
