"""The RoPE scaling override (``--rope-scaling yarn --rope-factor 4``, ``config.with_rope_scaling``): logits equal
transformers' for a checkpoint whose config.json carries the same ``rope_scaling``, past the trained context;
speculation stays lossless under it; bad input is named before anything loads; the context checks use the
scaled context. Tiny random models with a 64-token trained context, so positions past it are cheap."""

import json
import shutil
from dataclasses import replace

import pytest
import torch

from tiny import save_folder
from triforce.cli import main
from triforce.engine import SpeculationConfig
from triforce.formats.loading import load_model
from triforce.kv.caches import FullKVCache
from triforce.model.config import ModelConfig, with_rope_scaling
from triforce.speculation.sampling import SamplingParams

OLD = 64  # the trained context of every tiny checkpoint here
GREEDY = SamplingParams(temperature=0)


def _scaled_copy(src, dst, scaling: dict, max_pos: int = OLD) -> str:
    """A copy of the folder ``src`` whose config.json carries ``rope_scaling`` (transformers' spelling, ``type``)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(rope_scaling=scaling, max_position_embeddings=max_pos)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen64")
    save_folder(path, seed=5, family="qwen2", layers=2, max_pos=OLD)
    return path


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama64")
    save_folder(path, seed=6, family="llama", layers=3, max_pos=OLD)
    return path


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft64")
    save_folder(path, seed=1006, family="llama", layers=1, hidden=32, heads=2, kv_heads=1, max_pos=OLD)
    return str(path)


def _logits(model, ids):
    model.set_request_length(ids.shape[1])  # dynamic NTK: one pass of this length, as transformers takes it
    return model(ids, torch.arange(ids.shape[1]), FullKVCache(model.cfg, ids.shape[1]))


@pytest.mark.parametrize("family,rope_type", [("qwen2", "yarn"), ("llama", "yarn"), ("qwen2", "linear"),
                                              ("qwen2", "dynamic")])
def test_override_logits_equal_transformers_past_the_trained_context(family, rope_type, qwen_folder, llama_folder,
                                                                     tmp_path):
    """fp32 logits at 200 positions (3x the trained 64) under the override equal transformers' on the same weights
    saved with ``rope_scaling: {type, factor 4, original_max_position_embeddings 64}``, and ours on that folder."""
    from transformers import AutoModelForCausalLM

    folder = qwen_folder if family == "qwen2" else llama_folder
    scaling = {"type": rope_type, "factor": 4.0, "original_max_position_embeddings": OLD}
    saved = _scaled_copy(folder, tmp_path / "scaled", scaling)
    lm = load_model(str(folder), rope_scaling=rope_type, rope_factor=4)
    assert lm.model.cfg.rope_type == rope_type
    assert lm.model.cfg.max_position_embeddings == (OLD if rope_type == "dynamic" else 4 * OLD)
    ids = torch.randint(3, 96, (1, 200), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids).logits
    out = _logits(lm.model, ids)
    plain = _logits(load_model(str(folder)).model, ids)
    assert ref.abs().max() > 1.0
    assert (out - ref).abs().max().item() <= 1e-4
    assert (out - _logits(load_model(saved).model, ids)).abs().max().item() <= 1e-4  # the checkpoint saved scaled
    assert (plain[:, -50:] - ref[:, -50:]).abs().max().item() > 1e-2  # the override changes the model


def test_speculative_greedy_equals_autoregressive_under_the_override(llama_folder, draft_folder):
    """A 120-token prompt (past the trained 64) and 24 new tokens under yarn x4: every speculative mode, with a draft
    model (which keeps its own RoPE) and with the target's own int4 copy, gives the autoregressive tokens."""
    from triforce import TriForce

    prompt = torch.randint(3, 96, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    tf = TriForce.load(str(llama_folder), draft=draft_folder, threads=1, rope_scaling="yarn", rope_factor=4)
    assert tf.draft.model.cfg.rope_type == "default"  # the draft keeps its RoPE
    ref = tf.generate(prompt, max_new_tokens=24, sampling=GREEDY, spec=SpeculationConfig()).token_ids
    assert len(ref) == 24
    accepted = 0
    for mode in ("retrieval", "draft", "triforce"):
        spec = SpeculationConfig(mode=mode, budget=40, chunk_size=8, gamma1=3, gamma2=4, draft_sink=4, draft_window=12)
        result = tf.generate(prompt, max_new_tokens=24, sampling=GREEDY, spec=spec)
        assert result.token_ids == ref, mode
        accepted += result.stats.tiers["target"]["accepted"]
    assert accepted > 0
    own = TriForce.load(str(llama_folder), draft="self", threads=1, rope_scaling="yarn", rope_factor=4)
    spec = SpeculationConfig(mode="draft", drafter="self", gamma2=4, draft_sink=4, draft_window=12)
    assert own.generate(prompt, max_new_tokens=24, sampling=GREEDY, spec=spec).token_ids == ref


def test_a_prompt_past_the_trained_context_is_accepted_only_with_the_override(llama_folder, capsys):
    """100 prompt tokens + 8 new in a 64-token checkpoint: refused without the override (the existing context error),
    accepted with yarn x4 (context 256); the command line likewise; a request past 256 is still refused."""
    from triforce import TriForce

    prompt = list(range(3, 96)) + list(range(3, 10))  # 100 tokens
    plain = TriForce.load(str(llama_folder), threads=1)
    with pytest.raises(ValueError, match=f"context {OLD}"):  # the prompt alone exceeds it
        plain.generate(prompt, max_new_tokens=8, spec=SpeculationConfig())
    tf = TriForce.load(str(llama_folder), threads=1, rope_scaling="yarn", rope_factor=4)
    assert len(tf.generate(prompt, max_new_tokens=8, sampling=GREEDY, spec=SpeculationConfig()).token_ids) >= 1
    with pytest.raises(ValueError, match=f"context of {4 * OLD}"):
        tf.generate(prompt, max_new_tokens=200, spec=SpeculationConfig())
    text = "abcdefghij" * 10
    argv = ["generate", "--model", str(llama_folder), "--prompt", text, "--max-new-tokens", "8", "--temperature", "0",
            "--mode", "autoregressive", "--threads", "1", "--no-progress", "--json"]
    assert main(argv) == 2
    assert f"context {OLD}" in capsys.readouterr().err
    assert main(argv + ["--rope-scaling", "yarn", "--rope-factor", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] == 100


def test_override_to_dynamic_behaves_as_a_dynamic_checkpoint(llama_folder, tmp_path):
    """``dynamic``: the same model as a checkpoint saved with dynamic scaling, and the same special cases: no context
    limit, no prompt log-probabilities, no batching."""
    from triforce import TriForce

    saved = _scaled_copy(llama_folder, tmp_path / "dyn", {"type": "dynamic", "factor": 2.0})
    tf = TriForce.load(str(llama_folder), threads=1, rope_scaling="dynamic", rope_factor=2)
    ref = TriForce.load(saved, threads=1)
    ours_cfg, saved_cfg = tf.target.model.cfg, ref.target.model.cfg
    saved_cfg.rope_parameters.pop("type")  # transformers keeps the spelling of config.json beside rope_type
    assert ours_cfg == saved_cfg and ours_cfg.max_position_embeddings == OLD
    prompt = torch.randint(3, 96, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    a = tf.generate(prompt, max_new_tokens=8, sampling=GREEDY, spec=SpeculationConfig()).token_ids
    assert a == ref.generate(prompt, max_new_tokens=8, sampling=GREEDY, spec=SpeculationConfig()).token_ids
    ids, cut = tf.encode_cut("abcdefghij" * 20, max_prompt_tokens=2 * OLD)  # a cut past the trained context is fine
    assert len(ids) == 2 * OLD and cut is not None
    with pytest.raises(ValueError, match="dynamic NTK"):
        tf.check_prompt_logprobs(prompt)
    with pytest.raises(ValueError, match="dynamic NTK"):
        tf.fork()


def test_dynamic_ntk_is_fixed_by_the_request_so_every_mode_and_a_reused_prefix_give_its_tokens(llama_folder):
    """Dynamic NTK's frequencies come from the request's length (prompt + new tokens), not from the cache a mode
    sizes (its verification blocks): every mode's greedy tokens equal autoregressive decoding's past the trained
    context, and a prefix kept from a request of another length is not reused (its keys were rotated for it)."""
    from triforce import TriForce

    prompt = torch.randint(3, 96, (150,), generator=torch.Generator().manual_seed(4)).tolist()
    specs = [SpeculationConfig(mode="autoregressive"),
             SpeculationConfig(mode="retrieval", budget=32, chunk_size=4, gamma2=4),
             SpeculationConfig(mode="draft", drafter="ngram", gamma2=6),
             SpeculationConfig(mode="triforce", drafter="ngram", budget=32, chunk_size=4, gamma1=3, gamma2=5)]
    for new in (8, 40):
        cold = [TriForce.load(str(llama_folder), threads=1, rope_scaling="dynamic", rope_factor=2)
                .generate(prompt, max_new_tokens=new, sampling=GREEDY, spec=spec).token_ids for spec in specs]
        assert all(c == cold[0] for c in cold), new
        if new == 8:
            short = cold[0]
    assert cold[0][:8] != short  # the length changes the model: the check below can tell a reused prefix apart
    tf = TriForce.load(str(llama_folder), threads=1, rope_scaling="dynamic", rope_factor=2)
    for new, expected in ((40, cold[0]), (8, short), (40, cold[0])):
        assert tf.generate(prompt, max_new_tokens=new, sampling=GREEDY, spec=specs[1]).token_ids == expected


def test_a_checkpoint_saved_with_yarn_uses_the_scaled_context(qwen_folder, tmp_path):
    """Qwen2.5's model card enables YaRN by adding rope_scaling and keeping max_position_embeddings: the context is
    still original x factor; an override of the same type replaces the factor (from the original context)."""
    saved = _scaled_copy(qwen_folder, tmp_path / "card", {"type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": OLD})
    cfg = load_model(saved).model.cfg
    assert cfg.max_position_embeddings == 4 * OLD
    again = with_rope_scaling(cfg, "yarn", 2)
    assert again.max_position_embeddings == 2 * OLD and again.rope_parameters["factor"] == 2.0
    assert again.rope_parameters["original_max_position_embeddings"] == OLD
    assert with_rope_scaling(ModelConfig.from_hf(load_model(str(qwen_folder)).hf_config), "linear", 2.5) \
        .max_position_embeddings == int(OLD * 2.5)
    assert with_rope_scaling(cfg, "yarn", 2, original_max_position_embeddings=100).max_position_embeddings == 200


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(rope_scaling="ntk", rope_factor=2), "rope_scaling must be one of yarn, linear, dynamic, got 'ntk'"),
    (dict(rope_scaling="llama3", rope_factor=2), "rope_scaling must be one of yarn, linear, dynamic"),
    (dict(rope_scaling="yarn", rope_factor=1), "rope_factor must be a finite number > 1"),
    (dict(rope_scaling="yarn", rope_factor=0.5), "rope_factor must be a finite number > 1"),
    (dict(rope_scaling="yarn", rope_factor=float("inf")), "rope_factor must be a finite number > 1"),
    (dict(rope_scaling="yarn", rope_factor=float("nan")), "rope_factor must be a finite number > 1"),
    (dict(rope_scaling="yarn", rope_factor="4"), "rope_factor must be a finite number > 1"),
    (dict(rope_scaling="yarn", rope_factor=True), "rope_factor must be a finite number > 1"),
    (dict(rope_scaling="yarn"), "rope_scaling needs rope_factor"),
    (dict(rope_factor=4.0), "rope_factor needs rope_scaling"),
])
def test_bad_overrides_are_named_before_anything_loads(kwargs, fragment):
    """The source does not exist: the override's error comes first, so nothing was read."""
    from triforce import TriForce

    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        load_model("/nonexistent/model", **kwargs)
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        TriForce.load("/nonexistent/model", **kwargs)


