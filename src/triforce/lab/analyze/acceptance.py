"""``triforce analyze``: the retrieval tier's acceptance against budget, chunk size, temperature, context length."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ...defaults import DEFAULTS
from .attention import ACCEPTANCE_FACTORS


# ---------------------------------------------------------------------------------------------------- acceptance
def acceptance_points(budgets: Sequence[int], chunk_sizes: Sequence[int], temperatures: Sequence[float],
                      lengths: Sequence[int], base: dict) -> list[dict]:
    """The runs of the acceptance analysis: one sweep per factor, the other factors held at ``base``.

    Args:
        budgets, chunk_sizes, temperatures, lengths: the values swept (context length = prompt tokens).
        base: ``{"budget", "chunk_size", "temperature", "prompt_tokens"}``, the point the other sweeps hold fixed.

    Returns:
        distinct points, each ``{"budget", "chunk_size", "temperature", "prompt_tokens", "sweeps": [factor, ...]}``
        (the base point belongs to every sweep whose list holds its value), ordered by prompt length (so that one
        engine with prefix reuse prefills each book once), then budget, chunk size and temperature.
    """
    points: dict[tuple, dict] = {}
    for factor, values in zip(ACCEPTANCE_FACTORS, (budgets, chunk_sizes, temperatures, lengths)):
        for v in values:
            p = dict(base, **{factor: v})
            key = tuple(p[f] for f in ACCEPTANCE_FACTORS)
            points.setdefault(key, dict(p, sweeps=[]))["sweeps"].append(factor)
    order = sorted(points, key=lambda k: (k[3], k[0], k[1], k[2]))
    return [points[k] for k in order]


def run_acceptance(engine: Any, prompt_ids: Sequence[int], points: Sequence[dict], new_tokens: int,
                   gamma2: int = DEFAULTS["gamma2"], top_p: float = DEFAULTS["top_p"],
                   chunk_score: str = DEFAULTS["chunk_score"], seed: int = 0,
                   progress: Callable[[int], None] | None = None) -> list[dict]:
    """Tier-1 acceptance rate of mode ``retrieval`` at each point (TriForce Sec. 4.1).

    Each run: ``Engine.generate(prompt_ids[:prompt_tokens], mode="retrieval")``: the target over a retrieval cache
    (``budget``, ``chunk_size``, ``chunk_score``, selected at the last prompt token) proposes ``gamma2`` tokens, the
    target over its full cache verifies them by speculative sampling.

    Args:
        engine: a :class:`~triforce.engine.Engine` (prefix reuse on: the prompt is prefilled once for all points).
        prompt_ids: token ids, at least the longest ``prompt_tokens`` of the points.
        points: from :func:`acceptance_points`.
        new_tokens: tokens generated per run.
        gamma2: tokens the retrieval tier proposes per verification.
        top_p: nucleus mass at temperatures > 0 (1.0 under greedy decoding).
        chunk_score: ``mean``, ``max`` or ``bound``.
        seed: the seed of every run (the same draws for every point).
        progress: called with 1 after each run.

    Returns:
        one record per point: the point, ``acceptance_rate`` (= accepted / proposed at the target's verifications,
        recovered and bonus tokens not counted; ``stats.tiers["target"]["acceptance_rate"]``),
        ``mean_tokens_per_verification``, ``proposed``, ``accepted``, ``verifications``, ``rebuilds``,
        ``generated_tokens``, ``finish_reason``, ``decode_seconds`` (s).

    Raises:
        ValueError: a point's configuration is invalid (e.g. budget < chunk_size + gamma2 + 2).
    """
    from ...engine import SpeculationConfig
    from ...speculation.sampling import SamplingParams

    out = []
    for p in points:
        spec = SpeculationConfig(mode="retrieval", budget=p["budget"], chunk_size=p["chunk_size"], gamma2=gamma2,
                                 chunk_score=chunk_score)
        t = p["temperature"]
        sampling = SamplingParams(temperature=t, top_p=top_p if t > 0 else 1.0)
        _, st = engine.generate(list(prompt_ids[:p["prompt_tokens"]]), max_new_tokens=new_tokens, sampling=sampling,
                                spec=spec, seed=seed)
        tgt = st.tiers["target"]
        out.append({k: v for k, v in p.items()} | {
            "acceptance_rate": tgt.get("acceptance_rate"),
            "mean_tokens_per_verification": tgt.get("mean_tokens_per_verification"),
            "proposed": tgt.get("proposed"), "accepted": tgt.get("accepted"),
            "verifications": tgt.get("verifications"), "rebuilds": st.tiers.get("retrieval", {}).get("rebuilds"),
            "generated_tokens": st.generated_tokens, "finish_reason": st.finish_reason,
            "decode_seconds": st.decode_seconds})
        if progress is not None:
            progress(1)
    return out
