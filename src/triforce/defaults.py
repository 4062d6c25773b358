"""Every default of triforce's options, in one place (torch-free).

The library (:class:`~triforce.speculation.hierarchy.SpeculationConfig`,
:class:`~triforce.speculation.sampling.SamplingParams` through its callers,
:class:`~triforce.serve.schema.ServerDefaults`, :func:`~triforce.speculation.auto.plan_hierarchy`), the command line
(``triforce.cli.options`` builds every shared option from these tables), the research tools (``triforce.lab``) and
README's options table read their defaults here; ``tests/test_layout.py`` checks README's table against the parser.

Keys are the options' ``dest`` names (``--chunk-size`` -> ``chunk_size``). None means "off" or "chosen at run
time" (the option's help says how).
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

#: dtypes of weights and KV caches, by name
DTYPE_NAMES = ("float32", "bfloat16", "float16")
#: weights of the ``self`` tier (the target's own weights, quantized; ``model/quant.py``)
SELF_WEIGHTS = ("int4", "int8", "bfloat16")
#: weights of the tiers below the verifier (``--lower-weights``; ``quant.lower_precision_copy``)
LOWER_WEIGHTS = ("int8", "int4", "bfloat16", "codes")
#: every name a dtype option takes, on the command line and in the Python API alike (``--dtype``, ``--kv-dtype``,
#: ``--lower-kv-dtype``; ``dtype``, ``kv_dtype``, ``lower_kv_dtype``) -> its name in :data:`DTYPE_NAMES`; the torch
#: dtypes: ``triforce.kv.caches.KV_DTYPES``. A lower tier's cache may be float32 under a bf16/fp16 verifier
DTYPE_ALIASES = {**{name: name for name in DTYPE_NAMES}, "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: ``--packed-weights`` values
PACKED_WEIGHTS = ("auto", "on", "off")
#: ``--compile`` modes (``torch.compile``)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
#: ``--cuda-graphs`` values
CUDA_GRAPHS = ("on", "off")
#: ``--rope-scaling`` values: the RoPE scalings an override may apply (``config.with_rope_scaling``)
ROPE_SCALINGS = ("yarn", "linear", "dynamic")

#: options shared by ``generate``, ``serve``, ``bench``, ``analyze`` and the Python API
DEFAULTS: dict[str, object] = {
    # model
    "model": None,  # the embedded SmolLM2-135M-Instruct (formats/download.py)
    "draft": None,  # --mode auto picks the bottom tier (speculation/auto.py)
    "dtype": "float32",
    "device": "cpu",
    "threads": None,  # one thread per physical core other programs leave idle (kernels/threads.py)
    "kv_dtype": None,  # as --dtype
    "quantize": None,
    "packed_weights": "auto",
    "compile": None,
    # the retrieval tier's forwards on a GPU (model/cudagraph.py): off until bench/gpu/gpu_check.py has run them on a
    # GPU
    "cuda_graphs": "off",
    "offload_kv": False,
    "on_chip_layers": None,  # chosen by the memory planner
    "prompt_cache": None,  # no prompt cache files (kv/promptcache.py)
    "prompt_cache_max_bytes": None,  # no cap on the directory
    "prompt_cache_min_tokens": 64,  # a request writes its KV when it computed at least this many new tokens
    "rope_scaling": None,  # the checkpoint's RoPE (config.with_rope_scaling: yarn, linear, dynamic)
    "rope_factor": None,  # given with rope_scaling
    "tp": 1,
    # sampling
    "max_new_tokens": 256,
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 0,
    "seed": None,  # random, reported
    # speculation (TriForce, arXiv 2404.11912, Sec. 5: gamma 4 / 6, budget 4096, chunk 8)
    "mode": "auto",
    "gamma1": 4,
    "gamma2": 6,
    "budget": 4096,
    "chunk_size": 8,
    "chunk_score": "mean",
    "rebuild_every": None,
    "rebuild_below": None,
    "stop_below": None,
    "adaptive_gamma": False,
    "draft_sink": 16,
    "draft_window": 240,
    "self_weights": "int4",
    "ngram_n": 4,
    "ngram_min": 3,  # measured best on 4 books x 2 prompt kinds (bench/e2e/beyond.py, docs/history.md)
    "lower_weights": None,
    "lower_kv_dtype": None,
    "tiers": None,
    # batching (continuous batching of concurrent generations, model/batching.py)
    "max_batch": 8,
}

#: ``SpeculationConfig()``'s mode: plain decoding unless the caller asks for a hierarchy (the command line and
#: ``TriForce.stream`` without ``spec`` use ``DEFAULTS["mode"]``, ``auto``)
LIBRARY_MODE = "autoregressive"

#: ``triforce serve`` only
SERVE_DEFAULTS: dict[str, object] = {
    "host": "127.0.0.1",
    "port": 8000,
    "queue_size": 16,
    "prefix_cache_gib": 4.0,  # idle requests' KV caches kept for prefix reuse (the last one is kept even if larger)
    "request_timeout": 600.0,
    "log_level": "info",
}

#: ``triforce bench`` only (shared options: :data:`DEFAULTS`, except where the bench overrides them here)
BENCH_DEFAULTS: dict[str, object] = {
    "prompt_tokens": 8000,
    "new_tokens": 128,
    "reps": 3,
    "seed": 0,  # repetition r uses seed + r
}

#: ``triforce analyze`` only (shared options: :data:`DEFAULTS`, except where the analysis overrides them here)
ANALYZE_DEFAULTS: dict[str, object] = {
    "books": ("pg1342", "pg84", "pg2701"),
    "prompt_tokens": 7500,
    "new_tokens": 256,
    "budgets": (256, 512, 1024, 2048),
    "reselect_every": 8,
    "chunk_sizes": (4, 8, 16, 32),
    "temperatures": (0.0, 0.6, 1.0),
    "base_budget": 1024,
    "base_temperature": 0.6,
    "acceptance_tokens": 128,
    "seed": 0,
    "out": "analysis",
}


def default(name: str, command: str | None = None) -> object:
    """The default of option ``name`` (its ``dest``) for ``command`` (``serve``, ``bench``, ``analyze`` or None).

    The command's own table wins over :data:`DEFAULTS`.

    Raises:
        KeyError: no such option, naming it.
    """
    own = {"serve": SERVE_DEFAULTS, "bench": BENCH_DEFAULTS, "analyze": ANALYZE_DEFAULTS}.get(command or "", {})
    if name in own:
        return own[name]
    if name in DEFAULTS:
        return DEFAULTS[name]
    raise KeyError(f"no default for option {name!r}" + (f" of {command}" if command else ""))


def cache_dir() -> Path:
    """Folder where triforce keeps the default model, built kernels and derived files: ``$TRIFORCE_CACHE``, else the
    user cache folder (``platformdirs.user_cache_dir("triforce")``). Not created here."""
    return Path(os.environ.get("TRIFORCE_CACHE") or platformdirs.user_cache_dir("triforce"))
