"""``triforce bench``: the human-readable table and the PNG chart of a result."""

from __future__ import annotations


# ---------------------------------------------------------------------------------------------------- output
def format_table(result: dict) -> str:
    """The human-readable table of a result: one line per method, notes, then :func:`fastest_line`."""
    s = result["settings"]
    head = (f"{'SYNTHETIC (timing only): ' if result['synthetic'] else ''}{s['model']}, "
            f"{s['prompt_tokens']}-token prompt ({s['prompt_source']}), {s['new_tokens']} new tokens, "
            f"T={s['temperature']} top-p={s['top_p']} top-k={s['top_k']}, {s['dtype']}, {s['threads']} threads, "
            f"{s['reps']} interleaved reps (median [min-max])")
    lines = [head, f"{'method':<15} {'TBT ms':>22} {'tok/s':>7} {'vs hf-ar':>8} {'vs ar':>6} {'TTFT s':>7} "
                   f"{'peak MiB':>8}  acceptance / note"]
    for m, r in result["methods"].items():
        if r["status"] != "ok":
            lines.append(f"{m:<15} {r['status']}: {r['reason']}")
            continue
        t = r["mean_time_between_tokens_ms"]
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        tbt = f"{fmt(t['median'], '.1f')} [{fmt(t['min'], '.1f')}-{fmt(t['max'], '.1f')}]"
        acc = ", ".join(f"{k} {v['acceptance_rate']:.2f} ({v['mean_tokens_per_verification']:.2f}/verif)"
                        for k, v in (r.get("acceptance") or {}).items() if v.get("acceptance_rate") is not None)
        if r.get("predicted_speedup_vs_autoregressive"):
            sp = r.get("speedup_vs_autoregressive")
            acc += (f"; measured {sp:.2f}x vs ar" if sp else "") + \
                f" (cost-model prediction {r['predicted_speedup_vs_autoregressive']:.2f}x"
            run = (r.get("predicted_from_run") or {}).get("speedup")
            acc += f", {run:.2f}x from the run's steps)" if run else ")"
        if r.get("greedy") and not r["greedy"]["same_tokens"]:
            acc += f"; GREEDY TOKENS DIFFER from {result['greedy']['reference']} at {r['greedy']['first_difference']}"
        mem = r.get("peak_memory_bytes")
        lines.append(f"{m:<15} {tbt:>22} {fmt(r['tokens_per_second']['median'], '7.2f'):>7} "
                     f"{fmt(r.get('speedup_vs_hf_ar'), '.2f'):>8} {fmt(r.get('speedup_vs_autoregressive'), '.2f'):>6} "
                     f"{fmt(r['time_to_first_token_s']['median'], '.2f'):>7} "
                     f"{fmt(mem / 2**20 if mem else None, '.0f'):>8}  {acc}")
    timed = {m: r["mean_time_between_tokens_ms"]["median"] for m, r in result["methods"].items()
             if r["status"] == "ok" and r["mean_time_between_tokens_ms"]["median"] is not None}
    if any(r.get("predicted_speedup_vs_autoregressive") for r in result["methods"].values()):
        lines.append("measured figures are what this machine did; a cost-model prediction is an estimate from tier "
                     "latencies and acceptance, not a measurement (docs/history.md)")
    if result["greedy"]:
        lines.append("greedy: every method produced the reference's tokens" if result["greedy"]["all_same"] else
                     f"greedy: tokens differ from {result['greedy']['reference']}: "
                     f"{', '.join(result['greedy_mismatches'])}")
    if timed:  # the last line: the method that won, and by how much
        lines.append(fastest_line(timed))
    return "\n".join(lines)


#: the methods the fastest one is compared with by name, and the name each is called in the line
REFERENCES = {"autoregressive": "plain decoding", "llama.cpp": "llama.cpp", "hf-ar": "transformers"}


def fastest_line(timed: dict[str, float]) -> str:
    """The table's last word: the method with the lowest median time between tokens (``timed``: method -> ms), how
    many times faster it ran than plain decoding, llama.cpp and transformers where they ran, and than the next
    method; e.g. ``fastest: auto, 8.2 ms/token median: 1.62x plain decoding, 2.68x llama.cpp; 1.62x the next
    (autoregressive, 13.3)``."""
    best = min(timed, key=timed.get)
    line = f"fastest: {best}, {timed[best]:.1f} ms/token median"
    versus = [f"{timed[m] / timed[best]:.2f}x {name}" for m, name in REFERENCES.items() if m in timed and m != best]
    if versus:
        line += ": " + ", ".join(versus)
    rest = [m for m in timed if m != best]
    if rest:
        runner = min(rest, key=timed.get)
        line += f"; {timed[runner] / timed[best]:.2f}x the next ({runner}, {timed[runner]:.1f})"
    return line


def write_png(result: dict, path: str) -> str | None:
    """Draw median TBT (with min-max bars) and peak memory per method; returns None, or why nothing was drawn.

    Needs matplotlib (``pip install matplotlib``), imported here only (``cmd_bench`` checks it before the run).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); no chart written"
    ok = [(m, r) for m, r in result["methods"].items() if r["status"] == "ok"
          and r["mean_time_between_tokens_ms"]["median"] is not None]
    if not ok:
        return "no method ran; no chart written"
    names = [m for m, _ in ok]
    med = [r["mean_time_between_tokens_ms"]["median"] for _, r in ok]
    lo = [r["mean_time_between_tokens_ms"]["median"] - r["mean_time_between_tokens_ms"]["min"] for _, r in ok]
    hi = [r["mean_time_between_tokens_ms"]["max"] - r["mean_time_between_tokens_ms"]["median"] for _, r in ok]
    mem = [(r.get("peak_memory_bytes") or 0) / 2**20 for _, r in ok]
    colors = ["tab:gray" if m.startswith("hf") else "tab:purple" if m == "llama.cpp" else "tab:blue" for m in names]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.5 * len(names) + 2.2), gridspec_kw={"width_ratios": [3, 1.3]})
    y = list(range(len(names)))
    a1.barh(y, med, xerr=[lo, hi], color=colors, capsize=3)
    for i, (_, r) in enumerate(ok):
        sp = r.get("speedup_vs_autoregressive")
        label = f"{med[i]:.1f} ms" + (f"  (measured {sp:.2f}x ours ar)" if sp else "")
        if r.get("predicted_speedup_vs_autoregressive"):
            label += f", cost-model prediction {r['predicted_speedup_vs_autoregressive']:.2f}x"
        a1.text(med[i] + hi[i], i, " " + label, va="center", fontsize=8)
    a1.set_yticks(y, names)
    a1.invert_yaxis()
    a1.set_xlabel("mean time between tokens, ms (median, min-max bars; lower is better)")
    a1.set_xlim(0, max(m + h for m, h in zip(med, hi)) * 1.45)
    a2.barh(y, mem, color=colors)
    a2.set_yticks(y, [""] * len(names))
    a2.invert_yaxis()
    a2.set_xlabel("peak RSS of the method's process, MiB")
    s = result["settings"]
    title = (f"{'SYNTHETIC, timing only: ' if result['synthetic'] else ''}{s['model']}: "
             f"{s['prompt_tokens']}-token prompt, {s['new_tokens']} new tokens, T={s['temperature']}"
             f"{'' if s['temperature'] == 0 else ' top-p=' + str(s['top_p'])}, {s['dtype']}, {s['threads']} threads, "
             f"{s['reps']} interleaved reps")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
