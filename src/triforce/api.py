"""Text-level API: a target (and optional draft) model with its tokenizer, stop strings, streaming text.

Example::

    from triforce import TriForce, SamplingParams, SpeculationConfig
    tf = TriForce.load()                           # the embedded SmolLM2-135M-Instruct
    result = tf.generate("Once upon a time", max_new_tokens=32, sampling=SamplingParams(temperature=0))
    print(result.text, result.stats.decode_tokens_per_second)

    gen = tf.stream("Once upon a time")            # yields TokenEvent(token_id, text) as tokens are accepted
    for event in gen: print(event.text, end="")
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Callable, Generator, Sequence

from .defaults import DEFAULTS
from .engine import Engine, GenerationStats, SpeculationConfig
from .formats.loading import LoadedModel, ModelLoadError, load_model
from .kv.caches import KV_DTYPES
from .model.config import check_rope_scaling
from .model.precision import check_precision
from .plan import cache_capacity
from .speculation.grammar import constraint_for
from .speculation.logprobs import TokenLogprob, check_top_logprobs, prompt_logprobs
from .speculation.sampling import SamplingParams
from .text.detok import IncrementalDetokenizer
from .text.prompts import encode_prompt_cut


class TokenizerMismatchError(ValueError):
    """The draft model's tokenizer differs from the target's (speculation needs one vocabulary)."""


@dataclass
class TokenEvent:
    """One accepted token: its id and the text it completes (may be empty while a character or a possible stop
    string is incomplete). A final event with ``token_id`` None flushes text held back until the end."""

    token_id: int | None
    text: str
    logprob: TokenLogprob | None = None  # with ``SamplingParams(logprobs=...)``: the token's log-probability


@dataclass
class GenerationResult:
    """The outcome of :meth:`TriForce.generate`.

    Attributes:
        text: generated text (cut before a stop string). token_ids: generated token ids (through the token that
        completed a stop string or the EOS). finish_reason: ``eos``, ``stop``, ``length`` or ``interrupted`` (Ctrl-C).
        stats: :class:`~triforce.engine.GenerationStats`. logprobs: with ``SamplingParams(logprobs=...)``, one
        :class:`~triforce.speculation.logprobs.TokenLogprob` per
            token of ``token_ids``; else None.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None

    def to_dict(self) -> dict:
        """The ``--json`` object: text, token_ids, finish_reason and the stats fields (docs/usage.md, "JSON output")."""
        d = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason}
        d.update(self.stats.to_dict())
        d["finish_reason"] = self.finish_reason
        if self.logprobs is not None:
            d["logprobs"] = [x.to_dict() for x in self.logprobs]
        return d


def check_same_tokenizer(target_tok, draft_tok) -> None:
    """Raise :class:`TokenizerMismatchError` unless both tokenizers map the same strings to the same ids."""
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise TokenizerMismatchError(
            f"the draft's tokenizer differs from the target's (vocabularies of {len(draft_tok)} and {len(target_tok)} "
            "tokens do not match); a draft model must share the target's tokenizer")


