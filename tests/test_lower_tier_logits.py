"""The lower tiers' logits against a dense reference computation (issue 12, item 6).

Greedy equality cannot see a bug in a lower tier's cache: the verifier decides every token, so a wrong retrieval or
StreamingLLM attention only lowers acceptance. Here each tier's logits for a block are compared with the model run
from scratch over a reference cache that attends densely, one query at a time, over exactly the positions the policy
keeps (written from the policy's definition, not from the cache's slots and masks):

* retrieval tier (TriForce Sec. 4.1): a prompt position sees every earlier position (the verifier's exact KV); a block
  position sees the chunks a brute-force selection (``references.reference_selection``, from the last prompt token's
  query of a full-attention pass) keeps beside the block, and the block up to itself;
* StreamingLLM tier (arXiv 2309.17453): position t sees the sinks and the window (t - window, t], scored with keys
  re-rotated at in-cache positions 0..n-1 and the query at n-1 (StreamingLLM's scheme), over a prompt long enough that
  the cache evicts.

Tolerance: fp32, max abs difference of the logits <= 1e-4 (the two computations sum in different orders).
"""

import math

import torch

from references import reference_selection
from tiny import hf_model, ours, pair
from triforce.engine import Engine, SpeculationConfig
from triforce.kernels.cpu import apply_rope
from triforce.kv.caches import KVCache
from triforce.speculation.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
ATOL = 1e-4


class DenseReference(KVCache):
    """Attention of every query over the positions ``visible(layer, kv_head, t)`` lists, one query at a time.

    Keeps every layer's post-RoPE keys, values and queries (B = 1). With ``rope`` the scores use StreamingLLM's
    in-cache positions: keys are un-rotated and rotated again at 0..n-1 over the n visible positions, the query at n-1.
    """

    def __init__(self, visible, rope=None):
        self.visible, self.rope = visible, rope
        self.k, self.v, self.q = {}, {}, {}
        self.length = 0

    def begin_forward(self, positions):
        self._check_block(positions)
        self.positions = positions

    def attend(self, layer, q, k, v, q_pre):
        for store, x in ((self.k, k), (self.v, v), (self.q, q)):
            store[layer] = torch.cat([store[layer], x], 2) if layer in store else x
        keys, values = self.k[layer][0], self.v[layer][0]  # (nkv, S, hs)
        nh, nkv, hs = q.shape[1], k.shape[1], q.shape[-1]
        out = torch.zeros_like(q)
        for i, t in enumerate(self.positions.tolist()):
            for h in range(nh):
                kv = h // (nh // nkv)
                pos = list(self.visible(layer, kv, t))
                if self.rope is None:
                    scores = keys[kv, pos] @ q[0, h, i]
                else:
                    cos, sin = self.rope.cos_sin(torch.tensor(pos), keys.dtype)
                    k_pre = apply_rope(keys[kv, pos], cos, -sin)  # undo the rotation at the absolute positions
                    cos_c, sin_c = self.rope.cos_sin(torch.arange(len(pos)), keys.dtype)
                    query = apply_rope(q_pre[0, h, i:i + 1], cos_c[-1:], sin_c[-1:])[0]
                    scores = apply_rope(k_pre, cos_c, sin_c) @ query
                out[0, h, i] = torch.softmax(scores / math.sqrt(hs), -1) @ values[kv, pos]
        return out

    def end_forward(self):
        self.length = int(self.positions[-1]) + 1

    def rollback(self, length):
        raise NotImplementedError


def _run(model, tokens, cache):
    """Logits (T, V) of ``tokens`` at positions 0..T-1 through ``cache``."""
    return model(torch.tensor([tokens]), torch.arange(len(tokens)), cache)[0]


