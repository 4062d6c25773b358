"""Cost model of hierarchical speculative decoding: step latency per tier, predicted time per token and speedup.

Sources: Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding" (arXiv 2211.17192),
Sec. 3.3 (expected tokens per verification, Eq. 1) and Sec. 3.4 (walltime: improvement factor
``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1))``, Theorem 3.8); TriForce (Sun et al., arXiv 2404.11912),
Sec. 4.3 and Appendix (the same analysis applied twice: the draft speeds up the retrieval-cache tier, which speeds
up the full-cache target).

Two parts:

* :func:`measure_tier_latencies` times each tier's forward at fixed context lengths, with caches filled with random
  KV (:func:`triforce.lab.synthetic.fill_random_kv`), so no prefill is needed and any context can be timed;
* :func:`predict` combines those latencies with measured acceptance rates into seconds per token and a speedup.
"""

from __future__ import annotations

import gc
import random
import statistics
from typing import Callable

import torch

from ..defaults import DEFAULTS
from ..kv.caches import FullKVCache, kv_bytes
from ..kv.retrieval import RetrievalCache
from ..kv.streaming import StreamingCache
from ..model.transformer import Transformer
from ..speculation.ngram import NGramDrafter
from ..speculation.rule import rejection_sample
from ..speculation.sampling import SamplingParams, logits_to_probs
from ..speculation.steptimes import expected_tokens, time_interleaved
from .synthetic import fill_random_kv

#: what :func:`measure_tier_latencies` times, in seconds (medians); see its docstring.
LATENCY_KEYS = ("draft_step", "draft_pass", "ngram_propose", "retrieval_decode", "retrieval_pass", "full_decode",
                "full_pass")
#: verifying tiers, as named in ``GenerationStats.tiers`` (the keys of ``acceptance`` in :func:`predict`).
VERIFIER_NAMES = ("draft", "retrieval", "target")


