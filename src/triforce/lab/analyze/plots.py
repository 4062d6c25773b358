"""``triforce analyze``: the PNG charts (matplotlib, imported only when drawing)."""

from __future__ import annotations

import os
from typing import Sequence

from .attention import ACCEPTANCE_FACTORS, ORACLE


# ---------------------------------------------------------------------------------------------------- plots
class PlotUnavailable(ImportError):
    """matplotlib is not installed: the JSON is written, the PNG skipped."""


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise PlotUnavailable("matplotlib is not installed; install it with `pip install 'triforce[bench]'` "
                              "(or `pip install matplotlib`) for the PNG charts") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str | os.PathLike, title: str) -> None:
    """Title (if any), tight layout, write the PNG at 110 dpi, free the figure."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_recovery(summary: dict, path: str | os.PathLike, title: str = "") -> None:
    """recovery.png: mean recovery against budget per chunk score, and per layer (paper's rule and oracle).

    Raises:
        PlotUnavailable: matplotlib is missing.
    """
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    mean, per_layer = summary["mean_recovery"], summary["per_layer"]
    for s, row in mean.items():
        bs = sorted(row, key=int)
        a.plot([int(x) for x in bs], [row[x] for x in bs], marker="o", label=s, ls="--" if s == ORACLE else "-")
    a.set_xscale("log", base=2)
    a.set_xlabel("budget (KV slots per layer and KV head)")
    a.set_ylabel("attention recovery (mean over layers, heads, books)")
    a.set_title("recovery against budget, by chunk score")
    a.grid(alpha=0.3)
    a.legend()
    cmap = plt.get_cmap("viridis")
    budgets = sorted(per_layer.get("mean", per_layer[next(iter(per_layer))]), key=int)
    for i, bud in enumerate(budgets):
        color = cmap(i / max(1, len(budgets) - 1))
        for s, ls in (("mean", "-"), (ORACLE, ":")):
            if s in per_layer:
                vals = per_layer[s][bud]
                b.plot(range(len(vals)), vals, ls=ls, color=color, marker="." if ls == "-" else None,
                       label=f"{s}, budget {bud}")
    b.set_xlabel("layer")
    b.set_ylabel("attention recovery (mean over heads, books)")
    b.set_title("per layer: paper's chunk rule (solid) and oracle tokens (dotted)")
    b.grid(alpha=0.3)
    b.legend(fontsize=7, ncol=2)
    _save(plt, fig, path, title)


def plot_locality(summary: dict, path: str | os.PathLike, title: str = "", reselect_every: int = 1) -> None:
    """locality.png: recovery per generated step, selection fixed at the prompt (solid) or re-chosen (dashed).

    Raises:
        PlotUnavailable: matplotlib is missing.
    """
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5.6), gridspec_kw={"width_ratios": [2, 1]})
    cmap = plt.get_cmap("viridis")
    budgets = sorted(summary["fixed"], key=int)
    for i, bud in enumerate(budgets):
        color = cmap(i / max(1, len(budgets) - 1))
        again = "re-chosen each step" if reselect_every == 1 else f"re-chosen (every {reselect_every} steps)"
        for key, ls, lab in (("fixed", "-", "chosen at the prompt"), ("reselected", "--", again)):
            ys = summary[key][bud]
            xs = [s for s, y in enumerate(ys) if y is not None]
            a.plot(xs, [ys[s] for s in xs], ls=ls, color=color, label=f"budget {bud}, {lab}")
    a.set_xlabel("generated tokens since the selection (step 0 = last prompt token)")
    a.set_ylabel("attention recovery (mean over layers, heads, books)")
    a.set_title("contextual locality")
    a.grid(alpha=0.3)
    a.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    g = summary["generated_share"]
    b.plot(range(len(g)), g, color="k")
    b.set_xlabel("generated tokens")
    b.set_ylabel("attention mass on the generated tokens")
    b.set_title("share of attention on generated tokens")
    b.grid(alpha=0.3)
    _save(plt, fig, path, title)


def plot_acceptance(summary: dict, records: Sequence[dict], path: str | os.PathLike, title: str = "") -> None:
    """acceptance.png: one panel per factor, mean acceptance rate over books (line) and each book (dots).

    Raises:
        PlotUnavailable: matplotlib is missing.
    """
    plt = _pyplot()
    factors = [f for f in ACCEPTANCE_FACTORS if f in summary]
    fig, axes = plt.subplots(1, len(factors), figsize=(4 * len(factors), 4), squeeze=False)
    labels = {"budget": "budget (KV slots)", "chunk_size": "chunk size (tokens)", "temperature": "temperature",
              "prompt_tokens": "context length (prompt tokens)"}
    for ax, f in zip(axes[0], factors):
        rows = summary[f]
        ax.plot([r["value"] for r in rows], [r["acceptance_rate_mean"] for r in rows], marker="o", color="C0",
                label="mean over books")
        pts = [(r[f], r["acceptance_rate"]) for r in records if f in r["sweeps"] and r["acceptance_rate"] is not None]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, color="C1", alpha=0.6, label="each book")
        if f in ("budget", "chunk_size"):
            ax.set_xscale("log", base=2)
        ax.set_xlabel(labels[f])
        ax.set_ylabel("acceptance rate (retrieval tier)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(plt, fig, path, title)
