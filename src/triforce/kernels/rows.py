"""One rule on every path: a verifier row's value does not depend on how many tokens, rows or requests
share its forward, nor on which of our paths computes it.

Greedy equality of every speculative mode with autoregressive decoding needs a decode step (1 row) and its row of a
verification block (k rows) to round alike, and batch invariance needs a request's rows to round alike alone and
beside others. Our kernels compute each row in an order that does not depend on the other rows (``csrc/qlinear.c``:
one chain of FMAs per output; ``csrc/attention.c``: the same key chunks and order per query row, whatever the block;
``csrc/blockcodes.c``: bitwise ``qlinear.c`` over the dequantized weights), while PyTorch's products and SDPA pick
their kernels by shape (MKL's GEMV for one row, GEMM or oneDNN for several). So a forward whose cache says it holds
the verifier's decode steps or verification blocks (:meth:`~triforce.kv.caches.KVCache.exact_rows`: the full KV cache,
blocks of at most :data:`EXACT_MAX_BLOCK` tokens, on the CPU) runs inside :func:`exact_forward`, and there

* every fp32 product runs on our kernel whatever its rows (in one call up to ``kernels.F32_MAX_ROWS``; each row's
  value is the same whatever the other rows), any output width (the kernel's tail columns), on the AVX-512, the
  AVX2 and the portable build alike (a CPU with neither, or aarch64: plain C, one chain per output too), one row
  included (MKL's GEMV only with ``TRIFORCE_ONE_ROW_KERNEL=0``, an A/B switch that gives up the rule); where the
  kernel is off or unavailable, each row is its own PyTorch product, the call a decode step makes
  (:func:`~triforce.kernels.linear.linear_forward`);
* the full cache attends with ``csrc/attention.c`` (one call for the whole block), or, where that kernel is off,
  each row with its own SDPA call over the keys it sees, the call a decode step makes (:func:`rowwise_attention`);
* a model on block codes runs its layers in one ``csrc/decode_step.c`` call for a block of up to 64 tokens, and a
  batch's blocks in calls of whole blocks of at most 64 rows (``decode_step.DecodeStep``);
* a batch's forward holds either such blocks only or none (:func:`split_exact`): a prefill chunk that shares a round
  with decode steps runs as a forward of its own;
* a verification block longer than :data:`EXACT_MAX_BLOCK` tokens (``--gamma2`` 64 and up, ``--adaptive-gamma``
  past 63) runs as consecutive forwards of at most that many tokens (:func:`verify_forward`, which the verifier's
  tier calls for its blocks and its prompt's last tokens, not for its prefill chunks): each keeps the rule, so
  every gamma the options allow gives the decode steps' tokens;
* the prompt's last :data:`PREFILL_EXACT_TAIL` tokens never share a prefill chunk of more than
  :data:`EXACT_MAX_BLOCK` tokens: the verifier prefills the rest in chunks and then these tokens on these paths
  (:func:`prefill_forward_size`), so the first token's logits and those tokens' keys are what a request that
  reuses the prompt's KV (the engine's or the server's prefix cache, ``adopt_prefix``, a prompt-cache file) and
  feeds them again computes, in every mode: one more forward, of 8 rows, only for a prompt whose last chunk is
  that long.

Prefill chunks longer than :data:`EXACT_MAX_BLOCK` tokens and the tiers below the verifier keep the fastest paths
(their rounding changes no token: the verifier decides every token), which round a row by its chunk: a prompt that
extends a reused prefix (a chat's next turn) holds KV computed with other chunk boundaries than a fresh prefill's.
Measured costs: docs/performance.md, "Exactness paths: what they cost"; the claim's scope and its tests:
docs/architecture.md, "The exactness rule".
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable

import torch

from .sdpa import gqa_attention

#: longest block of one sequence (tokens in one forward) that runs on the row-invariant paths: decode steps and
#: verification blocks up to gamma 63 in one forward (``scheduling.SHORT_FORWARD_ROWS``), longer verification blocks
#: in pieces of at most this many (:func:`verify_forward`); longer forwards are prefill chunks, which keep SDPA and
#: PyTorch's products (docs/performance.md, "Exactness paths: what they cost")
EXACT_MAX_BLOCK = 64

#: the prompt's last tokens that the verifier's prefill runs on the row-invariant paths, apart from a longer chunk
#: (:func:`prefill_forward_size`): at least as many as any mode's prefix reuse feeds again (``ModelTier.refeed``: 1,
#: or the ``attn`` rule's query window, ``retrieval.ATTN_QUERY_WINDOW``), and the same in every mode, so that every
#: mode prefills a prompt alike (greedy equality) and any mode's reuse of its KV recomputes them as it did
PREFILL_EXACT_TAIL = 8

#: False turns the rule off, so that every forward takes the fastest paths by shape: for A/B
#: timings only (``bench/kernels/rows.py``); speculative modes then match autoregressive decoding in distribution
#: but may differ from it by a greedy near-tie
ROW_INVARIANT = True

_state = threading.local()


@contextmanager
def exact_forward(on: bool):
    """Run the enclosed forward with :func:`exact_rows` answering ``on`` (restored after, nested or not; per thread).

    Args:
        on: whether the forward's rows must be row-invariant (the verifier's decode steps and blocks); ignored
            (False) while :data:`ROW_INVARIANT` is False.
    """
    before = getattr(_state, "on", False)
    _state.on = bool(on) and ROW_INVARIANT
    try:
        yield
    finally:
        _state.on = before


def exact_rows() -> bool:
    """Whether the forward running in this thread must keep the rule (inside :func:`exact_forward`)."""
    return getattr(_state, "on", False)


def rowwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_keys: int) -> torch.Tensor:
    """The full cache's causal attention of a block that ends the sequence, each query row by its own SDPA call: row
    i (position n_keys - T + i) over keys [0, n_keys - T + i], the call a decode step at that position makes (where
    ``csrc/attention.c`` is off, so that a decode step and its row of a block round alike; T SDPA calls, each
    reading the keys it sees).

    Args:
        q: (B, nh, T, hs) queries after RoPE.
        k, v: (B, nkv, capacity, hs) one layer's cache, capacity >= n_keys >= T.
        n_keys: the cache length after this block's tokens were written.

    Returns:
        (B, nh, T, hs), q's dtype.
    """
    t = q.shape[2]
    start = n_keys - t
    return torch.cat([gqa_attention(q[:, :, i:i + 1].contiguous(), k[:, :, :start + i + 1], v[:, :, :start + i + 1],
                                    None) for i in range(t)], dim=2)


def split_exact(blocks: list[tuple], run: Callable[[list[tuple]], list[torch.Tensor]]) -> list[torch.Tensor]:
    """A ragged forward's blocks run as one forward, or as two where they mix blocks whose cache keeps the rule
    (:meth:`~triforce.kv.caches.KVCache.exact_rows`: the verifier's decode steps and verification blocks) with others
    (prefill chunks, a lower tier's blocks on the same model): each then runs on its own paths, at the cost of one
    more pass over the weights.

    Args:
        blocks: ``(input_ids (1, T_i), positions (T_i,), cache, num_logits)`` per sequence
            (:meth:`~triforce.model.transformer.Transformer.forward_ragged`'s argument).
        run: the ragged forward of blocks that all keep the rule or none does, called once per group.

    Returns:
        per block, in order, its logits, (1, num_logits or T_i, V).
    """
    flags = [cache.exact_rows(pos.numel()) for _, pos, cache, _ in blocks]
    if all(flags) or not any(flags):
        return run(blocks)
    out: list = [None] * len(blocks)
    for want in (True, False):
        index = [i for i, flag in enumerate(flags) if flag == want]
        for i, logits in zip(index, run([blocks[i] for i in index])):
            out[i] = logits
    return out


def verify_forward(forward: Callable[[list[int], int | None], torch.Tensor], cache, tokens: list[int],
                   num_logits: int | None) -> torch.Tensor:
    """The verifier's forward of a verification block (the pending token and the proposals, whatever gamma), on the
    row-invariant paths at any length: a block of more than :data:`EXACT_MAX_BLOCK` tokens through a
    cache that keeps the rule runs as consecutive forwards of at most that many tokens (sizes as equal as they go).
    Each piece keeps the rule, so each of its rows, and each key and value it writes, is bitwise what that token's
    decode step gives, and a later piece attends the earlier pieces' keys as a later decode step does: the block's
    logits are its decode steps' whatever gamma. Otherwise (a lower tier's cache, a block of at most
    :data:`EXACT_MAX_BLOCK` tokens, or :data:`ROW_INVARIANT` False) one forward. Prefill chunks do not come here:
    they keep the fast paths (a prompt's last tokens do, :func:`prefill_forward_size`). Under the scheduler each
    piece is a short forward that joins its model's batch.

    Args:
        forward: ``(tokens, num_logits) -> (n, V)`` fp32 logits of the last ``n`` = ``num_logits or len(tokens)``
            tokens, one forward that extends ``cache`` (``ModelTier._forward``).
        cache: the tier's cache (:meth:`~triforce.kv.caches.KVCache.exact_rows` says whether it keeps the rule); while
            a later piece runs, its ``join_queries`` is True, so that a full cache recording queries keeps the whole
            block's (the retrieval tier selects with any of its positions' queries).
        tokens: the block's token ids, T of them.
        num_logits: logits wanted for the last ``num_logits`` tokens (None: all T).

    Returns:
        (num_logits or T, V) fp32, as one ``forward(tokens, num_logits)`` returns them.

    Raises:
        whatever ``forward`` raises (``CacheError``: a block that does not fit); the cache then holds the pieces
        that ran, as after a forward that failed midway.
    """
    t = len(tokens)
    if t <= EXACT_MAX_BLOCK or not ROW_INVARIANT or not cache.exact_rows(1):
        return forward(tokens, num_logits)
    want = t if num_logits is None else min(num_logits, t)
    size = -(-t // -(-t // EXACT_MAX_BLOCK))  # ceil(T / pieces), pieces = ceil(T / EXACT_MAX_BLOCK)
    parts = []
    try:
        for a in range(0, t, size):
            b = min(t, a + size)
            keep = max(0, b - max(a, t - want))  # of this piece's rows, those among the last `want` of the block
            cache.join_queries = a > 0
            logits = forward(tokens[a:b], max(1, keep))
            parts.append(logits[logits.shape[0] - keep:])
    finally:
        cache.join_queries = False
    return torch.cat(parts)


def prefill_forward_size(cache, remaining: int, chunk: int, tail: int) -> int:
    """Tokens the verifier's next prefill forward holds: ``chunk``, except that a forward off the row-invariant
    paths (more than :data:`EXACT_MAX_BLOCK` tokens) stops before the prompt's last ``tail`` tokens, which then run
    on those paths (through :func:`verify_forward`, the caller's part). Prefix reuse feeds a reused prompt's last
    ``tail`` tokens again in one short forward (``ModelTier.refeed``: 1, or a retrieval rule's query window), so a
    fresh prefill must compute them, and the first token's logits, as such a forward does: a row of a long chunk
    rounds by the chunk's shape (MKL's or oneDNN's product, SDPA), and on a near tie the same prompt would give
    other greedy tokens the second time on one engine. The cost: one more forward of ``tail`` rows where the last
    chunk is long, none otherwise (a forward of up to :data:`EXACT_MAX_BLOCK` tokens keeps the rule whole).

    Args:
        cache: the verifier's cache (:meth:`~triforce.kv.caches.KVCache.exact_rows` says which forwards keep the rule;
            a cache that keeps none, a GPU's or a lower tier's, keeps ``chunk``).
        remaining: prompt tokens not yet fed, the prompt's last ones (>= 1).
        chunk: tokens the forward would hold (``scheduling.prefill_chunk``: the tier's chunk, or fewer beside
            running generations), >= 1.
        tail: the prompt's last tokens to keep on the row-invariant paths (the verifier:
            ``max(refeed, PREFILL_EXACT_TAIL)``; 0: none, a lower tier's prefill).

    Returns:
        tokens for the next forward, in [1, remaining]: ``min(chunk, remaining)`` unless that forward leaves the
        row-invariant paths and reaches into the tail, then ``remaining - tail``.
    """
    size = min(chunk, remaining)
    if tail < 1 or remaining <= tail or not ROW_INVARIANT or cache.exact_rows(size) or not cache.exact_rows(1):
        return size
    return min(size, remaining - tail)
