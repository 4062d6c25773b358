"""Regression tests for bugs reproduced by running them (issue 12, item 4), one section per bug."""

import pytest
import torch

from tiny import pair
from triforce.engine import Engine, SpeculationConfig
from triforce.sampling import SamplingParams
from triforce.tiers import RetrievalTier

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95)


@pytest.fixture(scope="module")
def engine():
    target, draft = pair(seed=0)
    return Engine(target, draft)


def _prompts(n, seed, lo=30, hi=90):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _count_unrecorded_queries(monkeypatch) -> list:
    """Record every position whose query the retrieval tier asked the full cache for while the full cache's last
    forward did not compute it (the case that used to crash); returns the list it fills."""
    from triforce.caches import CacheError, FullKVCache

    missed = []
    original = FullKVCache.query_at

    def query_at(cache, position):
        try:
            return original(cache, position)
        except CacheError:
            missed.append(position)
            raise

    monkeypatch.setattr(FullKVCache, "query_at", query_at)
    return missed


# ------------------------------------------------------------------ 4a: re-selection at the first commit
@pytest.mark.parametrize("kw", [
    dict(mode="retrieval", budget=16, chunk_size=4, gamma2=3, rebuild_every=1),
    dict(mode="triforce", budget=16, chunk_size=4, gamma1=2, gamma2=3, rebuild_every=1, draft_sink=2, draft_window=6),
    dict(mode="retrieval", budget=40, chunk_size=4, gamma2=16, rebuild_below=1.0),  # 16 proposals fill the window
], ids=["rebuild-every-1", "triforce-rebuild-every-1", "rebuild-below-gamma16"])
def test_reselection_right_after_the_first_verification(engine, kw, monkeypatch):
    """Re-selecting at the first commit needs the last prompt token's query: the first verification reused the
    prefill's logits, so when it accepted nothing that query was not in its forward ("full KV cache: no recorded
    query for position P-1"). Greedy output must equal autoregressive, and the case must really occur."""
    missed = _count_unrecorded_queries(monkeypatch)
    spec = SpeculationConfig(**kw)
    for prompt in _prompts(4, seed=41):
        ref, _ = engine.generate(prompt, max_new_tokens=24, sampling=GREEDY)
        out, stats = engine.generate(prompt, max_new_tokens=24, sampling=GREEDY, spec=spec)
        assert out == ref
        assert stats.tiers["retrieval"]["rebuilds"] > 1
        engine.generate(prompt, max_new_tokens=24, sampling=SAMPLED, spec=spec, seed=5)  # no crash under sampling
    assert missed  # the failing case occurred (and was served by the kept query)


def test_reselection_after_a_first_verification_that_accepted_nothing(engine):
    """The exact failing case, forced: the verifier rejects the whole first block (a verification rule that accepts
    nothing and emits the target's argmax stays lossless under greedy decoding), then the chunks are re-selected."""
    from triforce.speculative import rejection_sample

    def reject_all(d, q, p, generator, greedy=False):
        n_acc, nxt = rejection_sample(d[:, :0], q[:, :0], p[:, :1], generator, greedy=greedy)
        return n_acc, nxt

    spec = SpeculationConfig(mode="retrieval", budget=16, chunk_size=4, gamma2=3, rebuild_every=1)
    eng = Engine(engine.target)
    eng.tier_verify["target"] = reject_all
    for prompt in _prompts(3, seed=42):
        ref, _ = engine.generate(prompt, max_new_tokens=6, sampling=GREEDY)
        out, stats = eng.generate(prompt, max_new_tokens=6, sampling=GREEDY, spec=spec)
        assert out == ref
        assert stats.tiers["target"]["accepted"] == 0 and stats.tiers["retrieval"]["rebuilds"] >= 6


def test_smallest_budget_is_chunk_plus_gamma_plus_2(engine):
    with pytest.raises(ValueError, match=r"budget must be >= chunk_size \+ gamma \+ 2 = 9"):
        SpeculationConfig(mode="retrieval", budget=8, chunk_size=4, gamma2=3)
    spec = SpeculationConfig(mode="retrieval", budget=9, chunk_size=4, gamma2=3)
    for prompt in _prompts(4, seed=43):
        ref, _ = engine.generate(prompt, max_new_tokens=20, sampling=GREEDY)
        out, stats = engine.generate(prompt, max_new_tokens=20, sampling=GREEDY, spec=spec)
        assert out == ref and stats.tiers["retrieval"]["rebuilds"] > 1


# ------------------------------------------------------------------ 4b: a retrieval tier not directly under the target
@pytest.mark.parametrize("tiers,reach", [("retrieval:2,draft:8", 8), ("retrieval:1,draft:5", 5),
                                         ("ngram:2,retrieval:3,draft:6", 6)])
