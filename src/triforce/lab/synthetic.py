"""Paper-shaped synthetic models for timing only: real layer shapes, random weights, random KV caches.

TriForce's regime (arXiv 2404.11912, Sec. 1 and 3: a KV cache much larger than the weights) needs a 7B-class
target at 16K-128K tokens, which no real checkpoint here provides. These models have the exact layer shapes of
the paper's models, random weights, and caches filled with random keys and values instead of a prefill, so the
*bytes* a decode step moves (weights of each layer + KV cache) are those of the real model, and step latencies can
be timed on a CPU or a GPU. Their tokens mean nothing: never report acceptance or text from them. Every output
made with them carries ``"synthetic": true`` and the shape's name.

``--layers N`` keeps N of the decoder blocks (embedding, LM head and every per-layer shape unchanged), so a 7B
shape fits in memory; per-layer costs (weights and KV) scale linearly in N.

Shapes (Hugging Face ``config.json`` fields, ``LlamaForCausalLM``):

* ``llama2-7b``: meta-llama/Llama-2-7b-hf (Touvron et al., arXiv 2307.09288, Table 1; the Hub's config.json):
  hidden 4096, 32 layers, 32 heads, 32 KV heads (MHA), intermediate 11008, vocab 32000, RoPE theta 10000.
  ``max_position_embeddings`` is raised to 131072, the context of the paper's Llama2-7B-128K targets
  (NousResearch/Yarn-Llama-2-7b-128k, LWM-Text-128K); their RoPE scaling (YaRN, raised theta) changes values, not
  costs, so plain RoPE is kept.
* ``llama3.1-8b``: meta-llama/Llama-3.1-8B (Llama Team, arXiv 2407.21783, Table 3; the Hub's config.json):
  hidden 4096, 32 layers, 32 heads, 8 KV heads (GQA), intermediate 14336, vocab 128256, RoPE theta 500000 with
  ``llama3`` scaling (factor 8, low 1, high 4, original context 8192), context 131072.
* ``llama-68m``: JackFram/llama-68m (Miao et al., SpecInfer, arXiv 2305.09781; the Hub's config.json), the
  paper's draft model (TriForce Sec. 5.1): hidden 768, 2 layers, 12 heads (MHA), intermediate 3072, vocab 32000,
  context 2048 (with a StreamingLLM cache it never sees a distance beyond sink + window).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from ..kv.caches import FullKVCache
from ..kv.retrieval import RetrievalCache
from ..kv.streaming import StreamingCache
from ..model.config import ModelConfig
from ..model.rope import RotaryEmbedding
from ..model.transformer import Transformer

SYNTHETIC_SHAPES: dict[str, dict] = {
    "llama2-7b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "llama3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "llama-68m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 2,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 2,
    },
}


def synthetic_config(name: str, layers: int | None = None, *, vocab_size: int | None = None) -> ModelConfig:
    """The :class:`~triforce.model.config.ModelConfig` of a paper shape, optionally with fewer decoder blocks.

    Args:
        name: a key of :data:`SYNTHETIC_SHAPES` (``llama2-7b``, ``llama3.1-8b``, ``llama-68m``).
        layers: number of decoder blocks to keep, 1 <= layers (None: the shape's own count). More than the shape's
            count is allowed (a deeper model of the same width).
        vocab_size: replace the vocabulary size (e.g. a ``llama-68m`` draft for a ``llama3.1-8b`` target must share
            its 128256-token vocabulary); None keeps the shape's.

    Returns:
        The config, read by :meth:`ModelConfig.from_hf` from the shape's Hugging Face fields (so it is exactly what
        loading a checkpoint with that ``config.json`` would give).

    Raises:
        ValueError: an unknown ``name`` (the valid names are in the message), or ``layers`` / ``vocab_size`` not an
            integer >= 1.
    """
    if name not in SYNTHETIC_SHAPES:
        raise ValueError(f"synthetic shape must be one of {', '.join(SYNTHETIC_SHAPES)}, got {name!r}")
    d = copy.deepcopy(SYNTHETIC_SHAPES[name])
    for arg, value in (("layers", layers), ("vocab_size", vocab_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{arg} must be an integer >= 1, got {value!r}")
    if layers is not None:
        d["num_hidden_layers"] = layers
    if vocab_size is not None:
        d["vocab_size"] = vocab_size
    return ModelConfig.from_hf(SimpleNamespace(**d))


def shape_name(cfg: ModelConfig) -> str | None:
    """The :data:`SYNTHETIC_SHAPES` name whose per-layer shapes ``cfg`` has (any layer count), or None.

    Compares every field of :class:`ModelConfig` except ``num_hidden_layers`` and ``vocab_size``.
    """
    def key(c: ModelConfig) -> dict:
        d = dict(vars(c))
        d.pop("num_hidden_layers")
        d.pop("vocab_size")
        return d

    for name in SYNTHETIC_SHAPES:
        if key(synthetic_config(name)) == key(cfg):
            return name
    return None


@torch.no_grad()
def random_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 seed: int = 0, *, std: float = 0.02, name: str | None = None) -> Transformer:
    """A :class:`~triforce.model.transformer.Transformer` with random weights, for timing (its tokens mean nothing).

    Every linear weight and the embedding are drawn from N(0, std^2) (std 0.02: the ``initializer_range`` of the
    Llama configs), biases are 0, RMSNorm weights 1. The weights are drawn in place on ``device`` with a generator
    seeded by ``seed`` (no Hugging Face state dict is built), so the same arguments give the same model.

    Args:
        cfg: the configuration (e.g. from :func:`synthetic_config`).
        dtype: weights dtype (float32, bfloat16, float16).
        device: torch device.
        seed: seed of the weights.
        std: standard deviation of the weights (> 0). Tests use a larger one for sharp logits.
        name: label; None: the matching :data:`SYNTHETIC_SHAPES` name (see :func:`shape_name`) or ``custom``.

    Returns:
        The model in eval mode, labelled: ``model.synthetic = True``, ``model.name`` (e.g.
        ``"synthetic llama2-7b (2 of 32 layers)"``), ``model.synthetic_shape`` (the shape name) and
        ``model.synthetic_layers`` (its block count).

    Raises:
        ValueError: ``cfg`` is not a ModelConfig, ``dtype`` is not a floating dtype, or ``std`` <= 0.
    """
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig (see synthetic_config), got {type(cfg).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype (float32, bfloat16, float16), got {dtype!r}")
    if not isinstance(std, (int, float)) or not std > 0:
        raise ValueError(f"std must be > 0, got {std!r}")
    device = torch.device(device)
    with torch.device(device):
        model = Transformer(cfg)
    model = model.to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for pname, p in model.named_parameters():
        if pname.endswith("norm.weight"):
            p.fill_(1.0)
        elif pname.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)
    model.rope = RotaryEmbedding(cfg, device=device)
    model.eval()
    shape = shape_name(cfg)
    model.synthetic = True
    model.synthetic_shape = shape or "custom"
    model.synthetic_layers = cfg.num_hidden_layers
    if name is None:
        full = SYNTHETIC_SHAPES[shape]["num_hidden_layers"] if shape else None
        layers = f"{cfg.num_hidden_layers} of {full} layers" if full else f"{cfg.num_hidden_layers} layers"
        name = f"synthetic {shape or 'custom'} ({layers})"
    model.name = name
    return model


def random_query(cfg: ModelConfig, batch: int = 1, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """A random post-RoPE query of every layer, N(0, 1), for :meth:`RetrievalCache.build` without a prefill.

    Returns:
        (L, B, nh, hs) tensor in ``dtype`` (L = ``cfg.num_hidden_layers``, nh query heads, hs head width).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (cfg.num_hidden_layers, batch, cfg.num_attention_heads, cfg.head_dim)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


