"""The StreamingLLM cache (Xiao et al., arXiv 2309.17453): attention sinks + a recent window, the draft tiers' cache.

Its own module because it has its own position scheme (the sinks' distances are re-rotated) and, for CUDA graphs, a
fixed-shape attention over its whole capacity (``model/cudagraph.py``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..kernels.cpu import apply_rope
from .caches import MAX_GRAPH_TOKENS, CacheError, KVCache

if TYPE_CHECKING:  # the model imports the caches, never the reverse
    from ..model.config import ModelConfig


class StreamingCache(KVCache):
    """StreamingLLM cache (Xiao et al., arXiv 2309.17453): ``sink`` first tokens + a ``window`` of recent tokens.

    Policy: a query at position t attends to the sinks (positions < sink) and to the window (t - window, t].
    Evicted tokens are dropped from memory in batches; ``slack`` extra slots keep the tokens a rollback may still
    need (a rejected speculation block) and the block being written.

    Position scheme (StreamingLLM's, positions inside the cache): the cache is [sinks, window] with in-cache
    positions 0..sink+window-1 and the query last. Window keys then keep their true distance to the query
    (t - p), so they are stored rotated at their absolute positions and the query is rotated at t; only the sinks
    move: their distance becomes ``min(t, sink + window - 1) - p``, obtained by rotating the query a second time, at
    ``min(t, sink + window - 1)``, for the sink scores. A draft model trained on short contexts thus never sees a
    relative distance above ``sink + window - 1``, however long the prompt.

    Args:
        cfg: the draft model's configuration.
        sink: attention-sink tokens kept (>= 0).
        window: recent tokens kept (>= 1).
        slack: extra slots: at least the largest block written at once plus the deepest rollback.
        rope: the draft model's :class:`~triforce.model.rope.RotaryEmbedding` (re-rotates queries for the sinks).
        dtype, device, batch: storage.
        fixed_shape: attend over every slot (the ones a query may not see masked out) with the step's slot indices,
            mask and sink rotation in buffers refreshed in place, so that a CUDA graph can replay the forward
            (``model/cudagraph.py``; blocks of up to ``MAX_GRAPH_TOKENS`` tokens). The same attention up to the order
            of the softmax's sums.

    Raises:
        ValueError: sink < 0 or window < 1.
        CacheError: (rollback) the window tokens the next query needs were already dropped.
    """

    def __init__(self, cfg: ModelConfig, sink: int, window: int, slack: int, rope, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", batch: int = 1, fixed_shape: bool = False) -> None:
        if sink < 0:
            raise ValueError(f"draft_sink must be >= 0, got {sink}")
        if window < 1:
            raise ValueError(f"draft_window must be >= 1, got {window}")
        self.sink, self.window, self.slack, self.rope = sink, window, slack, rope
        self.groups = cfg.num_kv_groups
        self.capacity = sink + window + slack
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, self.capacity, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self.win_start = sink  # absolute position held by slot `sink`
        self.floor = 0  # no rollback below this position will be asked for
        # fixed_shape: per block length T, (slots (T,) int64, mask (g*T, capacity) bool, sink cos and sin (T, hs))
        self._step_buffers: dict[int, tuple[torch.Tensor, ...]] = {}
        self._fixed: tuple[torch.Tensor, ...] | None = None  # this forward's, when it attends over every slot
        self.cuda_graphs: dict | None = {} if fixed_shape else None  # captured forwards (model/cudagraph.py)

    def _slot(self, p: int) -> int:
        return p if p < self.sink else self.sink + p - self.win_start

    def begin_forward(self, positions: torch.Tensor) -> None:
        start, t = self._check_block(positions)
        end = start + t
        if self._slot(end - 1) >= self.capacity:  # drop window tokens no query or rollback can need
            keep_from = max(self.win_start, min(self.floor, start) - self.window)
            n_keep = start - keep_from
            if self.sink + n_keep + t > self.capacity:
                raise CacheError(f"StreamingLLM cache: a block of {t} tokens does not fit (capacity {self.capacity}, "
                                 f"{n_keep} window tokens still needed)")
            src = self._slot(keep_from)
            if src > self.sink and n_keep > 0:
                self.k[:, :, :, self.sink:self.sink + n_keep] = self.k[:, :, :, src:src + n_keep].clone()
                self.v[:, :, :, self.sink:self.sink + n_keep] = self.v[:, :, :, src:src + n_keep].clone()
            self.win_start = keep_from
        self._start, self._t = start, t
        dev = self.k.device
        n_sink = min(self.sink, end)
        self._n_sink = n_sink
        self._n_win = max(0, end - max(self.win_start, self.sink))
        win_pos = torch.arange(self.win_start, self.win_start + self._n_win, device=dev)
        sink_pos = torch.arange(n_sink, device=dev)
        q_pos = positions[:, None]
        sink_mask = sink_pos[None, :] <= q_pos  # (T, n_sink)
        win_mask = (win_pos[None, :] <= q_pos) & (win_pos[None, :] > q_pos - self.window)  # (T, n_win)
        # (g*T, n_sink + n_win): the g query heads of a KV head are stacked along time, as in gqa_attention
        self._mask = torch.cat([sink_mask, win_mask], dim=1).repeat(self.groups, 1)
        # query re-rotation for the sink scores: from t to min(t, sink + window - 1)
        sink_q_pos = torch.clamp(positions, max=self.sink + self.window - 1)
        self._sink_rope = self.rope.cos_sin(sink_q_pos, self.k.dtype) if n_sink else None
        self._slot_lo = self._slot(start)
        self._fixed = None
        if self.cuda_graphs is not None and t <= MAX_GRAPH_TOKENS:
            if t not in self._step_buffers:
                hs = self.k.shape[-1]
                self._step_buffers[t] = (torch.empty(t, dtype=torch.long, device=dev),
                                         torch.empty((self.groups * t, self.capacity), dtype=torch.bool, device=dev),
                                         *(torch.ones((t, hs), dtype=self.k.dtype, device=dev) for _ in range(2)))
            slots, mask, cos, sin = self._fixed = self._step_buffers[t]
            slots.copy_(torch.arange(self._slot_lo, self._slot_lo + t, device=dev))
            mask.zero_()[:, :n_sink + self._n_win] = self._mask
            if n_sink:
                cos.copy_(self._sink_rope[0])
                sin.copy_(self._sink_rope[1])

    def graph_key(self) -> tuple | None:
        """(T,) when this forward attends over every slot through the step buffers (``fixed_shape``), else None."""
        return None if self._fixed is None else (self._t,)

    def attend(self, layer, q, k, v, q_pre):
        t = self._t
        if self._fixed is not None:  # every slot, through this step's buffers (a CUDA graph replays it)
            slots, mask, *sink_rope = self._fixed
            self.k[layer].index_copy_(2, slots, k.to(self.k.dtype))
            self.v[layer].index_copy_(2, slots, v.to(self.v.dtype))
            ns, n = self.sink, self.capacity  # sink slots not yet filled are masked out
        else:
            self.k[layer, :, :, self._slot_lo:self._slot_lo + t] = k
            self.v[layer, :, :, self._slot_lo:self._slot_lo + t] = v
            # slots [0, ns) hold the sinks and [sink, sink + nw) the window; nw > 0 only once every sink is in
            # (ns == sink), so the visible keys and values are the contiguous slots [0, ns + nw): no copy
            ns, mask, sink_rope = self._n_sink, self._mask, self._sink_rope
            n = ns + self._n_win
        keys, vals = self.k[layer, :, :, :n], self.v[layer, :, :, :n]  # (B, nkv, n, hs)
        b, nh, _, hs = q.shape
        nkv = k.shape[1]
        g = nh // nkv
        scale = 1.0 / math.sqrt(hs)
        out_dtype, q, q_pre = q.dtype, q.to(self.k.dtype), q_pre.to(self.k.dtype)  # attend in the cache's dtype
        scores = q.reshape(b, nkv, g * t, hs) @ keys.transpose(-1, -2)  # (B, nkv, g*T, n)
        if ns:  # the sinks are scored by the query re-rotated at its in-cache position
            q_sink = apply_rope(q_pre, *sink_rope).reshape(b, nkv, g * t, hs)
            scores[..., :ns] = q_sink @ keys[:, :, :ns].transpose(-1, -2)
        scores = scores.float() * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = probs @ vals  # (B, nkv, g*T, hs)
        return out.view(b, nh, t, hs).to(out_dtype)

    def end_forward(self) -> None:
        self.length = self._start + self._t

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise CacheError(f"StreamingLLM cache: cannot roll back to {length} (length {self.length})")
        needed_from = max(self.sink, length - self.window + 1)
        if length > self.sink and self.win_start > needed_from:
            raise CacheError(f"StreamingLLM cache: cannot roll back to {length}: window tokens from {needed_from} "
                             f"were already dropped (kept from {self.win_start}); raise the cache's slack")
        self.length = length

    def skip_to(self, position: int) -> None:
        """Continue at ``position`` without the tokens before it past the sinks (they are never computed).

        For a long prompt only the sinks and the last tokens matter to a StreamingLLM cache: the window keeps the
        most recent ``window`` tokens, whose keys and values depend on earlier tokens only through the windowed
        attention of the layers below. Skipping the middle of the prompt changes a drafter's proposals slightly, its
        exactness not at all (the tier above verifies every token). Nothing below ``position`` can be rolled back to.

        Raises:
            CacheError: ``position`` before the current length, or the sinks not yet filled.
        """
        if position < self.length or self.length < min(self.sink, position):
            raise CacheError(f"StreamingLLM cache: cannot skip to {position} (length {self.length}, "
                             f"{self.sink} sinks)")
        self.length = self.win_start = self.floor = position

    def visible_positions(self, query_position: int) -> list[int]:
        """Positions a query at ``query_position`` (== length) would attend to, excluding itself (for tests)."""
        t = query_position
        sinks = list(range(min(self.sink, self.length)))
        lo = max(self.win_start, self.sink, t - self.window + 1)
        return sinks + list(range(lo, self.length))

    def key_at(self, layer: int, position: int) -> torch.Tensor:
        """Stored key (B, nkv, hs) of ``position`` in ``layer`` (for tests)."""
        return self.k[layer, :, :, self._slot(position)]

