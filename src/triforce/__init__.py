"""triforce: lossless long-context generation with hierarchical speculative decoding.

Implements TriForce (Sun et al., arXiv 2404.11912): a tiny draft model with a StreamingLLM cache drafts for
the target model over a retrieval-based KV cache, whose tokens the target with its full KV cache verifies.

Where things happen:
    model.py        the forward pass (explicit KV cache object + absolute positions)
    caches.py       full, retrieval and StreamingLLM KV caches
    sampling.py     temperature / top-k / top-p, identical in every tier
    speculative.py  the acceptance rule: accepted, recovered and bonus tokens
    tiers.py        drafting, verifying and accepting, tier by tier
    hierarchy.py    the hierarchy: tier specs, --mode presets; defaults.py every default
    plan.py         a request sized and placed once (capacities, cache bytes, KV placement)
    engine.py       builds the tiers, prefill, the decode loop, stats
    api.py          text-level API (tokenizer, stop strings)
    cli/, serve/    the command line; the OpenAI-compatible server
    lab/            research tools (bench, analyze, cost model), never imported by the library
"""

__version__ = "0.1.0"

from .hugepages import configure_huge_pages  # noqa: E402  (torch-free; must run before the first CPU tensor)
from .threads import configure_openmp  # noqa: E402  (torch-free; must run before anything imports torch)

configure_openmp()
configure_huge_pages()

from .api import GenerationResult, TokenEvent, TriForce  # noqa: E402
from .engine import MODES, Engine, GenerationStats, SpeculationConfig  # noqa: E402
from .hierarchy import TierSpec  # noqa: E402
from .loading import LoadedModel, load_model  # noqa: E402
from .plan import RequestPlan  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__all__ = ["TriForce", "GenerationResult", "TokenEvent", "Engine", "GenerationStats", "SpeculationConfig", "MODES",
           "TierSpec", "RequestPlan",
           "SamplingParams", "load_model", "LoadedModel", "__version__"]
