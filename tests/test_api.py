"""The Python API (``api.py``, ``TriForce``): several prompts at once, Ctrl-C in a batch, the prefill progress
callback, the command line's dtype names, and errors that name the API's parameters (the command line's options
where it calls the same checks)."""

import pytest

from triforce import SamplingParams, SpeculationConfig, TriForce
from triforce.cli import main

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def tf(tiny_folder):
    return TriForce.load(tiny_folder)


def test_python_api_prefill_progress_callback(tf):
    seen = []
    tf.engine.reuse_prefix = False
    try:
        r = tf.generate([5] * 400, max_new_tokens=2, sampling=GREEDY, prefill_progress=seen.append)
    finally:
        tf.engine.reuse_prefix = True
    # the last 8 tokens apart from the long chunk, on the row-invariant paths (exact.prefill_forward_size)
    assert seen == [392, 8] and r.stats.prompt_tokens == 400


def test_a_list_of_prompts_says_how_to_pass_several(tf):
    with pytest.raises(ValueError, match=r"for several prompts use generate\(prompts=\[\.\.\.\]\)"):
        tf.generate(["a", "b"], max_new_tokens=2)


def test_generate_prompts_returns_each_prompts_result_alone(tf):
    """generate(prompts=[...]): one result per prompt, in order, each equal to the prompt generated alone (greedy;
    texts and token ids, per-prompt max_new_tokens and specs, more prompts than max_batch)."""
    prompts = ["Once upon a time", [5, 9, 14, 3, 22], "abc", "the quick brown fox jumps"]
    news = [12, 7, 15, 9]
    specs = [SpeculationConfig(), SpeculationConfig(mode="retrieval", budget=24, chunk_size=4, gamma2=3),
             SpeculationConfig(mode="draft", drafter="ngram", gamma2=3), SpeculationConfig()]
    greedy = SamplingParams(temperature=0)
    alone = [tf.generate(p, max_new_tokens=n, sampling=greedy, spec=s) for p, n, s in zip(prompts, news, specs)]
    batch = tf.generate(prompts=prompts, max_new_tokens=news, sampling=greedy, spec=specs, max_batch=3)
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    assert [r.text for r in batch] == [r.text for r in alone]
    assert [r.finish_reason for r in batch] == [r.finish_reason for r in alone]