@torch.no_grad()
def fill_random_kv(cache, length: int, seed: int = 0) -> None:
    """Make ``cache`` represent positions [0, length) with random keys and values, without running a prefill.

    Keys and values are drawn from N(0, 1) in the cache's dtype, on its device, one layer at a time (no fp32 copy
    of the whole cache), with a generator seeded by ``seed``: the same call gives the same cache. Afterwards
    ``cache.length == length`` and the cache serves the next forwards (positions ``length, length + 1, ...``) and
    rollbacks to ``length`` exactly as after a prefill of ``length`` tokens. Timing use only: the KV belongs to no
    token sequence.

    Per cache type:

    * :class:`~triforce.kv.caches.FullKVCache`: slots [0, length) of every layer are filled.
    * :class:`~triforce.kv.streaming.StreamingCache`: the sink slots and the recent window (positions
      ``[max(sink, length - window), length)``) are filled, as the StreamingLLM policy would keep them.
    * :class:`~triforce.kv.retrieval.RetrievalCache`: built (chunk selection, TriForce Sec. 4.1) from its full cache,
      which must already hold ``length`` positions, with :func:`random_query` (seed ``seed``).

    Args:
        cache: one of the three caches above.
        length: positions to represent, 0 <= length <= what the cache can hold.
        seed: random seed.

    Raises:
        ValueError: ``length`` negative or larger than the cache's capacity, or an unsupported cache type.
        CacheError: (RetrievalCache) the full cache holds fewer than ``length`` positions.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be an integer >= 0, got {length!r}")
    if isinstance(cache, RetrievalCache):
        cache.build(length, random_query(cache.cfg, cache.k.shape[1], seed, torch.float32, cache.k.device))
        return
    gen = torch.Generator(device=cache.k.device).manual_seed(seed)
    if isinstance(cache, FullKVCache):
        if length > cache.capacity:
            raise ValueError(f"length must be <= the full KV cache's capacity {cache.capacity}, got {length}")
        for layer in range(cache.k.shape[0]):
            cache.k[layer, :, :, :length].normal_(0.0, 1.0, generator=gen)
            cache.v[layer, :, :, :length].normal_(0.0, 1.0, generator=gen)
        if cache.offload and cache.on_chip_layers:  # the on-chip copies of the leading layers too
            cache.copy_prefix_from(cache, length)
        cache.length = length
        cache.query_start = -1
        cache.queries = [None] * len(cache.queries)
        return
    if isinstance(cache, StreamingCache):
        kept_window = max(0, min(cache.window, length - cache.sink))
        if cache.sink + kept_window > cache.capacity:
            raise ValueError(f"StreamingLLM cache capacity {cache.capacity} < sink + window kept "
                             f"({cache.sink + kept_window})")
        win_start = max(cache.sink, length - cache.window)
        used = min(cache.sink, length) + kept_window
        for layer in range(cache.k.shape[0]):
            cache.k[layer, :, :, :used].normal_(0.0, 1.0, generator=gen)
            cache.v[layer, :, :, :used].normal_(0.0, 1.0, generator=gen)
        cache.win_start = win_start
        cache.length = length
        cache.floor = length  # the filled positions are final: no rollback below them
        return
    raise ValueError(f"cache must be a FullKVCache, StreamingCache or RetrievalCache, got {type(cache).__name__}")


def synthetic_label(shape: str, layers: int, draft_shape: str | None = None) -> dict:
    """The fields every output made with synthetic models carries, e.g.
    ``{"synthetic": True, "synthetic_shape": "llama2-7b", "layers": 2, "synthetic_draft_shape": "llama-68m"}``."""
    out = {"synthetic": True, "synthetic_shape": shape, "layers": layers}
    if draft_shape is not None:
        out["synthetic_draft_shape"] = draft_shape
    return out


__all__ = ["SYNTHETIC_SHAPES", "synthetic_config", "shape_name", "random_model", "random_query", "fill_random_kv",
           "synthetic_label"]
