"""triforce: lossless long-context generation with hierarchical speculative decoding.

Implements TriForce (Sun et al., arXiv 2404.11912): a tiny draft model with a StreamingLLM cache drafts for
the target model over a retrieval-based KV cache, whose tokens the target with its full KV cache verifies.

Where things happen (bottom layer first; a package imports only the ones above it in this list):
    defaults.py, errors.py  every default; errors that name the caller's parameters
    text/          prompts to token ids, token ids to text
    kernels/       C kernels (csrc/), their build, the product dispatch, the row-invariance rule
    kv/            full, retrieval and StreamingLLM KV caches, the prompt cache, memory accounting
    model/         config, RoPE, the forward pass (model/transformer.py), lower-tier weights, batching
    formats/       loading Hugging Face folders and GGUF files, the default model's download
    speculation/   the accept rule (rule.py), sampling, tiers (drafting and verifying), hierarchies, auto
    plan.py        a request sized and placed once (capacities, cache bytes, KV placement)
    engine.py      builds the tiers, prefill, the decode loop, stats
    api.py         text-level API (tokenizer, stop strings)
    cli/, serve/   the command line; the OpenAI-compatible server
    lab/           research tools (bench, analyze, cost model), never imported by the library
"""

from ._version import __version__  # noqa: E402
from .kernels.hugepages import configure_huge_pages  # noqa: E402  (torch-free; must run before the first CPU tensor)
from .kernels.threads import configure_openmp  # noqa: E402  (torch-free; must run before anything imports torch)

configure_openmp()
configure_huge_pages()

from .api import GenerationResult, TokenEvent, TriForce  # noqa: E402
from .engine import MODES, Engine, GenerationStats, SpeculationConfig  # noqa: E402
from .formats.loading import LoadedModel, load_model  # noqa: E402
from .plan import RequestPlan  # noqa: E402
from .speculation.hierarchy import TierSpec  # noqa: E402
from .speculation.sampling import SamplingParams  # noqa: E402

__all__ = ["TriForce", "GenerationResult", "TokenEvent", "Engine", "GenerationStats", "SpeculationConfig", "MODES",
           "TierSpec", "RequestPlan",
           "SamplingParams", "load_model", "LoadedModel", "__version__"]
