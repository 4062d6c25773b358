import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)  # tiny models: one thread avoids OpenMP overhead and contention

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


@pytest.fixture(scope="session")
def smollm2():
    """Folder of the embedded default model; skips (with the reason) when it has not been downloaded."""
    from triforce.download import default_model_dir, is_default_model_present

    if not is_default_model_present():
        pytest.skip(f"SmolLM2-135M-Instruct not in {default_model_dir()}: run `triforce download` first")
    return str(default_model_dir())


@pytest.fixture(scope="session")
def book_text():
    path = os.path.join(BOOKS, "pg1342.txt")
    if not os.path.isfile(path):
        pytest.skip(f"books folder absent ({BOOKS})")
    from triforce.prompts import strip_gutenberg

    with open(path, encoding="utf-8") as f:
        return strip_gutenberg(f.read())
