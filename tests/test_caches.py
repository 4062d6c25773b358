"""Cache policies: after any sequence of appends and rollbacks each cache holds what its policy prescribes."""

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from references import reference_selection
from triforce.kernels.cpu import apply_rope
from triforce.kv.caches import FullKVCache
from triforce.kv.retrieval import RetrievalCache
from triforce.kv.streaming import StreamingCache
from triforce.model.config import ModelConfig
from triforce.model.rope import RotaryEmbedding

CFG = ModelConfig(model_type="llama", vocab_size=10, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
L, NH, NKV, HS = 2, 4, 2, 8


def _kv(positions, salt=0):
    """Deterministic distinct key/value per (layer, position): (L, 1, nkv, T, hs) each."""
    g = torch.Generator().manual_seed(1000 * salt + int(positions[0]))
    k = torch.randn(L, 1, NKV, len(positions), HS, generator=g)
    return k, k + 100


def _write(cache, start, t, salt=0):
    pos = torch.arange(start, start + t)
    k, v = _kv(pos, salt)
    cache.begin_forward(pos)
    q = torch.randn(1, NH, t, HS)
    outs = [cache.attend(layer, q, k[layer], v[layer], q) for layer in range(L)]
    cache.end_forward()
    return k, v, outs


# --------------------------------------------------------------------------- full cache
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=12))
def test_full_cache_holds_exactly_the_accepted_prefix(ops):
    cache = FullKVCache(CFG, capacity=80)
    ref = {}  # position -> key written last
    salt = 0
    for block, reject in ops:
        if cache.length + block > 80:
            break
        salt += 1
        k, _, _ = _write(cache, cache.length, block, salt)
        for i in range(block):
            ref[cache.length - block + i] = k[:, :, :, i]
        cache.rollback(max(0, cache.length - reject))
        for p in range(cache.length):
            assert torch.equal(cache.k[:, :, :, p], ref[p])


# --------------------------------------------------------------------------- retrieval cache
def _reference_scores(keys, query, length, chunk, score):
    """Brute-force chunk scores (L, nkv, n_chunks) of the three rules."""
    g = NH // NKV
    out = torch.zeros(L, NKV, math.ceil(length / chunk))
    for layer in range(L):
        for h in range(NKV):
            qs = query[layer, 0, h * g:(h + 1) * g]  # (g, hs)
            for c in range(out.shape[-1]):
                kc = keys[layer, 0, h, c * chunk:min(length, (c + 1) * chunk)]  # (m, hs)
                if score == "mean":
                    out[layer, h, c] = (qs @ kc.mean(0)).sum()
                elif score == "max":
                    out[layer, h, c] = (qs @ kc.T).sum(0).max()
                else:
                    lo, hi = qs[:, None] * kc.min(0).values, qs[:, None] * kc.max(0).values
                    out[layer, h, c] = torch.maximum(lo, hi).sum()
    return out


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 40), st.integers(1, 5), st.sampled_from(["mean", "max", "bound"]))
def test_chunk_scores_match_brute_force(length, chunk, score):
    full = _full_with(length)
    query = torch.randn(L, 1, NH, HS, generator=torch.Generator().manual_seed(length))
    cache = RetrievalCache(CFG, full, 64, chunk, score)
    n_chunks = math.ceil(length / chunk)
    ours = cache._chunk_scores(full.k[:, :, :, :length], query.reshape(L, 1, NKV, -1, HS), n_chunks,
                               n_chunks * chunk - length)
    assert torch.allclose(ours[:, 0], _reference_scores(full.k, query, length, chunk, score), atol=1e-4)


def test_bound_score_bounds_every_key_and_max_is_attained():
    length, chunk = 37, 4
    full = _full_with(length)
    query = torch.randn(L, 1, NH, HS, generator=torch.Generator().manual_seed(9))
    qg = query.reshape(L, 1, NKV, -1, HS)
    n_chunks = math.ceil(length / chunk)
    pad = n_chunks * chunk - length
    bound = RetrievalCache(CFG, full, 64, chunk, "bound")._chunk_scores(full.k[:, :, :, :length], qg, n_chunks, pad)
    best = RetrievalCache(CFG, full, 64, chunk, "max")._chunk_scores(full.k[:, :, :, :length], qg, n_chunks, pad)
    assert (bound >= best - 1e-5).all()  # an upper bound of every key's score in the chunk


