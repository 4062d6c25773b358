"""The paper's analyses on a real model and real text: ``triforce analyze`` (TriForce, arXiv 2404.11912, Sec. 3).

Three analyses, each a plain dict (JSON-ready) and a PNG chart:

* **Attention recovery** (Sec. 3.1, Fig. 2, "attention sparsity"): the share of the last prompt token's attention
  mass that falls on the positions a retrieval cache of ``budget`` slots keeps, per layer, for each chunk score
  (``mean``: the paper's q . mean key; ``max``; ``bound``: Quest's) and for the ``oracle`` (the best individual
  tokens of each query head).
* **Contextual locality** (Sec. 3.2): the recovery, over the next generated tokens, of the chunks chosen once at the
  last prompt token, against chunks re-chosen with each token's own query (the reference line).
* **Acceptance** (Sec. 4.1, tier 1): the acceptance rate of mode ``retrieval`` (the target over a retrieval cache
  drafting for the target over its full cache) against budget, chunk size, temperature and context length.

Definitions shared by the first two (the same as ``bench/recovery.py`` always used):

* queries and keys are post-RoPE, exactly as the model's attention receives them (``FullKVCache(record_queries=
  True)``); attention probabilities are recomputed in float64 from them;
* the query at position q attends over keys [0, q); its own key, present in every cache, is left out of both the
  kept and the total mass;
* the chunk selection is ``RetrievalCache.build`` itself, run at length n = P - 1 (P prompt tokens) with the last
  prompt token's query, as the engine builds it. Its ranking does not depend on the budget (a budget keeps the first
  ``min(budget, n)`` ranked positions), so one build at the largest budget serves every budget;
* recovery of a query head = sum of its softmax over the kept keys; reported values are means over query heads
  (and layers, where said).

The ``triforce analyze`` subcommand (:func:`add_analyze_parser`, :func:`cmd_analyze`) runs the three on a model and
books and writes ``recovery.json/.png``, ``locality.json/.png`` and ``acceptance.json/.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from .caches import CHUNK_SCORES, FullKVCache, RetrievalCache
from .model import Transformer

ANALYSES = ("recovery", "locality", "acceptance")
ORACLE = "oracle"
PREFILL_CHUNK = 512
DEFAULT_BOOKS = ("pg1342", "pg84", "pg2701")
DEFAULT_BOOKS_DIR = Path("..") / "shared" / "data" / "books"
ACCEPTANCE_FACTORS = ("budget", "chunk_size", "temperature", "prompt_tokens")


# ---------------------------------------------------------------------------------------------------- prompts
def resolve_book(name: str, books_dir: str | os.PathLike = DEFAULT_BOOKS_DIR) -> Path:
    """The file of a book given as a path, or as a name in ``books_dir`` (``pg1342`` or ``pg1342.txt``).

    Raises:
        FileNotFoundError: neither ``name`` nor ``books_dir/name[.txt]`` is a file (the places tried are in the message).
    """
    tried = [Path(name), Path(books_dir) / name, Path(books_dir) / f"{name}.txt"]
    for p in tried:
        if p.is_file():
            return p
    raise FileNotFoundError(f"book {name!r} not found (tried {', '.join(str(p) for p in tried)})")


def book_prompt(tokenizer: Any, path: str | os.PathLike, n: int) -> list[int]:
    """The first ``n`` tokens of a book, Project Gutenberg header and footer removed, no chat template.

    Tokenizes a character prefix of the text (doubling it until it yields at least n + 64 tokens), so only the
    tokens near the cut could differ from tokenizing the whole book, and those are dropped.

    Args:
        tokenizer: a transformers tokenizer.
        path: the book's text file (UTF-8; undecodable bytes replaced).
        n: tokens wanted (>= 1).

    Returns:
        list of ``n`` int token ids (with the tokenizer's special tokens at the start, if it adds any).

    Raises:
        ValueError: the book has fewer than ``n`` tokens (its name and token count are in the message).
    """
    from .prompts import strip_gutenberg

    text = strip_gutenberg(Path(path).read_text(encoding="utf-8", errors="replace"))
    chars = 8 * n
    while True:
        ids = tokenizer(text[:chars], verbose=False)["input_ids"]
        if len(ids) >= n + 64 or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n:
        raise ValueError(f"{Path(path).name} has only {len(ids)} tokens after stripping, fewer than {n}")
    return [int(t) for t in ids[:n]]


# ---------------------------------------------------------------------------------------------------- core
def prefill_recorded(model: Transformer, ids: Sequence[int], extra_capacity: int = 0,
                     progress: Callable[[int], None] | None = None) -> tuple[FullKVCache, torch.Tensor, torch.Tensor]:
    """Prefill ``ids`` into a fresh full KV cache that records queries; returns it, the last query and logits.

    Args:
        model: the model (its RoPE is set for ``len(ids) + extra_capacity`` positions during the call and restored).
        ids: prompt token ids, P >= 2 of them.
        extra_capacity: positions to leave free after the prompt (tokens generated later into the same cache).
        progress: called with the number of tokens of each prefill chunk (512).

    Returns:
        (full cache holding positions [0, P), post-RoPE query of position P - 1: (L, 1, nh, hs) in the model dtype,
        fp32 logits (V,) of position P - 1: the distribution of the first generated token).
    """
    cfg = model.cfg
    P = len(ids)
    saved_rope = model.rope
    try:
        model.set_request_length(P + extra_capacity)
        full = FullKVCache(cfg, P + extra_capacity, model.dtype, model.device, record_queries=True)
        for i in range(0, P, PREFILL_CHUNK):
            chunk = list(ids[i:i + PREFILL_CHUNK])
            logits = model(torch.tensor([chunk], device=model.device),
                           torch.arange(i, i + len(chunk), device=model.device), full, num_logits=1)
            if progress is not None:
                progress(len(chunk))
    finally:
        model.rope = saved_rope
    return full, full.query_at(P - 1).clone(), logits[0, -1]


def attention_probs(full: FullKVCache, query: torch.Tensor, length: int) -> torch.Tensor:
    """Softmax attention of ``query`` over the keys of positions [0, length), as the model computes it.

    The scores q . k / sqrt(hs) are computed in fp32 (as the model's attention does on CPU), the softmax in float64,
    so sums of kept probabilities (recovery) carry no fp32 rounding.

    Args:
        full: full KV cache holding at least ``length`` positions (keys post-RoPE).
        query: (L, B, nh, hs) post-RoPE query (any float dtype), e.g. :meth:`FullKVCache.query_at`.
        length: keys [0, length) (the query's own key, at position ``length``, is left out).

    Returns:
        (L, B, nkv, g, length) float64, each row summing to 1; g = nh // nkv query heads per KV head.

    Raises:
        ValueError: ``length`` < 1 or above the cache's length.
    """
    if not 1 <= length <= full.length:
        raise ValueError(f"length must be in [1, {full.length}] (the cache's length), got {length}")
    L, B, nh, hs = query.shape
    nkv = full.k.shape[2]
    qg = query.float().reshape(L, B, nkv, nh // nkv, hs)
    keys = full.k[:, :, :, :length].float()  # (L, B, nkv, length, hs); no copy for an fp32 cache
    logits = torch.matmul(qg, keys.transpose(-1, -2)) / math.sqrt(hs)  # (L, B, nkv, g, length)
    return torch.softmax(logits.double(), -1)


def chunk_ranking(model: Transformer, full: FullKVCache, query: torch.Tensor, length: int, chunk_size: int,
                  score: str = "mean", max_budget: int | None = None,
                  cache: RetrievalCache | None = None) -> torch.Tensor:
    """The retrieval cache's ranked positions (chunk 0 first), from ``RetrievalCache.build`` itself.

    Args:
        model: the model whose config the cache uses.
        full: full KV cache holding at least ``length`` positions.
        query: (L, B, nh, hs) post-RoPE query the chunks are scored with (the query of position ``length``).
        length: positions [0, length) are ranked.
        chunk_size: tokens per chunk (>= 1).
        score: chunk score, one of ``mean`` (TriForce Sec. 4.1), ``max``, ``bound`` (Quest, arXiv 2406.10774).
        max_budget: rank only the first ``max_budget`` positions (None: all ``length``).
        cache: a :class:`RetrievalCache` over ``full`` to (re)build instead of allocating one (repeated rankings);
            its budget, chunk size and score are used.

    Returns:
        (L, B, nkv, m) int64 positions, m = min(max_budget, length): the first min(b, length) are what a cache of
        budget b selects (the ranking is budget-independent).

    Raises:
        ValueError: bad ``chunk_size``, ``score`` or ``max_budget`` (from :class:`RetrievalCache`).
    """
    budget = length if max_budget is None else min(max_budget, length)
    if cache is None:
        cache = RetrievalCache(model.cfg, full, max(budget, chunk_size), chunk_size, score)
    cache.build(length, query)
    return cache.selected[..., :min(budget, cache.n_selected)].clone()


def _kept_mass(probs: torch.Tensor, ranking: torch.Tensor) -> torch.Tensor:
    """Cumulative mass (L, B, nkv, g, m) of the first 1..m ranked positions; ranking (L,B,nkv,m) or (L,B,nkv,g,m)."""
    if ranking.dim() == probs.dim() - 1:
        ranking = ranking[:, :, :, None, :].expand(*probs.shape[:4], ranking.shape[-1])
    return torch.gather(probs, -1, ranking).cumsum(-1)


def _at(cum: torch.Tensor, k: int) -> torch.Tensor:
    """Mass of the first k ranked positions from a cumulative sum (k = 0: zero)."""
    k = min(k, cum.shape[-1])
    return cum[..., k - 1] if k > 0 else torch.zeros(cum.shape[:-1], dtype=cum.dtype)


def recovery_at_query(model: Transformer, full: FullKVCache, query: torch.Tensor, length: int,
                      budgets: Sequence[int], chunk_size: int,
                      scores: Sequence[str] = CHUNK_SCORES + (ORACLE,)) -> dict[str, dict[int, list[float]]]:
    """Attention recovery per layer of a retrieval cache's selection (TriForce Sec. 3.1, Fig. 2).

    For each chunk score and budget b, the kept positions are the first min(b, length) of :func:`chunk_ranking`
    (what ``RetrievalCache.build`` keeps); ``oracle`` keeps each query head's min(b, length) most attended positions.

    Args:
        model, full: the model and a full cache holding at least ``length`` positions.
        query: (L, B, nh, hs) post-RoPE query of position ``length`` (the last prompt token: length = P - 1).
        length: keys [0, length).
        budgets: retrieval budgets (slots per layer and KV head), each >= chunk_size.
        chunk_size: tokens per chunk.
        scores: any of ``mean``, ``max``, ``bound``, ``oracle``.

    Returns:
        ``{score: {budget: [recovery of layer 0, ..., layer L-1]}}``, each value in [0, 1], mean over query heads
        (and batch); exactly 1 (up to float64 rounding) when b >= length.

    Raises:
        ValueError: an unknown score, or a budget below chunk_size.
    """
    for s in scores:
        if s not in CHUNK_SCORES + (ORACLE,):
            raise ValueError(f"scores must be among {', '.join(CHUNK_SCORES + (ORACLE,))}, got {s!r}")
    for b in budgets:
        if b < chunk_size:
            raise ValueError(f"budgets must each be >= chunk_size ({chunk_size}), got {b}")
    probs = attention_probs(full, query, length)
    out: dict[str, dict[int, list[float]]] = {}
    for s in scores:
        if s == ORACLE:
            cum = probs.sort(-1, descending=True).values.cumsum(-1)
        else:
            cum = _kept_mass(probs, chunk_ranking(model, full, query, length, chunk_size, s, max(budgets)))
        out[s] = {b: _at(cum, min(b, length)).mean(dim=(1, 2, 3)).tolist() for b in budgets}
    return out


def locality_after_prompt(model: Transformer, full: FullKVCache, query: torch.Tensor, logits: torch.Tensor,
                          prompt_ids: Sequence[int], budgets: Sequence[int], new_tokens: int, chunk_size: int,
                          score: str = "mean", eos_ids: Iterable[int] = (),
                          progress: Callable[[int], None] | None = None, reselect_every: int = 1) -> dict:
    """Contextual locality (TriForce Sec. 3.2): recovery of the prompt-time selection over the generated tokens.

    Generates ``new_tokens`` tokens greedily with the full cache (the model directly, argmax of fp32 logits, stopping
    after an EOS), recording each one's post-RoPE query. Step s is the query at position q = n + s, with n = P - 1
    the last prompt token (step 0) and steps 1..S the generated tokens. At step s, for budget b:

    * keys are [0, q) (the query's own key left out, as in :func:`recovery_at_query`);
    * kept = the positions generated since the build, [n, q), plus the first ``min(b, n) - max(0, s - (b - min(b,
      n)))`` ranked prompt positions: generated tokens take slots from the end of the budget, overwriting the
      lowest-ranked selected positions once the free slots are used, as :class:`RetrievalCache` does;
    * ``fixed``: the ranking chosen at step 0 with the last prompt token's query (what the engine uses);
      ``reselected``: the prompt positions re-ranked with step s's own query (the reference line), at the steps
      that are multiples of ``reselect_every`` (None at the others: a re-ranking costs a ``RetrievalCache.build``);
    * a step past the cache's generation capacity (``b - min(chunk_size, min(b, n))`` generated tokens, where the
      engine would rebuild) is None.

    At step 0 both equal :func:`recovery_at_query` for the same selection.

    Args:
        model: the model; ``full`` its full cache after :func:`prefill_recorded` with ``extra_capacity >= new_tokens``.
        query: (L, 1, nh, hs) the last prompt token's query (from :func:`prefill_recorded`).
        logits: (V,) the last prompt token's logits (from :func:`prefill_recorded`).
        prompt_ids: the P prompt token ids in ``full``.
        budgets: retrieval budgets (each >= chunk_size).
        new_tokens: tokens to generate (>= 1).
        chunk_size, score: as in :func:`chunk_ranking`.
        eos_ids: generation stops after one of these.
        progress: called with 1 after each step.
        reselect_every: compute the re-chosen reference at every this many steps (>= 1).

    Returns:
        dict with ``tokens`` (generated ids), ``steps`` (number of steps, S + 1), ``generated_share`` (per step,
        mean over layers and heads: attention mass on [n, q)), ``fixed`` and ``reselected`` (``{budget: [per-step
        recovery, mean over layers and heads, or None]}``), ``fixed_per_layer`` and ``reselected_per_layer``
        (``{budget: [per-layer recovery, mean over the valid steps >= 1]}``; None if no step >= 1 is valid).

    Raises:
        ValueError: new_tokens < 1, a budget below chunk_size, or a cache too small for the tokens.
    """
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    if reselect_every < 1:
        raise ValueError(f"reselect_every must be >= 1, got {reselect_every}")
    for b in budgets:
        if b < chunk_size:
            raise ValueError(f"budgets must each be >= chunk_size ({chunk_size}), got {b}")
    P = len(prompt_ids)
    n = P - 1
    if full.length != P or full.capacity < P + new_tokens:
        raise ValueError(f"the full cache must hold the {P} prompt tokens with room for {new_tokens} more "
                         f"(length {full.length}, capacity {full.capacity})")
    eos = set(int(e) for e in eos_ids)
    b_max = max(budgets)
    ranker = RetrievalCache(model.cfg, full, max(min(b_max, n), chunk_size), chunk_size, score)  # rebuilt each step
    fixed_rank = chunk_ranking(model, full, query, n, chunk_size, score, b_max, ranker)
    steps_q = [query]
    tokens: list[int] = []
    saved_rope = model.rope
    try:
        model.set_request_length(full.capacity)  # as in prefill_recorded (only dynamic NTK depends on it)
        for i in range(new_tokens):
            tok = int(logits.argmax())
            tokens.append(tok)
            if tok in eos:
                break  # the EOS ends generation: no query of it is ever used
            pos = P + i
            logits = model(torch.tensor([[tok]], device=model.device), torch.tensor([pos], device=model.device),
                           full)[0, -1]
            steps_q.append(full.query_at(pos).clone())
    finally:
        model.rope = saved_rope

    def kept_prompt(b: int, s: int) -> int | None:
        m = min(b, n)
        if s + 1 > b - min(chunk_size, m) and s > 0:
            return None  # past the generation capacity: the engine would have rebuilt the cache
        return m - max(0, s - (b - m))

    fixed: dict[int, list] = {b: [] for b in budgets}
    resel: dict[int, list] = {b: [] for b in budgets}
    fixed_layer: dict[int, list] = {b: [] for b in budgets}
    resel_layer: dict[int, list] = {b: [] for b in budgets}
    gen_share: list[float] = []
    for s, q in enumerate(steps_q):
        length = n + s
        probs = attention_probs(full, q, length)  # (L, B, nkv, g, length)
        generated = probs[..., n:].sum(-1)  # (L, B, nkv, g): the positions generated since the build
        gen_share.append(float(generated.mean()))
        cum_fixed = _kept_mass(probs[..., :n], fixed_rank)
        cum_resel = None
        if s % reselect_every == 0:
            cum_resel = cum_fixed if s == 0 else _kept_mass(
                probs[..., :n], chunk_ranking(model, full, q, n, chunk_size, score, b_max, ranker))
        for b in budgets:
            k = kept_prompt(b, s)
            for cum, agg, per_layer in ((cum_fixed, fixed, fixed_layer), (cum_resel, resel, resel_layer)):
                if k is None or cum is None:
                    agg[b].append(None)
                    continue
                rec = _at(cum, k) + generated  # (L, B, nkv, g)
                agg[b].append(float(rec.mean()))
                if s > 0:
                    per_layer[b].append(rec.mean(dim=(1, 2, 3)))
        if progress is not None:
            progress(1)

    def layer_means(d: dict[int, list]) -> dict[int, list[float] | None]:
        return {b: (torch.stack(v).mean(0).tolist() if v else None) for b, v in d.items()}

    return {"tokens": tokens, "steps": len(steps_q), "generated_share": gen_share, "fixed": fixed,
            "reselected": resel, "fixed_per_layer": layer_means(fixed_layer),
            "reselected_per_layer": layer_means(resel_layer)}


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


def run_acceptance(engine: Any, prompt_ids: Sequence[int], points: Sequence[dict], new_tokens: int, gamma2: int = 6,
                   top_p: float = 0.9, chunk_score: str = "mean", seed: int = 0,
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
    from .engine import SpeculationConfig
    from .sampling import SamplingParams

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
    lines = ["| factor | value | acceptance (mean) | min | max | tokens/verification |", "|---|---:|---:|---:|---:|---:|"]
    for f, rows in summary.items():
        for r in rows:
            lines.append(f"| {f} | {r['value']} | {r['acceptance_rate_mean']:.3f} | {r['acceptance_rate_min']:.3f} | "
                         f"{r['acceptance_rate_max']:.3f} | {r['mean_tokens_per_verification_mean']:.2f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- CLI
def add_analyze_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``triforce analyze`` to the ``triforce`` subcommands; returns its parser."""
    p = subparsers.add_parser(
        "analyze", help="the paper's analyses on a model and books: attention recovery, contextual locality, "
                        "acceptance (JSON + PNG)",
        description="TriForce's analyses (arXiv 2404.11912, Sec. 3) on a real model and books: (i) attention "
                    "recovery of the retrieval cache's chunks per layer against budget, (ii) contextual locality "
                    "over the generated tokens, (iii) the retrieval tier's acceptance rate against budget, chunk "
                    "size, temperature and context length. Writes NAME.json and NAME.png per analysis into --out.")
    m = p.add_argument_group("model")
    m.add_argument("--model", help="Hugging Face folder, .gguf file or hub id (default: the embedded SmolLM2-135M-"
                                   "Instruct)")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights and KV dtype")
    m.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1)")
    m.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    d = p.add_argument_group("data")
    d.add_argument("--books", nargs="+", default=list(DEFAULT_BOOKS),
                   help=f"book names in --books-dir (pg1342 or pg1342.txt) or paths (default: {' '.join(DEFAULT_BOOKS)})")
    d.add_argument("--books-dir", default=str(DEFAULT_BOOKS_DIR), help=f"folder of books (default {DEFAULT_BOOKS_DIR})")
    d.add_argument("--prompt-tokens", type=int, default=7500,
                   help="prompt: the first N tokens of each book (Gutenberg header stripped) (7500)")
    d.add_argument("--new-tokens", type=int, default=256, help="locality: tokens generated per book (256)")
    a = p.add_argument_group("analyses")
    a.add_argument("--analyses", nargs="+", choices=ANALYSES, default=list(ANALYSES), help="which analyses (all)")
    a.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048],
                   help="retrieval budgets: recovery, locality and the acceptance budget sweep (256 512 1024 2048)")
    a.add_argument("--chunk-size", type=int, default=8, help="chunk size of recovery and locality, and the acceptance "
                                                             "sweeps' base (8)")
    a.add_argument("--chunk-score", default="mean", choices=list(CHUNK_SCORES),
                   help="chunk score of locality and acceptance (recovery reports every score) (mean)")
    a.add_argument("--reselect-every", type=int, default=8,
                   help="locality: compute the re-chosen reference line every N steps (8; 1 = every step)")
    a.add_argument("--chunk-sizes", type=int, nargs="+", default=[4, 8, 16, 32],
                   help="acceptance: chunk sizes swept (4 8 16 32)")
    a.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6, 1.0],
                   help="acceptance: temperatures swept, 0 = greedy (0 0.6 1.0)")
    a.add_argument("--lengths", type=int, nargs="+",
                   help="acceptance: context lengths (prompt tokens) swept (default: 2048 and 4096 when below "
                        "--prompt-tokens, and --prompt-tokens)")
    a.add_argument("--base-budget", type=int, default=1024, help="acceptance: budget of the other sweeps (1024)")
    a.add_argument("--base-temperature", type=float, default=0.6,
                   help="acceptance: temperature of the other sweeps (0.6); their chunk size is --chunk-size and "
                        "their length --prompt-tokens")
    a.add_argument("--top-p", type=float, default=0.9, help="acceptance: nucleus mass at temperatures > 0 (0.9)")
    a.add_argument("--gamma2", type=int, default=6, help="acceptance: tokens the retrieval tier proposes per "
                                                         "verification (6)")
    a.add_argument("--acceptance-tokens", type=int, default=128, help="acceptance: tokens generated per run (128)")
    a.add_argument("--seed", type=int, default=0, help="acceptance: seed of every run (0)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="analysis", help="output folder for the JSON and PNG files (analysis)")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _command_line(args: argparse.Namespace) -> str:
    """A ``triforce analyze`` command line that reruns with the same settings."""
    parts = ["triforce analyze"]
    if args.model:
        parts.append(f"--model {args.model}")
    parts += [f"--books {' '.join(args.books)}", f"--prompt-tokens {args.prompt_tokens}",
              f"--new-tokens {args.new_tokens}", f"--analyses {' '.join(args.analyses)}",
              f"--budgets {' '.join(map(str, args.budgets))}", f"--chunk-size {args.chunk_size}"]
    if args.chunk_score != "mean":
        parts.append(f"--chunk-score {args.chunk_score}")
    if "locality" in args.analyses:
        parts.append(f"--reselect-every {args.reselect_every}")
    if "acceptance" in args.analyses:
        parts += [f"--chunk-sizes {' '.join(map(str, args.chunk_sizes))}",
                  f"--temperatures {' '.join(f'{t:g}' for t in args.temperatures)}",
                  f"--lengths {' '.join(map(str, args.lengths))}", f"--base-budget {args.base_budget}",
                  f"--base-temperature {args.base_temperature:g}", f"--top-p {args.top_p:g}",
                  f"--gamma2 {args.gamma2}", f"--acceptance-tokens {args.acceptance_tokens}", f"--seed {args.seed}"]
    if args.dtype != "float32":
        parts.append(f"--dtype {args.dtype}")
    if args.threads is not None:
        parts.append(f"--threads {args.threads}")
    parts.append(f"--out {args.out}")
    return " ".join(parts)


def check_analyze_args(args: argparse.Namespace) -> tuple[list[Path], list[dict]]:
    """Check every ``triforce analyze`` option before anything is loaded; fills defaults (``--lengths``).

    Returns:
        (the book files, the acceptance points (empty without the acceptance analysis)).

    Raises:
        CLIError: the first bad option, named, with the allowed values.
    """
    from .cli import CLIError
    from .engine import SpeculationConfig
    from .loading import parse_device
    from .sampling import SamplingParams

    if args.threads is not None:
        limit = 4 * (os.cpu_count() or 1)
        if not 1 <= args.threads <= limit:
            raise CLIError(f"--threads must be between 1 and {limit} (4x this machine's {os.cpu_count()} CPUs), "
                           f"got {args.threads}")
    try:
        parse_device(args.device)
    except ValueError as e:
        raise CLIError("--" + str(e)) from e
    if args.prompt_tokens < 2:
        raise CLIError(f"--prompt-tokens must be an integer >= 2 (a query and at least one key), got {args.prompt_tokens}")
    if args.new_tokens < 1:
        raise CLIError(f"--new-tokens must be an integer >= 1, got {args.new_tokens}")
    if args.chunk_size < 1:
        raise CLIError(f"--chunk-size must be an integer >= 1, got {args.chunk_size}")
    if args.reselect_every < 1:
        raise CLIError(f"--reselect-every must be an integer >= 1, got {args.reselect_every}")
    args.analyses = [x for x in ANALYSES if x in args.analyses]
    args.budgets = sorted(set(args.budgets))
    if args.budgets[0] < args.chunk_size:
        raise CLIError(f"--budgets must each be >= --chunk-size ({args.chunk_size}), got {args.budgets[0]}")
    books = []
    for name in args.books:
        try:
            books.append(resolve_book(name, args.books_dir))
        except FileNotFoundError as e:
            raise CLIError(f"--books: {e}") from e
    points: list[dict] = []
    if args.lengths is None:
        args.lengths = [n for n in (2048, 4096) if n < args.prompt_tokens] + [args.prompt_tokens]
    args.lengths = sorted(set(args.lengths))
    args.chunk_sizes = sorted(set(args.chunk_sizes))
    args.temperatures = sorted(set(args.temperatures))
    if "acceptance" in args.analyses:
        if args.acceptance_tokens < 1:
            raise CLIError(f"--acceptance-tokens must be an integer >= 1, got {args.acceptance_tokens}")
        if args.lengths[0] < 2:
            raise CLIError(f"--lengths must each be an integer >= 2, got {args.lengths[0]}")
        if not 0 < args.top_p <= 1:
            raise CLIError(f"--top-p must be in (0, 1], got {args.top_p}")
        if not 0 <= args.seed < 2**63:
            raise CLIError(f"--seed must be an integer in [0, 2**63), got {args.seed}")
        for opt, values in (("--temperatures", args.temperatures), ("--base-temperature", [args.base_temperature])):
            for t in values:
                try:
                    SamplingParams(temperature=t, top_p=args.top_p)
                except ValueError as e:
                    raise CLIError(f"{opt}: {e}") from e
        base = {"budget": args.base_budget, "chunk_size": args.chunk_size, "temperature": args.base_temperature,
                "prompt_tokens": args.prompt_tokens}
        points = acceptance_points(args.budgets, args.chunk_sizes, args.temperatures, args.lengths, base)
        for pt in points:
            try:
                SpeculationConfig(mode="retrieval", budget=pt["budget"], chunk_size=pt["chunk_size"],
                                  gamma2=args.gamma2, chunk_score=args.chunk_score)
            except ValueError as e:
                opt = {"budget": "--budgets" if "budget" in pt["sweeps"] else "--base-budget",
                       "chunk_size": "--chunk-sizes", "gamma2": "--gamma2"}
                name = next((k for k in opt if str(e).startswith(k)), None)
                where = opt[name] if name else "--budgets/--chunk-sizes/--gamma2"
                if name == "budget" and "chunk_size" in pt["sweeps"] and "budget" not in pt["sweeps"]:
                    where = "--chunk-sizes"  # a large chunk size against the base budget
                raise CLIError(f"{where}: at budget {pt['budget']}, chunk size {pt['chunk_size']}: {e}") from e
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise CLIError(f"--out {args.out!r}: {e.strerror}") from e
    return books, points


def _provenance(model: Transformer, source: str) -> dict:
    import subprocess

    try:
        root = Path(__file__).resolve().parents[2]
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except Exception:
        commit = None
    cfg = model.cfg
    return {"model": source, "layers": cfg.num_hidden_layers, "query_heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "dtype": str(model.dtype).split(".")[-1],
            "device": str(model.device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "git_commit": commit}


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def cmd_analyze(args: argparse.Namespace) -> int:
    """``triforce analyze``: check the options, load the model and books, run the analyses, write JSON + PNG.

    Returns:
        0 (PNG charts skipped with a message when matplotlib is missing).

    Raises:
        CLIError, ModelLoadError, ValueError: reported by :func:`triforce.cli.main` as one line, exit status 2.
    """
    from tqdm import tqdm

    from .cli import CLIError
    from .loading import load_model

    books, points = check_analyze_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    out = Path(args.out)
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    model, cfg = lm.model, lm.model.cfg
    context = cfg.max_position_embeddings
    if cfg.rope_type != "dynamic":
        if "locality" in args.analyses and args.prompt_tokens + args.new_tokens > context:
            raise CLIError(f"--prompt-tokens {args.prompt_tokens} + --new-tokens {args.new_tokens} exceeds the model's "
                           f"context of {context} tokens")
        if args.prompt_tokens > context:
            raise CLIError(f"--prompt-tokens {args.prompt_tokens} exceeds the model's context of {context} tokens")
        if points and max(args.lengths) + args.acceptance_tokens > context:
            raise CLIError(f"--lengths {max(args.lengths)} + --acceptance-tokens {args.acceptance_tokens} exceeds the "
                           f"model's context of {context} tokens")
    need = max([args.prompt_tokens] + (args.lengths if points else []))
    prompts = {}
    for path in books:
        try:
            prompts[path.stem] = book_prompt(lm.tokenizer, path, need)
        except ValueError as e:
            raise CLIError(f"--books: {e} (--prompt-tokens / --lengths)") from e
    meta = dict(command=_command_line(args), books=list(prompts), prompt_tokens=args.prompt_tokens,
                chunk_size=args.chunk_size, provenance=_provenance(model, lm.source))
    title = f"{Path(lm.source).name}, {len(prompts)} books"
    quiet = args.no_progress
    written: list[str] = []

    def save(name: str, data: dict, plot: Callable[[], None]) -> None:
        _write_json(out / f"{name}.json", data)
        written.append(str(out / f"{name}.json"))
        try:
            plot()
            written.append(str(out / f"{name}.png"))
        except PlotUnavailable as e:
            print(f"triforce: {name}.png skipped: {e}", file=sys.stderr)

    if {"recovery", "locality"} & set(args.analyses):
        rec_books: dict[str, dict] = {}
        loc_books: dict[str, dict] = {}
        for book, ids in prompts.items():
            ids = ids[:args.prompt_tokens]
            t0 = time.perf_counter()
            extra = args.new_tokens if "locality" in args.analyses else 0
            with tqdm(total=len(ids), unit="tok", desc=f"{book} prefill", disable=quiet, file=sys.stderr,
                      leave=False) as bar:
                full, query, logits = prefill_recorded(model, ids, extra, bar.update)
            n = len(ids) - 1
            if "recovery" in args.analyses:
                rec_books[book] = recovery_at_query(model, full, query, n, args.budgets, args.chunk_size)
            if "locality" in args.analyses:
                with tqdm(total=args.new_tokens + 1, unit="step", desc=f"{book} locality", disable=quiet,
                          file=sys.stderr, leave=False) as bar:
                    loc_books[book] = locality_after_prompt(model, full, query, logits, ids, args.budgets,
                                                            args.new_tokens, args.chunk_size, args.chunk_score,
                                                            lm.eos_ids, bar.update, args.reselect_every)
            del full
            if not quiet:
                tqdm.write(f"{book}: recovery/locality done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        sub = f"{title}, {args.prompt_tokens}-token prompts, chunk size {args.chunk_size}"
        if rec_books:
            summary = summarize_recovery(rec_books)
            data = dict(meta, analysis="attention recovery (TriForce Sec. 3.1, Fig. 2)", budgets=args.budgets,
                        scores=list(CHUNK_SCORES) + [ORACLE],
                        definition="share of the last prompt token's attention mass over positions [0, P-1) on the "
                                   "positions kept: the first min(budget, P-1) of RetrievalCache.build's ranking "
                                   "(chunk scores) or each query head's most attended positions (oracle); mean over "
                                   "query heads, then layers and books",
                        **summary, per_book=rec_books)
            save("recovery", data, lambda: plot_recovery(summary, out / "recovery.png", sub))
            print("attention recovery (mean over books, layers, heads)\n" + recovery_table(summary) + "\n")
        if loc_books:
            lsum = summarize_locality(loc_books)
            data = dict(meta, analysis="contextual locality (TriForce Sec. 3.2)", budgets=args.budgets,
                        chunk_score=args.chunk_score, new_tokens=args.new_tokens,
                        reselect_every=args.reselect_every,
                        definition="step s = query at position P-1+s (step 0: last prompt token, steps >= 1: the "
                                   "greedy tokens generated with the full cache); recovery = its attention mass over "
                                   "[0, P-1+s) on the positions generated since P-1 plus the ranked prompt positions "
                                   "that still have a slot (generated tokens take slots from the end of the budget); "
                                   "fixed: ranking chosen at step 0, reselected: re-ranked with step s's own query "
                                   "(every reselect_every steps, None between); "
                                   "None past the cache's generation capacity (the engine would rebuild)",
                        **lsum, per_book=loc_books)
            save("locality", data, lambda: plot_locality(lsum, out / "locality.png",
                                                         f"{sub}, chunk score {args.chunk_score}",
                                                         args.reselect_every))
            print("contextual locality: recovery fixed at the prompt / re-chosen each step (mean over books)\n"
                  + locality_table(lsum) + "\n")
    if points:
        from .engine import Engine

        engine = Engine(model, eos_ids=lm.eos_ids)
        records: list[dict] = []
        with tqdm(total=len(points) * len(prompts), unit="run", desc="acceptance", disable=quiet,
                  file=sys.stderr) as bar:
            for book, ids in prompts.items():
                for r in run_acceptance(engine, ids, points, args.acceptance_tokens, args.gamma2, args.top_p,
                                        args.chunk_score, args.seed, bar.update):
                    records.append(dict(book=book, **r))
        base = {"budget": args.base_budget, "chunk_size": args.chunk_size, "temperature": args.base_temperature,
                "prompt_tokens": args.prompt_tokens}
        asum = summarize_acceptance(records, base)
        data = dict(meta, analysis="tier-1 acceptance (mode retrieval, TriForce Sec. 4.1)", base=base,
                    gamma2=args.gamma2, top_p=args.top_p, chunk_score=args.chunk_score, seed=args.seed,
                    new_tokens=args.acceptance_tokens,
                    definition="acceptance rate = accepted / proposed tokens at the full-cache target's "
                               "verifications of the retrieval tier's gamma2-token proposals (recovered and bonus "
                               "tokens not counted); each sweep varies one factor, the others at the base",
                    summary=asum, records=records)
        save("acceptance", data, lambda: plot_acceptance(asum, records, out / "acceptance.png",
                                                         f"{title}, mode retrieval, gamma2 {args.gamma2}; base: "
                                                         f"budget {args.base_budget}, chunk size {args.chunk_size}, "
                                                         f"T {args.base_temperature:g}, {args.prompt_tokens} tokens"))
        print("acceptance of the retrieval tier (mean over books)\n" + acceptance_table(asum) + "\n")
    print(f"wrote {', '.join(written)} in {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return 0
