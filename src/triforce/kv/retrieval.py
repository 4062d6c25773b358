"""TriForce's retrieval KV cache (arXiv 2404.11912, Sec. 4.1): the middle tier's cache and its selection rules.

Its own module because it builds from the full cache (:mod:`triforce.kv.caches`) and holds the selection rules.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..kernels.cpu import gqa_attention_kernel, merge_attention
from ..kernels.sdpa import gqa_attention
from .caches import MAX_GRAPH_TOKENS, CacheError, FullKVCache, KVCache

if TYPE_CHECKING:  # the model imports the caches, never the reverse
    from ..model.config import ModelConfig

CHUNK_SCORES = ("mean", "max", "bound", "attn")
#: recent prompt positions the ``attn`` rule always keeps (ranked right after chunk 0), StreamingLLM/Quest style
ATTN_RECENT = 64
#: recorded verifier queries (ending at the selection point) the ``attn`` rule scores with
ATTN_QUERY_WINDOW = 8


def recent_queries(full: FullKVCache, position: int, window: int) -> torch.Tensor:
    """The verifier's post-RoPE queries of positions (position - window, position] recorded in its last forward.

    Only positions of the last forward are available (``FullKVCache.record_queries``), so fewer than ``window`` may
    come back; ``position`` itself must be there.

    Args:
        full: the verifier's full cache, recording queries.
        position: the newest query's absolute position.
        window: most queries wanted (>= 1).

    Returns:
        (L, B, nh, W, hs) in the model dtype, W = min(window, position - full.query_start + 1), oldest first.

    Raises:
        CacheError: queries were not recorded, or ``position`` was not in the last forward (from ``query_at``).
        ValueError: window < 1.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    full.query_at(position)  # raises CacheError when the position is not recorded
    i = position - full.query_start
    lo = max(0, i - window + 1)
    return torch.stack([q[:, :, lo:i + 1] for q in full.queries])


def attention_mass_scores(keys: torch.Tensor, queries: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """Per-token attention mass of a group of query heads: the ``attn`` rule's token score.

    score[t] = sum over the group's query heads h and the window's queries w of softmax_t(q_hw . k_t / sqrt(hs)),
    each softmax over the keys [0, n) visible to query w (keys at positions > the query's position are masked out,
    as causal attention would). Each query head thus weighs the same whatever the scale of its logits: massive
    activations on a few channels (q/k biases) cannot let one head's raw q . k dominate the group's ranking.
    The sum over heads is the mean recovery over the group's heads that a single position contributes, so ranking
    tokens by it maximises the group's mean attention recovery for these queries (Vegas / SparseSpec style
    selection from the verifier's own attention).

    Args:
        keys: (..., n, hs) post-RoPE keys of positions [0, n) (fp32 recommended).
        queries: (..., Q, hs) post-RoPE queries: the g heads x W window queries of one KV head, flattened as
            (head, window) in that order; same leading dims as ``keys``.
        query_positions: (Q,) int64 absolute position of each query (a key j is visible to a query at p iff j <= p).

    Returns:
        (..., n) float32, non-negative; sums to Q when every query sees at least one key.
    """
    hs = keys.shape[-1]
    logits = torch.matmul(queries.float(), keys.float().transpose(-1, -2)) / math.sqrt(hs)  # (..., Q, n)
    n = keys.shape[-2]
    visible = torch.arange(n, device=keys.device)[None, :] <= query_positions.to(keys.device)[:, None]  # (Q, n)
    if not bool(visible.all()):
        logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1).sum(-2)


