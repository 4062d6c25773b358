"""CUDA graphs of the retrieval tier's forwards (cudagraph.py), tested on the CPU.

A CUDA graph replays the kernels of its capture on the tensors of its capture. Two things make that exact: the
cache's promise (every forward with the same ``graph_key`` reads and writes the same storage, refreshed in place),
tested here directly, and the plumbing (capture once per key, copy each block into the graph's inputs, hand out a
copy of its output, capture again for a new RoPE, fall back to eager forwards when a capture fails), tested with a
stand-in backend that re-runs the captured forward where CUDA would replay it.
``bench/gpu/gpu_check.py --stages greedy`` checks greedy equality with real CUDA graphs on a GPU.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tiny import pair
from triforce.engine import Engine, SpeculationConfig
from triforce.kv.caches import FullKVCache
from triforce.kv.retrieval import RetrievalCache
from triforce.kv.streaming import StreamingCache
from triforce.model import cudagraph
from triforce.speculation.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
SPECS = [SpeculationConfig(mode="retrieval", budget=24, chunk_size=4, gamma2=4),
         SpeculationConfig(mode="triforce", budget=24, chunk_size=8, gamma1=2, gamma2=3, draft_sink=4,
                           draft_window=12)]


class StandIn(cudagraph.Backend):
    """Captures as CUDA does (warm-up runs, then the captured run); a replay re-runs the forward into the captured
    output tensor. Counts both."""

    def __init__(self, fail: bool = False) -> None:
        self.captures, self.replays, self.fail = 0, 0, fail

    def capture(self, fn, device):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        for _ in range(cudagraph.WARMUP_RUNS):
            fn()
        self.captures += 1
        out = fn()
        return (fn, out), out

    def replay(self, graph) -> None:
        fn, out = graph
        self.replays += 1
        out.copy_(fn())


@pytest.fixture
def stand_in(monkeypatch):
    backend = StandIn()
    monkeypatch.setattr(cudagraph, "GRAPH_DEVICES", ("cpu",))
    monkeypatch.setattr(cudagraph, "BACKEND", backend)
    return backend


def _graphed_pair():
    """tiny.pair with --cuda-graphs on (off by default)."""
    target, draft = pair(seed=3)
    target.cuda_graphs = draft.cuda_graphs = True
    return target, draft


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("spec", SPECS, ids=["retrieval", "triforce"])
def test_graphed_retrieval_forwards_keep_greedy_equality(stand_in, spec):
    """retrieval and triforce through the capture and replay path give the autoregressive tokens; graphs were
    captured (a few keys) and replayed many more times than captured."""
    target, draft = _graphed_pair()
    engine = Engine(target, draft)
    for seed, n in ((0, 70), (1, 45)):
        prompt = _prompt(n, seed)
        ref, _ = engine.generate(prompt, max_new_tokens=24, sampling=GREEDY, spec=SpeculationConfig())
        replays = stand_in.replays
        out, stats = engine.generate(prompt, max_new_tokens=24, sampling=GREEDY, spec=spec)
        assert out == ref
        assert stats.tiers["target"]["accepted"] > 0
        assert stand_in.replays > replays
    assert 0 < stand_in.captures < stand_in.replays


def test_graphs_are_off_where_they_do_not_apply(stand_in):
    """--cuda-graphs off (which the lower tiers' int8 copy follows), and a device not in GRAPH_DEVICES: every forward
    eager."""
    target, draft = _graphed_pair()
    engine = Engine(target, draft)
    specs = (SPECS[0], replace(SPECS[0], lower_weights="int8"))
    engine.generate(_prompt(70), max_new_tokens=12, sampling=GREEDY, spec=specs[1])
    assert stand_in.captures > 0  # the int8 copy's forwards, with the target's setting
    before = (stand_in.captures, stand_in.replays)
    target.cuda_graphs = False
    for spec in specs:
        engine.generate(_prompt(70), max_new_tokens=12, sampling=GREEDY, spec=spec)
    assert (stand_in.captures, stand_in.replays) == before
    target.cuda_graphs = True
    cudagraph.GRAPH_DEVICES = ("cuda",)  # monkeypatch restores it
    for spec in specs:
        engine.generate(_prompt(70), max_new_tokens=12, sampling=GREEDY, spec=spec)
    assert (stand_in.captures, stand_in.replays) == before


def test_forwards_with_one_graph_key_use_the_same_storage(stand_in, monkeypatch):
    """The promise a graph relies on: the slot indices, mask and sink rotation each forward of a key reads are the
    same tensors, refreshed in place, with this forward's values (retrieval and StreamingLLM caches; the stand-in
    re-runs each replayed forward, so every step's values are checked)."""
    target, draft = _graphed_pair()
    engine = Engine(target, draft)
    seen: dict[tuple, set] = {}
    attends = {cls: cls.attend for cls in (RetrievalCache, StreamingCache)}

    def retrieval(self, layer, q, k, v, q_pre):
        mask = self._mask
        ptrs = (self.k.data_ptr(), self._slot_idx.data_ptr(), None if mask is None else mask.data_ptr())
        seen.setdefault(("retrieval", id(self), self.graph_key()), set()).add(ptrs)
        expected = self.budget - 1 - (torch.arange(self._start, self._start + self._t) - self.build_len)
        assert torch.equal(self._slot_idx, expected)
        return attends[RetrievalCache](self, layer, q, k, v, q_pre)

    def streaming(self, layer, q, k, v, q_pre):
        if self._fixed is not None:
            seen.setdefault(("streaming", id(self), self.graph_key()), set()).add(
                (self.k.data_ptr(),) + tuple(t.data_ptr() for t in self._fixed))
            slots, mask = self._fixed[:2]
            assert torch.equal(slots, torch.arange(self._slot_lo, self._slot_lo + self._t))
            n = self._n_sink + self._n_win
            assert torch.equal(mask[:, :n], self._mask) and not mask[:, n:].any()
        return attends[StreamingCache](self, layer, q, k, v, q_pre)

    monkeypatch.setattr(RetrievalCache, "attend", retrieval)
    monkeypatch.setattr(StreamingCache, "attend", streaming)
    for spec in SPECS:
        engine.generate(_prompt(70), max_new_tokens=30, sampling=GREEDY, spec=spec)
    keys = {(kind, key) for kind, _, key in seen}
    # decode steps without a mask and triforce's blocks with one; the draft's steps
    assert {("retrieval", (1, True)), ("retrieval", (3, False)), ("streaming", (1,))} <= keys
    assert all(len(ptrs) == 1 for ptrs in seen.values())


@pytest.mark.parametrize("sink", [0, 4])
def test_fixed_shape_streaming_attention_equals_the_sliced_one(sink):
    """StreamingCache(fixed_shape=True) attends over every slot with the others masked out: the draft's logits
    equal the sliced cache's within fp32 rounding, through prefill, decode steps, blocks, rollbacks and
    evictions."""
    _, draft = pair(seed=3)
    caches = [StreamingCache(draft.cfg, sink, 12, 8, draft.rope, fixed_shape=f) for f in (False, True)]
    g = torch.Generator().manual_seed(1)
    pos = 0
    for step in range(40):
        t = 9 if step == 0 else int(torch.randint(1, 4, (1,), generator=g))
        ids = torch.randint(3, 96, (1, t), generator=g)
        for c in caches:
            c.floor = pos  # no rollback below the block's start (what the tiers promise)
        outs = [draft(ids, torch.arange(pos, pos + t), c) for c in caches]
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        keep = pos + t - (int(torch.randint(0, t, (1,), generator=g)) if step % 3 == 0 else 0)
        for c in caches:
            c.rollback(keep)
        pos = keep
    assert caches[1]._fixed is not None and caches[0]._fixed is None


def test_replayed_logits_equal_eager_ones_and_outlive_the_next_replay(stand_in):
    """Decode steps over a retrieval cache: the replayed logits are the eager ones, and each step's logits are a
    copy (the graph's output is overwritten by the next replay)."""
    target, _ = _graphed_pair()
    cfg = target.cfg
    query = torch.randn(cfg.num_hidden_layers, 1, cfg.num_attention_heads, cfg.head_dim,
                        generator=torch.Generator().manual_seed(0))

    def steps(graphs: bool) -> list[torch.Tensor]:
        target.cuda_graphs = graphs
        full = FullKVCache(cfg, 64, torch.float32, "cpu")
        target(torch.tensor([_prompt(40)]), torch.arange(40), full)
        retr = RetrievalCache(cfg, full, 16, 4)
        retr.build(40, query)
        return [target(torch.tensor([[5 + i]]), torch.tensor([40 + i]), retr) for i in range(3)]

    eager, captures = steps(False), stand_in.captures
    graphed = steps(True)
    assert stand_in.captures == captures + 1 and stand_in.replays == 3
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)


