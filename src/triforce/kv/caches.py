"""KV caches: which keys and values each speculation tier attends over.

Three policies, one interface (:class:`KVCache`):

* :class:`FullKVCache` every token; the verifier's (tier 2) cache. Static, preallocated for prompt + max_new_tokens
  + the largest speculation block + 1 (gpt-fast style), so rejected entries are simply overwritten and rollback is
  O(1).
* :class:`~triforce.kv.retrieval.RetrievalCache` a budget of slots filled from the full cache by chunk retrieval
  (TriForce, arXiv 2404.11912, Sec. 4.1): the target model with this cache is the middle tier (tier 1).
* :class:`~triforce.kv.streaming.StreamingCache` attention sinks + a recent window (StreamingLLM, arXiv 2309.17453): the
  tiny draft model's cache (tier 0).

Every cache stores keys after RoPE at their absolute positions, and every query is rotated at its true absolute
position, except for the StreamingLLM sinks (see :class:`~triforce.kv.streaming.StreamingCache`).

The model calls, for one forward of T tokens at positions ``positions`` (T,) int64::

    cache.begin_forward(positions)          # validates, computes the masks once
    for each layer: cache.attend(layer, q, k, v, q_pre)   # writes k/v, returns attention output
    cache.end_forward()                     # the cache now represents positions [0, positions[-1] + 1)

Shapes: q, q_pre (B, nh, T, hs); k, v (B, nkv, T, hs); output (B, nh, T, hs). GQA is computed without repeating
keys: the g = nh // nkv query heads of a KV head are stacked along the time axis, ``(B, nh, T, hs) -> (B, nkv, g*T,
hs)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from ..defaults import DTYPE_ALIASES
from ..kernels.cpu import gqa_attention_kernel
from ..kernels.rows import EXACT_MAX_BLOCK, rowwise_attention
from ..kernels.sdpa import gqa_attention, lower_right_attention

if TYPE_CHECKING:  # the model imports the caches, never the reverse
    from ..model.config import ModelConfig

#: longest block a cache offers a CUDA graph for (decode steps and verification blocks; prefill chunks run eagerly;
#: ``model/cudagraph.py``)
MAX_GRAPH_TOKENS = 16
#: every name a dtype option takes (:data:`~triforce.defaults.DTYPE_ALIASES`: float32, bfloat16, float16 and fp32,
#: bf16, fp16) -> its torch dtype; the one table of the command line and the Python API
KV_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, full) for name, full in DTYPE_ALIASES.items()}


class CacheError(RuntimeError):
    """A cache was asked for something its policy cannot provide (overflow, or a rollback past what it keeps)."""


def kv_bytes(cfg: ModelConfig, slots: int, dtype: torch.dtype, batch: int = 1) -> int:
    """Bytes of keys + values for ``slots`` positions in every layer: 2 * L * B * nkv * slots * hs * itemsize."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * slots * cfg.head_dim * itemsize