def _full_with(n, capacity=120):
    full = FullKVCache(CFG, capacity=capacity)
    _write(full, 0, n, salt=7)
    return full


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 60), st.integers(2, 5), st.integers(0, 4))
def test_retrieval_selection_matches_brute_force(length, chunk, extra_chunks):
    budget = chunk * (3 + extra_chunks) + 1  # not a multiple of the chunk size
    full = _full_with(length)
    query = torch.randn(L, 1, NH, HS, generator=torch.Generator().manual_seed(length))
    cache = RetrievalCache(CFG, full, budget, chunk)
    cache.build(length, query)
    ref = reference_selection(full.k, query, length, budget, chunk)
    assert torch.equal(cache.selected[:, 0], ref)
    m = min(budget, length)
    for layer in range(L):
        for h in range(NKV):
            idx = ref[layer, h, :m]
            assert torch.equal(cache.k[layer, 0, h, :m], full.k[layer, 0, h, idx])
    assert cache.holds_everything == (length <= budget)


@settings(max_examples=60, deadline=None)
@given(st.integers(10, 50), st.lists(st.tuples(st.integers(1, 4), st.integers(0, 4), st.booleans()), max_size=10))
def test_retrieval_cache_policy_after_random_accept_reject(prompt_len, ops):
    """Generated tokens take slots from the end; rollback restores the selected tokens; sync copies exact KV."""
    budget, chunk = 24, 4
    full = _full_with(prompt_len)
    cache = RetrievalCache(CFG, full, budget, chunk)
    cache.build(prompt_len, torch.randn(L, 1, NH, HS, generator=torch.Generator().manual_seed(1)))
    initial_k = cache.k.clone()
    own = {}  # generated position -> key the tier wrote
    salt = 100
    for block, reject, sync in ops:
        if cache.length + block - cache.build_len > cache.generation_capacity:
            break
        salt += 1
        start = cache.length
        k, _, _ = _write(cache, start, block, salt)
        for i in range(block):
            own[start + i] = k[:, :, :, i]
        cache.rollback(max(cache.build_len, cache.length - reject))
        if sync:  # the verifier accepted a prefix: its full cache now holds those positions
            keep = cache.length
            full.rollback(min(full.length, keep))
            if full.length < keep:
                _write(full, full.length, keep - full.length, salt=999)
            cache.sync_from_full()
            for p in range(cache.build_len, keep):
                own[p] = full.k[:, :, :, p]
        gen = cache.length - cache.build_len
        # policy: slots [0, budget - gen) hold the selection (empty slots past it are masked), the last gen slots
        # the generated tokens, newest first
        kept = min(cache.n_selected, budget - gen)
        assert torch.equal(cache.k[:, :, :, :kept], initial_k[:, :, :, :kept])
        for p in range(cache.build_len, cache.length):
            assert torch.equal(cache.k[:, :, :, budget - 1 - (p - cache.build_len)], own[p])


def test_retrieval_attention_equals_explicit_attention_over_kept_positions():
    prompt_len, budget, chunk = 40, 16, 4
    full = _full_with(prompt_len + 4)
    query = torch.randn(L, 1, NH, HS, generator=torch.Generator().manual_seed(3))
    cache = RetrievalCache(CFG, full, budget, chunk)
    cache.build(prompt_len, query)
    pos = torch.arange(prompt_len, prompt_len + 3)
    k, v = _kv(pos, salt=5)
    q = torch.randn(1, NH, 3, HS, generator=torch.Generator().manual_seed(4))
    cache.begin_forward(pos)
    out = cache.attend(0, q, k[0], v[0], q)
    sel = cache.selected[0, 0]  # (nkv, budget): the 3 newest slots now hold the block
    for h in range(NH):
        kv_h = h // (NH // NKV)
        kept = sel[kv_h, :budget - 3]
        for i in range(3):  # query i sees the selection and block tokens 0..i
            keys = torch.cat([full.k[0, 0, kv_h, kept], k[0, 0, kv_h, :i + 1]])
            vals = torch.cat([full.v[0, 0, kv_h, kept], v[0, 0, kv_h, :i + 1]])
            ref = torch.softmax(q[0, h, i] @ keys.T / math.sqrt(HS), -1) @ vals
            assert torch.allclose(out[0, h, i], ref, atol=1e-5)


# --------------------------------------------------------------------------- StreamingLLM cache
@settings(max_examples=60, deadline=None)
@given(st.integers(0, 4), st.integers(1, 8),
       st.lists(st.tuples(st.integers(1, 5), st.integers(0, 5), st.booleans()), min_size=1, max_size=25))
