"""``triforce bench``: per-run metrics from token timestamps, spreads over repetitions, summed tier counters,
the greedy token comparison."""

from __future__ import annotations

import statistics


# ---------------------------------------------------------------------------------------------------- analysis
def compare_greedy(tokens: dict[str, list[list[int]]], reference: str) -> dict[str, dict]:
    """Compare every method's greedy tokens with the reference method's first repetition.

    Args:
        tokens: method -> one token-id list per repetition.
        reference: the method whose first repetition is the reference (a key of ``tokens``).

    Returns:
        method -> ``{"same_tokens": bool, "first_difference": int | None, "reps_identical": bool}``:
        ``same_tokens`` is True when every repetition equals the reference; ``first_difference`` is the first
        position (0-based, in generated tokens) where some repetition differs, a length difference counting at
        the shorter length; ``reps_identical`` tells whether the method's own repetitions agree.

    Raises:
        KeyError: ``reference`` is not in ``tokens`` or has no repetition.
    """
    if reference not in tokens or not tokens[reference]:
        raise KeyError(f"reference method {reference!r} has no tokens")
    ref = list(tokens[reference][0])
    out = {}
    for method, reps in tokens.items():
        first = None
        for rep in reps:
            rep = list(rep)
            if rep != ref:
                i = next((j for j, (a, b) in enumerate(zip(rep, ref)) if a != b), min(len(rep), len(ref)))
                first = i if first is None else min(first, i)
        out[method] = {"same_tokens": first is None, "first_difference": first,
                       "reps_identical": all(list(r) == list(reps[0]) for r in reps)}
    return out


def rep_metrics(times: list[float]) -> dict[str, float | None]:
    """Metrics of one run from its token timestamps (seconds since the call, one per token, non-decreasing).

    Returns:
        ``time_to_first_token_s``, ``mean_time_between_tokens_ms`` (``1000 (t_last - t_first) / (n - 1)``),
        ``tokens_per_second`` (``1000 / TBT``) and ``total_seconds``; TBT and tokens/s are None for fewer than
        two tokens.
    """
    if not times:
        return {"time_to_first_token_s": None, "mean_time_between_tokens_ms": None, "tokens_per_second": None,
                "total_seconds": None}
    span = times[-1] - times[0]
    tbt = 1000 * span / (len(times) - 1) if len(times) > 1 else None
    return {"time_to_first_token_s": round(times[0], 6),
            "mean_time_between_tokens_ms": round(tbt, 4) if tbt is not None else None,
            "tokens_per_second": round(1000 / tbt, 4) if tbt else None,
            "total_seconds": round(times[-1], 6)}