def test_generate_prompts_refuses_bad_input_naming_it(tf):
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt token ids must be in"):
        tf.generate(prompts=["ok", [5, 10**9]], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens: a list must give one value per prompt"):
        tf.generate(prompts=["a", "b"], max_new_tokens=[2])
    with pytest.raises(ValueError, match="prompts must be a non-empty list"):
        tf.generate(prompts=[])
    with pytest.raises(ValueError, match="max_batch must be an integer >= 1"):
        tf.generate(prompts=["a", "b"], max_batch=0)
    with pytest.raises(ValueError, match="either prompt or prompts"):
        tf.generate("a", prompts=["b"])


def test_generate_prompts_ctrl_c_keeps_what_was_generated(tf, monkeypatch):
    """Ctrl-C during a batch (here: raised by the batched forward): the running prompts end as "interrupted" with
    their tokens so far, the prompts not started yet are None; one failing prompt raises its own error."""
    model = tf.target.model
    real, calls = model.forward_ragged, [0]

    def interrupted(blocks):
        calls[0] += 1
        if calls[0] == 12:
            raise KeyboardInterrupt
        return real(blocks)

    monkeypatch.setattr(model, "forward_ragged", interrupted)
    out = tf.generate(prompts=["abc", "hello there", "zzz"], max_new_tokens=40, max_batch=2,
                      sampling=SamplingParams(temperature=0))
    assert [r.finish_reason for r in out[:2]] == ["interrupted", "interrupted"] and out[2] is None
    assert all(0 < len(r.token_ids) < 40 for r in out[:2])
    monkeypatch.setattr(model, "forward_ragged", real)

    def fail(_n):
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        tf.generate(prompts=["abc", "hello"], max_new_tokens=5, prefill_progress=fail)
    with pytest.raises(ValueError, match="stop must be a string or a list"):
        tf.generate("abc", max_new_tokens=2, stop=5)
    with pytest.raises(ValueError, match="prefill_progress must be a callable"):
        tf.generate("abc", max_new_tokens=2, prefill_progress=5)


def test_python_api_takes_the_command_lines_dtype_names(tiny_folder, tf):
    """``kv_dtype="bf16"`` was refused by the Python API: every dtype parameter takes the command line's names, from
    one table (``KV_DTYPES``: float32, bfloat16, float16 and fp32, bf16, fp16), and a bad name lists them."""
    import argparse

    import torch

    from triforce.cli import build_parser
    from triforce.engine import Engine
    from triforce.kv.caches import KV_DTYPES

    assert set(KV_DTYPES) == {"float32", "bfloat16", "float16", "fp32", "bf16", "fp16"}
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["generate"]
    for action in sub._actions:
        if action.dest in ("dtype", "kv_dtype", "lower_kv_dtype"):
            assert set(action.choices) == set(KV_DTYPES), action.dest
    bf16 = TriForce.load(tiny_folder, dtype="fp32", kv_dtype="bf16")
    spec = SpeculationConfig(mode="retrieval", budget=32, chunk_size=4, lower_kv_dtype="bf16")
    assert spec.lower_kv_dtype == "bfloat16"  # one spelling downstream
    assert spec == SpeculationConfig(mode="retrieval", budget=32, chunk_size=4, lower_kv_dtype="bfloat16")
    result = bf16.generate("hello world " * 4, max_new_tokens=3, sampling=GREEDY, spec=spec)
    assert result.stats.generated_tokens == 3 and bf16.engine.full_cache.k.dtype == torch.bfloat16
    for make in (lambda: TriForce.load(tiny_folder, kv_dtype="half"), lambda: Engine(tf.target.model, kv_dtype="half"),
                 lambda: SpeculationConfig(lower_kv_dtype="half"), lambda: TriForce.load(tiny_folder, dtype="half")):
        with pytest.raises(ValueError, match="float32, bfloat16, float16, fp32, bf16, fp16, got 'half'"):
            make()


def test_python_api_errors_name_its_parameters_and_the_command_line_its_options(tiny_folder, tf, capsys):
    """Validation shared by the Python API and the command line: the API's messages named the command line's flags
    ("raise --budget or lower --chunk-size", "--chat", "--max-prompt-tokens N", "smaller --budget"). Each names the
    parameters as the caller spells them: the API by parameter name, the command line by option."""
    from triforce.engine import Engine
    from triforce.kv.memory import InsufficientMemoryError, check_fits

    context = tf.target.model.cfg.max_position_embeddings
    engine = Engine(tf.target.model)
    cases = [
        (lambda: SpeculationConfig(mode="retrieval", budget=9, chunk_size=4, gamma2=6),
         "budget must be >= chunk_size + gamma + 2 = 12", "raise budget or lower chunk_size / gamma2"),
        (lambda: SpeculationConfig(mode="auto", budget=5), "budget must be >= chunk_size + gamma + 2 = 16", "gamma2"),
        (lambda: SpeculationConfig(lower_kv_dtype="half"), "lower_kv_dtype must be None or one of", "bf16"),
        (lambda: tf.encode("hi", system="be brief"), "system is only used with chat", ""),
        (lambda: tf.encode(""), "prompt is empty", ""),
        (lambda: engine.generate([5], spec=SpeculationConfig(mode="draft")), "mode 'draft' needs a draft model",
         "drafter ngram"),
        (lambda: engine.generate([5] * context), "max_prompt_tokens: the prompt has", "with max_prompt_tokens N"),
        (lambda: check_fits({"full KV cache": 2**62}, "cpu", "this request"), "fewer max_new_tokens, a smaller budget",
         "gamma1/gamma2, or dtype bfloat16"),
    ]
    for call, start, fragment in cases:
        with pytest.raises((ValueError, InsufficientMemoryError)) as info:
            call()
        message = str(info.value)
        assert start in message and fragment in message and "--" not in message, message
    assert info.value.spelled(lambda name: "--" + name.replace("_", "-")).endswith(
        "fewer --max-new-tokens, a smaller --budget or --gamma1/--gamma2, or --dtype bfloat16")
    for argv, fragment in ((["--mode", "retrieval", "--budget", "9", "--chunk-size", "4"],
                            "--budget must be >= --chunk-size + gamma + 2 = 12 (chunk 0 plus room for a speculation "
                            "block of 6 tokens), got 9: raise --budget or lower --chunk-size / --gamma2"),
                           (["--budget", "5"], "--budget must be >= --chunk-size + gamma + 2 = 16"),
                           (["--system", "x", "--chat"], ""),
                           (["--prompt", ""], "--prompt/--prompt-file is empty")):
        argv = ["generate", "--model", tiny_folder, "--max-new-tokens", "2", "--no-progress", *argv]
        if "--prompt" not in argv:
            argv += ["--prompt", "hello"]
        code = main(argv)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        if not fragment:  # the tiny tokenizer has a chat template: no error
            assert code == 0, err
            continue
        assert code == 2 and fragment in err, err
