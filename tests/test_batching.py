"""Continuous batching (``scheduling.py``): a sequence's output in a batch is its output alone.

Greedy (fp32): token for token, for batches that mix prompt lengths, modes, gammas and budgets, with sequences
joining as others leave (more prompts than ``max_batch``), a sequence submitted mid-run, an EOS in one sequence
while the others continue, and a cancelled sequence. Sampling: the exact-enumeration chi-square test of
``distribution.py``, with the tested sequence batched next to others of other lengths and settings.
"""

import gc
import weakref

import pytest
import torch

from distribution import NEW, PROMPT_LEN, SETTINGS, V, chi2_pvalue, exact_distribution
from tiny import pair
from triforce.engine import Engine, SpeculationConfig
from triforce.kv.caches import RaggedCache
from triforce.model.batching import BatchScheduler, Cancelled
from triforce.speculation.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def engine():
    target, draft = pair(seed=3)
    return Engine(target, draft)


def _prompt(n, seed):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _spec(mode, **kw):
    base = dict(budget=24, chunk_size=4, gamma1=2, gamma2=3, draft_sink=4, draft_window=12)
    return SpeculationConfig(mode=mode, **dict(base, **kw))


# (prompt length, new tokens, spec): different lengths, modes, gammas and budgets in one batch
REQUESTS = [
    (40, 20, _spec("autoregressive")),
    (7, 12, _spec("retrieval")),
    (66, 25, _spec("triforce")),
    (23, 9, _spec("draft", gamma2=5)),
    (51, 17, _spec("triforce", drafter="ngram", gamma1=3, gamma2=4)),
    (90, 14, _spec("retrieval", budget=48, chunk_size=8, gamma2=6)),
    (3, 20, _spec("draft", drafter="self", self_weights="int8")),
]


def _alone(engine, prompt, new, spec, **kw):
    return engine.fork().generate(prompt, max_new_tokens=new, spec=spec, sampling=kw.pop("sampling", GREEDY), **kw)[0]


def _batched(engine, requests, max_batch, sampling=GREEDY):
    scheduler = BatchScheduler(max_batch)
    jobs = [lambda p=p, n=n, s=s: _alone(engine, p, n, s, sampling=sampling) for p, n, s in requests]
    seqs = scheduler.run(jobs)
    for seq in seqs:
        assert seq.error is None, seq.error
    return [seq.result for seq in seqs], scheduler


def record_forwards(target, monkeypatch) -> list[list[int]]:
    """The tokens of each sequence in every batched forward of ``target`` from now on (a list filled as they run)."""
    calls = []
    original = type(target).forward_ragged

    def recording(model, blocks):
        if model is target:
            calls.append([ids.shape[-1] for ids, *_ in blocks])
        return original(model, blocks)

    monkeypatch.setattr(type(target), "forward_ragged", recording)
    return calls


@pytest.mark.parametrize("max_batch", [3, 8])
def test_batched_greedy_equals_alone(engine, max_batch):
    """Every sequence of a mixed batch gives its autoregressive tokens; with max_batch 3, sequences join as others
    leave. The forwards really were batched (more sequences' forwards than forwards)."""
    requests = [(_prompt(n, i), new, spec) for i, (n, new, spec) in enumerate(REQUESTS)]
    reference = [_alone(engine, p, new, _spec("autoregressive")) for p, new, _ in requests]
    outs, scheduler = _batched(engine, requests, max_batch)
    assert outs == reference
    assert scheduler.sequence_forwards > 1.5 * scheduler.forwards


def test_prefill_chunks_share_forwards_first_come_first_served(engine, monkeypatch):
    """With a prefill budget of 60 rows per forward (short forwards, at most 8 rows, always join), the target's
    prefills run in admission order, each forward holding at most 60 prefill rows (or one longer prefill), and every
    sequence still gives its tokens alone."""
    import triforce.model.batching as scheduling

    monkeypatch.setattr(scheduling, "SHORT_FORWARD_ROWS", 8)
    monkeypatch.setattr(scheduling, "PREFILL_ROWS_PER_FORWARD", 60)
    requests = [(_prompt(n, i), new, spec) for i, (n, new, spec) in enumerate(REQUESTS)]
    reference = [_alone(engine, p, new, _spec("autoregressive")) for p, new, _ in requests]
    calls = record_forwards(engine.target, monkeypatch)
    outs, _ = _batched(engine, requests, 8)
    assert outs == reference
    long_rows = [[t for t in call if t > 8] for call in calls]
    assert all(sum(rows) <= 60 or len(rows) == 1 for rows in long_rows), long_rows
    prefills = [t for rows in long_rows for t in rows]
    # admission order: 40, 66, 23, 51, 90, a prompt past 64 tokens less its last 8 (a short forward of their own,
    # exact.prefill_forward_size)
    assert prefills == [n - 8 * (n > 64) for n, _, _ in REQUESTS if n > 8], prefills
    assert any(len(call) > 1 and any(t > 8 for t in call) for call in calls)  # prefills did share forwards


