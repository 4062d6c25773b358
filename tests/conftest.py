import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)  # tiny models: one thread avoids OpenMP overhead and contention


def _use_build(monkeypatch, module, attr: str, native_status: str, build, isa: str) -> None:
    """Swap ``module.attr`` (a kernel library) for its ``isa`` build ``build(isa)``; skips where the native build is
    that one or it does not load."""
    if isa in native_status:
        pytest.skip(f"the native build is the {isa} one")
    forced = build(isa)
    if forced.load() is None:
        pytest.skip(f"{isa} build {forced.status}")
    monkeypatch.setattr(module, attr, forced)


def use_avx2_build(monkeypatch, module, attr: str, native_status: str, build):
    """Swap ``module.attr`` for its AVX2 build, so that the AVX2 path is checked on an AVX-512 machine (skips where
    the native build is the AVX2 one or the AVX2 build does not load)."""
    _use_build(monkeypatch, module, attr, native_status, build, "AVX2")


def use_portable_build(monkeypatch, module, attr: str, native_status: str, build):
    """Swap ``module.attr`` for its portable build (plain C, no ISA flags: what a CPU without AVX2, or aarch64, runs),
    so that it is checked on an AVX2 or AVX-512 machine (skips where the native build is the portable one or the
    portable build does not load)."""
    _use_build(monkeypatch, module, attr, native_status, build, "portable")


@pytest.fixture(params=["native", "avx2", "portable"])
def blockcode_build(request, monkeypatch):
    """The block-code kernels as this CPU's build (AVX-512 or AVX2), the AVX2 build too where the native one is
    AVX-512, and the portable build (with the portable linear kernels, which its exact products equal bitwise), so
    every path of csrc/blockcodes.c this CPU runs is checked."""
    from triforce.kernels import blockcodes
    from triforce.kernels import cpu as kernels

    if request.param == "avx2":
        use_avx2_build(monkeypatch, blockcodes, "_blockcodes", blockcodes.blockcodes_status(),
                       blockcodes.blockcodes_build)
    if request.param == "portable":
        use_portable_build(monkeypatch, blockcodes, "_blockcodes", blockcodes.blockcodes_status(),
                           blockcodes.blockcodes_build)
        use_portable_build(monkeypatch, kernels, "_linear", kernels.linear_status(), kernels.linear_build)
    return request.param


BOOKS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "books")


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A tiny Llama target saved as a Hugging Face folder (config.json + safetensors + tokenizer)."""
    from tiny import save_folder

    path = tmp_path_factory.mktemp("tiny_target")
    save_folder(path, seed=0, layers=3)
    return str(path)


@pytest.fixture(scope="session")
def tiny_draft_folder(tmp_path_factory):
    from tiny import save_folder

    path = tmp_path_factory.mktemp("tiny_draft")
    save_folder(path, seed=1000, layers=1, hidden=32, heads=2, kv_heads=1)
    return str(path)


@pytest.fixture(scope="module")
def distribution_models():
    """``(target_hf, target, draft, prompt)`` of the exact-distribution tests (``distribution.py``)."""
    from distribution import distribution_models

    return distribution_models()


@pytest.fixture(scope="module")
def tiny_engine():
    """An Engine over ``tiny.pair(seed=0)``: a 3-layer target and a 1-layer draft on a 96-token vocabulary."""
    from tiny import pair
    from triforce.engine import Engine

    target, draft = pair(seed=0)
    return Engine(target, draft)


@pytest.fixture(scope="session")
def smollm2():
    """Folder of the embedded default model; skips (with the reason) when it has not been downloaded."""
    from triforce.formats.download import default_model_dir, is_default_model_present

    if not is_default_model_present():
        pytest.skip(f"SmolLM2-135M-Instruct not in {default_model_dir()}: run `triforce download` first")
    return str(default_model_dir())


@pytest.fixture(scope="session")
def book_text():
    path = os.path.join(BOOKS, "pg1342.txt")
    if not os.path.isfile(path):
        pytest.skip(f"books folder absent ({BOOKS})")
    from triforce.text.prompts import strip_gutenberg

    with open(path, encoding="utf-8") as f:
        return strip_gutenberg(f.read())