def test_retrieval_tier_below_another_tier_reaches_as_far_as_the_block_above(engine, tiers, reach):
    """Its lookahead and budget check use the largest gamma of the tiers above it, not its own: at the smallest
    budget that passes validation it never runs out of slots (it used to: "retrieval cache budget exhausted")."""
    chunk = 4
    with pytest.raises(ValueError, match=f"budget must be >= chunk_size \\+ gamma \\+ 2 = {chunk + reach + 2}"):
        SpeculationConfig(tiers=tiers, budget=chunk + reach + 1, chunk_size=chunk)
    for adaptive in (False, True):
        budget = chunk + (2 if adaptive else 1) * reach + 2
        spec = SpeculationConfig(tiers=tiers, budget=budget, chunk_size=chunk, draft_sink=2, draft_window=6,
                                 adaptive_gamma=adaptive)
        assert spec.reach(0) == (2 if adaptive else 1) * reach
        for prompt in _prompts(2, seed=44):
            ref, _ = engine.generate(prompt, max_new_tokens=30, sampling=GREEDY)
            out, _ = engine.generate(prompt, max_new_tokens=30, sampling=GREEDY, spec=spec)
            assert out == ref, (tiers, adaptive)
            engine.generate(prompt, max_new_tokens=30, sampling=SAMPLED, spec=spec, seed=3)  # no exhaustion either


def test_reach_is_the_largest_gamma_at_and_above_a_tier():
    spec = SpeculationConfig(tiers="ngram:9,retrieval:2,draft:5", budget=64)
    assert [spec.reach(i) for i in range(3)] == [9, 5, 5]
    with pytest.raises(IndexError, match=r"index must be in \[0, 3\)"):
        spec.reach(3)


# ------------------------------------------------------------------ 4c: Engine.validate has no side effect
def test_validate_returns_the_plan_and_leaves_a_running_request_alone():
    """The server validates incoming requests on its event loop while another one runs: validate must not replace
    the running request's offloading plan (its stats used to report the newcomer's)."""
    target, _ = pair(seed=0)
    engine = Engine(target, offload_kv=True, on_chip_layers=1)
    spec = SpeculationConfig(mode="retrieval", budget=16, chunk_size=4, gamma2=3)
    prompt_a, prompt_b = list(range(3, 40)), list(range(3, 90)) * 2
    plan_a = engine.validate(prompt_a, 12, spec)
    plan_b = engine.validate(prompt_b, 100, spec)
    assert engine.placement is None  # validating stored nothing
    assert plan_a.on_chip_layers == plan_b.on_chip_layers == 1 and plan_a.layers == 3
    assert plan_b.host_bytes > plan_a.host_bytes  # a longer request: a larger cache
    assert engine.validate(prompt_a, 12, SpeculationConfig()) is not None
    assert Engine(target).validate(prompt_a, 12, spec) is None  # no offloading, no plan
    gen = engine.stream(prompt_a, max_new_tokens=12, sampling=GREEDY, spec=spec)
    out = [next(gen), next(gen)]
    assert engine.placement == plan_a
    assert engine.validate(prompt_b, 100, spec) == plan_b  # another request arrives meanwhile
    while True:
        try:
            out.append(next(gen))
        except StopIteration as stop:
            stats = stop.value
            break
    assert len(out) == 12
    placed = dict(stats.kv_placement)
    assert placed.pop("streamed_bytes") > 0
    assert placed == plan_a.to_dict()


# ------------------------------------------------------------------ 4d: --compile with --lower-weights
@pytest.mark.parametrize("weights", ["int8", "bfloat16"])
def test_lower_precision_copy_of_a_compiled_model_runs_its_own_mlp(monkeypatch, weights):
    """compile_blocks stores a compiled forward bound to each full-precision MLP; the lower-precision copy used to
    carry it along, so its MLPs ran the source's weights. torch.compile is replaced by a pass-through that keeps the
    bound method (what the real one does, without minutes of inductor compilation)."""
    from triforce.caches import FullKVCache
    from triforce.quant import lower_precision_copy

    compiled = []

    def fake_compile(fn, **kw):
        compiled.append((getattr(fn, "__self__", None), kw))
        return fn

    target, _ = pair(seed=0)
    plain = lower_precision_copy(target, weights)  # from the uncompiled model: the reference
    monkeypatch.setattr(torch, "compile", fake_compile)
    target.compile_blocks("max-autotune")
    lower = lower_precision_copy(target, weights)
    for block, source in zip(lower.layers, target.layers):
        assert block.mlp is not source.mlp and block.mlp.forward.__self__ is block.mlp
        assert (block.mlp, dict(mode="max-autotune", dynamic=False)) in compiled  # the copy's MLP compiled, same mode

    def logits(model):
        ids = torch.tensor([list(range(3, 30))])
        return model(ids, torch.arange(27), FullKVCache(model.cfg, 32))

    ref, full = logits(plain), logits(target)
    assert torch.equal(logits(lower), ref)
    assert not torch.allclose(ref, full, atol=1e-4)  # the check can tell the two precisions apart


