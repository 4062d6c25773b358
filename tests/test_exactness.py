"""Exact on every path (issue 47): near-tie models, whose two best tokens differ by about 1e-6 at every position, run
through every path the verifier can take, with each build forced.

The tiny models of ``tiny.py`` have sharp logits, so rounding cannot flip their argmax; here the LM head's columns
come in pairs, column 2j + 1 = column 2j + 1e-6 r_j (r_j a random unit vector), so the best two logits at every
position are a pair about 1e-6 apart: any difference in rounding between a decode step and its row of a block, or
between a request alone and in a batch, flips greedy tokens (a difference of 2.4e-7 in the logits flipped 2-11 of
17-32 argmaxes in the runs that shaped these tests). Checked on each build: ``native`` (this CPU's best),
``avx2`` (``TRIFORCE_KERNEL_ISA=AVX2``: the AVX2 builds on an AVX-512 machine), ``portable``
(``TRIFORCE_KERNEL_ISA=portable``: every kernel's plain C build, what a CPU without AVX2 or aarch64 runs) and ``off``
(every kernel switched off: PyTorch's ops, each row of a verifier block computed by the call its decode step
makes; on these three forced builds checks (b)-(d) take vocabulary 101 only, for CI time). A build is chosen
when the kernels first load, so each runs in a subprocess that computes every check once
(:func:`_checks`) and prints the results; the tests assert on them.

* (a) a decode step's logits are bitwise its row of a block of 1-32 tokens, for vocabularies of 96, 97 and 101 (the
  LM head's width not a multiple of 16) and for a model on GGUF block codes, and its row (and recorded query) of a
  verification block of 65 and 100 tokens as the verifier runs it (``exact.verify_forward``: pieces of at most 64);
  each block of a ragged forward of up to 128 rows (8 sequences' 16-token blocks) is bitwise the block alone;
* (b) every speculative mode gives the autoregressive tokens, with verification blocks of 5, 17 and 32 tokens;
* (c) ``TriForce.generate(prompts=[...])`` gives each of 8 requests (prompts of 3-62 tokens, several modes) its
  tokens alone beside 1, 3 and 7 others;
* (d) the n-gram drafter's and the retrieval tier's proposals give the autoregressive tokens with verification
  blocks of 65-100 tokens (gamma2 99: the verifier runs them in pieces of at most 64);
* (e) a 130-token prompt (a prefill chunk past 64 tokens) gives its fresh engine's tokens again on the same engine
  (prefix reuse, across modes), from a copy of its KV (``adopt_prefix``) and from a prompt-cache file, in
  autoregressive and retrieval mode (``exact.prefill_forward_size``: its last 8 tokens run as a reuse feeds them).

(a), (b), (c) and (e) also run on a near-tie target on GGUF-like block codes that computes on the file's arithmetic
(``--precision file``: int8 activations and integer dot products in every product, prefill included), where the
block-code kernel is on.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from near_tie import GREEDY_NEW, INTER, near_tie, near_tie_pair, random_ids

HERE = os.path.dirname(os.path.abspath(__file__))
#: environment of each forced build (a build is chosen when the kernels first load: each runs in a subprocess)
OFF = {name: "0" for name in ("TRIFORCE_ATTENTION_KERNEL", "TRIFORCE_LINEAR_KERNEL", "TRIFORCE_NORM_ROPE_KERNEL",
                              "TRIFORCE_DECODE_STEP_KERNEL", "TRIFORCE_SAMPLING_KERNEL", "TRIFORCE_BLOCK_CODES")}
BUILDS = {"native": {}, "avx2": {"TRIFORCE_KERNEL_ISA": "AVX2"}, "portable": {"TRIFORCE_KERNEL_ISA": "portable"},
          "off": OFF}
VOCABS = (96, 101)  # a multiple of 16 and not


def _vocabs() -> tuple[int, ...]:
    """The vocabularies of checks (b)-(d): both on the native build; on a forced build (AVX2, portable, kernels off:
    the slower ones, for CI time) only 101, whose LM head is not a multiple of 16 (the tail-column path).
    Check (a) runs every vocabulary on every build."""
    forced = os.environ.get("TRIFORCE_KERNEL_ISA") or any(os.environ.get(k) == "0" for k in OFF)
    return VOCABS[-1:] if forced else VOCABS
def _rows_differing(model, prompt: int, t: int, seed: int) -> int:
    """Rows of a t-token block (after a prompt) whose logits differ from the same tokens' decode steps."""
    from triforce.kv.caches import FullKVCache

    ids = torch.tensor([random_ids(prompt + t, model.cfg.vocab_size, seed)])
    block, steps = FullKVCache(model.cfg, prompt + t + 1), FullKVCache(model.cfg, prompt + t + 1)
    for cache in (block, steps):
        model(ids[:, :prompt], torch.arange(prompt), cache)
    whole = model(ids[:, prompt:], torch.arange(prompt, prompt + t), block)[0]
    one = torch.cat([model(ids[:, prompt + i:prompt + i + 1], torch.tensor([prompt + i]), steps)[0] for i in range(t)])
    return int((whole != one).any(dim=1).sum())