# ----------------------------------------------------------------------------------------------- measurement
def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def measure_tier_latencies(target: Transformer, draft: Transformer | None, contexts: list[int], *,
                           gamma1: int = DEFAULTS["gamma1"], gamma2: int = DEFAULTS["gamma2"],
                           budget: int = DEFAULTS["budget"], chunk_size: int = DEFAULTS["chunk_size"],
                           draft_sink: int = DEFAULTS["draft_sink"], draft_window: int = DEFAULTS["draft_window"],
                           reps: int = 5, progress: Callable[[int], None] | None = None,
                           seed: int = 0, lower: Transformer | None = None, lower_kv: torch.dtype | None = None,
                           sampling: SamplingParams | None = None,
                           selection_logits: torch.Tensor | None = None) -> list[dict]:
    """Median latency of each tier's step at each context length, caches filled with random KV (no prefill).

    For each context n the caches are allocated, filled by :func:`~triforce.lab.synthetic.fill_random_kv` to
    represent positions [0, n), and each forward below runs at positions n, n+1, ... over random token ids, then
    the cache is rolled back to n (``cache.rollback``), so every repetition sees the same context. The forwards are
    interleaved: each repetition runs every kind once, in an order rotated from one repetition to the next, after
    one untimed warm-up of each, so background load affects all kinds alike (the lower tiers' copy of the weights,
    ``lower``, is timed in the same loop, not in a second call: a machine runs in slow and fast phases;
    docs/performance.md). Medians over ``reps``.

    With ``sampling``, each timed call is a step as ``speculation/tiers.py`` runs it: the forward, then the token
    selection on its logits (:func:`~triforce.speculation.sampling.logits_to_probs` over every row and
    :func:`~triforce.speculation.rule.rejection_sample` of the ``t - 1`` drafts a ``t``-token pass verifies; a 1-token
    step draws its token the same way with no drafts): work over the whole vocabulary (49,152 tokens for SmolLM2)
    that the forward alone leaves out. Its cost depends on the distributions: random tokens over random KV give
    flat ones, whose nucleus is not among the 128 most likely tokens, so top-p sorts the whole vocabulary (the slow
    path ``bench/kernels/nucleus.py`` times); real text's nuclei are small. ``selection_logits``
    (:func:`text_logits` of the prompt) gives real ones.

    What is timed (seconds per call; the block sizes are the ones ``speculation/tiers.py`` feeds in steady state):

    * ``full_decode``: target over the full KV cache, 1 token (autoregressive decoding; a top tier without drafter).
    * ``full_pass``: target over the full KV cache, ``gamma2 + 1`` tokens: the pending token plus the ``gamma2``
      proposals the target verifies (``ModelTier.step`` feeds ``seq[len(cached):] + drafts``; the recovered/bonus
      token of the previous step is not cached yet, hence +1), logits for every position.
    * ``retrieval_decode``: target over a ``budget``-slot :class:`~triforce.kv.retrieval.RetrievalCache` built from the
      full cache (random query), 1 token: a retrieval tier without drafter (``retrieval`` mode) or the last step of
      a proposal.
    * ``retrieval_pass``: the same cache, ``gamma1 + 1`` tokens: the pending token plus the ``gamma1`` draft tokens
      it verifies. In ``triforce`` mode the retrieval tier builds each ``gamma2``-token proposal from several
      steps, each verifying ``min(gamma1, still needed - 1)`` drafts, so shorter blocks (down to a 1-token decode)
      also occur; :func:`predict` (``engine_*`` figures) interpolates between the two measurements for them. After
      the target accepts a whole block, the first step also feeds the target's bonus token (one more).
      The retrieval cache attends over all ``budget`` slots whatever the context (a masked slot still costs), so
      at a context shorter than the budget this tier reads the same bytes as at a long one.
    * ``draft_step``: draft model over a StreamingLLM cache (``draft_sink`` + ``draft_window``), 1 token. None
      without a draft model.
    * ``draft_pass``: the draft model over ``gamma1 + 1`` tokens, its cost as a verifier (``--tiers ngram:G,draft:...``
      feeds ``G + 1`` tokens; measured at ``gamma1 + 1``). None without a draft model.
    * ``ngram_propose``: one :class:`~triforce.speculation.ngram.NGramDrafter` proposal of ``gamma2`` tokens (a dict
      lookup and a one-hot tensor; microseconds, i.e. ~0 next to any model forward), over an index of ``min(n, 8192)``
      tokens.

    Args:
        target: the target model (tiers 1 and 2).
        draft: the draft model, or None (then the bottom tier is the model-free n-gram drafter).
        contexts: context lengths n (integers >= 1), timed in this order. Positions past the target's
            ``max_position_embeddings`` are allowed (RoPE is computed for any position; timing only) and flagged.
        gamma1, gamma2: speculation lengths (>= 1), see above.
        budget: retrieval cache slots (>= chunk_size + max(gamma1, gamma2) + 2).
        chunk_size: retrieval chunk size (>= 1).
        draft_sink, draft_window: StreamingLLM cache of the draft (>= 0, >= 1).
        reps: timed repetitions per kind and context (>= 1).
        progress: called with 1 after each timed forward (e.g. ``tqdm.update``), or None.
        seed: seed of the random KV, queries and tokens.
        lower: the copy of the target the tiers below the verifier run (``Engine.lower_model``: int8, int4 or block
            codes with int8 activations), timed for ``retrieval_decode`` and ``retrieval_pass``; None: the target.
            It must share the target's config (its retrieval cache is built from the target's full cache).
        lower_kv: dtype of the retrieval and draft caches (``--lower-kv-dtype``); None: the models' dtypes.
        sampling: time each step's token selection with these parameters too (see above); None: forwards only.
        selection_logits: (R, V) fp32 logits the token selection works on instead of the forward's own (a step of
            t tokens takes the next t rows, cycling), e.g. :func:`text_logits`; None: the forward's.

    Returns:
        One dict per context: ``context``, the :data:`LATENCY_KEYS` (median seconds, None where not measured),
        ``spread`` (``[min, max]`` seconds per key), ``blocks`` (tokens per timed forward), ``reps``,
        ``beyond_model_context`` (bool), ``token_selection`` (whether the steps include it: ``sampling`` given),
        and ``bytes`` read per forward by tier: ``target_weights``, ``lower_weights`` (``lower``'s, or the
        target's), ``full_kv`` (n positions), ``retrieval_kv`` (budget slots), ``draft_weights``, ``draft_kv``.

    Raises:
        ValueError: a parameter out of range (named in the message), raised before any allocation.

    Memory is not checked here (a context whose caches do not fit fails in the allocator);
    ``bench/analysis/cost_model.py`` checks the largest context with :func:`triforce.kv.memory.check_fits` first.
    """
    if not isinstance(target, Transformer):
        raise ValueError(f"target must be a triforce Transformer, got {type(target).__name__}")
    if draft is not None and not isinstance(draft, Transformer):
        raise ValueError(f"draft must be a triforce Transformer or None, got {type(draft).__name__}")
    if isinstance(contexts, (str, bytes)) or not hasattr(contexts, "__iter__") or not (contexts := list(contexts)):
        raise ValueError(f"contexts must be a non-empty list of integers >= 1, got {contexts!r}")
    for n in contexts:
        _check_int("contexts", n, 1)
    for name, value, minimum in (("gamma1", gamma1, 1), ("gamma2", gamma2, 1), ("chunk_size", chunk_size, 1),
                                 ("draft_sink", draft_sink, 0), ("draft_window", draft_window, 1), ("reps", reps, 1)):
        _check_int(name, value, minimum)
    _check_int("budget", budget, chunk_size + max(gamma1, gamma2) + 2)
    if lower is not None and (not isinstance(lower, Transformer) or lower.cfg != target.cfg):
        raise ValueError("lower must be a triforce Transformer with the target's config (a copy of its weights, "
                         f"Engine.lower_model), got {type(lower).__name__}")
    if lower_kv is not None and not isinstance(lower_kv, torch.dtype):
        raise ValueError(f"lower_kv must be a torch dtype or None, got {lower_kv!r}")
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
    if selection_logits is not None and (not isinstance(selection_logits, torch.Tensor) or selection_logits.dim() != 2
                                         or selection_logits.shape[-1] != target.cfg.vocab_size):
        raise ValueError(f"selection_logits must be a (rows, {target.cfg.vocab_size}) tensor of logits, got "
                         f"{getattr(selection_logits, 'shape', type(selection_logits).__name__)}")
    if draft is not None and draft.cfg.vocab_size > target.cfg.vocab_size:
        raise ValueError(f"draft vocabulary ({draft.cfg.vocab_size}) is larger than the target's "
                         f"({target.cfg.vocab_size}); the draft must share the target's tokenizer")

    cfg, dev = target.cfg, target.device
    rng = random.Random(seed)
    generator = torch.Generator(device=dev).manual_seed(seed)
    next_row = [0]
    if selection_logits is not None:
        selection_logits = selection_logits.to(device=dev, dtype=torch.float32)
    results = []
    for n in contexts:
        capacity = n + max(gamma1, gamma2) + 2
        target.set_request_length(capacity)
        full = FullKVCache(cfg, capacity, target.dtype, dev)
        fill_random_kv(full, n, seed)
        retrieval = RetrievalCache(cfg, full, budget, chunk_size, dtype=lower_kv)
        fill_random_kv(retrieval, n, seed + 1)
        stream = None
        if draft is not None:
            draft.set_request_length(capacity)
            stream = StreamingCache(draft.cfg, draft_sink, draft_window, gamma1 + gamma2 + 4, draft.rope,  # slack
                                    lower_kv or draft.dtype, draft.device)
            fill_random_kv(stream, n, seed + 2)

        # the closures below read this context's `n`: they are timed and dropped before the next one (B023)
        def ids(t: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
            tok = torch.tensor([[rng.randrange(vocab) for _ in range(t)]], dtype=torch.long, device=dev)
            return tok, torch.arange(n, n + t, device=dev)  # noqa: B023

        def forward(model: Transformer, cache, t: int) -> Callable[[], None]:
            def run() -> None:
                tok, pos = ids(t, model.cfg.vocab_size)
                logits = model(tok, pos, cache, num_logits=t)[0]  # (t, V)
                if sampling is not None:
                    if selection_logits is not None:  # the next t rows of real text's logits, cycling
                        rows = torch.arange(next_row[0], next_row[0] + t) % selection_logits.shape[0]
                        next_row[0] += t
                        logits = selection_logits[rows][:, :model.cfg.vocab_size]
                    _select_tokens(logits, sampling, generator)
                cache.rollback(n)  # noqa: B023
            return run

        low = lower if lower is not None else target
        kinds: dict[str, Callable[[], None]] = {
            "full_decode": forward(target, full, 1),
            "full_pass": forward(target, full, gamma2 + 1),
            "retrieval_decode": forward(low, retrieval, 1),
            "retrieval_pass": forward(low, retrieval, gamma1 + 1),
        }
        if draft is not None:
            kinds["draft_step"] = forward(draft, stream, 1)
            kinds["draft_pass"] = forward(draft, stream, gamma1 + 1)
        kinds["ngram_propose"] = _ngram_call(cfg.vocab_size, min(n, 8192), gamma2, rng, dev)

        times = time_interleaved(kinds, reps, dev, progress)
        row: dict = {"context": n}
        for k in LATENCY_KEYS:
            row[k] = statistics.median(times[k]) if k in times else None
        row["spread"] = {k: [min(v), max(v)] for k, v in times.items()}
        row["blocks"] = {"full_decode": 1, "full_pass": gamma2 + 1, "retrieval_decode": 1,
                         "retrieval_pass": gamma1 + 1, "draft_step": 1, "draft_pass": gamma1 + 1,
                         "ngram_propose": gamma2}
        row["reps"] = reps
        row["beyond_model_context"] = capacity > cfg.max_position_embeddings
        row["token_selection"] = sampling is not None
        row["bytes"] = {
            "target_weights": target.weight_bytes(),
            "lower_weights": low.weight_bytes(),
            "full_kv": kv_bytes(cfg, n, target.dtype),
            "retrieval_kv": kv_bytes(cfg, budget, lower_kv or target.dtype),
            "draft_weights": draft.weight_bytes() if draft is not None else 0,
            "draft_kv": kv_bytes(draft.cfg, min(n, draft_sink + draft_window), lower_kv or draft.dtype) if draft else 0,
        }
        results.append(row)
        del full, retrieval, stream, kinds
        gc.collect()
    return results


def text_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    """The model's logits (len(ids), V) fp32 at every position of ``ids``, from one forward over a fresh cache: the
    distributions of real text, for :func:`measure_tier_latencies`' ``selection_logits``. The model's RoPE is left
    as it was.

    Raises:
        ValueError: ``ids`` empty, or not token ids of the model's vocabulary.
    """
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < model.cfg.vocab_size for i in ids):
        raise ValueError(f"ids must be a non-empty list of token ids in [0, {model.cfg.vocab_size})")
    rope = model.rope  # kept: a request that reuses its cache keeps its RoPE (dynamic NTK depends on the length)
    try:
        model.set_request_length(len(ids))
        cache = FullKVCache(model.cfg, len(ids), model.dtype, model.device)
        tok = torch.tensor([ids], dtype=torch.long, device=model.device)
        with torch.no_grad():
            return model(tok, torch.arange(len(ids), device=model.device), cache, num_logits=len(ids))[0].float()
    finally:
        model.rope = rope