def _tier_logits(engine, spec, prompt, block):
    """The logits of the tier below the verifier for prompt[-1] + block, right after the prefill."""
    plan = engine.plan(prompt, 8, spec, sampling=GREEDY)
    top = engine.build_hierarchy(plan, GREEDY, torch.Generator().manual_seed(0))
    top.prefill(prompt)
    return top.drafter, top.drafter.logits_for(prompt + block, len(block) + 1)


def test_retrieval_tier_logits_equal_dense_attention_over_the_selected_positions():
    # the shapes of test_caches (2 layers, 4 query heads, 2 KV heads, head size 8), so its brute-force selection applies
    target = ours(hf_model(seed=5, vocab=96, hidden=32, layers=2, heads=4, kv_heads=2))
    g = torch.Generator().manual_seed(6)
    checked = 0
    for prompt_len, budget, chunk in ((41, 16, 4), (60, 23, 3), (30, 64, 4)):  # the last: everything fits
        prompt = torch.randint(3, 96, (prompt_len,), generator=g).tolist()
        block = torch.randint(3, 96, (4,), generator=g).tolist()
        spec = SpeculationConfig(mode="retrieval", budget=budget, chunk_size=chunk, gamma2=4)
        tier, logits = _tier_logits(Engine(target), spec, prompt, block)
        # the selection: a full-attention pass gives the keys and the last prompt token's query
        full = DenseReference(lambda layer, kv, t: range(t + 1))
        dense = _run(target, prompt + block, full)
        P = prompt_len
        keys = torch.stack([full.k[layer][:, :, :P - 1] for layer in range(2)])  # (L, 1, nkv, P-1, hs)
        query = torch.stack([full.q[layer][:, :, P - 1] for layer in range(2)])  # (L, 1, nh, hs)
        sel = reference_selection(keys, query, P - 1, budget, chunk)  # (L, nkv, budget), -1 = empty
        n_block = len(block) + 1  # positions P-1 .. P-1+len(block) take the last slots
        kept = [[[p for p in sel[layer, kv, :budget - n_block].tolist() if p >= 0] for kv in range(2)]
                for layer in range(2)]
        ref = _run(target, prompt + block, DenseReference(
            lambda layer, kv, t: range(t + 1) if t < P - 1 else kept[layer][kv] + list(range(P - 1, t + 1))))  # noqa: B023  (run here)
        assert (logits - ref[-n_block:]).abs().max() <= ATOL
        if budget - n_block < P - 1:  # positions were dropped: the check can tell the caches apart
            assert (logits - dense[-n_block:]).abs().max() > 1e-2
            checked += 1
        else:
            assert tier.cache.holds_everything
    assert checked == 2


def test_streaming_tier_logits_equal_the_streamingllm_reference_over_sinks_and_window():
    target, draft = pair(seed=7)
    sink, window = 2, 6
    spec = SpeculationConfig(mode="draft", gamma2=3, draft_sink=sink, draft_window=window)
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(3, 96, (300,), generator=g).tolist()  # longer than the cache: tokens are evicted
    block = torch.randint(3, 96, (3,), generator=g).tolist()
    tier, logits = _tier_logits(Engine(target, draft), spec, prompt, block)
    assert tier.cache.win_start > sink and tier.cache.capacity < len(prompt)  # it did evict

    def visible(layer, kv, t):
        return list(range(min(sink, t + 1))) + list(range(max(sink, t - window + 1), t + 1))

    ref = _run(draft, prompt + block, DenseReference(visible, rope=draft.rope))
    n = len(block) + 1
    assert (logits - ref[-n:]).abs().max() <= ATOL
    dense = _run(draft, prompt + block, DenseReference(lambda layer, kv, t: range(t + 1)))
    assert (logits - dense[-n:]).abs().max() > 1e-2  # the check can tell the caches apart
    # absolute positions for the sinks instead of StreamingLLM's in-cache ones: a different computation
    absolute = _run(draft, prompt + block, DenseReference(visible))
    assert (logits - absolute[-n:]).abs().max() > 1e-3