def test_a_new_rope_recaptures(stand_in):
    target, _ = _graphed_pair()
    engine = Engine(target)
    engine.generate(_prompt(70), max_new_tokens=8, sampling=GREEDY, spec=SPECS[0])
    captures = stand_in.captures
    target.set_request_length(200)  # a new RotaryEmbedding: the graphs read the old one's tables
    engine.generate(_prompt(70), max_new_tokens=8, sampling=GREEDY, spec=SPECS[0])
    assert stand_in.captures > captures


def test_a_failed_capture_turns_graphs_off_for_the_cache_and_keeps_the_tokens(monkeypatch):
    monkeypatch.setattr(cudagraph, "GRAPH_DEVICES", ("cpu",))
    monkeypatch.setattr(cudagraph, "BACKEND", StandIn(fail=True))
    target, _ = _graphed_pair()
    engine = Engine(target)
    prompt = _prompt(70)
    ref, _ = engine.generate(prompt, max_new_tokens=16, sampling=GREEDY, spec=SpeculationConfig())
    with pytest.warns(RuntimeWarning, match="CUDA graphs are off"):
        out, _ = engine.generate(prompt, max_new_tokens=16, sampling=GREEDY, spec=SPECS[0])
    assert out == ref


def test_the_next_request_reuses_the_retrieval_cache_and_its_graphs(stand_in):
    """A request with the same retrieval settings gets the last request's cache (reset) and replays its graphs (the
    same captured forwards, none added), the same tokens."""
    target, draft = _graphed_pair()
    engine = Engine(target, draft)
    prompt = _prompt(70)
    first, _ = engine.generate(prompt, max_new_tokens=20, sampling=GREEDY, spec=SPECS[1])
    kept = engine.retrieval_cache
    graphs = dict(kept.cuda_graphs)
    second, _ = engine.generate(prompt, max_new_tokens=20, sampling=GREEDY, spec=SPECS[1])
    assert second == first and engine.retrieval_cache is kept and kept.cuda_graphs == graphs and graphs
    engine.generate(prompt, max_new_tokens=20, sampling=GREEDY, spec=replace(SPECS[1], budget=32))
    assert engine.retrieval_cache is not kept  # another budget: a new cache
