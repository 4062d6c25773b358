"""Model configuration: the few numbers our forward pass needs, read from a Hugging Face config.

Supported families (decoder-only, Llama-style blocks: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention):

* ``llama``   Llama 2 / 3 / 3.1 (and anything saved as LlamaForCausalLM, e.g. SmolLM2, LWM, Yarn-Llama-2)
* ``mistral`` Mistral (a sliding window shorter than the request is refused, see :meth:`check_length`)
* ``qwen2``   Qwen2 / Qwen2.5 (bias on the q/k/v projections)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ..defaults import ROPE_SCALINGS
from ..errors import ParameterError

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
        max_position_embeddings: the context in tokens that the length checks use: the one the checkpoint declares,
            or for YaRN the original context times its factor when that is longer (:func:`with_rope_scaling`).
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
            raise UnsupportedModelError(f"num_attention_heads={heads} is not a multiple of "
                                        f"num_key_value_heads={kv_heads}")
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        sliding = None
        if model_type == "mistral":
            sliding = getattr(hf_config, "sliding_window", None)
        elif model_type == "qwen2" and getattr(hf_config, "use_sliding_window", False):
            sliding = getattr(hf_config, "sliding_window", None)
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        max_pos = int(getattr(hf_config, "max_position_embeddings", 4096))
        if rope_type == "yarn":  # the context YaRN scales to (Qwen2.5's card keeps max_position_embeddings at 32768)
            rope.setdefault("original_max_position_embeddings", max_pos)
            if rope.get("factor"):
                max_pos = max(max_pos, int(rope["original_max_position_embeddings"] * float(rope["factor"])))
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
            max_position_embeddings=max_pos,
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


def check_rope_scaling(rope_scaling: str | None, rope_factor: float | None) -> None:
    """Check a RoPE scaling override's arguments (no model needed: run before anything loads).

    Args:
        rope_scaling: None (no override) or one of :data:`~triforce.defaults.ROPE_SCALINGS`: ``yarn``, ``linear``,
            ``dynamic``.
        rope_factor: None, or the scaling factor, a finite number > 1 (the new context over the old one).

    Raises:
        ParameterError (a ValueError): one given without the other (naming both), an unknown type (listing the
            allowed ones), a factor that is not a finite number > 1.
    """
    if rope_scaling is None and rope_factor is None:
        return
    if rope_scaling is None or rope_factor is None:
        given, missing = ("rope_scaling", "rope_factor") if rope_factor is None else ("rope_factor", "rope_scaling")
        raise ParameterError(f"`{given}` needs `{missing}`: give `rope_scaling` (one of {', '.join(ROPE_SCALINGS)}) "
                             "and `rope_factor` together, or neither")
    if rope_scaling not in ROPE_SCALINGS:
        raise ParameterError(f"`rope_scaling` must be one of {', '.join(ROPE_SCALINGS)}, got {rope_scaling!r}")
    if isinstance(rope_factor, bool) or not isinstance(rope_factor, (int, float)) or not math.isfinite(rope_factor) \
            or rope_factor <= 1:
        raise ParameterError(f"`rope_factor` must be a finite number > 1 (the new context over the trained one), "
                             f"got {rope_factor!r}")


def with_rope_scaling(cfg: ModelConfig, rope_type: str, factor: float,
                      original_max_position_embeddings: int | None = None) -> ModelConfig:
    """``cfg`` with its RoPE scaled as transformers scales a checkpoint whose config.json carries ``rope_scaling:
    {"rope_type": rope_type, "factor": factor, "original_max_position_embeddings": old}``.

    This changes the model: its logits differ from the checkpoint's at every position for ``yarn`` and ``linear``
    (past ``old`` for ``dynamic``), and what it does past the trained context is the scaling's, not guaranteed.

    The context the length checks use (``max_position_embeddings``, in tokens) becomes ``int(old * factor)`` for
    ``yarn`` and ``linear``, as llama.cpp's ``--rope-scaling``/``--rope-scale`` and vLLM's ``max_model_len`` take it
    (transformers checks no length; its YaRN validation calls ``max_position_embeddings / old`` the factor). For
    ``dynamic`` it stays ``old``: transformers' dynamic NTK divides by ``max_position_embeddings``, so it must stay
    the trained context, and a dynamic model has no length limit here (``model/rope.py``: the scaling is fixed once per
    request from its length), exactly as a checkpoint saved with dynamic scaling.

    Args:
        cfg: the checkpoint's configuration.
        rope_type: ``yarn``, ``linear`` or ``dynamic`` (:data:`~triforce.defaults.ROPE_SCALINGS`).
        factor: a finite number > 1.
        original_max_position_embeddings: ``old``, the trained context in tokens; None: the checkpoint's
            ``original_max_position_embeddings`` when it already has this scaling type, else its
            ``max_position_embeddings``.

    Returns:
        a new :class:`ModelConfig`; rope_theta and, for the same type, the checkpoint's other scaling keys (YaRN's
        beta_fast, beta_slow, mscale, attention_factor) are kept; ``factor`` and ``original_max_position_embeddings``
        are replaced.

    Raises:
        ParameterError (a ValueError): see :func:`check_rope_scaling`; ``original_max_position_embeddings`` not an
            integer >= 1; a checkpoint whose RoPE is already scaled with another type (naming both types).

    Source: YaRN, Peng et al., arXiv 2309.00071; linear interpolation, Chen et al., arXiv 2306.15595; dynamic NTK and
    the parameters' meaning: transformers' ``modeling_rope_utils`` (``_compute_yarn_parameters``,
    ``_compute_linear_scaling_rope_parameters``, ``_compute_dynamic_ntk_parameters``).
    """
    check_rope_scaling(rope_type, factor)
    old = original_max_position_embeddings
    if old is not None and (isinstance(old, bool) or not isinstance(old, int) or old < 1):
        raise ParameterError(f"`original_max_position_embeddings` must be an integer >= 1 (tokens), got {old!r}")
    current = cfg.rope_type
    if current not in ("default", rope_type):
        raise ParameterError(f"`rope_scaling` {rope_type}: this checkpoint's RoPE is already scaled ({current}, "
                             f"{_describe(cfg.rope_parameters)}); an override may only change a {current} scaling's "
                             f"factor (`rope_scaling` {current}), or leave the checkpoint as it is")
    params = dict(cfg.rope_parameters)
    params.pop("type", None)
    if old is None:
        old = int(params.get("original_max_position_embeddings") or cfg.max_position_embeddings) \
            if current == rope_type and rope_type != "dynamic" else cfg.max_position_embeddings
    if current != rope_type:  # scaling a default RoPE: only its base carries over
        params = {"rope_theta": params.get("rope_theta", 10000.0)}
    params.update(rope_type=rope_type, factor=float(factor))
    if rope_type == "dynamic":
        params.pop("original_max_position_embeddings", None)
        return replace(cfg, rope_parameters=params, max_position_embeddings=int(old))
    params["original_max_position_embeddings"] = int(old)
    return replace(cfg, rope_parameters=params, max_position_embeddings=int(old * float(factor)))


def _describe(params: dict[str, Any]) -> str:
    """``factor 4.0, original context 32768`` of a rope_parameters dict (the keys it has)."""
    keys = (("factor", "factor"), ("original_max_position_embeddings", "original context"))
    return ", ".join(f"{name} {params[k]}" for k, name in keys if params.get(k) is not None) or "no factor"
