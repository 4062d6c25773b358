"""The paper's analyses on a real model and real text: ``triforce analyze`` (TriForce, arXiv 2404.11912, Sec. 3).

Three analyses, each a plain dict (JSON-ready) and a PNG chart:

* **Attention recovery** (Sec. 3.1, Fig. 2, "attention sparsity"): the share of the last prompt token's attention
  mass that falls on the positions a retrieval cache of ``budget`` slots keeps, per layer, for each chunk score
  (``mean``: the paper's q . mean key; ``max``; ``bound``: Quest's) and for the ``oracle`` (the best individual
  tokens of each query head).
* **Contextual locality** (Sec. 3.2): the recovery, over the next generated tokens, of the chunks chosen once at the
  last prompt token, against chunks re-chosen with each token's own query (the reference line).
* **Acceptance** (Sec. 4.1, tier 1): the acceptance rate of mode ``retrieval`` (the target over a retrieval cache
  drafting for the target over its full cache) against budget, chunk size, temperature and context length.

Definitions shared by the first two (and by ``bench/acceptance/recovery.py``):

* queries and keys are post-RoPE, exactly as the model's attention receives them (``FullKVCache(record_queries=
  True)``); attention probabilities are recomputed in float64 from them;
* the query at position q attends over keys [0, q); its own key, present in every cache, is left out of both the
  kept and the total mass;
* the chunk selection is ``RetrievalCache.build`` itself, run at length n = P - 1 (P prompt tokens) with the last
  prompt token's query, as the engine builds it. Its ranking does not depend on the budget (a budget keeps the first
  ``min(budget, n)`` ranked positions), so one build at the largest budget serves every budget;
* recovery of a query head = sum of its softmax over the kept keys; reported values are means over query heads
  (and layers, where said).

The ``triforce analyze`` subcommand (parser: ``triforce.cli.analyze``; :func:`~triforce.lab.analyze.run.cmd_analyze`)
runs the three on a model and books and writes ``recovery.json/.png``, ``locality.json/.png`` and
``acceptance.json/.png``.

Modules: ``attention`` (prefill with recorded queries, attention probabilities, chunk rankings, recovery and
locality), ``acceptance`` (the acceptance sweeps), ``summaries`` (means over books, tables), ``plots`` (PNG charts),
``run`` (option checks and ``cmd_analyze``).
"""

from .acceptance import acceptance_points, run_acceptance
from .attention import (
                        ANALYSES,
                        ORACLE,
                        attention_probs,
                        chunk_ranking,
                        locality_after_prompt,
                        prefill_recorded,
                        recovery_at_query,
)
from .summaries import summarize_acceptance, summarize_locality, summarize_recovery

__all__ = ["acceptance_points", "run_acceptance", "ANALYSES", "ORACLE", "attention_probs", "chunk_ranking",
           "locality_after_prompt", "prefill_recorded", "recovery_at_query", "summarize_acceptance",
           "summarize_locality", "summarize_recovery"]
