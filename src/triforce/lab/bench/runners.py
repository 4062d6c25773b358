"""``triforce bench``: the worker side of each family of methods (ours, transformers, llama.cpp)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from ...defaults import DEFAULTS
from ...plan import cache_capacity
from .methods import PREDICT_TEXT_TOKENS, SYNTHETIC_DRAFT, _costmodel_module, _gguf_for, _synthetic_module
from .stats import acceptance_inputs


def _hf_source(model: str | None) -> tuple[str, dict]:
    """``(path or hub id, extra from_pretrained kwargs)`` for transformers from a ``--model`` value."""
    if model is None:
        from ...formats.download import download_default_model

        return str(download_default_model(quiet=True)), {}
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return str(p.parent), {"gguf_file": p.name}
    if p.is_dir() and not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(p), {"gguf_file": ggufs[0].name}
    return model, {}


class _Clock:
    """A transformers streamer (``BaseStreamer`` protocol: ``put``, ``end``) that timestamps generated tokens.

    transformers' first ``put()`` carries the prompt; every later one carries one token (or an accepted block of
    tokens in assisted generation), all given the same timestamp.
    """

    def __init__(self, t0: float) -> None:
        self.t0, self.first = t0, True
        self.times: list[float] = []
        self.tokens: list[int] = []

    def put(self, value) -> None:
        if self.first:
            self.first = False
            return
        now = time.perf_counter() - self.t0
        ids = value.reshape(-1).tolist()
        self.tokens.extend(int(i) for i in ids)
        self.times.extend([now] * len(ids))

    def end(self) -> None:
        pass


class _OursRunner:
    """Worker side of our methods: an :class:`~triforce.engine.Engine` that ignores EOS."""

    def __init__(self, method: str, cfg: dict) -> None:
        import torch

        from ...engine import Engine, SpeculationConfig
        from ...speculation.sampling import SamplingParams

        self.method, self.cfg = method, cfg
        self.synthetic = cfg.get("synthetic")
        draft_src = cfg.get("draft")
        uses_bottom = method in ("draft", "triforce", "triforce-int8", "auto", "auto-exact")
        drafter = "ngram" if draft_src in (None, "ngram") else "model"
        if self.synthetic:
            syn = _synthetic_module()
            scfg = syn.synthetic_config(self.synthetic, layers=cfg.get("layers"))
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg["dtype"]]
            target = syn.random_model(scfg, dtype, "cpu", cfg["seed"])
            self.tokenizer, self.context, self.rope_dynamic = None, None, False
            draft = None
            if uses_bottom and draft_src != "ngram":  # the paper's draft shape, sharing the target's vocabulary
                dcfg = syn.synthetic_config(SYNTHETIC_DRAFT, vocab_size=scfg.vocab_size)
                draft, drafter = syn.random_model(dcfg, dtype, "cpu", cfg["seed"] + 1), "model"
        else:
            from ...formats.loading import ModelLoadError, load_model

            precision = "exact" if method.endswith("-exact") else cfg.get("precision")
            lm = load_model(cfg.get("model"), cfg["dtype"], rope_scaling=cfg.get("rope_scaling"),
                            rope_factor=cfg.get("rope_factor"), precision=precision)  # the draft keeps its own RoPE
            target = lm.model
            self.tokenizer, self.context = lm.tokenizer, lm.model.cfg.max_position_embeddings
            self.rope_dynamic = lm.model.cfg.rope_type == "dynamic"
            draft = None
            if uses_bottom and drafter == "model":
                try:
                    draft_lm = load_model(draft_src, cfg["dtype"])
                except ModelLoadError as e:
                    raise ModelLoadError(f"draft: {e}") from e
                from ...api import check_same_tokenizer

                check_same_tokenizer(lm.tokenizer, draft_lm.tokenizer)
                draft = draft_lm.model
        packed = cfg.get("packed_weights", "auto")
        if packed == "on" or (packed == "auto" and target.packing_pays()):
            for model in (target, draft):
                if model is not None:
                    model.pack_weights()
        self.target, self.draft = target, draft
        self.engine = Engine(target, draft, eos_ids=())
        self.prompt_cache = None
        if cfg.get("prompt_cache") and not self.synthetic:
            from ...kv.promptcache import PromptCache, model_key

            key = model_key(lm.source, target.cfg, target.dtype, self.engine.kv_dtype, target.precision)
            self.prompt_cache = PromptCache(cfg["prompt_cache"], key,
                                            min_new_tokens=DEFAULTS["prompt_cache_min_tokens"])
        self.sampling = SamplingParams(temperature=cfg["temperature"], top_p=cfg["top_p"], top_k=cfg["top_k"])
        mode = method.removesuffix("-int8").removesuffix("-codes").removesuffix("-exact")
        lower = (dict(lower_weights="int8", lower_kv_dtype="bfloat16") if method.endswith("-int8")
                 else dict(lower_weights="codes") if method.endswith("-codes") else {})
        if method == "self":
            mode, drafter = "draft", "self"
        elif mode == "auto" and drafter == "ngram" and draft_src is None:
            drafter = "model"  # auto's own choice of bottom tier, as `triforce generate` without --draft
        self._prompt_tail: list[int] = []  # the last run's prompt end: real text's logits for the cost model
        self.spec = SpeculationConfig(mode=mode, drafter=drafter, budget=cfg["budget"], chunk_size=cfg["chunk_size"],
                                      gamma1=cfg["gamma1"], gamma2=cfg["gamma2"], **lower)

    def describe(self) -> dict:
        return {"chain": [list(x) for x in self.spec.chain], "drafter": self.spec.drafter,
                "precision": self.target.precision,
                "spec": {"mode": self.spec.mode, "budget": self.spec.budget, "chunk_size": self.spec.chunk_size,
                         "gamma1": self.spec.gamma1, "gamma2": self.spec.gamma2, "drafter": self.spec.drafter,
                         "lower_weights": self.spec.lower_weights, "lower_kv_dtype": self.spec.lower_kv_dtype}}

    def _fill_prefix(self, ids: list[int], new_tokens: int) -> None:
        """Synthetic models: make the engine's full KV cache hold random KV for ``ids[:-1]`` (no prefill), so the
        engine's prefix reuse feeds only the last prompt token (which also records the query the retrieval cache
        selects chunks with)."""
        from ...kv.caches import FullKVCache
        from ...plan import size_request

        n = len(ids) - 1
        eng = self.engine
        held = eng.prefix_tokens
        if n < 1 or (len(held) >= n and held[:n] == ids[:n]):
            return
        total = size_request(len(ids), new_tokens, self.spec)[0]
        self.target.set_request_length(total)
        eng.forget_prefix()
        full = FullKVCache(self.target.cfg, total, self.target.dtype, self.target.device)
        _synthetic_module().fill_random_kv(full, n, self.cfg["seed"])
        eng.adopt_prefix(full, list(ids[:n]))

    def run(self, ids: list[int], new_tokens: int, seed: int) -> dict:
        if self.synthetic:
            self._fill_prefix(ids, new_tokens)
        self._prompt_tail = list(ids[-PREDICT_TEXT_TOKENS:])
        t0 = time.perf_counter()
        if self.prompt_cache is not None:  # the file's load counts in the time to first token, as a prefill would
            cached, hit = self.prompt_cache.before_request(self.engine, ids,
                                                           cache_capacity(len(ids), new_tokens, self.spec))
        gen = self.engine.stream(ids, max_new_tokens=new_tokens, sampling=self.sampling, spec=self.spec, seed=seed)
        tokens, times = [], []
        for tok in gen:
            times.append(time.perf_counter() - t0)
            tokens.append(int(tok))
        stats = self.engine.last_stats
        out = {"tokens": tokens, "times": times, "stats": stats.to_dict() if stats else None}
        if self.prompt_cache is not None:
            # written where this run prefilled enough of the prompt, not again for each repetition's new tokens
            out["prompt_cache"] = self.prompt_cache.after_request(self.engine, cached + len(tokens), hit)
        return out

    def predict(self, context: int, acceptance: dict, reps: int) -> dict:
        """The cost model's prediction for this method at ``context`` tokens."""
        from ...engine import KV_DTYPES

        cm = _costmodel_module()
        s = self.spec
        draft = self.draft
        if any(k == "self" for k, _ in s.chain):  # the self tier is timed as a draft model: the target's copy
            draft = self.engine.lower_model(self.target, s.self_weights)
        elif draft is not None and s.lower_weights:  # the draft tier runs the draft's lower copy (Engine)
            draft = self.engine.lower_model(draft, s.lower_weights)
        # one interleaved loop: the verifier's steps and the lower tiers' (their copy of the weights, their caches'
        # dtype), each with its token selection under this method's sampling, as the engine runs them
        lower = self.engine.lower_model(self.target, s.lower_weights) if s.lower_weights else None
        # the token selection works on real text's distributions: the last prompt tokens' (random KV gives flat ones)
        real = None
        if not self.synthetic and self._prompt_tail and not self.sampling.greedy:
            real = cm.text_logits(self.target, self._prompt_tail)
        latencies = cm.measure_tier_latencies(self.target, draft, [context], gamma1=s.gamma1, gamma2=s.gamma2,
                                              budget=s.budget, chunk_size=s.chunk_size, draft_sink=s.draft_sink,
                                              draft_window=s.draft_window, reps=reps, progress=None, lower=lower,
                                              lower_kv=KV_DTYPES[s.lower_kv_dtype] if s.lower_kv_dtype else None,
                                              sampling=self.sampling, selection_logits=real)[0]
        rates, lengths = acceptance_inputs(acceptance)
        pred = cm.predict(s.chain, latencies, rates, accepted_lengths=lengths)
        return {"latencies": latencies, "prediction": pred}