def test_another_scaling_type_is_refused_before_the_weights_are_read(qwen_folder, tmp_path):
    """A checkpoint already scaled with linear refuses a yarn override, naming both; its weights file is garbage, so
    an error raised after reading it would be another one."""
    saved = _scaled_copy(qwen_folder, tmp_path / "linear", {"type": "linear", "factor": 2.0})
    (tmp_path / "linear" / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(ValueError, match=r"rope_scaling yarn: this checkpoint's RoPE is already scaled \(linear, "
                                         r"factor 2.0"):
        load_model(saved, rope_scaling="yarn", rope_factor=4)
    cfg = ModelConfig.from_hf(load_model(str(qwen_folder)).hf_config)
    llama3 = replace(cfg, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match=r"already scaled \(llama3, factor 8.0\)"):
        with_rope_scaling(llama3, "dynamic", 2)
    with pytest.raises(ValueError, match="original_max_position_embeddings must be an integer >= 1"):
        with_rope_scaling(cfg, "yarn", 2, original_max_position_embeddings=0)


@pytest.mark.parametrize("args,flags", [
    (["--rope-scaling", "yarn"], ("--rope-scaling", "--rope-factor")),
    (["--rope-factor", "4"], ("--rope-factor", "--rope-scaling")),
    (["--rope-scaling", "yarn", "--rope-factor", "1"], ("--rope-factor",)),
    (["--rope-scaling", "yarn", "--rope-factor", "nan"], ("--rope-factor",)),
    (["--rope-scaling", "yarn", "--rope-factor", "four"], ("--rope-factor",)),
    (["--rope-scaling", "ntk", "--rope-factor", "4"], ("--rope-scaling",)),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_command_line_names_the_flags(command, args, flags, capsys):
    """Exit status 2 and one line on stderr naming the flag(s), before the model loads (the model does not exist)."""
    from triforce.cli.serve import main_for_tests

    argv = ["--model", "/nonexistent/model", *args]
    try:
        if command == "generate":
            code = main(["generate", "--prompt", "x", *argv])
        else:
            code = main_for_tests(argv)
    except SystemExit as e:  # argparse's own checks (choices, types)
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert all(f in err for f in flags), err