def _select_tokens(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> None:
    """What ``ModelTier.step`` does with a step's logits (t, V): the distributions of every row, then the verification
    of t - 1 drafts (here the argmax of the first t - 1 rows, drafted from those rows' own distributions: every
    draft accepted, the bonus drawn) or, for t = 1, the draw of the step's one token."""
    p = logits_to_probs(logits, sampling)  # (t, V) fp32
    k = p.shape[0] - 1
    drafts = p[:k].argmax(-1)[None]  # (1, k)
    rejection_sample(drafts, p[None, :k], p[None], generator, greedy=sampling.greedy)


def _ngram_call(vocab: int, n: int, gamma: int, rng: random.Random, device) -> Callable[[], None]:
    """A timed n-gram proposal of ``gamma`` tokens over an index of ``n`` random tokens whose suffix recurs."""
    tokens = [rng.randrange(vocab) for _ in range(n)]
    drafter = NGramDrafter(vocab, 4, (), device)
    drafter.prefill(tokens)
    seq = tokens + tokens[: min(4, n)]  # the last 4 tokens occurred at the start: a match to follow

    def run() -> None:
        drafter.propose(seq, gamma)
    return run


# ----------------------------------------------------------------------------------------------- prediction
# a drafter-less model tier: 1 token/forward; the ``self`` tier (the target's int4 copy over a StreamingLLM cache) is
# timed as the draft tier, with that copy as the draft model
_PROPOSE_KEY = {"draft": "draft_step", "self": "draft_step", "retrieval": "retrieval_decode"}
_PASS_KEY = {"draft": "draft_pass", "self": "draft_pass", "retrieval": "retrieval_pass", "target": "full_pass"}
_DECODE_KEY = {"draft": "draft_step", "self": "draft_step", "retrieval": "retrieval_decode", "target": "full_decode"}


def _latency(latencies: dict, key: str, why: str) -> float:
    value = latencies.get(key)
    if value is None:
        raise ValueError(f"latencies[{key!r}] is needed for {why}; measure it (measure_tier_latencies) or give it")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"latencies[{key!r}] must be a number of seconds >= 0, got {value!r}")
    return float(value)