class _HFRunner:
    """Worker side of the transformers methods (``generate`` with a timestamping streamer)."""

    def __init__(self, method: str, cfg: dict) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.method, self.cfg = method, cfg
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg["dtype"]]
        self.cache, self._cache_ids = None, None  # the prompt's KV but its last token, kept between runs
        if cfg.get("synthetic"):
            from transformers import LlamaConfig

            fields = dict(_synthetic_module().SYNTHETIC_SHAPES[cfg["synthetic"]])
            fields.pop("architectures", None)
            fields.pop("model_type", None)
            if cfg.get("layers"):
                fields["num_hidden_layers"] = cfg["layers"]
            torch.manual_seed(cfg["seed"])
            self.model = AutoModelForCausalLM.from_config(LlamaConfig(**fields), dtype=dtype).eval()
            self.tokenizer = None
        else:
            src, kw = _hf_source(cfg.get("model"))
            self.model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kw).eval()
            self.tokenizer = AutoTokenizer.from_pretrained(src, **kw)
        self.context = self.model.config.max_position_embeddings
        self.assistant = None
        if method == "hf-assisted":
            dsrc, dkw = _hf_source(cfg["draft"])
            self.assistant = AutoModelForCausalLM.from_pretrained(dsrc, dtype=dtype, **dkw).eval()

    def describe(self) -> dict:
        return {}

    def run(self, ids: list[int], new_tokens: int, seed: int) -> dict:
        import torch
        from transformers import GenerationConfig

        cfg = self.cfg
        greedy = cfg["temperature"] == 0
        gc = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=not greedy,
                              eos_token_id=None, pad_token_id=0,
                              **({} if greedy else dict(temperature=cfg["temperature"], top_p=cfg["top_p"],
                                                         top_k=cfg["top_k"] or None)))
        extra: dict[str, Any] = {}
        if self.method == "hf-assisted":
            extra["assistant_model"] = self.assistant
        elif self.method == "hf-lookup":
            gc.prompt_lookup_num_tokens = cfg["gamma2"]
        x = torch.tensor([ids])
        t0 = time.perf_counter()  # a prefill of the prompt's KV (first run only) counts in the time to first token
        if cfg.get("synthetic"):
            extra["past_key_values"] = self._random_prefix(ids)
        elif self.method == "hf-ar":  # assisted and prompt-lookup generation mishandle a given cache (their greedy
            extra["past_key_values"] = self._prefix(ids)  # tokens then differ): they prefill on every run
        torch.manual_seed(seed)
        clock = _Clock(t0)
        with torch.no_grad():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc, streamer=clock,
                                      **extra)
        tokens = out[0, len(ids):].tolist()
        if self.cache is not None:  # back to the prompt minus its last token, for the next run
            extra_len = self.cache.get_seq_length() - (len(ids) - 1)
            if extra_len > 0:
                self.cache.crop(-extra_len)
        return {"tokens": tokens, "times": clock.times[:len(tokens)], "stats": None}


    def _prefix(self, ids: list[int]):
        """The prompt's KV cache but its last token (a DynamicCache), computed by one forward the first time and
        kept between runs, as our engine's prefix reuse does; ``generate`` then feeds only the last prompt token.
        Returns None (a plain prefill) for a one-token prompt."""
        import torch
        from transformers import DynamicCache

        n = len(ids) - 1
        if n < 1:
            return None
        if self.cache is not None and self.cache.get_seq_length() == n and self._cache_ids == ids[:n]:
            return self.cache
        self.cache = None
        cache = DynamicCache(config=self.model.config)
        with torch.no_grad():
            self.model(torch.tensor([ids[:n]]), past_key_values=cache, use_cache=True)
        self.cache, self._cache_ids = cache, list(ids[:n])
        return cache

    def _random_prefix(self, ids: list[int]):
        """Synthetic models: a DynamicCache holding random KV for ``ids[:-1]`` (kept and reused across runs)."""
        import torch
        from transformers import DynamicCache

        n = len(ids) - 1
        if self.cache is not None and self.cache.get_seq_length() == n and getattr(self, "_cache_ids", None) == ids[:n]:
            return self.cache
        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        gen = torch.Generator().manual_seed(self.cfg["seed"])
        cache = DynamicCache(config=c)
        for layer in range(c.num_hidden_layers):
            shape = (1, c.num_key_value_heads, n, head_dim)
            cache.update(torch.randn(shape, generator=gen).to(self.model.dtype),
                         torch.randn(shape, generator=gen).to(self.model.dtype), layer)
        self.cache, self._cache_ids = cache, list(ids[:n])
        return cache


