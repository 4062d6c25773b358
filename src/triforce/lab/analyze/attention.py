"""``triforce analyze``: attention recovery and contextual locality (TriForce Sec. 3.1, 3.2) from recorded queries."""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import torch

from ...kv.caches import FullKVCache
from ...kv.retrieval import CHUNK_SCORES, RetrievalCache
from ...model.transformer import Transformer

ANALYSES = ("recovery", "locality", "acceptance")
ORACLE = "oracle"
PREFILL_CHUNK = 512
ACCEPTANCE_FACTORS = ("budget", "chunk_size", "temperature", "prompt_tokens")


# ---------------------------------------------------------------------------------------------------- core
def prefill_recorded(model: Transformer, ids: Sequence[int], extra_capacity: int = 0,
                     progress: Callable[[int], None] | None = None,
                     cache: FullKVCache | None = None) -> tuple[FullKVCache, torch.Tensor, torch.Tensor]:
    """Prefill ``ids`` into a full KV cache that records queries; returns it, the last query and logits.

    Args:
        model: the model (its RoPE is set for ``len(ids) + extra_capacity`` positions during the call and restored).
        ids: prompt token ids, P >= 2 of them.
        extra_capacity: positions to leave free after the prompt (tokens generated later into the same cache).
        progress: called with the number of tokens of each prefill chunk (512).
        cache: a full KV cache of at least ``P + extra_capacity`` positions already holding the KV of
            ``ids[:cache.length]`` (a :class:`~triforce.kv.promptcache.PromptCache` hit), ``cache.length < P``: only
            the rest is prefilled into it (the last token at least, whose query is recorded). None: a fresh cache.

    Raises:
        ValueError: ``cache`` too small or holding P or more positions.

    Returns:
        (full cache holding positions [0, P), post-RoPE query of position P - 1: (L, 1, nh, hs) in the model dtype,
        fp32 logits (V,) of position P - 1: the distribution of the first generated token).
    """
    cfg = model.cfg
    P = len(ids)
    saved_rope = model.rope
    try:
        model.set_request_length(P + extra_capacity)
        if cache is None:
            full, start = FullKVCache(cfg, P + extra_capacity, model.dtype, model.device, record_queries=True), 0
        else:
            if not cache.length < P <= cache.capacity - extra_capacity:
                raise ValueError(f"cache must hold fewer than the {P} prompt positions and have room for "
                                 f"{P + extra_capacity}, got length {cache.length}, capacity {cache.capacity}")
            full, start = cache, cache.length
            full.record_queries = True  # the queries of the forwards below (the last token's at least)
        for i in range(start, P, PREFILL_CHUNK):
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