def accepted_length_distribution(alpha: float, gamma: int, counts: list[int] | None = None) -> list[float]:
    """P(j drafted tokens accepted), j = 0..gamma, for one verification of ``gamma`` drafts.

    Without ``counts``: independent acceptances with rate ``alpha`` (Leviathan et al. 2023, Sec. 3.3):
    ``alpha^j (1 - alpha)`` for j < gamma and ``alpha^gamma`` for j = gamma. With ``counts`` (``counts[j]`` =
    verifications observed accepting exactly j, ``TierStats.accepted_lengths``): their frequencies, runs longer than
    ``gamma`` counted at ``gamma``. Acceptance on real text comes in runs (a verifier that accepts one token tends to
    accept the next), which the independent model underestimates.

    Returns:
        gamma + 1 probabilities summing to 1.
    """
    if counts and sum(counts) > 0:
        c = [float(x) for x in counts[:gamma]] + [float(sum(counts[gamma:]))]
        c += [0.0] * (gamma + 1 - len(c))
        total = sum(c)
        return [x / total for x in c]
    return [alpha ** j * (1 - alpha) for j in range(gamma)] + [alpha ** gamma]


def predict(chain: list[tuple[str, int]], latencies: dict, acceptance: dict[str, float],
            accepted_lengths: dict[str, list[int]] | None = None) -> dict:
    """Predicted seconds per token and speedup over autoregressive decoding for a speculation hierarchy.

    Notation: ``chain = [(k_0, g_0), ..., (k_{m-1}, g_{m-1})]`` bottom first, as ``SpeculationConfig.chain``
    (kinds ``ngram``, ``draft``, ``retrieval``); tier m is the full-cache target. Tier i >= 1 verifies the
    ``g_{i-1}`` tokens tier i-1 proposes, with acceptance rate ``a_i = acceptance[name_i]`` (``name`` = the kind,
    ``target`` for tier m), and ``E_i = expected_tokens(a_i, g_{i-1})`` tokens emitted per verification
    (Leviathan et al., arXiv 2211.17192, Eq. 1). ``V_i`` is tier i's verification pass (``draft_pass``,
    ``retrieval_pass``, ``full_pass``), ``D`` = ``full_decode``.

    Cost of the bottom tier's proposal of g tokens: ``P_0(g) = g * draft_step`` (draft model),
    ``g * retrieval_decode`` (retrieval tier), ``ngram_propose`` (n-gram drafter: one lookup; 0 when absent).

    Each verification of tier i costs the proposal below plus its own pass and yields ``E_i`` tokens, so its cost
    per produced token is::

        c_i = (P_{i-1}(g_{i-1}) + V_i) / E_i,      P_i(g) = g * c_i

    and the prediction is ``seconds_per_token = c_m``, ``speedup = D / c_m`` (``D`` itself without a chain). At
    depth 1 with ``V_m = D`` this is Leviathan et al.'s improvement factor (Sec. 3.4, Theorem 3.8)
    ``E / (g c + 1)`` with ``c = P_0(g) / (g D)``; TriForce (Sec. 4.3, Appendix) applies it at two levels.

    The ``engine_*`` figures follow the schedule of ``speculation/tiers.py`` exactly, under the same
    independent-acceptance assumption: a tier asked for n tokens runs steps until it has them, each step verifying ``k =
    min(g, n_left - 1)`` drafts (k = 0: a 1-token decode, ``draft_step`` / ``retrieval_decode``) and emitting j + 1
    tokens with ``P(j) = a^j (1 - a)`` for j < k, ``a^k`` for j = k. With ``Q_i(n)`` the expected cost of tier i
    proposing n tokens (``Q_0 = P_0``)::

        Q_i(n) = sum_j P(j) [Q_{i-1}(k) + V_i(k + 1) + Q_i(n - j - 1)],  Q_i(0) = 0

    where ``V_i(t)`` interpolates linearly between the 1-token decode and the measured pass over
    ``latencies["blocks"]`` tokens (constant when ``blocks`` is absent). The top tier is never truncated:
    ``engine_seconds_per_token = (Q_{m-1}(g_{m-1}) + V_m(g_{m-1} + 1)) / E_m``.

    Args:
        chain: ``[(kind, gamma), ...]`` bottom first; kinds in ``ngram`` (bottom only), ``draft``, ``retrieval``;
            gamma an integer >= 1.
        latencies: one row of :func:`measure_tier_latencies` (seconds), or any dict with the keys the chain needs.
        acceptance: acceptance rate in [0, 1] of each verifying tier, keyed by tier name as in
            ``GenerationStats.tiers`` (``draft``, ``retrieval``, ``target``).
        accepted_lengths: optional observed run lengths per verifying tier (``TierStats.accepted_lengths``); where
            given, ``E_i`` and the schedule's ``P(j)`` come from them (:func:`accepted_length_distribution`)
            instead of the independent-acceptance formula.

    Returns:
        ``{"chain", "seconds_per_token", "speedup", "autoregressive_seconds_per_token", "engine_seconds_per_token",
        "engine_speedup", "tiers": [{"name", "verifies", "gamma", "acceptance", "expected_tokens",
        "pass_seconds", "seconds_per_token"}, ...]}`` (tiers bottom-up, the target last).

    Raises:
        ValueError: a malformed chain, a missing or out-of-range acceptance or latency (the key is named).
    """
    if isinstance(chain, (str, bytes)) or not hasattr(chain, "__iter__"):
        raise ValueError(f"chain must be a list of (kind, gamma) pairs, got {chain!r}")
    chain = [tuple(e) for e in chain]
    for i, entry in enumerate(chain):
        if len(entry) != 2 or entry[0] not in ("ngram", "self", "draft", "retrieval") or isinstance(entry[1], bool) \
                or not isinstance(entry[1], int) or entry[1] < 1:
            raise ValueError("chain entries must be (kind, gamma) with kind in ngram, self, draft, retrieval and "
                             f"gamma an integer >= 1, got {entry!r}")
        if entry[0] == "ngram" and i:
            raise ValueError("chain: ngram can only be the bottom tier")
    if len({k for k, _ in chain}) != len(chain):
        raise ValueError(f"chain: each kind at most once, got {chain!r}")
    if not isinstance(latencies, dict):
        raise ValueError(f"latencies must be a dict of seconds, got {type(latencies).__name__}")
    if not isinstance(acceptance, dict):
        raise ValueError(f"acceptance must be a dict tier name -> rate, got {type(acceptance).__name__}")
    ar = _latency(latencies, "full_decode", "the autoregressive baseline")
    names = [k for k, _ in chain[1:]] + ["target"]  # verifying tiers, bottom-up
    alphas = {}
    for name in (names if chain else []):
        a = acceptance.get(name)
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise ValueError(f"acceptance[{name!r}] must be a rate in [0, 1] (the {name} tier verifies the tier "
                             f"below), got {a!r}")
        alphas[name] = float(a)
    out = {"chain": [list(e) for e in chain], "autoregressive_seconds_per_token": ar}
    if not chain:
        out.update(seconds_per_token=ar, speedup=1.0, engine_seconds_per_token=ar, engine_speedup=1.0, tiers=[])
        return out

    bottom, g0 = chain[0]
    if bottom == "ngram":
        ng = latencies.get("ngram_propose") or 0.0
        propose_bottom = lambda g: float(ng)  # noqa: E731  (one lookup, whatever g)
    else:
        unit = _latency(latencies, _PROPOSE_KEY[bottom], f"a {bottom} bottom tier")
        propose_bottom = lambda g: g * unit  # noqa: E731
    blocks = latencies.get("blocks") or {}

    def pass_cost(name: str, t: int) -> float:
        """V(t): the tier's forward over t tokens, interpolated between its decode and its measured pass."""
        full = _latency(latencies, _PASS_KEY[name], f"the {name} tier's verification")
        b = blocks.get(_PASS_KEY[name])
        dec = latencies.get(_DECODE_KEY[name])
        if not b or b <= 1 or dec is None:
            return full
        return max(0.0, dec + (full - dec) * (t - 1) / (b - 1))

    tiers = []
    cost_below = propose_bottom  # paper formula: P_{i-1}(g)
    engine_below = propose_bottom  # exact schedule: Q_{i-1}(n)
    c = 0.0
    observed = accepted_lengths or {}
    dists = {name: accepted_length_distribution(alphas[name], chain[i][1], observed.get(name))
             for i, name in enumerate(names)}
    for i, name in enumerate(names):
        g = chain[i][1]
        a = alphas[name]
        e = sum((j + 1) * p for j, p in enumerate(dists[name]))
        v = _latency(latencies, _PASS_KEY[name], f"the {name} tier's verification")
        c = (cost_below(g) + v) / e
        tiers.append({"name": name, "verifies": chain[i][0], "gamma": g, "acceptance": a, "expected_tokens": e,
                      "pass_seconds": v, "seconds_per_token": c})
        cost_below = (lambda cc: (lambda gg: gg * cc))(c)
        if name != "target":
            engine_below = _engine_q(name, g, dists[name], engine_below, pass_cost,
                                     _latency(latencies, _DECODE_KEY[name], f"the {name} tier's 1-token step"))
    top_g = chain[-1][1]
    engine = (engine_below(top_g) + pass_cost("target", top_g + 1)) / tiers[-1]["expected_tokens"]
    out.update(seconds_per_token=c, speedup=ar / c if c > 0 else float("inf"),
               engine_seconds_per_token=engine, engine_speedup=ar / engine if engine > 0 else float("inf"),
               tiers=tiers)
    return out


def _engine_q(name: str, g: int, dist: list[float], below: Callable[[int], float],
              pass_cost: Callable[[str, int], float], decode: float) -> Callable[[int], float]:
    """Q(n): expected cost of tier ``name`` proposing n tokens through the tiers' step loop (:func:`predict`)."""
    memo: dict[int, float] = {0: 0.0}

    def q(n: int) -> float:
        for m in range(1, n + 1):
            if m in memo:
                continue
            k = min(g, m - 1)
            if k == 0:
                memo[m] = decode + memo[m - 1]
                continue
            step = below(k) + pass_cost(name, k + 1)
            # P(j) for a block of k <= g drafts: the distribution's mass at j >= k falls on k
            rest = sum(dist[j] * memo[m - j - 1] for j in range(k)) + sum(dist[k:]) * memo[m - k - 1]
            memo[m] = step + rest
        return memo[n]
    return q


__all__ = ["LATENCY_KEYS", "VERIFIER_NAMES", "accepted_length_distribution", "expected_tokens",
           "measure_tier_latencies", "predict", "text_logits"]