def _verification_differing(model, prompt: int, t: int, seed: int, num_logits: int | None = None) -> int:
    """Rows of a t-token verification block run as the verifier runs it (``exact.verify_forward``: pieces of at most
    64 tokens past 64) whose logits differ from the same tokens' decode steps, plus positions whose recorded queries
    differ (the retrieval tier selects with them: the pieces' queries count as one forward's)."""
    from triforce.kernels.rows import verify_forward
    from triforce.kv.caches import FullKVCache

    ids = torch.tensor([random_ids(prompt + t, model.cfg.vocab_size, seed)])
    block, steps = (FullKVCache(model.cfg, prompt + t + 1, record_queries=True) for _ in range(2))
    for cache in (block, steps):
        model(ids[:, :prompt], torch.arange(prompt), cache)

    def forward(tokens, n):
        return model(torch.tensor([tokens]), torch.arange(block.length, block.length + len(tokens)), block, n)[0]

    whole = verify_forward(forward, block, ids[0, prompt:].tolist(), num_logits)
    one, queries = [], []
    for i in range(t):
        one.append(model(ids[:, prompt + i:prompt + i + 1], torch.tensor([prompt + i]), steps)[0])
        queries.append(steps.query_at(prompt + i))
    one = torch.cat(one)[t - whole.shape[0]:]
    return (int((whole != one).any(dim=1).sum()) + (whole.shape[0] != (num_logits or t))
            + sum(not torch.equal(block.query_at(prompt + i), q) for i, q in enumerate(queries)))


def _ragged_blocks_differing(model, seqs: int, t: int) -> int:
    """Blocks of a ragged forward of ``seqs`` sequences' t-token blocks whose logits differ from the block alone."""
    from triforce.kv.caches import FullKVCache

    blocks, alone = [], []
    for i in range(seqs):
        n = 5 + 3 * i  # other prompt lengths
        ids = torch.tensor([random_ids(n + t, model.cfg.vocab_size, 100 + i)])
        caches = [FullKVCache(model.cfg, n + t + 1) for _ in range(2)]
        for cache in caches:
            model(ids[:, :n], torch.arange(n), cache)
        pos = torch.arange(n, n + t)
        alone.append(model(ids[:, n:], pos, caches[0], num_logits=t))
        blocks.append((ids[:, n:], pos, caches[1], t))
    return sum(not torch.equal(a, b) for a, b in zip(alone, model.forward_ragged(blocks)))


def _file_model(vocab: int, seed: int):
    """A near-tie target on GGUF-like block codes that computes on the file's arithmetic (``set_precision(...,
    "file")``: int8 activations, integer dot products), or None where the block-code kernel is off."""
    from references import gguf_like
    from tiny import hf_model, ours
    from triforce.model.precision import file_arithmetic_ok, set_precision

    model = ours(gguf_like(hf_model(seed, vocab=vocab, layers=3, intermediate_size=INTER)))
    model.attach_block_codes()
    if not file_arithmetic_ok(model):
        return None
    set_precision(model, "file")
    return near_tie(model, seed)


def _file_pair(vocab: int, seed: int = 0):
    """(target on the file's arithmetic, near-tie draft), or None where the block-code kernel is off."""
    target = _file_model(vocab, seed)
    return None if target is None else (target, near_tie_pair(vocab, seed)[1])


