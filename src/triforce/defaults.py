"""Every default of triforce's options, in one place (torch-free).

The library (:class:`~triforce.speculation.hierarchy.SpeculationConfig`,
:class:`~triforce.speculation.sampling.SamplingParams` through its callers,
:class:`~triforce.serve.schema.ServerDefaults`, :func:`~triforce.speculation.auto.choose_hierarchy`), the command line
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
#: ``--precision`` values: the verifier's arithmetic (``model/precision.py``): ``file`` = a GGUF file's block codes
#: times int8 activations, as llama.cpp computes; ``exact`` = fp32 products over the weights the checkpoint stands for
PRECISIONS = ("file", "exact")
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
    "model": None,  # target: the embedded SmolLM2-135M-Instruct (formats/download.py)
    "draft": None,  # draft model: --mode auto picks the bottom tier (speculation/auto.py)
    "dtype": "float32",  # weights and KV dtype
    "device": "cpu",  # torch device
    "threads": None,  # CPU threads: one per physical core other programs leave idle (kernels/threads.py)
    "kv_dtype": None,  # dtype of every KV cache: as --dtype
    "quantize": None,  # weight-only quantization of the target itself: none
    "precision": None,  # the models' arithmetic: file for a GGUF file on the CPU in fp32, else exact
    "packed_weights": "auto",  # oneDNN-prepacked fp32 weights on the CPU (Transformer.packing_pays)
    "compile": None,  # torch.compile mode: none
    "cuda_graphs": "off",  # the retrieval and draft tiers' forwards replayed as CUDA graphs (model/cudagraph.py)
    "offload_kv": False,  # full KV cache in host memory, streamed layer by layer
    "on_chip_layers": None,  # with offload_kv, layers kept on the device: chosen by the memory planner
    "prompt_cache": None,  # prompt cache directory (kv/promptcache.py): none
    "prompt_cache_max_bytes": None,  # cap on the prompt cache directory, bytes: none
    "prompt_cache_min_tokens": 64,  # tokens a request must compute (not reuse) before it writes its KV, tokens
    "rope_scaling": None,  # RoPE override (config.with_rope_scaling: yarn, linear, dynamic): the checkpoint's RoPE
    "rope_factor": None,  # the factor of rope_scaling (> 1)
    "tp": 1,  # tensor-parallel ranks
    # sampling
    "max_new_tokens": 256,  # tokens generated at most
    "temperature": 0.6,  # 0: greedy
    "top_p": 0.9,  # nucleus mass, in (0, 1]
    "top_k": 0,  # 0: off
    "seed": None,  # random, reported
    # speculation (TriForce, arXiv 2404.11912, Sec. 5: gamma 4 / 6, budget 4096, chunk 8)
    "mode": "auto",  # hierarchy chosen per request (speculation/auto.py)
    "gamma1": 4,  # tokens the draft tier proposes per retrieval-tier verification
    "gamma2": 6,  # tokens proposed per target verification
    "budget": 4096,  # retrieval cache slots per layer and KV head
    "chunk_size": 8,  # tokens per retrieval chunk
    "chunk_score": "mean",  # retrieval chunk score (kv/retrieval.py: CHUNK_SCORES)
    "rebuild_every": None,  # re-select retrieval chunks every N tokens: never
    "rebuild_below": None,  # re-select when the retrieval tier's recent acceptance falls below this fraction: never
    "stop_below": None,  # model drafters end a proposal before a token below this confidence: off
    "adaptive_gamma": False,  # adapt each verifier's gamma from its last block
    "draft_sink": 16,  # StreamingLLM sink tokens of the draft cache
    "draft_window": 240,  # StreamingLLM recent-window tokens of the draft cache
    "self_weights": "int4",  # weights of the ``self`` tier (model/quant.py)
    "ngram_n": 4,  # longest suffix the n-gram drafter matches, tokens
    "ngram_min": 3,  # shortest suffix the n-gram drafter may match, tokens
    "lower_weights": None,  # weights of the tiers below the verifier: as loaded (--mode auto: codes where present)
    "lower_kv_dtype": None,  # dtype of the retrieval and draft caches: as kv_dtype
    "tiers": None,  # explicit hierarchy (KIND:GAMMA,...): none, --mode decides
    # batching (continuous batching of concurrent generations, model/batching.py)
    "max_batch": 8,  # generations run at once
}

#: ``SpeculationConfig()``'s mode: plain decoding unless the caller asks for a hierarchy (the command line and
#: ``TriForce.stream`` without ``spec`` use ``DEFAULTS["mode"]``, ``auto``)
LIBRARY_MODE = "autoregressive"

#: ``triforce serve`` only
SERVE_DEFAULTS: dict[str, object] = {
    "host": "127.0.0.1",  # address to bind
    "port": 8000,  # TCP port
    "queue_size": 16,  # requests waiting beyond the running ones; more get 503
    "prefix_cache_gib": 4.0,  # KV of idle requests kept for prefix reuse, GiB (the last one's kept even if larger)
    "request_timeout": 600.0,  # seconds from a request's arrival until its generation ends
    "log_level": "info",  # uvicorn's log level
}

#: ``triforce bench`` only (shared options: :data:`DEFAULTS`, except where the bench overrides them here)
BENCH_DEFAULTS: dict[str, object] = {
    "prompt_tokens": 8000,  # the prompt's first tokens kept
    "new_tokens": 128,  # tokens generated per run
    "reps": 3,  # timed repetitions of every method
    "seed": 0,  # repetition r uses seed + r
}

#: ``triforce analyze`` only (shared options: :data:`DEFAULTS`, except where the analysis overrides them here)
ANALYZE_DEFAULTS: dict[str, object] = {
    "books": ("pg1342", "pg84", "pg2701"),  # books folder names (lab/books.py)
    "prompt_tokens": 7500,  # each book's first tokens
    "new_tokens": 256,  # locality: tokens generated per book
    "budgets": (256, 512, 1024, 2048),  # retrieval budgets analysed, slots
    "reselect_every": 8,  # locality: steps between two re-chosen reference selections
    "chunk_sizes": (4, 8, 16, 32),  # acceptance: chunk sizes swept, tokens
    "temperatures": (0.0, 0.6, 1.0),  # acceptance: temperatures swept
    "base_budget": 1024,  # acceptance: the budget the other sweeps hold, slots
    "base_temperature": 0.6,  # acceptance: the temperature the other sweeps hold
    "acceptance_tokens": 128,  # acceptance: tokens generated per run
    "seed": 0,  # seed of every acceptance run
    "out": "analysis",  # output folder
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