# ------------------------------------------------------------------ 4e: tensor-parallel ranks agree on memory
def _tp_memory_worker(rank, world, port, folder, prompt, queue):
    import os

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch.distributed as dist

    from triforce import memory
    from triforce.loading import load_model
    from triforce.parallel import init_tensor_parallel

    tp = init_tensor_parallel(world)
    real = memory.available_bytes

    def attempt(fn):
        memory.available_bytes = (lambda device: 0) if rank == 1 else real  # rank 1 alone has no free memory
        try:
            fn()
            return "went on"
        except memory.InsufficientMemoryError as e:
            return str(e)
        finally:
            memory.available_bytes = real

    out = [attempt(lambda: load_model(folder, tp=tp))]
    engine = Engine(load_model(folder, tp=tp).model)
    spec = SpeculationConfig(mode="retrieval", budget=16, chunk_size=4, gamma2=3)
    out.append(attempt(lambda: engine.generate(prompt, max_new_tokens=8, sampling=GREEDY, spec=spec)))
    out.append(engine.generate(prompt, max_new_tokens=8, sampling=GREEDY, spec=spec)[0])  # still in lockstep
    queue.put((rank, out))
    dist.destroy_process_group()


def test_tensor_parallel_ranks_agree_when_one_lacks_memory(tiny_folder):
    """A rank that refuses (weights or a request) while the others go on used to leave them waiting forever in the
    next collective: now every rank raises, the refusing one with its figures, the others naming it."""
    import queue as queues

    import torch.multiprocessing as mp
    from test_parallel import _free_port
    from triforce.loading import load_model

    prompt = list(range(3, 40))
    ref, _ = Engine(load_model(tiny_folder).model).generate(
        prompt, max_new_tokens=8, sampling=GREEDY, spec=SpeculationConfig(mode="retrieval", budget=16, chunk_size=4,
                                                                          gamma2=3))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_tp_memory_worker, args=(r, 2, port, tiny_folder, prompt, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(q.get(timeout=120) for _ in procs)
    except queues.Empty:
        pytest.fail("a rank is still waiting: the ranks did not agree on the memory check")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    (load0, gen0, tokens0), (load1, gen1, tokens1) = results[0], results[1]
    assert load1.startswith("rank 1: model ") and "is free" in load1
    assert load0 == "rank 1 of 2 refused for lack of memory (its own message says how much); every rank stops"
    assert gen1.startswith("rank 1: this request needs ") and gen0 == load0
    assert tokens0 == tokens1 == ref


# ------------------------------------------------------------------ drift: one check of --threads and --seed
@pytest.mark.parametrize("option,value", [("--threads", "0"), ("--threads", "100000"), ("--seed", "-1"),
                                          ("--seed", str(2**63))])
def test_generate_and_serve_check_threads_and_seed_alike(tiny_folder, option, value):
    """`serve` used to accept any --threads >= 1 and wrote its --seed range differently: one helper each now (checked
    before anything is loaded; `serve`'s option checks are called directly, so no server can start here)."""
    from triforce.cli import CLIError, build_parser, cmd_generate
    from triforce.cli.serve import defaults_from_args

    errors = []
    for command, run in (("generate", cmd_generate), ("serve", defaults_from_args)):
        prompt = ["--prompt", "x"] if command == "generate" else []
        with pytest.raises(CLIError) as e:
            run(build_parser().parse_args([command, "--model", tiny_folder, *prompt, option, value]))
        errors.append(str(e.value))
    assert errors[0] == errors[1] and len(errors[0].splitlines()) == 1 and option in errors[0]
    if option == "--seed":
        assert "[0, 2**63 - 1]" in errors[0]


def test_the_largest_seed_is_the_same_everywhere(engine):
    from triforce.cli import check_seed
    from triforce.engine import MAX_SEED
    from triforce.serve.schema import MAX_SEED as SERVER_MAX_SEED

    assert MAX_SEED == SERVER_MAX_SEED == 2**63 - 1
    check_seed(MAX_SEED)
    out, stats = engine.generate([5, 6, 7], max_new_tokens=2, sampling=SAMPLED, seed=MAX_SEED)
    assert stats.seed == MAX_SEED and len(out) == 2
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63 - 1\], got 9223372036854775808"):
        engine.generate([5, 6, 7], max_new_tokens=2, seed=MAX_SEED + 1)