class KVCache(ABC):
    """Interface every cache implements (see the module docstring for the call protocol).

    Attributes:
        length: number of leading positions of the sequence this cache represents (tokens [0, length)).
    """

    length: int
    #: set by :func:`triforce.kernels.rows.verify_forward` while a later piece of a long verification block runs: a
    #: cache that records queries keeps the earlier pieces' too (:class:`FullKVCache`), as one forward would
    join_queries: bool = False

    @abstractmethod
    def begin_forward(self, positions: torch.Tensor) -> None:
        """Prepare a forward of T tokens at absolute ``positions`` (T,) int64; they must be ``length .. length+T-1``.

        Raises:
            CacheError: the positions are not contiguous with the cache, or they do not fit.
        """

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               q_pre: torch.Tensor) -> torch.Tensor:
        """Store k, v (B, nkv, T, hs) for ``layer`` and return attention of q (B, nh, T, hs) over the cache."""

    @abstractmethod
    def end_forward(self) -> None:
        """Finish the forward: the cache now holds the block's tokens too."""

    def exact_rows(self, t: int) -> bool:
        """Whether a forward of ``t`` tokens through this cache is the verifier's decode step or verification block,
        whose rows must not depend on the forward they share: the model then runs it inside
        :func:`triforce.kernels.rows.exact_forward`. False (the default): a lower tier's cache, whose rounding changes
        no token."""
        return False

    def one_query_rows(self) -> tuple[torch.Tensor, torch.Tensor, int, int, int | None] | None:
        """Where the forward begun by :meth:`begin_forward` may run every layer in one kernel call, or None.

        For a forward of one token (batch 1) whose query sees every row of ``k, v`` below ``n_keys``, or of a block
        of T tokens written at rows ``slot .. slot + T - 1`` whose token i sees rows ``j <= n_keys - T + i`` (the
        full cache's causal block, ``n_keys = slot + T``): returns ``(k, v, slot, n_keys, None)``, the
        (L, 1, nkv, capacity, hs) tensors the keys and values are written into and attended over
        (``decode_step.decode_layers``); ``(k, v, slot, n_keys, shared)`` for the retrieval cache's layout (token t
        at row ``slot - t``, rows [0, shared) and [slot + 1, n_keys) seen by every token; see ``decode_layers``).
        None (the default): the model calls :meth:`attend` layer by layer.
        """
        return None

    def graph_key(self) -> tuple | None:
        """For the forward begun by :meth:`begin_forward`: a key under which a CUDA graph of it may be replayed
        (``model/cudagraph.py``), or None (the default: its attention reads shapes or tensors that change between
        steps).

        A key promises that every :meth:`attend` of this forward, and of any later forward with the same key, reads
        and writes only tensors that keep their storage (the KV buffers, index and mask buffers refreshed in place)
        with the same shapes. A cache that gives keys holds its graphs in a ``cuda_graphs`` dict attribute."""
        return None

    def query_buffer(self) -> torch.Tensor | None:
        """Where a one-call forward (:meth:`one_query_rows`) writes every layer's rotated query, or None (the
        default: this cache keeps no queries)."""
        return None

    @abstractmethod
    def rollback(self, length: int) -> None:
        """Forget every token at position >= ``length`` (after a verification rejected them).

        Raises:
            CacheError: the cache cannot return to that length (see each policy).
        """

    def _check_block(self, positions: torch.Tensor) -> tuple[int, int]:
        start, t = int(positions[0]), positions.numel()
        if start != self.length or int(positions[-1]) != start + t - 1:
            raise CacheError(f"{type(self).__name__}: block positions {start}..{int(positions[-1])} do not continue "
                             f"the cache (length {self.length})")
        return start, t


class RaggedCache(KVCache):
    """Several sequences' caches behind one forward whose T axis holds their blocks one after another (ragged).

    :meth:`~triforce.model.transformer.Transformer.forward_ragged` concatenates the blocks of several sequences into
    (1, sum T_i); this cache hands each sequence's slice of the positions, queries, keys and values to that
    sequence's own cache and concatenates the attention outputs, so every sequence attends only over its own KV (the
    continuous-batching layout of vLLM's varlen attention, Kwon et al., arXiv 2309.06180, without the paging).

    Args:
        caches: one cache per sequence, in the order of the blocks.
        lengths: T_i, the tokens of each block (>= 1).

    Raises:
        ValueError: ``caches`` and ``lengths`` of different sizes, or a length below 1.
    """

    def __init__(self, caches: list[KVCache], lengths: list[int]) -> None:
        if len(caches) != len(lengths) or any(t < 1 for t in lengths):
            raise ValueError(f"lengths must be one positive block length per cache, got {lengths} for {len(caches)}")
        self.caches, self.lengths = caches, lengths
        self.bounds = [0]
        for t in lengths:
            self.bounds.append(self.bounds[-1] + t)
        self.length = 0  # not one sequence's: each cache keeps its own

    def _slices(self):
        return zip(self.caches, self.bounds[:-1], self.bounds[1:])

    def begin_forward(self, positions: torch.Tensor) -> None:  # positions: (sum T_i,)
        if positions.numel() != self.bounds[-1]:
            raise CacheError(f"ragged block: {positions.numel()} positions for blocks of {self.lengths} tokens")
        for cache, a, b in self._slices():
            cache.begin_forward(positions[a:b])

    def attend(self, layer, q, k, v, q_pre):  # q, q_pre (1, nh, sum T_i, hs); k, v (1, nkv, sum T_i, hs)
        return torch.cat([cache.attend(layer, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], q_pre[:, :, a:b])
                          for cache, a, b in self._slices()], dim=2)  # (1, nh, sum T_i, hs)

    def end_forward(self) -> None:
        for cache in self.caches:
            cache.end_forward()

    def exact_rows(self, t: int) -> bool:
        """Whether any sequence's block keeps the rule (``t``, the sum, is not used: each cache judges its own
        block; ``exact.split_exact`` gives such blocks forwards of their own)."""
        return any(cache.exact_rows(n) for cache, n in zip(self.caches, self.lengths))

    def segment_rows(self) -> list[tuple] | None:
        """Per sequence, ``(k, v, slot, n_keys, queries)`` of its cache's :meth:`~KVCache.one_query_rows` and
        :meth:`~KVCache.query_buffer`, for every layer of the forward in one call
        (``decode_step.decode_layers_ragged``); None unless every cache offers its full-cache layout."""
        rows = [cache.one_query_rows() for cache in self.caches]
        if any(r is None or r[4] is not None for r in rows):
            return None
        return [(k, v, slot, n_keys, cache.query_buffer()) for (k, v, slot, n_keys, _), cache in zip(rows, self.caches)]

    def rollback(self, length: int) -> None:
        raise CacheError("a ragged cache is rolled back through each sequence's own cache")


