"""TriForce's retrieval KV cache (arXiv 2404.11912, Sec. 4.1): the middle tier's cache and its selection rules.

Moved out of :mod:`triforce.caches` (which still re-exports :class:`RetrievalCache` and ``CHUNK_SCORES`` lazily, so
``from triforce.caches import RetrievalCache`` keeps working).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .caches import CacheError, FullKVCache, KVCache, gqa_attention
from .config import ModelConfig

CHUNK_SCORES = ("mean", "max", "bound")


class RetrievalCache(KVCache):
    """TriForce's retrieval-based KV cache (arXiv 2404.11912, Sec. 4.1): the middle tier's cache.

    Policy, for a committed sequence of length n built at length ``build_len`` (n >= build_len):

    * **Selection** (at build): the full cache's positions [0, build_len) are cut into chunks of
      ``chunk_size``. For each layer and KV head, chunk c scores ``sum_{query heads h of the group} q_h . mean(K_c)``
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
              per-channel key minima and maxima (Quest, Tang et al., arXiv 2406.10774).

    Raises:
        ValueError: budget or chunk_size < 1, budget < chunk_size, or an unknown score (the names and values are
            in the message).
    """

    def __init__(self, cfg: ModelConfig, full: FullKVCache, budget: int, chunk_size: int, score: str = "mean",
                 dtype: torch.dtype | None = None) -> None:
        if score not in CHUNK_SCORES:
            raise ValueError(f"chunk_score must be one of {', '.join(CHUNK_SCORES)}, got {score!r}")
        self.score = score
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
        self.build_len = 0
        self.length = 0
        self.synced = 0  # positions [build_len, synced) hold the full cache's KV
        self.builds = 0

    @property
    def generation_capacity(self) -> int:
        """Generated tokens the cache can hold before chunk 0 would be overwritten."""
        return self.budget - min(self.chunk_size, self.n_selected)

    @property
    def holds_everything(self) -> bool:
        """True when every position the cache represents is in it (prompt shorter than the budget, no overwrite)."""
        return self.n_selected == self.build_len and self.length - self.build_len <= self.budget - self.n_selected

    def build(self, length: int, query: torch.Tensor) -> None:
        """Select chunks from the full cache's positions [0, length) with ``query`` (L, B, nh, hs), post-RoPE.

        After the build the cache represents positions [0, length) (``self.length = length``).

        Raises:
            CacheError: the full cache holds fewer than ``length`` positions.
        """
        if length > self.full.length:
            raise CacheError(f"retrieval build at {length} but the full cache holds {self.full.length}")
        L, B, nkv, _, hs = self.k.shape
        self.selected.fill_(-1)
        m = min(self.budget, length)
        c = self.chunk_size
        n_chunks = math.ceil(length / c)
        pad = n_chunks * c - length
        for layer in range(L if length > 0 else 0):  # one layer at a time: fp32 scoring of one layer's keys
            dev = self.k.device  # the full cache may be offloaded to host memory: one layer at a time to the device
            keys = self.full.k[layer:layer + 1, :, :, :length].to(dev)  # (1, B, nkv, n, hs)
            qg = query[layer:layer + 1].float().reshape(1, B, nkv, -1, hs)  # (1, B, nkv, g, hs)
            scores = self._chunk_scores(keys.float(), qg, n_chunks, pad)  # (1, B, nkv, n_chunks)
            scores[..., 0] = float("inf")  # chunk 0, the attention sink, is always kept
            token_scores = scores.repeat_interleave(c, dim=-1)[..., :length]  # (1, B, nkv, n)
            order = torch.sort(token_scores, dim=-1, descending=True, stable=True).indices[..., :m]
            self.selected[layer:layer + 1, ..., :m] = order
            idx = order[..., None].expand(1, B, nkv, m, hs)
            self.k[layer:layer + 1, :, :, :m] = torch.gather(keys, 3, idx)
            self.v[layer:layer + 1, :, :, :m] = torch.gather(self.full.v[layer:layer + 1, :, :, :length].to(dev), 3, idx)
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
        self._slot_idx = self._slots(positions)
        gen_end = end - self.build_len  # generated tokens held once the block is written
        first_gen_slot = self.budget - gen_end
        if t == 1 and self.n_selected >= first_gen_slot:
            self._mask = None  # every slot is filled and visible to the single query
            return
        slot = torch.arange(self.budget, device=self.k.device)
        q_pos = positions[:, None]  # (T, 1)
        gen_pos = self.build_len + (self.budget - 1 - slot)  # position held by a generated slot
        is_gen = slot >= first_gen_slot
        self._mask = torch.where(is_gen[None, :], gen_pos[None, :] <= q_pos, (slot < self.n_selected)[None, :].expand(t, -1))

    def attend(self, layer, q, k, v, q_pre):
        self.k[layer][:, :, self._slot_idx] = k.to(self.k.dtype)
        self.v[layer][:, :, self._slot_idx] = v.to(self.v.dtype)
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