def _check_rows() -> dict:
    """(a): rows differing per (model, block length), and blocks differing in ragged forwards of 8-128 rows."""
    from references import gguf_like
    from tiny import hf_model, ours

    out = {}
    for vocab in (96, 97, 101):
        model = near_tie(ours(hf_model(0, vocab=vocab, layers=3, intermediate_size=INTER)))
        for t in (1, 2, 7, 16, 17, 32) if vocab != 97 else (2, 17):
            out[f"fp32 V={vocab} T={t}"] = _rows_differing(model, 20, t, seed=t)
        if vocab == 101:  # verification blocks past 64 tokens (gamma2 64 and up): in pieces of at most 64
            for t, n in ((65, None), (100, 70)):
                out[f"fp32 V={vocab} verification T={t}"] = _verification_differing(model, 20, t, t, n)
        for seqs, t in ((8, 1), (5, 13), (8, 16)) if vocab != 97 else ((5, 13),):  # 8, 65 and 128 rows
            out[f"fp32 V={vocab} ragged {seqs}x{t}"] = _ragged_blocks_differing(model, seqs, t)
    # the LM head's pairs are not block codes: it stays fp32, the layers' projections are codes
    coded = near_tie(ours(gguf_like(hf_model(5, vocab=96, layers=3, intermediate_size=INTER))))
    coded.attach_block_codes()  # 12 projections on codes (none with the kernels off): one C call per forward
    for t in (1, 7, 17, 32):
        out[f"codes T={t}"] = _rows_differing(coded, 20, t, seed=t)
    for t in (65, 100):  # csrc/decode_step.c calls of at most 64 tokens, one per piece
        out[f"codes verification T={t}"] = _verification_differing(coded, 20, t, t)
    for seqs, t in ((5, 13), (8, 16)):
        out[f"codes ragged {seqs}x{t}"] = _ragged_blocks_differing(coded, seqs, t)
    file = _file_model(96, 5)  # the file's arithmetic: every projection on int8 activations
    if file is not None:
        for t in (1, 7, 17, 32):
            out[f"file T={t}"] = _rows_differing(file, 20, t, seed=t)
        for t in (65, 100):
            out[f"file verification T={t}"] = _verification_differing(file, 20, t, t)
        for seqs, t in ((5, 13), (8, 16)):
            out[f"file ragged {seqs}x{t}"] = _ragged_blocks_differing(file, seqs, t)
    return out


def _check_modes() -> dict:
    """(b): per (vocabulary, setting, prompt), whether the tokens equal the autoregressive ones."""
    from triforce.engine import Engine, SpeculationConfig
    from triforce.speculation.sampling import SamplingParams

    greedy = SamplingParams(temperature=0)
    out = {}
    pairs = [(str(vocab), near_tie_pair(vocab)) for vocab in _vocabs()]
    if _file_pair(VOCABS[-1]) is not None:  # the verifier on the file's arithmetic
        pairs.append((f"{VOCABS[-1]} file", _file_pair(VOCABS[-1])))
    for name, models in pairs:
        vocab = models[0].cfg.vocab_size
        engine = Engine(*models)
        settings = [("retrieval", 4, dict(budget=16, chunk_size=4, gamma2=4)),
                    ("triforce", 4, dict(budget=24, chunk_size=4, gamma1=2, gamma2=4)),
                    ("draft", 16, dict(gamma2=16)),
                    ("retrieval", 31, dict(budget=72, chunk_size=4, gamma2=31)),
                    ("triforce", 31, dict(budget=72, chunk_size=8, gamma1=3, gamma2=31, drafter="ngram")),
                    ("draft", 16, dict(gamma2=16, drafter="self", self_weights="int8"))]
        for p, n in enumerate((6, 40)):
            prompt = random_ids(n, vocab, 10 + p)
            ref = engine.generate(prompt, max_new_tokens=GREEDY_NEW, sampling=greedy, spec=SpeculationConfig())[0]
            for mode, g2, kw in settings:
                spec = SpeculationConfig(mode=mode, draft_sink=4, draft_window=12, **kw)
                got = engine.generate(prompt, max_new_tokens=GREEDY_NEW, sampling=greedy, spec=spec)[0]
                out[f"V={name} {mode} {kw.get('drafter', '')} gamma2={g2} prompt={n}"] = got == ref
    return out


