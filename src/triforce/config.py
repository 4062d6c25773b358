"""Model configuration: the few numbers our forward pass needs, read from a Hugging Face config.

Supported families (decoder-only, Llama-style blocks: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention):

* ``llama``   Llama 2 / 3 / 3.1 (and anything saved as LlamaForCausalLM, e.g. SmolLM2, LWM, Yarn-Llama-2)
* ``mistral`` Mistral (a sliding window shorter than the request is refused, see :meth:`check_length`)
* ``qwen2``   Qwen2 / Qwen2.5 (bias on the q/k/v projections)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


class UnsupportedModelError(ValueError):
    """Raised for a checkpoint whose architecture or RoPE variant we do not implement."""


class ModelLoadError(ValueError):
    """A model source could not be found, read or fetched; the message says which and why."""


def check_architecture(model_type: str | None) -> None:
    """Raise :class:`UnsupportedModelError` (listing the supported ones) unless ``model_type`` is one of
    :data:`SUPPORTED_ARCHITECTURES`."""
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported architecture {model_type!r}: triforce runs "
                                    f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama 2/3/3.1, Mistral, Qwen2/2.5)")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a Llama-family decoder.

    Built from a Hugging Face config with :meth:`from_hf`. All sizes are counts (not bytes).

    Attributes:
        model_type: one of :data:`SUPPORTED_ARCHITECTURES`.
        vocab_size: V, rows of the embedding and of the LM head.
        hidden_size: model width d.
        intermediate_size: width of the SwiGLU MLP.
        num_hidden_layers: number of decoder blocks L.
        num_attention_heads: query heads nh.
        num_key_value_heads: key/value heads nkv (nh % nkv == 0; GQA group size nh // nkv).
        head_dim: per-head width hs.
        rms_norm_eps: epsilon of RMSNorm.
        max_position_embeddings: the context the checkpoint declares.
        rope_parameters: Hugging Face ``rope_parameters`` dict (``rope_type``, ``rope_theta``, scaling keys).
        qkv_bias: bias on the q/k/v projections (Qwen2, Llama ``attention_bias``).
        o_bias: bias on the output projection (Llama ``attention_bias``).
        mlp_bias: bias on the MLP projections (Llama ``mlp_bias``).
        tie_word_embeddings: the LM head reuses the embedding matrix.
        sliding_window: Mistral/Qwen2 attention window in tokens, or None.
        eos_token_ids: end-of-sequence ids declared by the config.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rope_type(self) -> str:
        """The RoPE variant: default, linear, dynamic, yarn or llama3."""
        return self.rope_parameters.get("rope_type", self.rope_parameters.get("type", "default"))

    @property
    def num_kv_groups(self) -> int:
        """Query heads served by each key/value head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        """Read a ``transformers.PretrainedConfig`` (or anything with the same attributes).

        Raises:
            UnsupportedModelError: the ``model_type`` is not one of :data:`SUPPORTED_ARCHITECTURES`, or the RoPE
                type is not one of :data:`SUPPORTED_ROPE_TYPES`; the message lists the supported values.
        """
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {model_type!r}: triforce runs {', '.join(SUPPORTED_ARCHITECTURES)} "
                "(Llama 2/3/3.1, Mistral, Qwen2/2.5 and checkpoints saved in those formats)"
            )
        rope = _rope_parameters(hf_config)
        rope_type = rope.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported RoPE type {rope_type!r}: supported are {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        if heads % kv_heads:
            raise UnsupportedModelError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        sliding = None
        if model_type == "mistral":
            sliding = getattr(hf_config, "sliding_window", None)
        elif model_type == "qwen2" and getattr(hf_config, "use_sliding_window", False):
            sliding = getattr(hf_config, "sliding_window", None)
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
            max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 4096)),
            rope_parameters=rope,
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=attention_bias if model_type == "llama" else False,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)) if model_type == "llama" else False,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            sliding_window=int(sliding) if sliding else None,
            eos_token_ids=eos_ids,
        )

    def check_length(self, total_tokens: int) -> None:
        """Refuse a request that a sliding-window model would attend to differently than we do.

        We implement full attention. A Mistral/Qwen2 config whose ``sliding_window`` is shorter than the request
        (prompt + new tokens + speculation block) would need the window, which we do not implement.

        Raises:
            ValueError: naming ``sliding_window`` and the two lengths.
        """
        if self.sliding_window is not None and total_tokens > self.sliding_window:
            raise ValueError(
                f"this {self.model_type} checkpoint uses sliding_window={self.sliding_window} tokens, shorter than the "
                f"request ({total_tokens} tokens); triforce implements full attention only, so shorten the prompt or "
                "max_new_tokens to at most the window"
            )


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    """Normalise RoPE settings across transformers versions (``rope_parameters`` in v5, ``rope_scaling`` before)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        out = dict(params)
    else:
        out = dict(getattr(hf_config, "rope_scaling", None) or {})
        out.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out.pop("type")
    out.setdefault("rope_type", "default")
    out.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return out