def spread(values: list[float | None]) -> dict[str, float | None]:
    """Median, min, max and interquartile range of the non-None values (None when there are none)."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return {"median": None, "min": None, "max": None, "iqr": None}
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0], v[0], v[0]]
    return {"median": round(statistics.median(v), 6), "min": round(v[0], 6), "max": round(v[-1], 6),
            "iqr": round(q[2] - q[0], 6)}


def aggregate_tiers(per_rep: list[dict]) -> dict[str, dict]:
    """Sum our engine's per-tier counters over repetitions (``GenerationStats.tiers`` dicts).

    Returns:
        tier -> ``{"verifications", "proposed", "accepted", "acceptance_rate", "mean_tokens_per_verification",
        "forward_passes", "forward_seconds", "accepted_lengths"}`` for every verifying tier (acceptance_rate None when
        nothing was proposed).
    """
    out: dict[str, dict] = {}
    for tiers in per_rep:
        for name, t in tiers.items():
            if not t.get("verifications"):
                continue
            a = out.setdefault(name, {"verifications": 0, "proposed": 0, "accepted": 0, "emitted": 0.0,
                                      "forward_passes": 0, "forward_seconds": 0.0})
            a["verifications"] += t["verifications"]
            a["proposed"] += t["proposed"]
            a["accepted"] += t["accepted"]
            a["emitted"] += t["mean_tokens_per_verification"] * t["verifications"]
            a["forward_passes"] += t.get("forward_passes", 0)
            a["forward_seconds"] += t.get("forward_seconds", 0.0)
            hist = a.setdefault("accepted_lengths", [])
            for j, n in enumerate(t.get("accepted_lengths") or []):
                hist.extend([0] * (j + 1 - len(hist)))
                hist[j] += n
    for a in out.values():
        a["acceptance_rate"] = round(a["accepted"] / a["proposed"], 6) if a["proposed"] else None
        a["mean_tokens_per_verification"] = round(a.pop("emitted") / a["verifications"], 6)
        a["forward_seconds"] = round(a["forward_seconds"], 6)
    return out





def step_seconds(per_rep: list[dict]) -> dict[str, float]:
    """Seconds per forward of each tier while generating, over every repetition (``GenerationStats.tiers`` dicts):
    ``(forward_seconds - prefill_seconds) / (forward_passes - prefill_passes)``, so a retrieval tier's re-selections
    count in its steps' time. The steps as this run ran them, for the cost model's prediction from the run itself.

    Returns:
        tier -> seconds (tiers without a forward while generating left out).
    """
    seconds: dict[str, float] = {}
    passes: dict[str, int] = {}
    for tiers in per_rep:
        for name, t in tiers.items():
            seconds[name] = seconds.get(name, 0.0) + t.get("forward_seconds", 0.0) - t.get("prefill_seconds", 0.0)
            passes[name] = passes.get(name, 0) + t.get("forward_passes", 0) - t.get("prefill_passes", 0)
    return {name: round(seconds[name] / passes[name], 6) for name in seconds if passes[name] > 0}


def acceptance_inputs(acceptance: dict[str, dict]) -> tuple[dict[str, float], dict[str, list[int]]]:
    """What :func:`~triforce.lab.costmodel.predict` takes from a method's ``acceptance`` (per tier, as
    :func:`aggregate_tiers` gives it): ``(rates, accepted_lengths)``, each tier name -> its acceptance rate and
    its observed run-length histogram, tiers without one left out."""
    rates = {name: t["acceptance_rate"] for name, t in acceptance.items() if t.get("acceptance_rate") is not None}
    lengths = {name: t["accepted_lengths"] for name, t in acceptance.items() if t.get("accepted_lengths")}
    return rates, lengths


def with_empty_proposals(lengths: dict[str, list[int]], acceptance: dict[str, dict],
                         chain: list[tuple[str, int]]) -> dict[str, list[int]]:
    """``lengths`` (from :func:`acceptance_inputs`) with the steps where an n-gram bottom tier proposed nothing
    counted as runs of length 0 of the tier above it, for :func:`~triforce.lab.costmodel.predict` on a run's own
    step times.

    An n-gram drafter without a match proposes no token; its tier then runs a one-token forward that emits one
    token, which its stats count in ``forward_passes`` but not in ``verifications`` (``speculation/tiers.py``). The
    cost model takes the drafter to propose gamma tokens at every step, which leaves those forwards out and
    over-predicts such a chain (docs/performance.md, "Figures behind the code's constants"). Counted as a proposal
    rejected at its first token (one forward, one token emitted), they cost exactly what they cost where the tier's
    decode and pass latency are the same per-forward average, as ``predicted_from_run`` takes them
    (``step_seconds``). Only for a tier below the target: the target's forwards also hold ``auto``'s plain decode
    steps. A tier's one-token steps at the end of a truncated block are counted too (the stats do not tell them
    apart; at most one per block above).

    Args:
        lengths: tier name -> run-length histogram (counts of 0 .. gamma accepted tokens per verification).
        acceptance: the method's per-tier stats (``verifications``, ``forward_passes``, ``prefill_passes``).
        chain: ``[(kind, gamma), ...]`` bottom first, as ``SpeculationConfig.chain``.

    Returns:
        a new dict; ``lengths`` itself is not changed.

    Raises:
        nothing: a tier without stats or histogram is left as it is.
    """
    out = dict(lengths)
    if len(chain) < 2 or chain[0][0] != "ngram":
        return out
    name = chain[1][0]
    t = acceptance.get(name) or {}
    empty = t.get("forward_passes", 0) - t.get("prefill_passes", 0) - t.get("verifications", 0)
    if empty > 0 and out.get(name):
        out[name] = [out[name][0] + empty] + list(out[name][1:])
    return out


def _summarize(res: dict, runs: list[dict]) -> None:
    """Fill one method's result from its timed runs (metrics, spread, tokens, acceptance)."""
    per = [rep_metrics(r["times"]) for r in runs]
    res["reps"] = per
    for key in ("mean_time_between_tokens_ms", "tokens_per_second", "time_to_first_token_s"):
        res[key] = spread([p[key] for p in per])
    res["generated_tokens"] = [len(r["tokens"]) for r in runs]
    res["token_ids"] = [r["tokens"] for r in runs]
    if any("prompt_cache" in r for r in runs):  # --prompt-cache: tokens loaded from a file, file written, per run
        res["prompt_cache"] = [r.get("prompt_cache") for r in runs]
    stats = [r["stats"] for r in runs if r.get("stats")]
    if stats:
        res["acceptance"] = aggregate_tiers([s["tiers"] for s in stats]) or None
        res["step_seconds"] = step_seconds([s["tiers"] for s in stats])
        res["engine_prefill_seconds"] = [s["prefill_seconds"] for s in stats]
        res["engine_mean_time_between_tokens_ms"] = [s["mean_time_between_tokens_ms"] for s in stats]
        autos = [s["auto"] for s in stats if s.get("auto")]
        if autos:  # mode auto: the hierarchy it chose and how many tokens it decoded with it, per repetition
            res["auto"] = autos
        holds = [s.get("retrieval_holds_full_cache") for s in stats]
        if any(h is not None for h in holds):
            res["retrieval_holds_full_cache"] = holds


def _speedups(results: dict, ok: list[str]) -> None:
    for base, key in (("hf-ar", "speedup_vs_hf_ar"), ("autoregressive", "speedup_vs_autoregressive")):
        ref = results.get(base, {}).get("mean_time_between_tokens_ms", {}).get("median") if base in ok else None
        for m in ok:
            mine = results[m]["mean_time_between_tokens_ms"]["median"]
            results[m][key] = round(ref / mine, 4) if ref and mine else None