def _check_long_blocks() -> dict:
    """(d): per (vocabulary, setting), whether the first tokens equal the autoregressive ones with verification
    blocks of 65-100 tokens, and whether such blocks ran (each verification's length recorded)."""
    import triforce.speculation.tiers as tiers
    from triforce.engine import Engine, SpeculationConfig
    from triforce.speculation.sampling import SamplingParams

    lengths, verify = [], tiers.verify_forward

    def recorded(forward, cache, tokens, num_logits):
        if cache.exact_rows(1):  # the verifier's
            lengths.append(len(tokens))
        return verify(forward, cache, tokens, num_logits)

    def first(models, prompt, n, spec):  # a fresh engine: no prefix reuse between runs
        gen = Engine(*models).stream(prompt, max_new_tokens=100, sampling=SamplingParams(temperature=0), spec=spec)
        out = [t for _, t in zip(range(n), gen)]
        gen.close()
        return out

    out = {}
    tiers.verify_forward = recorded
    try:
        for vocab in _vocabs():
            models = near_tie_pair(vocab)
            # every token once, then 100 of one: the n-gram drafter's match of a new token is early, its
            # proposal long (up to 99 tokens); the retrieval tier always proposes gamma2 = 99
            prompt = (torch.randperm(vocab - 3, generator=torch.Generator().manual_seed(vocab)) + 3).tolist()
            prompt += [3] * 100
            ref = first(models, prompt, 20, SpeculationConfig())
            settings = [(20, dict(tiers="ngram:99", ngram_min=1, ngram_n=1))]
            if vocab == VOCABS[-1]:  # 99 retrieval steps per verification: one vocabulary
                settings.append((3, dict(mode="retrieval", budget=108, chunk_size=4, gamma2=99)))
            for n, kw in settings:
                lengths.clear()
                key = f"V={vocab} {kw.get('tiers') or kw['mode']}"
                out[key] = first(models, prompt, n, SpeculationConfig(**kw)) == ref[:n]
                out[f"{key}: blocks of 65-100 tokens ran"] = any(65 <= t <= 100 for t in lengths)
    finally:
        tiers.verify_forward = verify
    return out


def _check_batch() -> dict:
    """(c): per (vocabulary, request, company), whether the request's tokens equal its tokens alone."""
    from tiny import char_tokenizer, hf_config
    from triforce.api import TriForce
    from triforce.engine import SpeculationConfig
    from triforce.formats.loading import LoadedModel
    from triforce.speculation.sampling import SamplingParams

    out = {}
    pairs = [(str(vocab), near_tie_pair(vocab, seed=7)) for vocab in _vocabs()]
    if _file_pair(VOCABS[-1], 7) is not None:  # the verifier on the file's arithmetic
        pairs.append((f"{VOCABS[-1]} file", _file_pair(VOCABS[-1], 7)))
    for name, (target, draft) in pairs:
        vocab = target.cfg.vocab_size
        tf = TriForce(LoadedModel(target, char_tokenizer(), hf_config(vocab=vocab), "near-tie target"),
                      LoadedModel(draft, char_tokenizer(), hf_config(vocab=vocab), "near-tie draft"))
        modes = [dict(mode="autoregressive"), dict(mode="retrieval", budget=24, chunk_size=4, gamma2=6),
                 dict(mode="triforce", budget=32, chunk_size=4, gamma1=2, gamma2=5), dict(mode="draft", gamma2=7)]
        lengths = (3, 62, 17, 40, 9, 33, 24, 50)
        prompts = [random_ids(n, vocab, 50 + i) for i, n in enumerate(lengths)]
        specs = [SpeculationConfig(draft_sink=4, draft_window=12, **modes[i % len(modes)]) for i in range(8)]
        kw = dict(max_new_tokens=GREEDY_NEW, sampling=SamplingParams(temperature=0))
        alone = [tf.generate(p, spec=s, **kw).token_ids for p, s in zip(prompts, specs)]
        for group in ([0, 1], [2, 3, 4, 5], list(range(8))):
            results = tf.generate(prompts=[prompts[i] for i in group], spec=[specs[i] for i in group],
                                  max_batch=len(group), **kw)
            for i, r in zip(group, results):
                out[f"V={name} request {i} ({lengths[i]} tokens) beside {len(group) - 1}"] = r.token_ids == alone[i]
    return out


