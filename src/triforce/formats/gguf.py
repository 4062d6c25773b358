"""Reading a GGUF file with transformers' reader: the Hugging Face config, the fp32 state dict, the tokenizer.

Used by the loader (``formats/loading.py``) and by the default model's download (``formats/download.py``), which
converts the embedded GGUF file into a Hugging Face folder once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..model.config import ModelLoadError, check_architecture


def read_gguf(path: str | Path, codes: bool = False) -> tuple[Any, dict[str, Any], Any]:
    """Read a GGUF file: ``(hf_config, state dict in HF names, tokenizer)``, config and tokenizer by transformers.

    Args:
        path: the .gguf file.
        codes: leave the tensors to the caller, who reads them as the file stores them
            (``ggufcodes.read_gguf_codes``; the state is then None); else transformers' reader dequantizes every
            tensor to fp32.

    Raises:
        UnsupportedModelError: an architecture outside :data:`~triforce.model.config.SUPPORTED_ARCHITECTURES`.
        ModelLoadError: the file cannot be parsed.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(path)
    try:
        meta = load_gguf_checkpoint(str(path), return_tensors=False)
    except Exception as e:  # transformers raises ValueError/KeyError/... for files it cannot read
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    check_architecture(meta.get("config", {}).get("model_type"))
    try:  # the config from the metadata just read (AutoConfig.from_pretrained would parse the file again)
        from transformers import CONFIG_MAPPING

        hf_config = CONFIG_MAPPING[meta["config"]["model_type"]].from_dict(dict(meta["config"]))
    except Exception:  # noqa: BLE001  (transformers' own path, slower)
        hf_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if codes:  # the caller reads the tensors as stored (ggufcodes.read_gguf_codes)
        state = None
    else:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(hf_config)
        state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return hf_config, state, tokenizer
