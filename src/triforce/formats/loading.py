"""Loading a model and its tokenizer from any source, with one function: :func:`load_model`.

Sources, in the order they are tried:

1. ``None``: the embedded default model (SmolLM2-135M-Instruct), fetched once (see ``formats/download.py``);
2. a GGUF file (``*.gguf``), or a folder holding exactly one GGUF file and no config.json, read and
   dequantized by transformers' GGUF reader;
3. a local Hugging Face folder: ``config.json`` + safetensors (one file or shards with an index);
4. a Hugging Face hub id (``org/name``), fetched with huggingface_hub where the network allows.

The tokenizer always comes from transformers (``AutoTokenizer``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..kv.caches import KV_DTYPES
from ..kv.memory import check_fits
from ..model.config import (  # noqa: F401  (re-exported)
    ModelConfig,
    ModelLoadError,
    UnsupportedModelError,
    check_architecture,
    check_rope_scaling,
    with_rope_scaling,
)
from ..model.precision import check_precision, set_precision
from ..model.transformer import Transformer
from .gguf import read_gguf


@dataclass
class LoadedModel:
    """A model ready to run.

    Attributes:
        model: our :class:`~triforce.model.transformer.Transformer`. tokenizer: the transformers tokenizer. hf_config:
        the transformers config it was read from. source: where it came from (path or hub id).
    """

    model: Transformer
    tokenizer: Any
    hf_config: Any
    source: str

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids: the tokenizer's EOS plus the config's."""
        ids = set(self.model.cfg.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` (or fp32/bf16/fp16, or a torch dtype) -> torch dtype.

    Raises:
        ValueError: any other value, listing the allowed ones.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in KV_DTYPES.values():
            return dtype
        raise ValueError(f"dtype must be one of {', '.join(KV_DTYPES)}, got {dtype}")
    if dtype not in KV_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(KV_DTYPES)}, got {dtype!r}")
    return KV_DTYPES[dtype]


def parse_device(device: str | torch.device) -> torch.device:
    """A torch device that exists here (``cpu``, ``cuda``, ``cuda:N``).

    Raises:
        ValueError: an unknown device string, or CUDA requested where it is not available (naming ``device``).
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available on this machine; use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA devices here")
    elif dev.type != "cpu":
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    return dev


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no safetensors weights in {folder} (expected model.safetensors or an index with shards)")
    return files


def _read_folder(folder: Path, dtype: torch.dtype, device: str | torch.device, tp=None, rope=None):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    raw = json.loads((folder / "config.json").read_text())
    check_architecture(raw.get("model_type"))
    hf_config = AutoConfig.from_pretrained(str(folder))
    _scaled(ModelConfig.from_hf(hf_config), rope)  # refuse an override the checkpoint's RoPE forbids before any weight
    if tp is not None:  # refuse a size that does not divide the heads before reading any weight
        from ..model.parallel import check_tp_size

        check_tp_size(ModelConfig.from_hf(hf_config), tp.world_size)
    files = _safetensors_files(folder)
    stored = _keeps_stored(dtype, device, tp)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = 0
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                s = sf.get_slice(name)
                two = stored and s.get_dtype() in ("BF16", "F16")
                nbytes += _prod(s.get_shape()) * (2 if two else itemsize)
    from ..model.parallel import agree_on_fit

    agree_on_fit(tp, lambda: check_fits({"weights": nbytes}, device, f"model {folder.name}"))
    state: dict[str, Any] = {}
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if stored and tied and name == "lm_head.weight":
                    continue  # tied: the head is the embedding's matrix, kept once
                state[name] = _as_stored(name, sf.get_tensor(name), dtype, state, tied) if stored else \
                    sf.get_tensor(name).to(dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return hf_config, state, tokenizer


def _keeps_stored(dtype: torch.dtype, device: torch.device, tp) -> bool:
    """Whether weights stay as the file stores them (GGUF block codes, a checkpoint's bf16/fp16 matrices): an fp32
    model on the CPU, one process, where the block-code kernel runs (``kernels/blockcodes.py``)."""
    from ..kernels.blockcodes import blockcodes_status

    return dtype == torch.float32 and device.type == "cpu" and tp is None and blockcodes_status().startswith("on")


def _as_stored(name: str, tensor: torch.Tensor, dtype: torch.dtype, state: dict, tied: bool):
    """A checkpoint tensor for the model: a bf16/fp16 projection or LM head kept at 2 bytes
    (:func:`~triforce.kernels.codes.codes_from_16bit`), its token embedding as
    :class:`~triforce.kernels.stored.Rows16` (tied: the head's codes, which it also writes to ``state``), anything else
    converted to ``dtype``."""
    from ..kernels.codes import WIDTH16_DTYPES, codes_from_16bit
    from ..kernels.stored import Rows16

    if tensor.dtype not in WIDTH16_DTYPES or tensor.dim() != 2:
        return tensor.to(dtype)
    if name.endswith("embed_tokens.weight"):
        if not tied:
            return Rows16(table=tensor)
        codes = codes_from_16bit(tensor)
        if codes is None:
            return tensor.to(dtype)
        state["lm_head.weight"] = codes
        return Rows16(codes=codes)
    if name.endswith("_proj.weight") or name == "lm_head.weight":
        codes = codes_from_16bit(tensor)
        if codes is not None:
            return codes
    return tensor.to(dtype)


def _read_gguf_as(path: Path, dtype: torch.dtype, device: torch.device, tp, rope=None):
    """A GGUF file's config, state and tokenizer: its quantized matrices kept as the file stores them (block codes,
    ``formats/ggufcodes.py``) for an fp32 model on the CPU where the block-code kernel runs, else dequantized to
    ``dtype``."""
    if _keeps_stored(dtype, device, tp):
        from .ggufcodes import read_gguf_codes

        hf_config, _, tokenizer = read_gguf(path, codes=True)
        cfg = _scaled(ModelConfig.from_hf(hf_config), rope)
        try:
            state = read_gguf_codes(path, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings)
        except ValueError as e:
            raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
        return hf_config, state, tokenizer
    hf_config, state, tokenizer = read_gguf(path)
    return hf_config, {k: v.to(dtype) for k, v in state.items()}, tokenizer


def _scaled(cfg: ModelConfig, rope: tuple[str, float] | None) -> ModelConfig:
    """``cfg`` under the RoPE scaling override ``(rope_scaling, rope_factor)``
    (:func:`~triforce.model.config.with_rope_scaling`; None: ``cfg`` itself)."""
    return cfg if rope is None else with_rope_scaling(cfg, *rope)


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _gguf_source(path: Path) -> bool:
    """Whether ``path`` is a GGUF file, or a folder that holds exactly one and no config.json."""
    if path.is_file():
        return path.suffix == ".gguf"
    return path.is_dir() and not (path / "config.json").is_file() and len(list(path.glob("*.gguf"))) == 1


def _looks_like_hub_id(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "/", "~"))


def load_model(source: str | os.PathLike | None = None, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", tp=None, rope_scaling: str | None = None,
               rope_factor: float | None = None, precision: str | None = None) -> LoadedModel:
    """Load a Llama-family model and its tokenizer from a folder, a GGUF file, a hub id, or the default model.

    Args:
        source: see the module docstring; None loads the embedded default (downloading it once). dtype: weights and
        KV-cache dtype: float32, bfloat16 or float16. device: torch device string (``cpu``, ``cuda``, ``cuda:1``). tp: a
        :class:`~triforce.model.parallel.TensorParallel`: load only this rank's shard (see ``model/parallel.py``).
        rope_scaling, rope_factor: a RoPE scaling override, given together: ``yarn``, ``linear`` or ``dynamic`` and a
            factor > 1 (``rope_scaling="yarn", rope_factor=4.0``: Qwen2.5's 32K to 128K). The model is the checkpoint
            with ``rope_scaling: {"rope_type": ..., "factor": ..., "original_max_position_embeddings": its
            context}`` in its config.json, and its context becomes ``int(context * factor)`` (yarn, linear; dynamic:
            no limit): :func:`~triforce.model.config.with_rope_scaling`. It changes the model's outputs. None: the
            checkpoint's RoPE.
        precision: the model's arithmetic (:mod:`triforce.model.precision`): ``"file"`` (a GGUF file's block codes
            times int8 activations, as llama.cpp computes), ``"exact"`` (fp32 products over the weights the file
            stands for, transformers' model), or None: ``file`` for a GGUF file on the CPU in fp32, else ``exact``
            (a Hugging Face folder whose weights are a GGUF file's blocks, as the default model's, takes ``file``
            when asked).

    Returns:
        :class:`LoadedModel`.

    Raises:
        ModelLoadError: the source does not exist, has no weights, or cannot be fetched.
        UnsupportedModelError: an architecture we do not run (the message lists the supported ones).
        InsufficientMemoryError: the weights do not fit in free memory (both figures in the message).
        ValueError: an unknown dtype, or a ``tp`` size that does not divide the heads (valid sizes listed); a bad RoPE
            override (before anything is read: one of the pair without the other, an unknown type, a factor not > 1;
            before the weights are read, except for a GGUF file read in fp32 blocks: a checkpoint whose RoPE is
            already scaled with another type); an unknown ``precision``, or ``"file"`` off the CPU or in another dtype
            than fp32 (before anything is read), or for weights that are no block codes (after the load).
    """
    check_rope_scaling(rope_scaling, rope_factor)
    check_precision(precision)
    rope = None if rope_scaling is None else (rope_scaling, rope_factor)
    torch_dtype = parse_dtype(dtype)
    device = parse_device(device)
    if source is not None and not isinstance(source, (str, os.PathLike)):
        raise ModelLoadError(f"model source must be a path or hub id string, got {source!r}")
    if source is None:
        from .download import download_default_model

        source = str(download_default_model())
    source = str(source)
    path = Path(source).expanduser()
    if precision == "file" and not (torch_dtype == torch.float32 and device.type == "cpu"):
        raise ValueError(f"precision='file' is a GGUF file's own arithmetic on the CPU in fp32, not dtype {dtype} on "
                         f"device {device}: use precision='exact' or None")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {path} is not a .gguf file; pass a GGUF file or a Hugging Face folder")
        hf_config, state, tokenizer = _read_gguf_as(path, torch_dtype, device, tp, rope)
    elif path.is_dir():
        if (path / "config.json").is_file():
            hf_config, state, tokenizer = _read_folder(path, torch_dtype, device, tp, rope)
        else:
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) != 1:
                raise ModelLoadError(f"folder {path} has no config.json and {len(ggufs)} GGUF files; expected a "
                                     "Hugging Face folder (config.json + safetensors) or exactly one .gguf file")
            hf_config, state, tokenizer = _read_gguf_as(ggufs[0], torch_dtype, device, tp, rope)
    elif _looks_like_hub_id(source):
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model",
                                                               "*.txt"])
        except Exception as e:  # network errors, unknown repo, gated repo
            raise ModelLoadError(f"could not fetch {source!r} from the Hugging Face hub ({type(e).__name__}); "
                                 "pass a local folder or GGUF file instead") from e
        return load_model(folder, dtype, device, tp, rope_scaling, rope_factor, precision)
    else:
        raise ModelLoadError(f"model {source!r} not found: pass a local Hugging Face folder, a .gguf file, or a hub "
                             "id like 'org/name'")
    cfg = _scaled(ModelConfig.from_hf(hf_config), rope)
    model = Transformer.from_state_dict(cfg, state, dtype=torch_dtype, device=device if tp is None else tp.device,
                                        tp=tp, consume=True)
    model.attach_block_codes()  # a GGUF model's exact 4/8-bit codes: the same fp32 products from fewer bytes
    # a Hugging Face checkpoint computes exactly unless asked (its weights may be a GGUF file's blocks: the default)
    set_precision(model, precision if _gguf_source(path) else precision or "exact")
    return LoadedModel(model, tokenizer, hf_config, source)