#: longest block (tokens per forward) the full KV cache attends with ``kernels.gqa_attention_kernel`` instead of SDPA
#: (where the kernel is available): decode steps and verification blocks
#: (:data:`~triforce.kernels.rows.EXACT_MAX_BLOCK`); longer blocks (prefill) use SDPA. A row's result does not depend on
#: the block it is in (same chunks, same order of operations), so a verification computes the logits a decode step
#: would.
KERNEL_MAX_BLOCK = EXACT_MAX_BLOCK


def _causal_offset_mask(start: int, t: int, total: int, device: torch.device) -> torch.Tensor:
    """(T, total) bool: query i (position start+i) sees key j iff j <= start + i."""
    q_pos = torch.arange(start, start + t, device=device)[:, None]
    return torch.arange(total, device=device)[None, :] <= q_pos


class FullKVCache(KVCache):
    """The full KV cache of one model: every position, preallocated, O(1) rollback.

    Layout: ``k, v`` of shape (L, B, nkv, capacity, hs), so one head's keys are contiguous for decode.

    **Offloading** (``offload=True``, TriForce Sec. 4.3 / Appendix: the full cache in host memory): ``k, v`` live in
    host memory (pinned when the device is CUDA) and hold every layer. The first ``on_chip_layers`` layers also stay
    on the device; the others are streamed to one of two device buffers layer by layer, the next offloaded layer
    being copied on a separate CUDA stream while the current one computes (double buffering). New keys and values
    are written to the device copy and to host memory. On a CPU device the same code runs, with synchronous copies
    into the buffers. Readers of ``k``/``v`` (the retrieval cache) always see every layer there.

    Args:
        cfg: model configuration.
        capacity: positions to preallocate (prompt + max_new_tokens + largest block + 1).
        dtype, device: storage dtype and the compute device.
        batch: B.
        record_queries: keep each layer's post-RoPE queries of the last forward (for building a retrieval cache; a
            verification block run in pieces, ``exact.verify_forward``, counts as one forward).
        offload: keep the cache in host memory and stream it to ``device`` (see above).
        on_chip_layers: with ``offload``, how many leading layers stay on the device (0 .. L; None: 0).

    Raises:
        ValueError: ``on_chip_layers`` outside [0, L].
        CacheError: (from :meth:`begin_forward`) a block that would go past ``capacity``.
    """

    def __init__(self, cfg: ModelConfig, capacity: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", batch: int = 1, record_queries: bool = False,
                 offload: bool = False, on_chip_layers: int | None = None) -> None:
        L = cfg.num_hidden_layers
        shape = (L, batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.device = torch.device(device)
        self.offload = bool(offload)
        self.on_chip_layers = L if not offload else (on_chip_layers or 0)
        if not isinstance(self.on_chip_layers, int) or not 0 <= self.on_chip_layers <= L:
            raise ValueError(f"on_chip_layers must be an integer in [0, {L}], got {on_chip_layers!r}")
        if not offload:
            self.k = torch.zeros(shape, dtype=dtype, device=self.device)
            self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        else:
            pin = self.device.type == "cuda"
            self.k = torch.zeros(shape, dtype=dtype, pin_memory=pin)  # host: every layer
            self.v = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            n_chip = self.on_chip_layers
            self._chip_k = torch.zeros((n_chip, *shape[1:]), dtype=dtype, device=self.device)
            self._chip_v = torch.zeros_like(self._chip_k)
            n_buf = min(2, L - n_chip)  # double buffer for the streamed layers
            self._buf_k = [torch.zeros(shape[1:], dtype=dtype, device=self.device) for _ in range(n_buf)]
            self._buf_v = [torch.zeros(shape[1:], dtype=dtype, device=self.device) for _ in range(n_buf)]
            self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            self._ready: dict[int, object] = {}  # layer -> CUDA event marking its prefetch complete
            self.streamed_bytes = 0  # host -> device bytes copied so far (for benchmarks)
        self.capacity = capacity
        self.length = 0
        self.record_queries = record_queries
        self.queries: list[torch.Tensor | None] = [None] * L  # each (B, nh, T, hs)
        self.query_start = -1  # absolute position of queries[l][:, :, 0]
        self.n_heads = cfg.num_attention_heads
        self._qbufs: dict[int, torch.Tensor] = {}  # the queries of one-call forwards, per block length (query_buffer)
        self._mask: torch.Tensor | None = None
        self._earlier: list[torch.Tensor] | None = None  # with join_queries: the earlier pieces' queries, per layer
        self.kernel_max_block = KERNEL_MAX_BLOCK

    def begin_forward(self, positions: torch.Tensor) -> None:
        start, t = self._check_block(positions)
        if start + t > self.capacity:
            raise CacheError(f"full KV cache overflow: {start + t} positions > capacity {self.capacity}")
        self._start, self._t = start, t
        self._mask = None if t == 1 else _causal_offset_mask(start, t, start + t, self.device)
        if self.record_queries:  # the next piece of a verification block (join_queries): the block's queries so far
            joined = (self.join_queries and self.queries[0] is not None
                      and start == self.query_start + self.queries[0].shape[2])
            self._earlier = [q.clone() for q in self.queries] if joined else None  # (B, nh, T0, hs) per layer
            if not joined:
                self.query_start = start
        if self.offload and self.on_chip_layers < self.k.shape[0]:
            self._prefetch(self.on_chip_layers)

    def _prefetch(self, layer: int) -> None:
        """Start copying ``layer``'s cached positions [0, start) from host memory into its device buffer."""
        n = self._start
        buf = (layer - self.on_chip_layers) % 2
        if self._stream is None:
            self._buf_k[buf][:, :, :n].copy_(self.k[layer, :, :, :n])
            self._buf_v[buf][:, :, :n].copy_(self.v[layer, :, :, :n])
        else:
            # the buffer may still be read by the attention of layer - 2, enqueued on the compute stream
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._buf_k[buf][:, :, :n].copy_(self.k[layer, :, :, :n], non_blocking=True)
                self._buf_v[buf][:, :, :n].copy_(self.v[layer, :, :, :n], non_blocking=True)
                self._ready[layer] = torch.cuda.Event()
                self._ready[layer].record(self._stream)
        self.streamed_bytes += 2 * self.k[layer, :, :, :n].numel() * self.k.element_size()

    def _layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device tensors (B, nkv, capacity, hs) that hold ``layer``'s keys and values for this forward."""
        if not self.offload:
            return self.k[layer], self.v[layer]
        if layer < self.on_chip_layers:
            return self._chip_k[layer], self._chip_v[layer]
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ready.pop(layer))
        if layer + 1 < self.k.shape[0]:
            self._prefetch(layer + 1)  # overlaps with this layer's attention
        buf = (layer - self.on_chip_layers) % 2
        return self._buf_k[buf], self._buf_v[buf]

    def exact_rows(self, t: int) -> bool:
        """True for blocks of at most :data:`KERNEL_MAX_BLOCK` tokens on the CPU: the verifier's decode steps and
        verification blocks (longer verification blocks run in pieces of at most that many,
        ``exact.verify_forward``; longer forwards are prefill chunks)."""
        return t <= self.kernel_max_block and self.device.type == "cpu"

    def one_query_rows(self):
        if self._t > self.kernel_max_block or self.offload or self.k.shape[1] != 1:
            return None  # a decode step or a verification block of one sequence, every layer in memory
        return self.k, self.v, self._start, self._start + self._t, None

    def query_buffer(self):
        if not self.record_queries:
            return None
        buf = self._qbufs.get(self._t)
        if buf is None:  # (L, 1, nh, T, hs), one per block length (decode steps and verification blocks alternate)
            buf = self._qbufs[self._t] = torch.empty(self.k.shape[0], 1, self.n_heads, self._t, self.k.shape[4])
        self.queries = list(buf)  # each (1, nh, T, hs), filled by the call
        return buf

    def attend(self, layer, q, k, v, q_pre):
        s, t = self._start, self._t
        keys, values = self._layer_kv(layer)
        keys[:, :, s:s + t] = k
        values[:, :, s:s + t] = v
        if self.offload:  # write-through: host memory holds every layer
            self.k[layer, :, :, s:s + t].copy_(k, non_blocking=True)
            self.v[layer, :, :, s:s + t].copy_(v, non_blocking=True)
        if self.record_queries:
            self.queries[layer] = q
        # a decode step or a verification block: csrc/attention.c on the CPU; on CUDA (half precision, MHA) SDPA's
        # flash kernels with a lower-right causal bias instead of the boolean mask
        out = gqa_attention_kernel(q, keys, values, s + t) if t <= self.kernel_max_block else None
        out = lower_right_attention(q, keys, values, s + t) if out is None else out
        if out is None and q.dtype == torch.float32 and self.exact_rows(t):  # the kernel off: each row alone
            out = rowwise_attention(q, keys, values, s + t)
        return out if out is not None else gqa_attention(q, keys[:, :, :s + t], values[:, :, :s + t], self._mask)

    def end_forward(self) -> None:
        if self.offload and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # host copies complete before anyone reads k/v
        self.length = self._start + self._t
        if self.record_queries and self._earlier is not None:  # query_at and the retrieval window see the whole block
            self.queries = [torch.cat([e, q], dim=2) for e, q in zip(self._earlier, self.queries)]
            self._earlier = None

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise CacheError(f"full KV cache: cannot roll back to {length} (length {self.length})")
        self.length = length

    @property
    def nbytes(self) -> int:
        """Bytes this cache holds allocated: K and V, plus the device copies and buffers when offloaded."""
        tensors = [self.k, self.v]
        if self.offload:
            tensors += [self._chip_k, self._chip_v, *self._buf_k, *self._buf_v]
        return sum(t.numel() * t.element_size() for t in tensors)

    def copy_prefix_from(self, other: "FullKVCache", n: int) -> None:
        """Take positions [0, n) of ``other`` (same model, smaller or equal capacity); ``length`` becomes n."""
        self.k[:, :, :, :n] = other.k[:, :, :, :n].to(self.k.device)
        self.v[:, :, :, :n] = other.v[:, :, :, :n].to(self.v.device)
        if self.offload and self.on_chip_layers:
            c = self.on_chip_layers
            self._chip_k[:, :, :, :n] = self.k[:c, :, :, :n].to(self.device)
            self._chip_v[:, :, :, :n] = self.v[:c, :, :, :n].to(self.device)
        self.length = n

    def query_at(self, position: int) -> torch.Tensor:
        """Post-RoPE queries of every layer at ``position`` from the last forward: (L, B, nh, hs).

        Raises:
            CacheError: queries were not recorded, or ``position`` was not in the last forward.
        """
        if not self.record_queries or self.queries[0] is None:
            raise CacheError("full KV cache: queries were not recorded")
        i = position - self.query_start
        if not 0 <= i < self.queries[0].shape[2]:
            raise CacheError(f"full KV cache: no recorded query for position {position}")
        return torch.stack([q[:, :, i] for q in self.queries])
