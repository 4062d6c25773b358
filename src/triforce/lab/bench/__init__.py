"""``triforce bench``: side-by-side decode speed of triforce and its peers, in one run.

Every method decodes the same prompt token ids with the same model, sampling, dtype and threads:

==================  ====================================================================================
``hf-ar``           transformers ``generate``, autoregressive (dynamic cache)
``hf-assisted``     transformers assisted generation with the draft model (``assistant_model=``; needs
                    ``--draft MODEL``)
``hf-lookup``       transformers prompt lookup decoding (``prompt_lookup_num_tokens=gamma2``)
``auto``            ours, the default mode: hierarchy chosen per request, bypassed while it does not pay
``autoregressive``  ours, one token per target forward
``self``            ours, the target's int4 copy over a StreamingLLM cache under the target (``--draft self``)
``draft``           ours, the draft tier (draft model + StreamingLLM cache, or the n-gram drafter) under the target
``retrieval``       ours, target + retrieval cache under target + full cache (TriForce Sec. 4.1)
``triforce``        ours, draft (or n-gram) -> retrieval -> full (TriForce Sec. 4.2)
``retrieval-int8``  ours, ``retrieval`` with int8 weights and a bf16 cache in the retrieval tier (``model/quant.py``)
``triforce-int8``   ours, ``triforce`` with int8 weights and bf16 caches in every tier below the verifier
``retrieval-codes`` ours, ``retrieval`` with ``--lower-weights codes``: the GGUF model's own block codes times
                    int8 activations in the retrieval tier (``model/quant.py``)
``autoregressive-exact``, ``auto-exact``
                    ours, with ``--precision exact`` (fp32 products over the weights a GGUF file stands for),
                    beside the default, the file's own arithmetic (``model/precision.py``)
``llama.cpp``       llama-cpp-python on the model's GGUF file (its own weights, Q4_1 for the default model, and
                    f16 KV cache); only when ``llama_cpp`` is importable
==================  ====================================================================================

Without ``--draft MODEL`` the bottom tier of ``draft`` and ``triforce`` is the model-free n-gram drafter
(``SpeculationConfig(drafter="ngram")``).

How it measures (the definitions are also written into the JSON, field ``definitions``):

* One long-lived worker subprocess per method (``python -m triforce.lab.bench.worker --worker METHOD --config JSON``)
  loads its model once and answers one JSON line per request on stdin/stdout. The parent runs the repetitions
  round-robin over the workers, one worker at a time, so background load hits every method alike; each worker reports
  its own peak resident set size (``ru_maxrss``) when it exits: that is the method's peak memory.
* Every worker first runs a short warm-up generation (the first 16 prompt tokens, 2 new tokens), not counted.
* Each token is timestamped when the method hands it out: our ``Engine.stream`` yields it; transformers calls
  its streamer's ``put()``; the llama.cpp loop samples it. Time to first token (TTFT) is from the call to the
  first token (prefill + the first decode step). **Mean time between tokens** (TBT) is
  ``(t_last - t_first) / (n - 1)`` and **tokens/s** is ``1000 / TBT``: the same definitions for every method, prefill
  excluded. Our engine keeps the prompt's KV cache between requests (prefix reuse), so its repetitions after the
  first skip most of the prefill. ``hf-ar`` gets the same treatment: its worker computes the prompt's KV cache
  (all but the last token) once, passes it to ``generate`` as ``past_key_values`` and crops it back after each run
  (``hf-assisted`` and ``hf-lookup`` produce other greedy tokens with a given cache, so they prefill every run);
  llama.cpp keeps its KV of the prompt from its previous run. TTFT is reported separately for that reason and TBT
  never includes it.
* ``--prompt-cache DIR``: our methods and llama.cpp load the prompt's KV from a file in DIR where one holds it and
  write it after a run that prefilled it (ours: ``kv/promptcache.py``'s safetensors files; llama.cpp: its own
  ``llama_state_save_file``), so a long prompt is prefilled once per model across methods and runs; each run's
  ``prompt_cache`` entry in the JSON says what it loaded and wrote.
* End-of-sequence tokens are ignored by every method, so each generates exactly ``--new-tokens`` tokens.
* Under greedy decoding (``--temperature 0``) every repetition of every method is compared token for token
  with the reference (``hf-ar``, else ``autoregressive``, else the first method that ran); a method that differs
  is flagged in the JSON (``greedy.same_tokens`` false, ``greedy_mismatches``) and by a warning line on stderr.
* When ``triforce.lab.costmodel`` is importable, each of our speculative methods also reports the cost model's predicted
  speedup (tier latencies measured in that method's worker at the bench's context length, acceptance from the run) next
  to the measured one; the tier latencies time each step as the engine runs it (the forward, then the token selection on
  real text's logits) in one interleaved loop. A second prediction, ``predicted_from_run``, takes the steps' own times
  in the run instead (``step_seconds``, forwards while generating), which tests the model of acceptance apart from the
  machine's changes of speed between two moments.

Bad options exit with status 2 and one line naming the option, before any model is loaded.

Modules: ``methods`` (the methods, option checks, which methods run), ``runners`` (each family's worker side),
``worker`` (the worker subprocess and its protocol), ``stats`` (metrics and aggregates), ``report`` (table, PNG),
``run`` (the interleaved run and ``cmd_bench``). The argument parser is ``triforce.cli.bench``.
"""

from .methods import METHODS, BenchError, plan_methods, validate_args
from .report import format_table, write_png
from .run import cmd_bench, run_bench
from .stats import aggregate_tiers, compare_greedy, rep_metrics, spread

__all__ = ["METHODS", "BenchError", "plan_methods", "validate_args", "format_table", "write_png", "cmd_bench",
           "run_bench", "aggregate_tiers", "compare_greedy", "rep_metrics", "spread"]