def test_prefill_beside_a_running_stream_comes_in_chunks_sized_by_time(engine, monkeypatch):
    """While another generation runs, a long prompt is prefilled in chunks sized from the last prefill forward's
    seconds per token (scheduling.prefill_chunk): with a target of 0 s, the smallest chunk; alone, or before any
    prefill forward was timed, the tier's own chunk. Both generations still give their tokens alone."""
    import triforce.model.batching as scheduling
    from triforce.model.batching import prefill_chunk

    assert prefill_chunk(512) == 512  # outside a scheduler
    monkeypatch.setattr(scheduling, "PREFILL_CHUNK_SECONDS", 0.0)
    short, long = (_prompt(5, 1), 40, _spec("autoregressive")), (_prompt(200, 2), 5, _spec("autoregressive"))
    reference = [_alone(engine, p, n, s) for p, n, s in (short, long)]
    calls = record_forwards(engine.target, monkeypatch)
    scheduler = BatchScheduler(2)
    scheduler.prefill_token_seconds = 1e-3  # as if a prefill forward had been timed
    seqs = scheduler.run([lambda r=r: _alone(engine, *r) for r in (short, long)])
    assert [s.result for s in seqs] == reference
    chunks = [t for call in calls for t in call if t > 5]
    m = scheduling.MIN_PREFILL_CHUNK
    assert chunks == [m] * (200 // m) + [200 % m], chunks  # the long prompt, beside the short one's decode steps
    assert all(len(call) == 2 for call in calls[1:len(chunks)])  # each chunk shared a forward with a decode step


def test_sequence_submitted_mid_run_and_eos_in_one_sequence():
    """A sequence that joins after others have decoded for a while, and an EOS (the 6th token of one sequence)
    that ends that sequence while the others continue: all equal their outputs alone."""
    target, draft = pair(seed=4)
    prompts = [_prompt(30, 10), _prompt(12, 11), _prompt(45, 12)]
    free = Engine(target, draft)
    eos = free.generate(prompts[1], max_new_tokens=6, sampling=GREEDY)[0][5]
    engine = Engine(target, draft, eos_ids=(eos,))
    specs = [_spec("triforce"), _spec("retrieval"), _spec("draft")]
    reference = [_alone(engine, p, 24, s) for p, s in zip(prompts, specs)]
    assert len(reference[1]) <= 6 and reference[1][-1] == eos
    scheduler = BatchScheduler(4)
    seqs = [scheduler.submit(lambda p=p, s=s: _alone(engine, p, 24, s)) for p, s in zip(prompts[:2], specs[:2])]
    for _ in range(6):
        scheduler.step()
    assert not seqs[0].done and scheduler.forwards == 6
    seqs.append(scheduler.submit(lambda: _alone(engine, prompts[2], 24, specs[2])))
    while scheduler.step():
        pass
    assert [s.result for s in seqs] == reference


def test_cancelled_sequence_frees_its_caches_and_others_continue(engine):
    """Cancel one sequence mid-generation: it ends with Cancelled at its next forward, its full KV cache is freed,
    and the other sequences' outputs are unchanged."""
    prompts = [_prompt(35, 20), _prompt(60, 21), _prompt(18, 22)]
    spec = _spec("triforce")
    reference = [_alone(engine, p, 20, spec) for p in prompts]
    forks, produced = [engine.fork() for _ in prompts], [0, 0, 0]

    def job(i):
        out = []
        for t in forks[i].stream(prompts[i], max_new_tokens=20, sampling=GREEDY, spec=spec):
            out.append(t)
            produced[i] = len(out)
        return out

    scheduler = BatchScheduler(3)
    seqs = [scheduler.submit(lambda i=i: job(i)) for i in range(3)]
    while produced[1] < 3:
        assert scheduler.step()
    cache = weakref.ref(forks[1].full_cache)
    seqs[1].cancel()
    scheduler.step()
    assert seqs[1].done and isinstance(seqs[1].error, Cancelled) and produced[1] < 20
    forks[1].forget_prefix()
    gc.collect()
    assert cache() is None
    while scheduler.step():
        pass
    assert [seqs[0].result, seqs[2].result] == [reference[0], reference[2]]


def test_ragged_forward_gives_each_block_its_logits_alone():
    """forward_ragged over a decode token, a 5-token block and a 9-token prefill chunk, each over its own cache:
    each block's logits equal a forward of that block alone (to fp32 rounding of the larger products)."""
    from triforce.kv.caches import FullKVCache

    target, _ = pair(seed=5)
    cfg = target.cfg
    blocks, alone = [], []
    for n_cached, t, seed in [(17, 1, 0), (8, 5, 1), (0, 9, 2)]:
        ids = torch.tensor([_prompt(n_cached + t, seed)])
        ca, cb = FullKVCache(cfg, 64), FullKVCache(cfg, 64)
        if n_cached:
            for c in (ca, cb):
                target(ids[:, :n_cached], torch.arange(n_cached), c)
        pos = torch.arange(n_cached, n_cached + t)
        alone.append(target(ids[:, n_cached:], pos, ca, num_logits=2 if t > 1 else None))
        blocks.append((ids[:, n_cached:], pos, cb, 2 if t > 1 else None))
    out = target.forward_ragged(blocks)
    for a, b, _ in zip(alone, out, blocks):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert [c.length for _, _, c, _ in blocks] == [18, 13, 9]
    with pytest.raises(ValueError, match="lengths"):
        RaggedCache([blocks[0][2]], [0])


def test_scheduler_refuses_bad_max_batch_and_fork_refuses_dynamic_rope():
    with pytest.raises(ValueError, match="max_batch"):
        BatchScheduler(0)
    from dataclasses import replace

    target, _ = pair(seed=6)
    target.cfg = replace(target.cfg, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="dynamic NTK"):
        Engine(target).fork()


def test_failing_sequence_does_not_stop_the_batch(engine):
    """A sequence whose code raises gets its own error; the others finish with their outputs alone."""
    prompt = _prompt(20, 30)
    reference = _alone(engine, prompt, 10, _spec("retrieval"))

    def bad():
        _alone(engine, prompt, 3, _spec("autoregressive"))
        raise KeyError("boom")

    scheduler = BatchScheduler(4)
    seqs = scheduler.run([bad, lambda: _alone(engine, prompt, 10, _spec("retrieval"))])
    assert isinstance(seqs[0].error, KeyError) and seqs[1].result == reference


def test_batched_forward_seconds_exclude_waiting_for_others(monkeypatch):
    """A tier's forward_seconds under the scheduler count the batched forwards, not the time its sequence waited
    while another sequence's code ran. On a fake clock (``time.perf_counter``) that only a sleeper's code (50 ms after
    each of its 4 forwards) and each batched forward (1 ms) advance, a generation batched beside the sleeper reports
    1 ms per forward pass of its target tier, while its own span holds the sleeps."""
    import time

    from triforce.kv.caches import FullKVCache
    from triforce.model.batching import run_forward

    target, _ = pair(seed=8)
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    ragged = target.forward_ragged
    batched = []

    def forward_ragged(blocks):
        clock[0] += 0.001
        batched.append(len(blocks))
        return ragged(blocks)

    monkeypatch.setattr(target, "forward_ragged", forward_ragged)

    def sleeper():
        cache = FullKVCache(target.cfg, 64)
        for i in range(4):
            run_forward(target, torch.tensor([[5 + i]]), torch.tensor([i]), cache)
            clock[0] += 0.05

    prompt = _prompt(12, 40)
    out = {}

    def generation():
        t0 = time.perf_counter()
        res = engine_alone.generate(prompt, max_new_tokens=4, spec=_spec("autoregressive"), sampling=GREEDY)
        out["span"] = time.perf_counter() - t0
        return res

    engine_alone = Engine(target).fork()
    seqs = BatchScheduler(2).run([sleeper, generation])
    assert all(s.error is None for s in seqs), [s.error for s in seqs]
    stats = seqs[1].result[1].tiers["target"]
    assert stats["forward_passes"] >= 4 and 2 in batched  # the two sequences shared forwards
    assert out["span"] > 0.15  # it did wait for the sleeper's code
    assert stats["forward_seconds"] == pytest.approx(0.001 * stats["forward_passes"]), stats


@pytest.mark.parametrize("mode", ["triforce", pytest.param("retrieval", marks=pytest.mark.slow)])
def test_batched_sequence_matches_exact_distribution(distribution_models, mode):
    """The tested sequence (20-token prompt, T = 1) runs batched with a longer greedy autoregressive sequence and a
    shorter T = 0.6 retrieval sequence; its 3-token outputs pass the chi-square test against the exact distribution
    (p > 1e-3, 1,200 samples)."""
    hf, target, draft, prompt = distribution_models
    params = SETTINGS["T1"]
    engine = Engine(target, draft)
    spec = SpeculationConfig(mode=mode, budget=8, chunk_size=2, gamma1=2, gamma2=2, draft_sink=2, draft_window=4)
    longer = torch.randint(0, V, (PROMPT_LEN + 13,), generator=torch.Generator().manual_seed(8)).tolist()
    companions = [
        (longer, 5, SamplingParams(temperature=0), SpeculationConfig()),
        (prompt[:9], 4, SamplingParams(0.6, 0.9, 0), spec),
    ]
    counts = torch.zeros(V**NEW, dtype=torch.float64)
    scheduler = BatchScheduler(3)
    n = 1200
    seqs = []
    for i in range(n):
        seqs.append(scheduler.submit(lambda i=i: engine.fork().generate(
            prompt, max_new_tokens=NEW, sampling=params, spec=spec, seed=77 * 1_000_003 + i)[0]))
        p, k, s, sp = companions[i % 2]
        scheduler.submit(lambda p=p, k=k, s=s, sp=sp, i=i: engine.fork().generate(p, max_new_tokens=k, sampling=s,
                                                                                 spec=sp, seed=i)[0])
    while scheduler.step():
        pass
    for seq in seqs:
        out = seq.result
        counts[out[0] * V * V + out[1] * V + out[2]] += 1
    assert scheduler.sequence_forwards > 1.5 * scheduler.forwards
    assert chi2_pvalue(counts, exact_distribution(hf, prompt, params)) > 1e-3


def test_ragged_forward_of_a_coded_model_runs_in_one_call_bitwise_as_each_block_alone(monkeypatch):
    """A model on GGUF block codes (its decode steps and blocks in one C call, ``decode_step.py``): a ragged forward
    over decode tokens and verification blocks of several sequences runs every layer in one call too
    (``decode_layers_ragged``), and each block's logits, cached keys and values and recorded queries are bitwise
    what the one-call forward of that block alone gives (row-invariant products; each sequence's attention its own
    call). Past 64 rows, in calls of whole blocks of at most 64 rows, each row still bitwise its block's alone
    (issue 47: batch invariance)."""
    from references import gguf_like
    from tiny import hf_model, ours
    from triforce.kernels import decode_step
    from triforce.kv.caches import FullKVCache

    if not decode_step.decode_step_status().startswith("on"):
        pytest.skip(f"decode step kernel {decode_step.decode_step_status()}")
    target = ours(gguf_like(hf_model(5, vocab=96, layers=3)))
    assert target.attach_block_codes() == 3 * 4 + 1
    ran = []
    real = decode_step.decode_layers_ragged
    monkeypatch.setattr("triforce.kernels.decode_step.decode_layers_ragged",
                        lambda *a: (r := real(*a), ran.append(r is not None))[0])

    def sequences(spec):  # (cached tokens, block tokens, records queries) per sequence
        blocks, alone = [], []
        for i, (n_cached, t, record) in enumerate(spec):
            ids = torch.tensor([_prompt(n_cached + t, i)])
            caches = [FullKVCache(target.cfg, 96, record_queries=record) for _ in range(2)]
            for c in caches:
                target(ids[:, :n_cached], torch.arange(n_cached), c)
            pos = torch.arange(n_cached, n_cached + t)
            alone.append((target(ids[:, n_cached:], pos, caches[0], num_logits=t), caches[0]))
            blocks.append((ids[:, n_cached:], pos, caches[1], t))
        return blocks, alone

    blocks, alone = sequences([(17, 1, False), (30, 7, True), (5, 1, True), (44, 4, False)])
    out = target.forward_ragged(blocks)
    assert ran == [True]
    for (a, ca), b, (_, _, cb, _) in zip(alone, out, blocks):
        assert torch.equal(a, b)
        assert ca.length == cb.length and torch.equal(ca.k[:, :, :, :ca.length], cb.k[:, :, :, :cb.length])
        assert torch.equal(ca.v[:, :, :, :ca.length], cb.v[:, :, :, :cb.length])
        if ca.record_queries:
            assert all(torch.equal(qa, qb) for qa, qb in zip(ca.queries, cb.queries))
    ran.clear()
    many, alone = sequences([(10, 16, False)] * 4 + [(10, 1, False)])  # 65 rows: two calls, 64 and 1
    out = target.forward_ragged(many)
    assert ran == [True, True]
    assert all(torch.equal(a, b) for (a, _), b in zip(alone, out))
