"""Fixed-shape forwards replayed as CUDA graphs: the retrieval and draft tiers' steps and blocks on a GPU.

On a GPU a 7B model's forward of one token spends most of its time launching its kernels one by one from Python,
whatever the cache, so the middle tier costs as much as the verifier and TriForce cannot pay (docs/performance.md,
"GPU: one H200"). A forward whose shapes and buffers stay the same from step to step can be captured once
(``torch.cuda.CUDAGraph``) and replayed with one launch, as the TriForce reference code captures its draft and
retrieval forwards and gpt-fast does through ``torch.compile``'s reduce-overhead mode.

Which forwards: those whose cache gives a key (:meth:`~triforce.kv.caches.KVCache.graph_key`) after ``begin_forward``,
promising that every ``attend`` of that forward reads and writes only tensors that keep their storage (its KV buffers
and the index and mask buffers ``begin_forward`` refreshes in place) with the same shapes, for blocks of up to
``kv.caches.MAX_GRAPH_TOKENS`` tokens. The retrieval cache's forwards qualify (its budget of slots is fixed), and so do
those of a StreamingLLM cache built with ``fixed_shape=True`` (it then attends over all its slots, the invisible ones
masked out; the engine builds it so for a model with graphs on, :func:`model_graphs_apply`); the full cache's do not
(its length grows every step). The engine keeps the last request's retrieval cache with its graphs for the next request
(``RetrievalCache.reset_or_new``). A graph replays the very kernels the eager forward runs, on the same inputs: the
logits are the eager ones, so greedy equality and the exact-distribution guarantee are untouched
(``bench/gpu/gpu_check.py --stages greedy`` checks it on a GPU).

Off (eager forwards) on the CPU, under tensor parallelism, with ``torch.compile`` (its own CUDA graphs), for a
batched (ragged) forward, and unless ``Transformer.cuda_graphs`` is set (``--cuda-graphs on``, off by default;
tests/test_cudagraph.py runs the capture and replay code on the CPU with a stand-in that re-runs the captured
forward).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

#: devices where forwards are captured (tests widen it to run the capture and replay code on a CPU, with a stand-in
#: ``BACKEND``)
GRAPH_DEVICES = ("cuda",)
#: graphs kept per cache (a forward key beyond them runs eagerly): T = 1 and the verification blocks of a few gammas
MAX_GRAPHS_PER_CACHE = 16
#: eager runs on a side stream before a capture (cuBLAS and SDPA set up their workspaces outside the graph)
WARMUP_RUNS = 2


@dataclass
class CapturedForward:
    """One captured forward: replay after copying the block into ``input_ids`` / ``positions``; ``logits`` is then
    the output (overwritten by the next replay)."""

    graph: object  # torch.cuda.CUDAGraph (or a stand-in in tests, see ``Backend``)
    model: object  # the Transformer whose weights the graph reads (kept alive with it)
    rope: object  # the RotaryEmbedding it was captured with: a new one (set_request_length) needs a new capture
    input_ids: torch.Tensor  # (B, T) int64
    positions: torch.Tensor  # (T,) int64
    logits: torch.Tensor  # (B, num_logits or T, V) fp32


class Backend:
    """How a forward is captured and replayed: CUDA graphs (``torch.cuda.CUDAGraph``). Tests swap in a stand-in."""

    def capture(self, fn, device: torch.device):
        """Run ``fn`` (no arguments, returns a tensor) eagerly ``WARMUP_RUNS`` times on a side stream, then capture
        it; returns ``(graph, output)``, the output tensor the graph writes at each replay.

        Raises:
            RuntimeError: from CUDA when the forward cannot be captured (e.g. it synchronises with the host)."""
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph, out

    def replay(self, graph) -> None:
        """Replay a graph :meth:`capture` returned (its kernels on the tensors of its capture)."""
        graph.replay()


BACKEND = Backend()


def model_graphs_apply(model) -> bool:
    """Whether ``model``'s fixed-shape forwards may replay CUDA graphs (see the module docstring): a cache built for
    it should then offer them (``StreamingCache(fixed_shape=True)``)."""
    return model.cuda_graphs and model.device.type in GRAPH_DEVICES and model.tp is None and model.compile_mode is None


def graphs_apply(model, cache) -> bool:
    """Whether ``model``'s forward over ``cache`` may replay a CUDA graph (see the module docstring)."""
    return model_graphs_apply(model) and getattr(cache, "cuda_graphs", None) is not None


def run_graphed(model, cache, key: tuple, input_ids: torch.Tensor, positions: torch.Tensor,
                num_logits: int | None) -> torch.Tensor | None:
    """The logits of the forward begun on ``cache`` (``begin_forward`` called, ``end_forward`` not yet), from its
    CUDA graph (captured on first use), or None where no graph serves it (too many graphs, or capture failed: the
    caller runs the forward eagerly; a failed capture turns graphs off for this cache, with a warning).

    Args:
        model: the :class:`~triforce.model.transformer.Transformer`.
        cache: the cache, whose ``cuda_graphs`` dict holds its graphs.
        key: ``cache.graph_key()`` for this forward.
        input_ids, positions: (B, T) int64 and (T,) int64 (as :meth:`~triforce.model.transformer.Transformer.forward`).
        num_logits: logits for the last ``num_logits`` positions (None: all T).

    Returns:
        (B, num_logits or T, V) fp32, a fresh tensor (the graph's output is overwritten by its next replay).
    """
    graphs = cache.cuda_graphs
    full_key = (id(model), key, tuple(input_ids.shape), num_logits)
    entry = graphs.get(full_key)
    if entry is not None and (entry.model is not model or entry.rope is not model.rope):
        del graphs[full_key]
        entry = None
    if entry is None:
        if len(graphs) >= MAX_GRAPHS_PER_CACHE:
            return None
        ids, pos = input_ids.clone(), positions.clone()
        try:
            graph, out = BACKEND.capture(lambda: model.forward_begun(ids, pos, cache, num_logits), input_ids.device)
        except RuntimeError as e:
            cache.cuda_graphs = None
            warnings.warn(f"CUDA graphs are off for this cache: capture failed ({str(e)[:200]}); eager forwards",
                          RuntimeWarning, stacklevel=3)
            return None
        entry = graphs[full_key] = CapturedForward(graph, model, model.rope, ids, pos, out)
    entry.input_ids.copy_(input_ids)
    entry.positions.copy_(positions)
    BACKEND.replay(entry.graph)
    return entry.logits.clone()