class RetrievalCache(KVCache):
    """TriForce's retrieval-based KV cache (arXiv 2404.11912, Sec. 4.1): the middle tier's cache.

    Policy, for a committed sequence of length n built at length ``build_len`` (n >= build_len):

    * **Selection** (at build): the full cache's positions [0, build_len) are cut into chunks of ``chunk_size``.
      For each layer and KV head, chunk c scores ``sum_{query heads h of the group} q_h . mean(K_c)``
      with q the post-RoPE query of the last token (position build_len, supplied by the caller). Chunk 0 (the
      attention sink) is always kept. Tokens are ranked by their chunk's score (ties by position) and the first
      ``budget`` fill slots 0, 1, ... in that order; with fewer tokens than the budget the rest stay empty.
    * **Generated tokens** (positions >= build_len) take slots from the end: position p -> slot
      ``budget - 1 - (p - build_len)``, overwriting the lowest-ranked selected tokens, so the cache never exceeds
      the budget. Their KV is the tier's own until :meth:`sync_from_full` replaces it with the verifier's exact KV.
    * **Rollback** to n restores the slots of positions >= n to the selected tokens they held (re-gathered from
      the full cache).

    Every key keeps its absolute RoPE position; queries are rotated at their true positions.

    Args:
        cfg: model configuration (the target's).
        full: the target's full cache (source of keys/values and of the build query).
        budget: slots per layer and KV head (counts chunk 0, the selected chunks and generated tokens).
        chunk_size: tokens per chunk.
        dtype: storage dtype (None: the full cache's); a cheaper one costs no exactness, the verifier decides.
        score: how a chunk is scored, for each KV head, with the group's queries q_h:

            * ``mean`` (the paper's rule): ``sum_h q_h . mean(K_c)``;
            * ``max``: ``max_{k in c} sum_h q_h . k``, the chunk's best-matching key;
            * ``bound``: ``sum_h sum_d max(q_hd * min_c K_d, q_hd * max_c K_d)``, an upper bound of ``q_h . k`` from
              per-channel key minima and maxima (Quest, Tang et al., arXiv 2406.10774);
            * ``attn``: the attention mass the chunk holds, summed over the group's query heads (each head's softmax
              normalised on its own, :func:`attention_mass_scores`) and over a window of up to ``ATTN_QUERY_WINDOW``
              recorded queries; the last min(``ATTN_RECENT``, budget // 4) positions are always kept (after chunk 0).
              Built for GQA models with wide groups and q/k biases (Qwen2.5, Llama-3; docs/acceptance.md).

            With a window of queries (see :meth:`build`), ``mean``/``max``/``bound`` sum the score over the window.
        recent: positions [length - recent, length) are always kept, ranked right after chunk 0 (None:
            min(``ATTN_RECENT``, budget // 4) for ``attn``, 0 for the other scores).
        query_window: queries :meth:`build_from_full` scores with (None: ``ATTN_QUERY_WINDOW`` for ``attn``, 1 for the
            other scores, the paper's last-token query).

    Raises:
        ValueError: budget or chunk_size < 1, budget < chunk_size, or an unknown score (the names and values are
            in the message).
    """

    def __init__(self, cfg: ModelConfig, full: FullKVCache, budget: int, chunk_size: int, score: str = "mean",
                 dtype: torch.dtype | None = None, recent: int | None = None, query_window: int | None = None) -> None:
        if score not in CHUNK_SCORES:
            raise ValueError(f"chunk_score must be one of {', '.join(CHUNK_SCORES)}, got {score!r}")
        self.score = score
        if recent is None:
            recent = min(ATTN_RECENT, budget // 4) if score == "attn" else 0
        self.recent = int(recent)
        self.query_window = (ATTN_QUERY_WINDOW if score == "attn" else 1) if query_window is None else int(query_window)
        if self.recent < 0 or self.query_window < 1:
            raise ValueError(f"recent must be >= 0 and query_window >= 1, got {recent!r} and {query_window!r}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if budget < chunk_size:
            raise ValueError(f"budget must be >= chunk_size ({chunk_size}), got {budget}")
        self.cfg, self.full = cfg, full
        self.budget, self.chunk_size = budget, chunk_size
        L, B, nkv, _, hs = full.k.shape
        self.k = torch.zeros((L, B, nkv, budget, hs), dtype=dtype or full.k.dtype, device=full.device)
        self.v = torch.zeros_like(self.k)
        # selected source position per slot, -1 for an empty slot: (L, B, nkv, budget) int64
        self.selected = torch.full((L, B, nkv, budget), -1, dtype=torch.long, device=full.device)
        self.n_selected = 0  # slots filled by the selection
        self._gen_from = 0  # the first generated slot of the current forward (begin_forward)
        self.build_len = 0
        self.length = 0
        self.synced = 0  # positions [build_len, synced) hold the full cache's KV
        self.builds = 0
        # per block length T: (slot of each token (T,) int64, mask (T, budget) bool), refreshed in place by
        # begin_forward so that a CUDA graph of a forward reads this step's (graph_key; model/cudagraph.py)
        self._step_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.cuda_graphs: dict | None = {}  # model/cudagraph.py: this cache's captured forwards (None: off)

    @classmethod
    def reset_or_new(cls, previous: "RetrievalCache | None", cfg: ModelConfig, full: FullKVCache, budget: int,
                     chunk_size: int, score: str = "mean", dtype: torch.dtype | None = None) -> "RetrievalCache":
        """A cache for a new request: ``previous`` emptied and reading ``full`` where it was made with the same
        arguments for a full cache of the same layout (its buffers, and the CUDA graphs captured over them, are
        kept: ``model/cudagraph.py``), else a new one (same arguments and errors as the constructor)."""
        same = (previous is not None and previous.cfg is cfg and (previous.budget, previous.chunk_size, previous.score)
                == (budget, chunk_size, score) and previous.k.dtype == (dtype or full.k.dtype)
                and previous.k.device == full.device and previous.k.shape[:3] == full.k.shape[:3])
        if not same:
            return cls(cfg, full, budget, chunk_size, score, dtype)
        previous.full = full
        previous.n_selected = previous._gen_from = previous.build_len = previous.length = previous.synced = 0
        previous.builds = 0
        return previous

    @property
    def generation_capacity(self) -> int:
        """Generated tokens the cache can hold before chunk 0 would be overwritten."""
        return self.budget - min(self.chunk_size, self.n_selected)

    @property
    def holds_everything(self) -> bool:
        """True when every position the cache represents is in it (prompt shorter than the budget, no overwrite)."""
        return self.n_selected == self.build_len and self.length - self.build_len <= self.budget - self.n_selected

    def build_from_full(self, length: int) -> None:
        """:meth:`build` with the verifier's recorded queries ending at position ``length`` (``query_window`` of them,
        or as many as its last forward recorded): no extra forward.

        Raises:
            CacheError: the full cache did not record the query of position ``length``, or holds fewer positions.
        """
        self.build(length, self.selection_query(length))

    def selection_query(self, length: int) -> torch.Tensor:
        """The recorded verifier queries a selection at ``length`` scores with: (L, B, nh, hs) for a window of 1, else
        (L, B, nh, W, hs) (see :func:`recent_queries`).

        Raises:
            CacheError: the full cache did not record the query of position ``length``.
        """
        if self.query_window == 1:
            return self.full.query_at(length)
        return recent_queries(self.full, length, self.query_window)

    def build(self, length: int, query: torch.Tensor) -> None:
        """Select chunks from the full cache's positions [0, length) with ``query``, post-RoPE.

        ``query`` is (L, B, nh, hs), the query of position ``length`` (the paper's rule), or (L, B, nh, W, hs), the
        queries of positions [length - W + 1, length] (a window of recent queries, oldest first).

        After the build the cache represents positions [0, length) (``self.length = length``).

        Raises:
            CacheError: the full cache holds fewer than ``length`` positions.
        """
        if length > self.full.length:
            raise CacheError(f"retrieval build at {length} but the full cache holds {self.full.length}")
        if query.dim() == 4:
            query = query[:, :, :, None]
        L, B, nkv, _, hs = self.k.shape
        W = query.shape[3]
        qpos = torch.arange(length - W + 1, length + 1, device=self.k.device)
        self.selected.fill_(-1)
        m = min(self.budget, length)
        c = self.chunk_size
        n_chunks = math.ceil(length / c)
        pad = n_chunks * c - length
        for layer in range(L if length > 0 else 0):  # one layer at a time: fp32 scoring of one layer's keys
            dev = self.k.device  # the full cache may be offloaded to host memory: one layer at a time to the device
            keys = self.full.k[layer:layer + 1, :, :, :length].to(dev)  # (1, B, nkv, n, hs)
            qg = query[layer:layer + 1].float().reshape(1, B, nkv, -1, hs)  # (1, B, nkv, g*W, hs): (head, window)
            if self.score == "attn":
                mass = attention_mass_scores(keys, qg, qpos.repeat(qg.shape[3] // W))  # (1, B, nkv, n)
                mass = F.pad(mass, (0, pad)) if pad else mass
                scores = mass.reshape(1, B, nkv, n_chunks, c).sum(-1)
            else:
                scores = self._chunk_scores(keys.float(), qg, n_chunks, pad)  # (1, B, nkv, n_chunks)
            scores[..., 0] = float("inf")  # chunk 0, the attention sink, is always kept
            token_scores = scores.repeat_interleave(c, dim=-1)[..., :length]  # (1, B, nkv, n)
            if self.recent:
                token_scores[..., max(0, length - self.recent):] = float("inf")  # the recent window, after chunk 0
            order = torch.sort(token_scores, dim=-1, descending=True, stable=True).indices[..., :m]
            self.selected[layer:layer + 1, ..., :m] = order
            idx = order[..., None].expand(1, B, nkv, m, hs)
            self.k[layer:layer + 1, :, :, :m] = torch.gather(keys, 3, idx)
            values = self.full.v[layer:layer + 1, :, :, :length].to(dev)
            self.v[layer:layer + 1, :, :, :m] = torch.gather(values, 3, idx)
        self.n_selected = m
        self.build_len = self.length = self.synced = length
        self.builds += 1

    def _chunk_scores(self, keys: torch.Tensor, qg: torch.Tensor, n_chunks: int, pad: int) -> torch.Tensor:
        """Scores (L, B, nkv, n_chunks) of keys (L, B, nkv, n, hs) fp32 for queries qg (L, B, nkv, g, hs) fp32."""
        L, B, nkv, _, hs = keys.shape
        c = self.chunk_size
        if self.score == "max":
            qk = torch.einsum("lbkgd,lbknd->lbkn", qg, keys)  # (L, B, nkv, n): summed over the group's heads
            qk = F.pad(qk, (0, pad), value=float("-inf")) if pad else qk
            return qk.reshape(L, B, nkv, n_chunks, c).amax(-1)
        padded = F.pad(keys, (0, 0, 0, pad)) if pad else keys
        chunks = padded.reshape(L, B, nkv, n_chunks, c, hs)
        if self.score == "mean":
            counts = torch.full((n_chunks,), float(c), device=keys.device)
            counts[-1] = c - pad
            mean_keys = chunks.sum(4) / counts[:, None]  # (L, B, nkv, n_chunks, hs)
            return torch.einsum("lbkgd,lbkcd->lbkc", qg, mean_keys)  # sums over the group's query heads
        # bound: per-channel extremes of the chunk's keys (padding replaced by a real key of the chunk)
        if pad:
            chunks = chunks.clone()
            chunks[:, :, :, -1, c - pad:] = chunks[:, :, :, -1, :1]
        kmin, kmax = chunks.amin(4), chunks.amax(4)  # (L, B, nkv, n_chunks, hs)
        q = qg[:, :, :, :, None, :]  # (L, B, nkv, g, 1, hs)
        bound = torch.maximum(q * kmin[:, :, :, None], q * kmax[:, :, :, None]).sum(-1)  # (L, B, nkv, g, n_chunks)
        return bound.sum(3)

    def _slots(self, positions: torch.Tensor) -> torch.Tensor:
        return self.budget - 1 - (positions - self.build_len)

    def begin_forward(self, positions: torch.Tensor) -> None:
        start, t = self._check_block(positions)
        end = start + t
        if end - self.build_len > self.generation_capacity:
            raise CacheError(f"retrieval cache budget {self.budget} exhausted: {end - self.build_len} generated "
                             f"tokens since the last build; it must be rebuilt first")
        self._start, self._t = start, t
        if t > MAX_GRAPH_TOKENS:  # a long catch-up block: no graph, fresh tensors
            self._slot_idx, mask = self._slots(positions), torch.empty((t, self.budget), dtype=torch.bool,
                                                                      device=self.k.device)
        else:
            if t not in self._step_buffers:
                self._step_buffers[t] = (torch.empty(t, dtype=torch.long, device=self.k.device),
                                         torch.empty((t, self.budget), dtype=torch.bool, device=self.k.device))
            self._slot_idx, mask = self._step_buffers[t]
            self._slot_idx.copy_(self._slots(positions))
        gen_end = end - self.build_len  # generated tokens held once the block is written
        first_gen_slot = self.budget - gen_end
        self._gen_from = first_gen_slot  # generated slots [first_gen_slot, budget) hold positions up to `end`
        if t == 1 and self.n_selected >= first_gen_slot:
            self._mask = None  # every slot is filled and visible to the single query
            return
        slot = torch.arange(self.budget, device=self.k.device)
        q_pos = positions[:, None]  # (T, 1)
        gen_pos = self.build_len + (self.budget - 1 - slot)  # position held by a generated slot
        is_gen = slot >= first_gen_slot
        self._mask = mask.copy_(torch.where(is_gen[None, :], gen_pos[None, :] <= q_pos,
                                            (slot < self.n_selected)[None, :].expand(t, -1)))

    def graph_key(self) -> tuple | None:
        """(T, whether the block has a mask): the budget is fixed, and begin_forward refreshes the slot and mask
        buffers of each T in place (see :meth:`~triforce.kv.caches.KVCache.graph_key`); None above
        ``MAX_GRAPH_TOKENS`` tokens."""
        return (self._t, self._mask is None) if self._t <= MAX_GRAPH_TOKENS else None

    def one_query_rows(self):
        if self.k.shape[1] != 1:
            return None  # one sequence
        slot = self.budget - 1 - (self._start - self.build_len)  # the block's first token; the others below it
        if self._t == 1 and self._mask is None:  # one query over every slot: one range (what attend does)
            return self.k, self.v, slot, self.budget, None
        # a block (or empty slots between the selected and the generated ones): the selected slots every token
        # sees, the ones generated before the block, and the block's own causally (the mask of begin_forward)
        return self.k, self.v, slot, self.budget, min(self.n_selected, self._gen_from)

    def attend(self, layer, q, k, v, q_pre):
        self.k[layer][:, :, self._slot_idx] = k.to(self.k.dtype)
        self.v[layer][:, :, self._slot_idx] = v.to(self.v.dtype)
        if self._mask is None:  # one query over every slot: csrc/attention.c where it applies (fp32 or bf16, CPU)
            out = gqa_attention_kernel(q, self.k[layer], self.v[layer], self.budget)
            if out is not None:
                return out
        elif self._t == 1 and 0 < self.n_selected < self._gen_from:
            # one query, empty slots between the selected ones and the generated ones (a prompt shorter than the
            # budget): the kernel over each filled range, merged by their log-sum-exps, rather than SDPA over every
            # slot with a mask
            b, nh = q.shape[:2]
            lse_sel = torch.empty(b, nh, 1)
            lse_gen = torch.empty(b, nh, 1)
            k, v = self.k[layer], self.v[layer]
            sel = gqa_attention_kernel(q, k, v, self.n_selected, lse_sel)
            gen = None if sel is None else gqa_attention_kernel(q, k[:, :, self._gen_from:], v[:, :, self._gen_from:],
                                                                 self.budget - self._gen_from, lse_gen)
            if gen is not None:
                return merge_attention(sel, lse_sel, gen, lse_gen)
        return gqa_attention(q, self.k[layer], self.v[layer], self._mask)

    def end_forward(self) -> None:
        self.length = self._start + self._t

    def rollback(self, length: int) -> None:
        """Return to ``length`` (>= build_len): slots of positions >= length get their selected tokens back.

        Raises:
            CacheError: ``length`` is below the build point or above the current length.
        """
        if not self.build_len <= length <= self.length:
            raise CacheError(f"retrieval cache: cannot roll back to {length} (built at {self.build_len}, "
                             f"length {self.length})")
        if length < self.length:
            slots = self._slots(torch.arange(length, self.length, device=self.k.device))
            slots = slots[slots < self.n_selected]
            if slots.numel():
                L, B, nkv, _, hs = self.k.shape
                src = self.selected[..., slots]  # (L, B, nkv, ns)
                idx = src[..., None].expand(L, B, nkv, slots.numel(), hs).to(self.full.k.device)
                self.k[:, :, :, slots] = torch.gather(self.full.k, 3, idx).to(self.k.device, self.k.dtype)
                self.v[:, :, :, slots] = torch.gather(self.full.v, 3, idx).to(self.k.device, self.k.dtype)
        self.length = length
        self.synced = min(self.synced, length)

    def sync_from_full(self) -> None:
        """Replace the tier's own KV of generated tokens with the verifier's exact KV (TriForce reference behaviour).

        Copies positions [synced, min(length, full.length)) from the full cache into their slots.
        """
        end = min(self.length, self.full.length)
        if end > self.synced:
            pos = torch.arange(self.synced, end, device=self.k.device)
            slots = self._slots(pos)
            src = pos.to(self.full.k.device)
            self.k[:, :, :, slots] = self.full.k[:, :, :, src].to(self.k.device, self.k.dtype)
            self.v[:, :, :, slots] = self.full.v[:, :, :, src].to(self.k.device, self.k.dtype)
            self.synced = end