def test_streaming_cache_keeps_sinks_and_window(sink, window, ops):
    rope = RotaryEmbedding(CFG)
    lookahead = 6
    cache = StreamingCache(CFG, sink, window, slack=lookahead + 5, rope=rope)
    written = {}
    salt = 0
    for block, reject, commit in ops:
        salt += 1
        start = cache.length
        if start + block - cache.floor > lookahead:  # as in the engine: speculation never runs further ahead
            cache.floor = start
        k, _, _ = _write(cache, start, block, salt)
        for i in range(block):
            written[start + i] = k[:, :, :, i]
        target = max(cache.floor, cache.length - reject)
        cache.rollback(target)
        if commit:
            cache.floor = max(cache.floor, cache.length - 1)
        n = cache.length
        expected = list(range(min(sink, n))) + [p for p in range(max(sink, n - window + 1), n)]
        assert cache.visible_positions(n) == expected
        for p in expected:
            assert torch.equal(cache.key_at(slice(None), p), written[p][:, :, :])  # noqa


def test_streaming_attention_uses_in_cache_positions():
    """StreamingLLM position scheme: the reference rotates pre-RoPE keys at in-cache positions 0..n-1 with the query
    last; ours keeps absolute RoPE keys and re-rotates the query for the sinks. Outputs must agree."""
    torch.manual_seed(0)
    sink, window, total = 3, 5, 30
    rope = RotaryEmbedding(CFG)
    cache = StreamingCache(CFG, sink, window, slack=12, rope=rope)
    k_pre = torch.randn(1, NKV, total, HS)
    v_all = torch.randn(1, NKV, total, HS)
    q_pre = torch.randn(1, NH, total, HS)
    outs = []
    for start, t in [(0, 7), (7, 1), (8, 5), (13, 1), (14, 9), (23, 7)]:
        pos = torch.arange(start, start + t)
        cos, sin = rope.cos_sin(pos, torch.float32)
        cache.floor = start
        cache.begin_forward(pos)
        outs.append(cache.attend(0, apply_rope(q_pre[:, :, pos], cos, sin), apply_rope(k_pre[:, :, pos], cos, sin),
                                 v_all[:, :, pos], q_pre[:, :, pos]))
        cache.end_forward()
    out = torch.cat(outs, 2)
    for t in range(total):
        visible = list(range(min(sink, t + 1))) + list(range(max(sink, t - window + 1), t + 1))
        n = len(visible)
        cos, sin = rope.cos_sin(torch.arange(n), torch.float32)  # in-cache positions, query at n - 1
        keys = apply_rope(k_pre[:, :, visible], cos, sin)
        query = apply_rope(q_pre[:, :, t:t + 1], cos[n - 1:n], sin[n - 1:n])
        for h in range(NH):
            kv_h = h // (NH // NKV)
            ref = torch.softmax(query[0, h, 0] @ keys[0, kv_h].T / math.sqrt(HS), -1) @ v_all[0, kv_h, visible]
            assert torch.allclose(out[0, h, t], ref, atol=1e-4), t


def test_full_cache_nbytes_counts_k_and_v():
    from triforce.kv.caches import kv_bytes

    cfg = CFG
    assert FullKVCache(cfg, 40).nbytes == kv_bytes(cfg, 40, torch.float32)
    assert FullKVCache(cfg, 40, dtype=torch.bfloat16).nbytes == kv_bytes(cfg, 40, torch.bfloat16)


def test_release_free_memory_returns_freed_heap_pages(tmp_path):
    """A fresh process: 63 freed 4 MiB tensors in glibc's heap (below its mmap threshold, raised to 16 MiB by a
    freed 16 MiB block) stay resident until ``release_free_memory``, which gives back at least half of them."""
    import subprocess
    import sys

    script = tmp_path / "release.py"
    script.write_text('''
import os, torch
from triforce.kv.memory import release_free_memory
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
big = torch.empty(16 << 20, dtype=torch.uint8); big.fill_(1); del big
ts = [torch.ones(1 << 20) for _ in range(64)]
keep = ts[-1]
del ts
before = rss()
print(release_free_memory(), (before - rss()) >> 20)
''')
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("needs Linux /proc")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout.split()
    if out[0] == "False":
        pytest.skip("this C library has no malloc_trim")
    assert int(out[1]) >= 126, out  # MiB given back, of the 252 freed