class _LlamaRunner:
    """Worker side of llama.cpp (llama-cpp-python): prefill with ``eval``, then sample/eval token by token."""

    def __init__(self, method: str, cfg: dict) -> None:
        import llama_cpp  # noqa: F401  (fails here, reported as the method's skip reason)

        self.cfg = cfg
        self.path = _gguf_for(cfg.get("model"))[0]
        self.llm = None
        self.n_ctx = 0
        self.context = None

    def describe(self) -> dict:
        import llama_cpp

        return {"gguf": self.path, "llama_cpp_python": getattr(llama_cpp, "__version__", None),
                "precision": "llama.cpp"}

    def _ensure(self, n_ctx: int) -> None:
        if self.llm is not None and self.n_ctx >= n_ctx:
            return
        from llama_cpp import Llama

        self.llm = None
        threads = self.cfg.get("threads") or os.cpu_count()
        self.n_ctx = 256 * math.ceil(n_ctx / 256)
        rope = {}
        if self.cfg.get("rope_scaling"):  # llama.cpp's --rope-scaling T --rope-scale F (yarn: its trained context)
            import llama_cpp

            rope = dict(rope_scaling_type={"linear": llama_cpp.LLAMA_ROPE_SCALING_TYPE_LINEAR,
                                           "yarn": llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN}[self.cfg["rope_scaling"]],
                        rope_freq_scale=1.0 / self.cfg["rope_factor"])
        self.llm = Llama(model_path=self.path, n_ctx=self.n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, seed=self.cfg["seed"], verbose=False, **rope)

    def _state_file(self, ids: list[int]) -> Path:
        """Where ``--prompt-cache`` keeps llama.cpp's state (its KV cache) after ``ids``: keyed by the GGUF file
        (path, size, modification time), the context size (the prompt's and ``--new-tokens``' positions, rounded up
        to 256: another ``--new-tokens`` may prefill again), the RoPE override and the tokens."""
        import hashlib

        st = os.stat(self.path)
        rope = f":{self.cfg['rope_scaling']}:{self.cfg['rope_factor']}" if self.cfg.get("rope_scaling") else ""
        key = f"{os.path.realpath(self.path)}:{st.st_size}:{st.st_mtime_ns}:{self.n_ctx}{rope}:{ids}"
        return Path(self.cfg["prompt_cache"]) / f"llamacpp-{hashlib.sha256(key.encode()).hexdigest()[:24]}.state"

    def _resume(self, ids: list[int]) -> dict | None:
        """Keep the prompt's KV where llama.cpp still holds it (the previous run), else load it from
        ``--prompt-cache`` (``llama_state_load_file``); ``llama.eval`` then drops every position past ``n_tokens``.
        Returns the run's ``prompt_cache`` entry, or None without ``--prompt-cache``."""
        import ctypes

        import llama_cpp

        llm, n = self.llm, len(ids) - 1
        if llm.n_tokens >= n and list(llm.input_ids[:n]) == ids[:n]:
            llm.n_tokens = n
            return None if not self.cfg.get("prompt_cache") else {"loaded_tokens": 0, "loaded_from": None,
                                                                    "stored": None}
        llm.reset()
        if not self.cfg.get("prompt_cache") or n < 1:
            return None
        path = self._state_file(ids[:n])
        if path.is_file():
            out = (llama_cpp.llama_token * n)()
            count = ctypes.c_size_t(0)
            if (llama_cpp.llama_state_load_file(llm._ctx.ctx, str(path).encode(), out, n, ctypes.byref(count))
                    and count.value == n and list(out) == ids[:n]):
                llm.input_ids[:n] = ids[:n]
                llm.n_tokens = n
                return {"loaded_tokens": n, "loaded_from": str(path), "stored": None}
            llm.reset()
        return {"loaded_tokens": 0, "loaded_from": None, "stored": None, "_store": str(path)}

    def run(self, ids: list[int], new_tokens: int, seed: int) -> dict:
        cfg = self.cfg
        self._ensure(len(ids) + new_tokens + 8)
        llm = self.llm
        t0 = time.perf_counter()  # a state file's load counts in the time to first token, as our methods' does
        cache = self._resume(ids)
        llm.set_seed(seed)
        greedy = cfg["temperature"] == 0
        tokens, times = [], []
        # one sampler chain for the whole run, so its random state advances from token to token (Llama.sample()
        # alone builds a fresh chain, re-seeded, for every token); llama.cpp's chain applies top-k, top-p, then
        # the temperature (transformers and triforce apply the temperature first)
        llm._sampler = llm._init_sampler(temp=0.0 if greedy else cfg["temperature"], top_k=cfg["top_k"],
                                         top_p=cfg["top_p"], min_p=0.0, typical_p=1.0, repeat_penalty=1.0,
                                         frequency_penalty=0.0, presence_penalty=0.0)
        try:
            llm.eval(ids[llm.n_tokens:])
            for i in range(new_tokens):
                tok = llm.sample()
                times.append(time.perf_counter() - t0)
                tokens.append(int(tok))
                if i + 1 < new_tokens:
                    llm.eval([tok])
        finally:
            llm._sampler = None
        out = {"tokens": tokens, "times": times, "stats": None}
        if cache is not None:
            path = cache.pop("_store", None)
            if path is not None and len(ids) - 1 >= DEFAULTS["prompt_cache_min_tokens"]:  # the prompt's KV (and
                # the generated tokens', dropped on load)
                import llama_cpp

                n = len(ids) - 1
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                tmp = path + ".tmp"
                tokens = (llama_cpp.llama_token * n)(*ids[:n])
                if llama_cpp.llama_state_save_file(llm._ctx.ctx, tmp.encode(), tokens, n):
                    os.replace(tmp, path)
                    cache["stored"] = path
                elif os.path.exists(tmp):  # a failed write leaves nothing behind
                    os.unlink(tmp)
            out["prompt_cache"] = cache
        return out