class TriForce:
    """A target model, an optional draft model, their tokenizer, and the engine that runs them.

    Args:
        target: the loaded target model.
        draft: an optional loaded draft model sharing the target's tokenizer, ``"ngram"`` for the model-free
            n-gram drafter, or ``"self"`` for the target drafting for itself with int4 weights (no second model).
        offload_kv, on_chip_layers, kv_dtype: KV-cache offloading and dtype (see :class:`~triforce.engine.Engine`).
        prompt_cache: a directory of prompt caches (``kv/promptcache.py``): each request first loads the longest prefix
            of its prompt that a file there holds, and a request that computed at least ``prompt_cache_min_tokens``
            new tokens writes its full KV cache there; ``prompt_cache_max_bytes`` caps the directory (least recently
            used first; None: no cap). None: no files.

    Raises:
        TokenizerMismatchError: the draft's vocabulary differs from the target's.
        ValueError: ``prompt_cache`` is a file, or a negative cap or minimum.
    """

    def __init__(self, target: LoadedModel, draft: LoadedModel | str | None = None, offload_kv: bool = False,
                 on_chip_layers: int | None = None, kv_dtype: str | None = None,
                 prompt_cache: str | os.PathLike | None = None,
                 prompt_cache_max_bytes: int | None = DEFAULTS["prompt_cache_max_bytes"],
                 prompt_cache_min_tokens: int = DEFAULTS["prompt_cache_min_tokens"]) -> None:
        self.drafter = draft if draft in ("ngram", "self") else "model"
        if draft in ("ngram", "self"):
            draft = None
        elif isinstance(draft, str):
            raise ValueError(f"draft must be a loaded model, 'ngram', 'self' or None, got {draft!r}")
        if draft is not None:
            check_same_tokenizer(target.tokenizer, draft.tokenizer)
        self.target, self.draft = target, draft
        self.tokenizer = target.tokenizer
        self.engine = Engine(target.model, draft.model if draft else None, eos_ids=target.eos_ids,
                             offload_kv=offload_kv, on_chip_layers=on_chip_layers, kv_dtype=kv_dtype)
        self.prompt_cache = None
        if prompt_cache is not None:
            from .kv.promptcache import PromptCache, model_key

            key = model_key(target.source, target.model.cfg, target.model.dtype, self.engine.kv_dtype,
                            target.model.precision)
            self.prompt_cache = PromptCache(prompt_cache, key, prompt_cache_max_bytes, prompt_cache_min_tokens)

    @classmethod
    def load(cls, model: str | None = None, draft: str | None = None, dtype: str = "float32",
             device: str = "cpu", tp=None, offload_kv: bool = False, on_chip_layers: int | None = None,
             kv_dtype: str | None = None, quantize: str | None = None,
             packed_weights: bool | None = None, threads: int | str | None = None,
             prompt_cache: str | os.PathLike | None = None,
             prompt_cache_max_bytes: int | None = DEFAULTS["prompt_cache_max_bytes"],
             prompt_cache_min_tokens: int = DEFAULTS["prompt_cache_min_tokens"],
             rope_scaling: str | None = DEFAULTS["rope_scaling"],
             rope_factor: float | None = DEFAULTS["rope_factor"],
             precision: str | None = DEFAULTS["precision"]) -> "TriForce":
        """Load the target (default: the embedded SmolLM2-135M-Instruct) and an optional draft (a model source,
        ``"ngram"`` for the model-free drafter or ``"self"`` for the target's own int4 copy); see :func:`load_model`.
        With ``tp`` (a :class:`~triforce.model.parallel.TensorParallel`) the target is this rank's shard and the draft
        is replicated; ``offload_kv`` / ``on_chip_layers`` / ``kv_dtype``: see :class:`~triforce.engine.Engine`
        (``dtype`` and ``kv_dtype`` take the command line's names, :data:`~triforce.kv.caches.KV_DTYPES`: ``"bf16"``
        too); ``quantize="int8"`` runs the target itself with weight-only int8 (``model/quant.py``; it changes the
        output distribution); ``packed_weights`` adds oneDNN-prepacked weights for multi-token passes on the CPU
        (:meth:`~triforce.model.transformer.Transformer.pack_weights`; one more copy of the weights); None (auto): on a
        CPU in fp32 where our fp32 kernel for a few rows cannot run and that copy takes at most a quarter of the free
        memory (:meth:`~triforce.model.transformer.Transformer.packing_pays`). ``threads``: CPU threads for torch, for
        the whole process (``torch.set_num_threads``): an integer, ``"auto"`` (the command line's default: one per
        physical core that other programs leave idle while the model loads, :mod:`triforce.kernels.threads`), or None to
        leave torch's current setting. ``prompt_cache``, ``prompt_cache_max_bytes``, ``prompt_cache_min_tokens``: see
        :class:`TriForce` (checked, and the directory created, before any model loads). ``rope_scaling``,
        ``rope_factor``: the target's RoPE scaling override, e.g. ``"yarn", 4.0`` (see :func:`load_model`; it changes
        the model); the draft keeps its own RoPE, since a StreamingLLM cache shows it distances of at most ``draft_sink
        + draft_window - 1`` whatever the position (``self`` is the target's copy). ``precision``: the models'
        arithmetic, ``"file"`` (a GGUF file's codes times int8 activations, as llama.cpp computes), ``"exact"`` (fp32
        products, transformers' model) or None (``file`` for a GGUF file on the CPU in fp32, else ``exact``;
        :mod:`triforce.model.precision`) of the target; a draft takes the fastest (its file's where it has one: a
        proposer's rounding changes no token).

        Raises:
            ValueError: an unknown ``quantize`` or ``kv_dtype``, or ``threads`` not ``"auto"``, None or an integer in
                [1, 4x the CPUs], or a bad RoPE override or ``precision`` (before loading), or see
                :func:`load_model`."""
        if quantize not in (None, "int8"):
            raise ValueError(f"quantize must be None or 'int8', got {quantize!r}")
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:  # the command line's --kv-dtype names, aliases too
            raise ValueError(f"kv_dtype must be None or one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        from .kernels.threads import IdleCPUProbe, check_threads, default_threads, set_threads

        check_threads(threads)
        check_rope_scaling(rope_scaling, rope_factor)
        check_precision(precision)
        if prompt_cache is not None:
            from .kv.promptcache import check_options

            check_options(prompt_cache, prompt_cache_max_bytes, prompt_cache_min_tokens)
        probe = IdleCPUProbe() if threads == "auto" else None  # measured over the loading below
        if isinstance(threads, int):
            set_threads(threads)
        target = load_model(model, dtype, device, tp=tp, rope_scaling=rope_scaling, rope_factor=rope_factor,
                            precision=precision)
        if quantize:
            from .model.quant import lower_precision_copy

            target.model = lower_precision_copy(target.model, quantize)
        if tp is not None:
            device = tp.device
        draft_model = None
        if draft in ("ngram", "self"):
            draft_model = draft
        elif draft is not None:
            from .model.parallel import agree_on_fit

            try:  # the draft is replicated: its weights must fit on every rank
                draft_model = agree_on_fit(tp, lambda: load_model(draft, dtype, device))
            except ModelLoadError as e:
                raise ModelLoadError(f"draft: {e}") from e
        if packed_weights is None:
            packed_weights = target.model.packing_pays()
        if packed_weights:
            target.model.pack_weights()
            if isinstance(draft_model, LoadedModel):
                draft_model.model.pack_weights()
        if probe is not None:
            set_threads(default_threads(probe.idle_cpus()))
        return cls(target, draft_model, offload_kv=offload_kv, on_chip_layers=on_chip_layers, kv_dtype=kv_dtype,
                   prompt_cache=prompt_cache, prompt_cache_max_bytes=prompt_cache_max_bytes,
                   prompt_cache_min_tokens=prompt_cache_min_tokens)

    def compile(self, mode: str = "default") -> None:
        """``torch.compile`` the target's (and the draft's) fixed-shape block code; see
        :meth:`~triforce.model.transformer.Transformer.compile_blocks` (ValueError for an unknown mode)."""
        self.target.model.compile_blocks(mode)
        if self.draft is not None:
            self.draft.model.compile_blocks(mode)

    def set_cuda_graphs(self, on: bool) -> None:
        """Replay the target's (and the draft's) fixed-shape forwards on a GPU as CUDA graphs (True) or run every
        forward eagerly (False, ``DEFAULTS["cuda_graphs"]``); see ``model/cudagraph.py``. Nothing changes on a CPU."""
        self.target.model.cuda_graphs = bool(on)
        if self.draft is not None:
            self.draft.model.cuda_graphs = bool(on)

    @property
    def default_mode(self) -> str:
        """``DEFAULTS["mode"]``, ``auto``: the hierarchy chosen per request and bypassed while it does not pay
        (``speculation/auto.py``)."""
        return DEFAULTS["mode"]

    def encode(self, prompt: str, chat: bool = False, system: str | None = None,
               max_prompt_tokens: int | None = None, document: str | None = None) -> list[int]:
        """Prompt text -> token ids: :meth:`encode_cut`'s ids (same arguments and errors)."""
        return self.encode_cut(prompt, chat, system, max_prompt_tokens, document)[0]

    def encode_cut(self, prompt: str, chat: bool = False, system: str | None = None,
                   max_prompt_tokens: int | None = None, document: str | None = None):
        """Prompt text -> ``(token ids, cut)``, ``cut`` a :class:`~triforce.text.prompts.PromptCut` saying what
        ``max_prompt_tokens`` dropped, or None (see :func:`~triforce.text.prompts.encode_prompt_cut`).

        With ``document``, ``prompt`` is a question about it: the prompt is the document, a blank line and the
        question (one user message with ``chat``), the document first so that a follow-up question about the same
        document reuses its KV cache; ``max_prompt_tokens`` then cuts the document, never the question.

        Raises:
            ValueError: ``prompt`` or ``document`` is not a string, or see :func:`~triforce.text.prompts.encode_prompt`.
        """
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if document is not None and not isinstance(document, str):
            raise ValueError(f"document must be a string or None, got {type(document).__name__}")
        cfg = self.target.model.cfg  # dynamic NTK has no length limit
        return encode_prompt_cut(self.tokenizer, prompt, chat=chat, system=system, max_prompt_tokens=max_prompt_tokens,
                                 context_length=None if cfg.rope_type == "dynamic" else cfg.max_position_embeddings,
                                 document=document)

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = DEFAULTS["max_new_tokens"],
               sampling: SamplingParams = SamplingParams(), spec: SpeculationConfig | None = None,
               seed: int | None = None, stop: Sequence[str] = (),
               prefill_progress: Callable[[int], None] | None = None,
               response_format: dict | None = None) -> Generator[TokenEvent, None, GenerationResult]:
        """Generate, yielding a :class:`TokenEvent` per accepted token; returns a :class:`GenerationResult`.

        Args:
            prompt: text (tokenized as is; use :meth:`encode` for chat templates) or token ids.
            max_new_tokens, sampling, seed, prefill_progress: see :meth:`triforce.engine.Engine.stream`.
            spec: speculation settings (default: :attr:`default_mode` with the paper's defaults).
            stop: stop strings; generation ends when the text contains one, and the text is cut before it (when two
                overlap, the one completed first).
            response_format: structured output, OpenAI's ``{"type": "json_object"}`` or ``{"type": "json_schema",
                "json_schema": {"schema": {...}}}`` (or ``regex`` / ``lark``): every tier samples from its
                distribution masked to what the grammar allows, so the output is exactly the constrained target
                distribution (``speculation/grammar.py``; needs llguidance, the ``grammar`` extra). None: unconstrained.

        Text is detokenized incrementally (:class:`~triforce.text.detok.IncrementalDetokenizer`: work linear in the
        output); a character split over several tokens comes out whole with the token that completes it.

        Raises:
            ValueError: bad arguments (named), before any model work.
        """
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {stop!r:.80}")
        if prefill_progress is not None and not callable(prefill_progress):
            raise ValueError(f"prefill_progress must be a callable or None, got {type(prefill_progress).__name__}")
        spec = spec or SpeculationConfig(mode=self.default_mode, drafter=self.drafter)
        if not isinstance(prompt, str) and not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not isinstance(prompt, str) and any(isinstance(p, str) for p in prompt):
            raise ValueError(f"prompt must be one string or a list of token ids, got a list of {len(prompt)} "
                             "strings: for several prompts use generate(prompts=[...])")
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        constraint = constraint_for(response_format, self.tokenizer, self.target.model.cfg.vocab_size,
                                    self.engine.eos_ids) if response_format is not None else None
        cached, file_hit = 0, None
        if self.prompt_cache:  # a file's KV goes straight into a cache of this request's capacity
            capacity = cache_capacity(len(ids), max_new_tokens, spec)
            cached, file_hit = self.prompt_cache.before_request(self.engine, ids, capacity)
        gen = self.engine.stream(ids, max_new_tokens=max_new_tokens, sampling=sampling, spec=spec, seed=seed,
                                 prefill_progress=prefill_progress, constraint=constraint)
        out: list[int] = []
        log: list[TokenLogprob] | None = None if sampling.logprobs is None else []
        detok = IncrementalDetokenizer(self.tokenizer)  # linear in the output, not a full decode per token
        pieces: list[str] = []  # the text given out
        pending = ""  # decoded text not given out yet: it may start a stop string
        finish = None
        hold = max((len(s) for s in stop), default=1) - 1

        def stop_at(text: str, start: int) -> int:  # first stop string in text[start:], -1 if none
            return min((i for i in (text.find(s, start) for s in stop) if i >= 0), default=-1)

        try:
            for tok in gen:
                out.append(tok)
                lp = None
                if log is not None:  # the verifier logged one entry per token it emitted (speculation/logprobs.py)
                    lp = self.engine.logprob_log[len(out) - 1]
                    log.append(lp)
                delta = detok.add(tok)
                start = max(0, len(pending) - hold)  # a new stop string ends in delta
                pending += delta
                hit = stop_at(pending, start) if stop and delta else -1
                if hit >= 0:
                    finish = "stop"
                    pieces.append(pending[:hit])
                    pending = ""
                    yield TokenEvent(tok, pieces[-1], lp)
                    break
                safe = max(0, len(pending) - hold)
                pieces.append(pending[:safe])
                pending = pending[safe:]
                yield TokenEvent(tok, pieces[-1], lp)
        except KeyboardInterrupt:
            finish = "interrupted"
        finally:
            gen.close()
        stats = self.engine.last_stats
        if stats is None:  # interrupted before the engine started (tokenizing, checks)
            raise KeyboardInterrupt
        if finish != "stop":  # the held-back tail: an incomplete character, text that might have started a stop string
            start = max(0, len(pending) - hold)
            pending += detok.flush()
            hit = stop_at(pending, start) if stop else -1
            if hit >= 0:
                pending, finish = pending[:hit], "stop"
            if pending:
                pieces.append(pending)
                yield TokenEvent(None, pending)
        finish = finish or stats.finish_reason
        if finish == "length" and out and out[-1] in self.engine.eos_ids:
            finish = "eos"
        stats.finish_reason = finish
        if self.prompt_cache is not None:
            stats.prompt_cache = self.prompt_cache.after_request(self.engine, cached, file_hit)
        text = "".join(pieces)
        return GenerationResult(text, out, finish, stats, log)

    def prompt_logprobs(self, prompt: str | Sequence[int], top_logprobs: int = 0,
                        progress: Callable[[int], None] | None = None) -> list[TokenLogprob | None]:
        """Log-probability of each prompt token given those before it under the target model (the first token has
        none: None), with ``top_logprobs`` alternatives each: one pass of the target over the prompt
        (:func:`~triforce.speculation.logprobs.prompt_logprobs`; what ``echo`` reports on ``/v1/completions``);
        ``progress``: called with each chunk's tokens (it may raise to stop).

        Raises:
            ValueError, InsufficientMemoryError: before any model work (:meth:`check_prompt_logprobs`).
        """
        ids = self.check_prompt_logprobs(prompt, top_logprobs)
        return prompt_logprobs(self.target.model, ids, top_logprobs, progress=progress)

    def check_prompt_logprobs(self, prompt: str | Sequence[int], top_logprobs: int = 0) -> list[int]:
        """The prompt's token ids after :meth:`prompt_logprobs`' checks: ``top_logprobs`` in [0, 20], token ids
        (integers in the vocabulary), at least one, and what a plain decoding of the prompt's positions would need
        (the model's context or sliding window, free memory for its KV cache: :meth:`Engine.plan`).

        Raises:
            ValueError: naming ``prompt`` or ``top_logprobs``; a model with dynamic NTK RoPE.
            InsufficientMemoryError: the prompt's KV cache does not fit.
        """
        check_top_logprobs(top_logprobs, "top_logprobs")
        if not isinstance(prompt, (str, list, tuple)) or (
                not isinstance(prompt, str) and any(isinstance(t, bool) or not isinstance(t, int) for t in prompt)):
            raise ValueError(f"prompt must be a string or a list of integer token ids, got {type(prompt).__name__}")
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must hold at least one token")
        cfg = self.target.model.cfg
        if cfg.rope_type == "dynamic":
            raise ValueError("prompt log-probabilities are not available for a model with dynamic NTK RoPE scaling")
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size}), got {bad[:5]}")
        if len(ids) > cfg.max_position_embeddings:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {cfg.max_position_embeddings}")
        if len(ids) > 1:  # the prompt's positions: its first n - 1 tokens and one more, as a request would take
            self.engine.plan(ids[:-1], 1, SpeculationConfig(mode="autoregressive"))
        return ids

    def generate(self, prompt: str | Sequence[int] | None = None, *,
                 prompts: Sequence[str | Sequence[int]] | None = None, max_batch: int = DEFAULTS["max_batch"],
                 **kwargs) -> GenerationResult | list[GenerationResult]:
        """Non-streaming :meth:`stream`; with ``prompts``, every prompt generated concurrently in batches.

        Args:
            prompt: one prompt (text or token ids), as :meth:`stream` takes it.
            prompts: several prompts instead: they run together, up to ``max_batch`` at a time, with their model
                forwards batched (continuous batching, ``model/batching.py``); each has its own caches and random
                generator, so its result is the one it gets alone (token for token under greedy decoding, in
                distribution under sampling). ``max_new_tokens``, ``sampling``, ``seed`` and ``spec`` may each be one
                value for every prompt or a list with one per prompt.
            max_batch: with ``prompts``, most sequences decoding at once (>= 1).
            kwargs: :meth:`stream`'s arguments.

        Returns:
            a :class:`GenerationResult`, or with ``prompts`` a list of them, one per prompt, in order. After Ctrl-C
            during a batch, the prompts that were running end with ``finish_reason`` ``interrupted`` and the
            prompts not started yet are None.

        Raises:
            ValueError: bad arguments (named; with ``prompts``, ``prompts[i]`` names the prompt), before any model work.
            InsufficientMemoryError: with ``prompts``, the caches of the ``max_batch`` largest requests do not fit
                together (lower ``max_batch``).
        """
        if prompts is not None:
            if prompt is not None:
                raise ValueError("give either prompt or prompts=[...], not both")
            return self._generate_batch(prompts, max_batch, kwargs)
        if prompt is None:
            raise ValueError("prompt: give a prompt (text or token ids), or prompts=[...] for several")
        gen = self.stream(prompt, **kwargs)
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                return stop.value

    def fork(self) -> "TriForce":
        """This model for one more concurrent sequence: the same models and tokenizer, its own engine state
        (:meth:`~triforce.engine.Engine.fork`, which says what cannot be batched).

        Raises:
            ValueError: see :meth:`~triforce.engine.Engine.fork`.
        """
        other = copy.copy(self)
        other.engine = self.engine.fork()
        return other

    PER_PROMPT = ("max_new_tokens", "sampling", "seed", "spec")  # generate(prompts=...) arguments given per prompt

    def _generate_batch(self, prompts, max_batch: int, kwargs: dict) -> list[GenerationResult]:
        from .kv.memory import check_fits
        from .model.batching import BatchScheduler, Cancelled

        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts (texts or token-id lists), "
                             f"got {prompts!r:.80}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        n = len(prompts)
        per = []
        for name in self.PER_PROMPT:
            value = kwargs.get(name)
            if isinstance(value, (list, tuple)):
                if len(value) != n:
                    raise ValueError(f"{name}: a list must give one value per prompt ({n}), got {len(value)}")
                per.append((name, list(value)))
        args = []
        needed: list[int] = []
        for i, p in enumerate(prompts):
            kw = dict(kwargs, **{name: values[i] for name, values in per})
            try:
                if isinstance(p, str):
                    ids = self.encode(p)
                elif isinstance(p, (list, tuple)):
                    ids = list(p)
                else:
                    raise ValueError(f"must be a string or a list of token ids, got {type(p).__name__}")
                spec = kw.get("spec") or SpeculationConfig(mode=self.default_mode, drafter=self.drafter)
                plan = self.engine.plan(ids, kw.get("max_new_tokens", DEFAULTS["max_new_tokens"]), spec,
                                        sampling=kw.get("sampling", SamplingParams()), seed=kw.get("seed"))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from e
            args.append((ids, kw))
            needed.append(sum(v for k, v in plan.cache_bytes.items() if "copies" not in k))
        if n == 1:
            return [self.generate(args[0][0], **args[0][1])]
        views = [self.fork() for _ in range(min(n, max_batch))]  # refuses what cannot be batched
        largest = sorted(needed, reverse=True)[:max_batch]
        check_fits({f"the caches of {len(largest)} concurrent requests": sum(largest)}, self.target.model.device,
                   f"max_batch={max_batch}", already={"weights": self.target.model.weight_bytes()})
        free = list(views)

        def job(ids, kw):
            view = free.pop()  # a finished sequence's view is reused: its caches are freed at the next request
            try:
                return view.generate(ids, **kw)
            finally:
                view.engine.forget_prefix()
                free.append(view)

        scheduler = BatchScheduler(max_batch)
        seqs = [scheduler.submit(lambda a=a: job(*a)) for a in args]
        try:
            while scheduler.step():
                failed = next((s for s in seqs if s.error is not None and not isinstance(s.error, Cancelled)), None)
                if failed is not None:  # one prompt failed: stop the others at once, raise its error
                    for s in seqs:
                        s.cancel()
                    while scheduler.step():
                        pass
                    raise failed.error
        except KeyboardInterrupt:  # Ctrl-C: the running prompts end as "interrupted", the queued ones get None
            scheduler.interrupt()
        for seq in seqs:
            if seq.error is not None and not isinstance(seq.error, (Cancelled, KeyboardInterrupt)):
                raise seq.error
        return [seq.result for seq in seqs]
