"""KV-cache offloading: the streamed path (host storage, double buffers, prefetch) gives exactly the on-device
tokens; validating a request leaves the running one's plan alone."""

import json
import subprocess
import sys

import pytest

from support import drain
from tiny import pair
from triforce.engine import Engine, SpeculationConfig
from triforce.kv.memory import InsufficientMemoryError, place_kv
from triforce.speculation.sampling import SamplingParams

SPECS = [SpeculationConfig(),
         SpeculationConfig(mode="retrieval", budget=16, chunk_size=4, gamma2=3),
         SpeculationConfig(mode="triforce", budget=16, chunk_size=4, gamma1=2, gamma2=3, draft_sink=4, draft_window=12),
         SpeculationConfig(tiers="ngram:3,retrieval:3", budget=16, chunk_size=4)]
PROMPT = [5, 17, 33, 5, 17, 40, 8, 9, 5, 17, 33, 61, 22, 7, 5, 17, 9, 9, 31, 44, 5, 17, 33]


@pytest.fixture(scope="module")
def models():
    return pair(seed=3)


@pytest.mark.parametrize("on_chip", [0, 1, 3])
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_p=0.95)],
                         ids=["greedy", "sampled"])
def test_offloaded_equals_on_device(models, on_chip, sampling):
    target, draft = models
    plain = Engine(target, draft)
    offloaded = Engine(target, draft, offload_kv=True, on_chip_layers=on_chip)
    for spec in SPECS:
        ref, _ = plain.generate(PROMPT, max_new_tokens=24, sampling=sampling, spec=spec, seed=11)
        out, stats = offloaded.generate(PROMPT, max_new_tokens=24, sampling=sampling, spec=spec, seed=11)
        assert out == ref, spec.name
        placement = stats.kv_placement
        assert placement["on_chip_layers"] == on_chip and placement["layers"] == 3
        # every streamed layer is copied in at every forward: more bytes than the prompt's KV of those layers
        cfg = target.cfg
        prompt_kv = 2 * (3 - on_chip) * cfg.num_key_value_heads * cfg.head_dim * 4 * (len(PROMPT) - 1)
        assert (placement["streamed_bytes"] >= prompt_kv) if on_chip < 3 else placement["streamed_bytes"] == 0


def test_offloaded_prefix_reuse_and_longer_request(models):
    target, draft = models
    greedy = SamplingParams(temperature=0)
    spec = SpeculationConfig(mode="retrieval", budget=16, chunk_size=4, gamma2=3)
    plain = Engine(target, draft, reuse_prefix=False)
    offloaded = Engine(target, draft, offload_kv=True, on_chip_layers=1)
    for prompt, n in ((PROMPT, 10), (PROMPT + [3, 4, 5], 30), (PROMPT[:12], 8)):
        ref, _ = plain.generate(prompt, max_new_tokens=n, sampling=greedy, spec=spec)
        out, stats = offloaded.generate(prompt, max_new_tokens=n, sampling=greedy, spec=spec)
        assert out == ref


def test_planner_fills_free_memory_and_keeps_two_buffers(monkeypatch):
    import triforce.kv.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1000)
    p = place_kv(32, 100, "cpu", headroom=0.1)  # 900 usable: 7 layers + 2 buffers
    assert (p.on_chip_layers, p.device_bytes, p.host_bytes, p.free_device_bytes) == (7, 900, 3200, 1000)
    assert place_kv(8, 100, "cpu", headroom=0.1).on_chip_layers == 8  # all fit: no buffers
    assert place_kv(8, 100, "cpu", headroom=0.1).device_bytes == 800
    assert place_kv(32, 100, "cpu", reserved_bytes=500, headroom=0.1).on_chip_layers == 2
    with pytest.raises(InsufficientMemoryError, match="stream buffers"):
        place_kv(32, 500, "cpu", headroom=0.1)
    assert place_kv(32, 100, "cpu", on_chip_layers=5).on_chip_layers == 5  # given: not chosen
    with pytest.raises(ValueError, match="on_chip_layers"):
        place_kv(32, 100, "cpu", on_chip_layers=33)


def test_engine_rejects_bad_offload_options(models):
    target, _ = models
    with pytest.raises(ValueError, match="on_chip_layers"):
        Engine(target, on_chip_layers=1)  # needs offload_kv
    with pytest.raises(ValueError, match="on_chip_layers"):
        Engine(target, offload_kv=True, on_chip_layers=4)  # 3 layers


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "triforce", *args], capture_output=True, text=True)


def test_cli_offload(tiny_folder):
    base = ["generate", "--model", tiny_folder, "--prompt", "abcabcab", "--max-new-tokens", "8", "--temperature", "0",
            "--json", "--no-progress"]
    r = _cli(*base, "--on-chip-layers", "1")
    assert r.returncode == 2 and "--on-chip-layers needs --offload-kv" in r.stderr
    r = _cli(*base, "--offload-kv", "--on-chip-layers", "9")
    assert r.returncode == 2 and "--on-chip-layers must be an integer in [0, 3]" in r.stderr
    plain, off = _cli(*base), _cli(*base, "--offload-kv", "--on-chip-layers", "1")
    assert off.returncode == 0, off.stderr
    assert "1 of 3 layers on cpu" in off.stderr
    a, b = json.loads(plain.stdout), json.loads(off.stdout)
    assert a["token_ids"] == b["token_ids"] and b["kv_placement"]["on_chip_layers"] == 1


def test_planning_returns_the_placement_and_leaves_a_running_request_alone():
    """The server checks incoming requests (``Engine.plan``, ``choose_auto=False``) on its event loop while another
    one runs: planning must not replace the running request's offloading plan (its stats used to report the
    newcomer's)."""
    target, _ = pair(seed=0)
    engine = Engine(target, offload_kv=True, on_chip_layers=1)
    spec = SpeculationConfig(mode="retrieval", budget=16, chunk_size=4, gamma2=3)
    prompt_a, prompt_b = list(range(3, 40)), list(range(3, 90)) * 2
    plan_a = engine.plan(prompt_a, 12, spec, choose_auto=False).placement
    plan_b = engine.plan(prompt_b, 100, spec, choose_auto=False).placement
    assert engine.placement is None  # planning stored nothing
    assert plan_a.on_chip_layers == plan_b.on_chip_layers == 1 and plan_a.layers == 3
    assert plan_b.host_bytes > plan_a.host_bytes  # a longer request: a larger cache
    assert engine.plan(prompt_a, 12, SpeculationConfig(), choose_auto=False).placement is not None
    assert Engine(target).plan(prompt_a, 12, spec).placement is None  # no offloading, no placement
    gen = engine.stream(prompt_a, max_new_tokens=12, sampling=SamplingParams(temperature=0), spec=spec)
    out = [next(gen), next(gen)]
    assert engine.placement == plan_a
    assert engine.plan(prompt_b, 100, spec, choose_auto=False).placement == plan_b  # another request arrives meanwhile
    rest, stats = drain(gen)
    out += rest
    assert len(out) == 12
    placed = dict(stats.kv_placement)
    assert placed.pop("streamed_bytes") > 0
    assert placed == plan_a.to_dict()