def _check_reuse() -> dict:
    """(e): per (mode, how the prompt's KV came), whether a 130-token prompt (its prefill chunk longer than 64 tokens)
    gives the tokens it gives on a fresh engine, and those the autoregressive ones: the same prompt again on an
    engine that ran it before in either mode (prefix reuse; the ``attn`` rule refeeds 8 tokens, the others 1), on a
    fresh engine adopting another choice's copy of its KV (``adopt_prefix``, the server's ``n`` > 1), and on one
    loading a prompt-cache file."""
    from triforce.kernels.rows import PREFILL_EXACT_TAIL
    from triforce.kv.retrieval import ATTN_QUERY_WINDOW

    assert ATTN_QUERY_WINDOW <= PREFILL_EXACT_TAIL  # every mode's refeed runs on the row-invariant paths
    out = {}
    for arithmetic, models in (("", near_tie_pair(VOCABS[-1], seed=3)), ("file ", _file_pair(VOCABS[-1], 3))):
        if models is not None:  # the verifier on fp32 products, and on the file's arithmetic
            out.update({arithmetic + k: v for k, v in _reuse(models).items()})
    return out


def _reuse(models) -> dict:
    """(e) for one (target, draft)."""
    import tempfile

    from triforce.engine import Engine, SpeculationConfig
    from triforce.kv.caches import FullKVCache
    from triforce.kv.promptcache import PromptCache
    from triforce.speculation.sampling import SamplingParams

    prompt = random_ids(130, VOCABS[-1], 77)
    shared = Engine(*models)  # runs the prompt in every mode, each run reusing the last one's KV
    out, ref = {}, None
    for name, spec in (("autoregressive", SpeculationConfig()),
                       ("retrieval", SpeculationConfig(mode="retrieval", budget=24, chunk_size=4, gamma2=4,
                                                       chunk_score="attn"))):

        def run(engine, spec=spec):
            return engine.generate(prompt, max_new_tokens=GREEDY_NEW, sampling=SamplingParams(temperature=0),
                                   spec=spec)[0]

        ref = ref or run(shared)
        cold = run(Engine(*models))
        out[f"{name}: a fresh engine gives the autoregressive tokens"] = cold == ref
        out[f"{name}: again on an engine that ran the prompt"] = run(shared) == cold
        copy = FullKVCache(models[0].cfg, len(prompt))
        copy.copy_prefix_from(shared.full_cache, len(prompt))
        other = Engine(*models)
        other.adopt_prefix(copy, prompt)
        out[f"{name}: a fresh engine adopting a copy of the prompt's KV"] = run(other) == cold
        with tempfile.TemporaryDirectory() as directory:
            files = PromptCache(directory, "near-tie")
            files.store(shared.full_cache, shared.prefix_tokens)
            other = Engine(*models)
            out[f"{name}: a fresh engine loading a prompt-cache file"] = (
                files.before_request(other, prompt)[0] == len(prompt) and run(other) == cold)
    return out


CHECKS = {"rows": _check_rows, "modes": _check_modes, "long": _check_long_blocks, "batch": _check_batch,
          "reuse": _check_reuse}


def _status() -> dict:
    from triforce.kernels import blockcodes, decode_step
    from triforce.kernels import cpu as kernels

    return {"attention": kernels.status(), "linear": kernels.linear_status(), "codes": blockcodes.blockcodes_status(),
            "decode_step": decode_step.decode_step_status()}


def _main() -> None:  # the subprocess: every check on the build its environment forces
    torch.set_num_threads(1)
    print(json.dumps({"status": _status(), **{name: fn() for name, fn in CHECKS.items()}}))


def _cpu_has(*flags: str) -> bool:
    from triforce.kernels.build import _cpu_flags

    return set(flags) <= _cpu_flags()


