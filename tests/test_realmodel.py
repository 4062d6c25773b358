"""The real model (SmolLM2-135M-Instruct): logits and greedy tokens against transformers, GGUF loading.

Skipped, with the reason, when the model has not been fetched (`triforce download`); .ci/run fetches it.
"""

import pytest
import torch

from triforce import SamplingParams, SpeculationConfig, load_model
from triforce.kv.caches import FullKVCache

pytestmark = pytest.mark.realmodel


@pytest.fixture(scope="module")
def loaded(smollm2):
    torch.set_num_threads(2)
    yield load_model(smollm2)
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def hf(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


def test_logits_match_transformers(loaded, hf, book_text):
    ids = loaded.tokenizer(book_text)["input_ids"][:300]
    x = torch.tensor([ids])
    ours = loaded.model(x, torch.arange(len(ids)), FullKVCache(loaded.model.cfg, len(ids)))
    with torch.no_grad():
        ref = hf(x).logits
    assert (ours - ref).abs().max().item() <= 1e-3  # 30 layers in fp32


def test_greedy_64_tokens_after_1k_book_excerpt_equal_transformers(loaded, hf, book_text):
    from triforce import Engine

    ids = loaded.tokenizer(book_text)["input_ids"][:1024]  # 1K: CI time
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False,
                          eos_token_id=None)[0, len(ids):].tolist()
    engine = Engine(loaded.model, eos_ids=())
    out, _ = engine.generate(ids, max_new_tokens=64, sampling=SamplingParams(temperature=0), spec=SpeculationConfig())
    assert out == ref
    spec = SpeculationConfig(mode="retrieval", budget=128, gamma2=6)  # 1/8 of the context
    spec_out, stats = engine.generate(ids, max_new_tokens=64, sampling=SamplingParams(temperature=0), spec=spec)
    assert spec_out == ref  # retrieval speculation on a real model: the same greedy tokens
    assert stats.tiers["target"]["acceptance_rate"] > 0.2


def test_gguf_file_loads_to_the_same_model(smollm2, loaded):
    from triforce.formats.download import default_gguf_path

    gguf = default_gguf_path()
    if not gguf.is_file():
        pytest.skip(f"GGUF file absent ({gguf})")
    from_gguf = load_model(str(gguf), precision="exact")
    ids = torch.tensor([[504, 2988, 314, 7042]])
    a = from_gguf.model(ids, torch.arange(4), FullKVCache(from_gguf.model.cfg, 4))
    b = loaded.model(ids, torch.arange(4), FullKVCache(loaded.model.cfg, 4))
    assert loaded.model.precision == "exact" and torch.equal(a, b)
    assert from_gguf.tokenizer.get_vocab() == loaded.tokenizer.get_vocab()


def test_the_gguf_file_computes_on_its_own_arithmetic_by_default(smollm2, loaded, book_text):
    """A GGUF file's default is ``file`` (its codes times int8 activations); the folder of the same blocks asked for
    ``file`` computes bitwise the same model; against ``exact`` (transformers' model) the next-token distributions
    stay close on real text (top-1 agreement >= 0.9, mean KL <= 0.05 nats over 200 positions: int8
    activations on a 135M model with 4-bit weights), and they differ (the
    arithmetic is not the fp32 one)."""
    from triforce.formats.download import default_gguf_path

    gguf = default_gguf_path()
    if not gguf.is_file():
        pytest.skip(f"GGUF file absent ({gguf})")
    from_gguf, folder_file = load_model(str(gguf)), load_model(smollm2, precision="file")
    assert from_gguf.model.precision == folder_file.model.precision == "file"
    ids = loaded.tokenizer(book_text)["input_ids"][:200]
    x, pos = torch.tensor([ids]), torch.arange(len(ids))
    with torch.no_grad():
        a, b, exact = (lm.model(x, pos, FullKVCache(lm.model.cfg, len(ids)))[0]
                       for lm in (from_gguf, folder_file, loaded))
    assert torch.equal(a, b)
    la, le = torch.log_softmax(a.double(), -1), torch.log_softmax(exact.double(), -1)
    kl = (la.exp() * (la - le)).sum(-1).mean()
    assert (a.argmax(-1) == exact.argmax(-1)).double().mean() >= 0.9 and kl <= 0.05, float(kl)
    assert not torch.equal(a, exact)


def test_ngram_triforce_on_copied_text_is_lossless_and_accepts_copies(loaded, book_text):
    """A paragraph repeated: greedy SmolLM2 copies it; the n-gram tier proposes the copy and the target accepts."""
    from triforce import Engine

    para = loaded.tokenizer(book_text)["input_ids"][1000:1200]
    ids = para + para + para[:100]
    engine = Engine(loaded.model, eos_ids=())
    ref, _ = engine.generate(ids, max_new_tokens=48, sampling=SamplingParams(temperature=0), spec=SpeculationConfig())
    spec = SpeculationConfig(mode="triforce", drafter="ngram", budget=256, gamma1=8, gamma2=8)
    out, stats = engine.generate(ids, max_new_tokens=48, sampling=SamplingParams(temperature=0), spec=spec)
    assert out == ref
    print(stats.tiers)
    assert stats.tiers["retrieval"]["acceptance_rate"] > 0.5  # n-gram proposals accepted by the retrieval tier
    assert stats.tiers["target"]["mean_tokens_per_verification"] > 3