@pytest.fixture(scope="module", params=list(BUILDS))
def build_results(request):
    """The results of every check on one build, computed in a subprocess; skips a build this CPU does not have."""
    name = request.param
    if name == "avx2" and not (_cpu_has("avx2", "fma") and _cpu_has("avx512f")):
        pytest.skip("the AVX2 build is this CPU's own (native) or it has no AVX2")
    env = {**{k: v for k, v in os.environ.items() if k not in OFF and not k.startswith("TRIFORCE_KERNEL_ISA")},
           **BUILDS[name], "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": os.pathsep.join([HERE, *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = subprocess.run([sys.executable, "-c", "import test_exactness; test_exactness._main()"], cwd=HERE, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    if name == "avx2":
        assert all("AVX2" in results["status"][k] for k in ("attention", "linear", "codes")), results["status"]
    if name == "portable":
        assert all("portable" in results["status"][k] for k in ("attention", "linear", "codes")), results["status"]
        assert results["status"]["decode_step"].startswith("on"), results["status"]
    if name == "off":
        assert all(s.startswith("off") or "off" in s for s in results["status"].values()), results["status"]
    return name, results


def test_a_decode_step_is_bitwise_its_row_of_a_block_and_a_block_its_rows_in_a_batch(build_results):
    """(a): 0 rows differ, for every block length (1-32), vocabulary (96, 97, 101), the coded model, and ragged
    forwards of 8, 65 and 128 rows."""
    name, results = build_results
    differing = {k: v for k, v in results["rows"].items() if v}
    assert not differing, f"{name} ({results['status']}): {differing}"


def test_every_mode_equals_autoregressive_decoding_on_near_ties(build_results):
    """(b): retrieval, triforce (draft or n-gram drafter), draft (a model or the target's int8 copy), verification
    blocks of 5, 17 and 32 tokens, vocabularies 96 and 101: the autoregressive tokens, every prompt."""
    name, results = build_results
    failed = [k for k, same in results["modes"].items() if not same]
    assert not failed, f"{name} ({results['status']}): {failed}"


def test_verification_blocks_of_65_to_100_tokens_equal_autoregressive_decoding(build_results):
    """(d): blocks past 64 tokens (``--gamma2`` 64 and up) run in pieces of at most 64 on the row-invariant paths:
    the n-gram drafter's blocks of 65-99 tokens and the retrieval tier's of 100 (its selection reads the queries of
    the block's pieces, vocabulary 101) give the autoregressive tokens, vocabularies 96 and 101."""
    name, results = build_results
    failed = [k for k, same in results["long"].items() if not same]
    assert not failed, f"{name} ({results['status']}): {failed}"


def test_a_request_gives_its_tokens_alone_and_beside_1_3_and_7_others(build_results):
    """(c): batch invariance through ``TriForce.generate(prompts=[...])``: 8 requests (prompts of 3-62 tokens, four
    modes), each alone and in batches of 2, 4 and 8, vocabularies 96 and 101: 0 differing requests."""
    name, results = build_results
    failed = [k for k, same in results["batch"].items() if not same]
    assert not failed, f"{name} ({results['status']}): {failed}"


def test_a_long_prompt_gives_its_tokens_again_from_its_reused_kv(build_results):
    """(e): a 130-token prompt on a fresh engine, again on an engine that ran it (autoregressive, then retrieval with
    the ``attn`` rule, which refeeds 8 tokens), adopting a copy of its KV, loading a prompt-cache file: the same
    greedy tokens, the autoregressive ones (without its last tokens prefilled apart, every reuse differs)."""
    name, results = build_results
    failed = [k for k, same in results["reuse"].items() if not same]
    assert not failed, f"{name} ({results['status']}): {failed}"


def test_the_checks_ran_on_the_file_arithmetic_where_the_block_code_kernel_is_on(build_results):
    """(a), (b), (c) and (e) include the near-tie target on the file's arithmetic (``--precision file``) on every
    build whose block-code kernel is on (all but ``off``), so its row invariance is checked, not assumed."""
    name, results = build_results
    if not results["status"]["codes"].startswith("on"):
        assert name == "off", results["status"]
        return
    for check, prefix in (("rows", "file "), ("modes", "V=101 file "), ("batch", "V=101 file "), ("reuse", "file ")):
        assert any(k.startswith(prefix) for k in results[check]), (name, check)
