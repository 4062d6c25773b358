"""`triforce bench`: one end-to-end run on a tiny random model folder, the comparison and metric helpers, bad
options, where the table and the JSON go."""

import json
import subprocess
import sys

import pytest
import torch

from triforce.cli import main
from triforce.cli.bench import add_bench_parser
from triforce.lab import bench
from triforce.lab.bench import methods

PROMPT = "the quick brown fox jumps over the lazy dog. " * 4
NEW_TOKENS = 8
METHODS = ["hf-ar", "autoregressive", "retrieval", "draft", "triforce-int8"]


@pytest.fixture(scope="module")
def bench_result(tiny_folder, tmp_path_factory):
    """One greedy bench run (1 rep) of hf-ar, our autoregressive, retrieval and draft (n-gram drafter)."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "triforce", "bench", "--model", tiny_folder, "--prompt", PROMPT, "--new-tokens",
         str(NEW_TOKENS), "--temperature", "0", "--reps", "1", "--threads", "1", "--budget", "32", "--chunk-size", "4",
         "--gamma2", "4", "--methods", ",".join(METHODS), "--json", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text()), proc.stderr


def test_every_method_ran_with_the_same_greedy_tokens(bench_result, tiny_folder):
    result, stderr = bench_result
    methods = result["methods"]
    assert sorted(methods) == sorted(METHODS)
    assert result["synthetic"] is False and result["settings"]["interleaved"] is True
    ids = [ord(c) - 29 for c in PROMPT]  # the char tokenizer of tests/tiny.py: ASCII 32.. -> ids 3..
    assert result["settings"]["prompt_tokens"] == len(ids)
    # the reference itself against transformers called directly
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    for name, r in methods.items():
        assert r["status"] == "ok", (name, r)
        assert r["token_ids"] == [ref], name
        assert r["generated_tokens"] == [NEW_TOKENS]
        assert r["greedy"] == {"same_tokens": True, "first_difference": None, "reps_identical": True}
        assert isinstance(r["peak_memory_bytes"], int) and r["peak_memory_bytes"] > 0
        tbt = r["mean_time_between_tokens_ms"]["median"]
        assert tbt > 0 and r["tokens_per_second"]["median"] == pytest.approx(1000 / tbt, rel=1e-3)
        assert r["speedup_vs_hf_ar"] == pytest.approx(methods["hf-ar"]["mean_time_between_tokens_ms"]["median"] / tbt,
                                                      rel=1e-3)
    assert result["greedy"]["reference"] == "hf-ar" and result["greedy"]["all_same"] is True
    assert result["greedy_mismatches"] == []
    assert "warning" not in stderr
    assert methods["autoregressive"]["speedup_vs_autoregressive"] == 1.0
    # acceptance per verifying tier, from our engine's counters
    for name in ("retrieval", "draft"):
        acc = methods[name]["acceptance"]["target"]
        assert acc["proposed"] > 0 and 0 <= acc["accepted"] <= acc["proposed"]
        assert acc["acceptance_rate"] == pytest.approx(acc["accepted"] / acc["proposed"], abs=1e-6)
    assert methods["draft"]["chain"] == [["ngram", 4]] and methods["retrieval"]["chain"] == [["retrieval", 4]]
    assert "acceptance" not in methods["hf-ar"]


def test_json_records_the_cpu_and_the_kernels_that_ran(bench_result):
    """The machine entry names the ISA the kernels were built for and each kernel's status, as this process sees
    them (figures differ between an AVX-512 and an AVX2 machine)."""
    from triforce.kernels import cpu as kernels
    from triforce.kernels.blockcodes import blockcodes_status
    from triforce.kernels.sampling import sampling_status

    machine = bench_result[0]["machine"]
    assert {k: machine[k] for k in ("cpu", "cores", "isa")} == kernels.cpu()
    assert machine["isa"] in ("AVX-512", "AVX2", "portable")
    assert machine["attention_kernel"] == kernels.status()
    assert machine["linear_kernel"] == kernels.linear_status()
    assert machine["block_code_kernel"] == blockcodes_status()
    assert machine["sampling_kernel"] == sampling_status()
    # the code behind the figures: this checkout's commit (tests run from a git checkout, CI's clean clone included)
    import subprocess

    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert machine["git_commit"] == head and isinstance(machine["git_dirty"], bool)


def test_cost_model_prediction_is_reported(bench_result):
    methods = bench_result[0]["methods"]
    for name in ("retrieval", "draft"):
        pred = methods[name]["predicted"]["prediction"]
        assert pred["chain"] == methods[name]["chain"]
        acceptance = methods[name]["acceptance"]["target"]["acceptance_rate"]
        assert pred["tiers"][-1]["acceptance"] == pytest.approx(acceptance)
        assert methods[name]["predicted_speedup_vs_autoregressive"] == pred["speedup"] > 0
        assert methods[name]["measured_over_predicted"] == pytest.approx(
            methods[name]["speedup_vs_autoregressive"] / pred["speedup"], rel=1e-3)
        assert pred["autoregressive_seconds_per_token"] > 0
        assert methods[name]["predicted"]["latencies"]["token_selection"] is True
    # from the run's own steps: the retrieval method's target verifications and retrieval steps, the AR decode step
    from triforce.lab.costmodel import predict

    ar_step = methods["autoregressive"]["step_seconds"]["target"]
    r = methods["retrieval"]
    assert set(r["step_seconds"]) == {"target", "retrieval"} and ar_step > 0
    lat = r["predicted_from_run"]["latencies"]
    assert lat["full_decode"] == ar_step and lat["full_pass"] == r["step_seconds"]["target"]
    assert lat["retrieval_decode"] == lat["retrieval_pass"] == r["step_seconds"]["retrieval"]
    by_hand = predict([("retrieval", 4)], lat, {"target": r["acceptance"]["target"]["acceptance_rate"]},
                      accepted_lengths={"target": r["acceptance"]["target"]["accepted_lengths"]})["speedup"]
    assert r["predicted_from_run"]["speedup"] == pytest.approx(by_hand, rel=1e-3)
    assert r["measured_over_predicted_from_run"] == pytest.approx(r["speedup_vs_autoregressive"] / by_hand, rel=1e-3)


def test_auto_is_predicted_from_its_run_only_for_one_hierarchy_without_bypasses():
    """auto's prediction from its run: the verification's time from the target's steps without the D decode steps of
    its plain opening tokens, the cost model's speedup S for the hierarchy it ran, and of the N tokens between
    tokens the D plain ones at the decode step's cost: N / ((N - D) / S + D); no prediction where it bypassed,
    changed hierarchy or decoded plainly."""
    from triforce.lab import costmodel
    from triforce.lab.bench.run import _predict_from_run

    def results(**rep):
        reps = [dict(hierarchy="retrieval:6", speculative_tokens=124, autoregressive_tokens=4, bypasses=0)] * 2
        return {"autoregressive": {"step_seconds": {"target": 0.030}},
                "auto": {"auto": [reps[0], dict(reps[1], **rep)], "chain": [], "speedup_vs_autoregressive": 1.2,
                         "step_seconds": {"target": 0.061, "retrieval": 0.0083},
                         "acceptance": {"target": {"acceptance_rate": 0.78, "verifications": 40,
                                                   "accepted_lengths": [9, 8, 6, 7, 5, 8, 68]}}}}

    r = results()
    _predict_from_run(r, ["auto", "autoregressive"], costmodel)
    d = 2 * 3  # 4 plain tokens per request, the first from the prefill
    full_pass = (0.061 * (40 + d) - d * 0.030) / 40
    lat = {"full_decode": 0.030, "ngram_propose": 0.0, "full_pass": full_pass, "retrieval_decode": 0.0083,
           "retrieval_pass": 0.0083}
    s = costmodel.predict([("retrieval", 6)], lat, {"target": 0.78},
                          accepted_lengths={"target": [9, 8, 6, 7, 5, 8, 68]})["speedup"]
    by_hand = (248 + d) / (248 / s + d)
    assert 1 < by_hand < s
    got = r["auto"]["predicted_from_run"]
    assert got["chain"] == [["retrieval", 6]]
    assert got["latencies"] == pytest.approx(lat, rel=1e-9)
    assert got["speedup"] == pytest.approx(by_hand, rel=1e-3)
    assert r["auto"]["measured_over_predicted_from_run"] == pytest.approx(1.2 / by_hand, rel=1e-3)
    for rep in (dict(bypasses=1), dict(hierarchy="self:4,retrieval:6"), dict(hierarchy="autoregressive"),
                dict(hierarchy=None), dict(speculative_tokens="x")):
        r = results(**rep)
        _predict_from_run(r, ["auto", "autoregressive"], costmodel)
        assert "predicted_from_run" not in r["auto"], rep


def test_an_ngram_drafters_empty_proposals_count_as_one_token_steps():
    """The retrieval tier over an n-gram drafter ran 10 forwards for 4 verifications: the other 6 were one-token
    steps where the drafter found no match. From the run's own step times (the tier's decode and pass at the same
    per-forward cost) the prediction counts every forward of the tier once and every token it emitted once; by hand
    with the cost model's formula c_i = (P_{i-1} + V_i) / E_i (costmodel.predict): the tier emits
    (1 + 2 + 3 + 5 + 6) / 10 tokens per forward, the target 7 per verification."""
    from triforce.lab import costmodel
    from triforce.lab.bench.run import _predict_from_run
    from triforce.lab.bench.stats import with_empty_proposals

    acc = {"retrieval": {"acceptance_rate": 0.6, "verifications": 4, "forward_passes": 10,
                         "accepted_lengths": [1, 1, 1, 0, 1]},
           "target": {"acceptance_rate": 1.0, "verifications": 3, "forward_passes": 3,
                      "accepted_lengths": [0, 0, 0, 0, 0, 0, 3]}}
    lengths = {"retrieval": [1, 1, 1, 0, 1], "target": [0, 0, 0, 0, 0, 0, 3]}
    chain = [("ngram", 4), ("retrieval", 6)]
    assert with_empty_proposals(lengths, acc, chain)["retrieval"] == [7, 1, 1, 0, 1]
    assert lengths["retrieval"] == [1, 1, 1, 0, 1]  # not changed in place
    assert with_empty_proposals(lengths, acc, [("retrieval", 6)]) == lengths  # no n-gram drafter
    assert with_empty_proposals(lengths, acc, [("ngram", 4)]) == lengths  # the target's forwards hold plain steps too
    t_r, v_t, d = 0.005, 0.030, 0.015
    r = {"autoregressive": {"step_seconds": {"target": d}},
         "triforce": {"chain": [list(e) for e in chain], "acceptance": acc, "speedup_vs_autoregressive": 1.5,
                      "step_seconds": {"ngram": 0.0, "retrieval": t_r, "target": v_t}}}
    _predict_from_run(r, ["triforce", "autoregressive"], costmodel)
    c_retrieval = t_r / ((1 + 2 + 3 + 5 + 6) / 10)
    by_hand = d / ((6 * c_retrieval + v_t) / 7)
    assert r["triforce"]["predicted_from_run"]["speedup"] == pytest.approx(by_hand, rel=1e-3)
    without = costmodel.predict(chain, r["triforce"]["predicted_from_run"]["latencies"],
                                {"retrieval": 0.6, "target": 1.0}, accepted_lengths=lengths)["speedup"]
    assert without > 1.1 * by_hand  # leaving the 6 one-token forwards out over-predicts (by 16% here)


def test_step_seconds_leave_the_prompt_out():
    from triforce.lab.bench.stats import step_seconds

    reps = [{"target": {"forward_seconds": 10.0, "prefill_seconds": 8.0, "forward_passes": 12, "prefill_passes": 2},
             "retrieval": {"forward_seconds": 1.5, "prefill_seconds": 0.5, "forward_passes": 20, "prefill_passes": 0}},
            {"target": {"forward_seconds": 3.0, "prefill_seconds": 0.0, "forward_passes": 10, "prefill_passes": 0},
             "ngram": {"forward_seconds": 0.0, "prefill_seconds": 0.0, "forward_passes": 0, "prefill_passes": 0}}]
    assert step_seconds(reps) == {"target": pytest.approx(5.0 / 20), "retrieval": pytest.approx(1.0 / 20)}


def test_png_chart(bench_result, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert bench.write_png(bench_result[0], str(path)) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_greedy_flags_a_different_method():
    tokens = {"hf-ar": [[5, 6, 7, 8]], "autoregressive": [[5, 6, 7, 8], [5, 6, 7, 8]], "broken": [[5, 6, 9, 8]],
              "short": [[5, 6]], "flaky": [[5, 6, 7, 8], [5, 1, 7, 8]]}
    out = bench.compare_greedy(tokens, "hf-ar")
    assert out["hf-ar"] == {"same_tokens": True, "first_difference": None, "reps_identical": True}
    assert out["autoregressive"] == {"same_tokens": True, "first_difference": None, "reps_identical": True}
    assert out["broken"] == {"same_tokens": False, "first_difference": 2, "reps_identical": True}
    assert out["short"] == {"same_tokens": False, "first_difference": 2, "reps_identical": True}
    assert out["flaky"] == {"same_tokens": False, "first_difference": 1, "reps_identical": False}
    with pytest.raises(KeyError):
        bench.compare_greedy(tokens, "llama.cpp")


def test_rep_metrics_and_spread_exact_values():
    m = bench.rep_metrics([0.5, 0.6, 0.8, 0.9])
    assert m["time_to_first_token_s"] == 0.5 and m["total_seconds"] == 0.9
    assert m["mean_time_between_tokens_ms"] == pytest.approx(400 / 3, abs=1e-3)
    assert m["tokens_per_second"] == pytest.approx(7.5, abs=1e-3)
    assert bench.rep_metrics([0.2])["mean_time_between_tokens_ms"] is None
    # quartiles 1.75, 4.75
    assert bench.spread([3.0, 1.0, 2.0, None, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "iqr": 3.0}
    assert bench.spread([None])["median"] is None


def test_aggregate_tiers_sums_over_reps():
    reps = [{"target": {"verifications": 2, "proposed": 8, "accepted": 6, "mean_tokens_per_verification": 4.0,
                        "forward_passes": 3, "forward_seconds": 0.5},
             "ngram": {"forward_passes": 0}},
            {"target": {"verifications": 3, "proposed": 12, "accepted": 3, "mean_tokens_per_verification": 2.0,
                        "forward_passes": 4, "forward_seconds": 0.25}}]
    out = bench.aggregate_tiers(reps)
    assert list(out) == ["target"]
    t = out["target"]
    assert (t["verifications"], t["proposed"], t["accepted"], t["forward_passes"]) == (5, 20, 9, 7)
    assert t["acceptance_rate"] == 0.45 and t["mean_tokens_per_verification"] == pytest.approx(14 / 5)
    assert t["forward_seconds"] == 0.75


def test_plan_skips_what_cannot_run(monkeypatch):
    args = add_bench_parser(_subparsers()).parse_args([])
    monkeypatch.setattr(methods.importlib.util, "find_spec", lambda name: None)
    run, skipped = bench.plan_methods(args)
    assert run == ["hf-ar", "hf-lookup", "auto", "autoregressive", "self", "draft", "retrieval", "triforce",
                   "retrieval-int8", "triforce-int8", "retrieval-codes"]
    assert "--draft MODEL" in skipped["hf-assisted"] and "llama-cpp-python" in skipped["llama.cpp"]
    assert all("computes exactly" in skipped[m] for m in ("autoregressive-exact", "auto-exact"))
    args = add_bench_parser(_subparsers()).parse_args(["--synthetic", "llama2-7b", "--layers", "1"])
    run, skipped = bench.plan_methods(args)
    assert run == list(methods.SYNTHETIC_METHODS) and "synthetic" in skipped["hf-lookup"]


def test_rope_scaling_runs_the_scaled_target_and_skips_transformers(tiny_folder):
    """--rope-scaling yarn --rope-factor 4: our rows load the target as generate's --rope-scaling does (its context
    4x the trained 512 tokens), so a 600-token prompt runs and the greedy tokens are the scaled model's; transformers'
    rows are skipped (they run the checkpoint as saved), and llama.cpp has no dynamic scaling."""
    from triforce import load_model
    from triforce.engine import Engine, SpeculationConfig
    from triforce.lab.bench.runners import _OursRunner
    from triforce.speculation.sampling import SamplingParams

    argv = ["--model", tiny_folder, "--rope-scaling", "yarn", "--rope-factor", "4", "--temperature", "0"]
    args = add_bench_parser(_subparsers()).parse_args(argv)
    _, skipped = bench.plan_methods(args)
    assert {"hf-ar", "hf-lookup"} <= set(skipped) and "config.json" in skipped["hf-ar"]
    dyn = add_bench_parser(_subparsers()).parse_args(argv[:2] + ["--rope-scaling", "dynamic", "--rope-factor", "2"])
    assert "dynamic" in bench.plan_methods(dyn)[1]["llama.cpp"]
    cfg = dict(model=tiny_folder, draft=None, dtype="float32", threads=1, temperature=0.0, top_p=1.0, top_k=0, seed=0,
               budget=64, chunk_size=4, gamma1=2, gamma2=3, rope_scaling="yarn", rope_factor=4.0)
    runner = _OursRunner("retrieval", cfg)
    assert runner.context == 2048 and runner.target.cfg.rope_type == "yarn"
    long = torch.randint(3, 96, (600,), generator=torch.Generator().manual_seed(3)).tolist()
    short = long[:500]  # within the unscaled model's 512 positions

    def plain(scaling, ids):  # autoregressive greedy tokens of the model loaded with or without the override
        lm = load_model(tiny_folder, rope_scaling=scaling, rope_factor=4.0 if scaling else None)
        return list(Engine(lm.model, eos_ids=()).stream(ids, max_new_tokens=8, sampling=SamplingParams(
            temperature=0.0), spec=SpeculationConfig(mode="autoregressive"), seed=0))

    assert runner.run(long, 8, seed=0)["tokens"] == plain("yarn", long)  # lossless with respect to the scaled target
    assert runner.run(short, 8, seed=0)["tokens"] != plain(None, short)  # and the scaling changed the model


def _subparsers():
    import argparse

    return argparse.ArgumentParser().add_subparsers()


@pytest.mark.parametrize("argv, option", [
    (["--reps", "0"], "--reps"),
    (["--new-tokens", "0"], "--new-tokens"),
    (["--methods", "hf-ar,vllm"], "--methods"),
    (["--methods", "hf-ar,hf-ar"], "--methods"),
    (["--top-p", "1.5"], "--top-p"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-k", "-2"], "--top-k"),
    (["--budget", "5"], "--budget"),
    (["--gamma2", "0"], "--gamma2"),
    (["--threads", "0"], "--threads"),
    (["--dtype", "int3"], "--dtype"),
    (["--book", "no-such-book.txt"], "--book"),
    (["--prompt", "a", "--book", "pg1342.txt"], "--prompt"),
    (["--prompt-file", "/no/such/file.txt"], "--prompt-file"),
    (["--model", "/no/such/model"], "--model"),
    (["--layers", "2"], "--layers"),
    (["--synthetic", "gpt-5"], "--synthetic"),
    (["--synthetic", "llama2-7b", "--prompt", "x"], "--synthetic"),
    (["--png", "chart.jpg"], "--png"),
    (["--json", "/no/such/dir/out.json"], "--json"),
    (["--reps", "many"], "--reps"),
    (["--rope-factor", "4"], "--rope-factor"),
    (["--rope-scaling", "yarn", "--rope-factor", "0.5"], "--rope-factor"),
    (["--rope-scaling", "ntk", "--rope-factor", "4"], "--rope-scaling"),
    (["--synthetic", "llama2-7b", "--rope-scaling", "yarn", "--rope-factor", "4"], "--rope-scaling"),
])
def test_bad_options_exit_2_naming_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as e:  # argparse type errors exit from the parser
        code = main(["bench", *argv])
        raise SystemExit(code)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option in err, err


def test_png_without_matplotlib_is_refused_before_the_run(monkeypatch, capsys):
    from triforce.lab.bench import run

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setattr(run, "run_bench", lambda args: pytest.fail("the run started"))
    assert main(["bench", "--png", "chart.png", "--reps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--png" in err and "pip install matplotlib" in err, err


def test_the_table_names_the_fastest_method(bench_result):
    result = bench_result[0]
    medians = {m: r["mean_time_between_tokens_ms"]["median"] for m, r in result["methods"].items()
               if r["status"] == "ok"}
    best = min(medians, key=medians.get)
    lines = bench.format_table(result).splitlines()
    line = next(x for x in lines if x.startswith("fastest: "))
    assert line.startswith(f"fastest: {best}, {medians[best]:.1f} ms/token median")
    for method, name in (("autoregressive", "plain decoding"), ("hf-ar", "transformers")):
        if best != method:
            assert f"{medians[method] / medians[best]:.2f}x {name}" in line, line
    assert "x the next (" in line


def test_the_fastest_line_compares_with_plain_decoding_llamacpp_and_transformers():
    from triforce.lab.bench.report import fastest_line

    timed = {"hf-ar": 80.3, "autoregressive": 13.3, "auto": 8.2, "retrieval": 9.0, "llama.cpp": 21.9}
    assert fastest_line(timed) == ("fastest: auto, 8.2 ms/token median: 1.62x plain decoding, 2.67x llama.cpp, "
                                   "9.79x transformers; 1.10x the next (retrieval, 9.0)")
    assert fastest_line({"autoregressive": 4.0, "auto": 5.0}) == \
        "fastest: autoregressive, 4.0 ms/token median; 1.25x the next (auto, 5.0)"
    assert fastest_line({"auto": 5.0}) == "fastest: auto, 5.0 ms/token median"


@pytest.fixture
def canned_run(bench_result, monkeypatch):
    """``triforce bench`` with the run replaced by the module's result: what cmd_bench writes where, in-process."""
    from triforce.lab.bench import run

    seen = {}

    def fake(args):
        seen["args"] = args
        return bench_result[0]

    monkeypatch.setattr(run, "run_bench", fake)
    return seen


def test_json_goes_to_stdout_only_when_asked(canned_run, tiny_folder, tmp_path, capsys):
    argv = ["bench", "--model", tiny_folder, "--prompt", PROMPT, "--no-progress"]
    assert main(argv) == 0  # no --json: the table on stdout, no JSON anywhere
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("fastest: ") and "{" not in out and "{" not in err
    assert main([*argv, "--json", "-"]) == 0  # --json -: stdout holds the JSON alone, the table goes to stderr
    out, err = capsys.readouterr()
    assert json.loads(out)["benchmark"] == "triforce bench"
    assert "fastest: " in err
    path = tmp_path / "r.json"
    assert main([*argv, "--json", str(path)]) == 0  # --json PATH: the file, and the table on stdout
    out, err = capsys.readouterr()
    assert json.loads(path.read_text())["benchmark"] == "triforce bench"
    assert out.splitlines()[-1].startswith("fastest: ") and "{" not in out


def test_dtype_short_names_are_accepted(canned_run, tiny_folder, capsys):
    """The help says fp32, bf16 and fp16 name the same dtypes: the bench takes them, as generate does."""
    assert main(["bench", "--model", tiny_folder, "--prompt", PROMPT, "--dtype", "fp32", "--no-progress"]) == 0
    assert canned_run["args"].dtype == "float32"


def test_bench_help_names_only_its_own_options_and_its_thread_default():
    import argparse
    import re

    from triforce.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices["bench"]
    flags = {f for a in parser._actions for f in a.option_strings}
    text = parser.description + " " + " ".join(a.help or "" for a in parser._actions)
    assert set(re.findall(r"--[a-z0-9-]+", text)) <= flags  # e.g. no "--mode auto": bench has no --mode
    threads = next(a for a in parser._actions if "--threads" in a.option_strings)
    assert "os.cpu_count()" in threads.help and "generate" in threads.help


def test_prompt_cache_prefills_the_prompt_once_across_methods(tiny_folder, tmp_path):
    """--prompt-cache: the first of our methods to run writes the prompt's KV once; the other loads it (all but the
    tokens fed again) and generates the same greedy tokens; later repetitions (prefix reuse) write nothing."""
    out, cache_dir = tmp_path / "bench.json", tmp_path / "kv"
    proc = subprocess.run(
        [sys.executable, "-m", "triforce", "bench", "--model", tiny_folder, "--prompt", PROMPT, "--new-tokens",
         str(NEW_TOKENS), "--temperature", "0", "--reps", "2", "--threads", "1", "--budget", "32", "--chunk-size", "4",
         "--methods", "autoregressive,retrieval", "--prompt-cache", str(cache_dir), "--json", str(out),
         "--no-progress"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert "--prompt-cache" in result["command"]
    runs = {m: r["prompt_cache"] for m, r in result["methods"].items()}
    files = list(cache_dir.glob("*.safetensors"))
    assert len(files) == 1
    writer = [m for m, rs in runs.items() if rs[0]["stored"]]
    assert len(writer) == 1 and runs[writer[0]][0]["loaded_tokens"] == 0
    reader = "retrieval" if writer == ["autoregressive"] else "autoregressive"
    assert runs[reader][0]["loaded_tokens"] == len(PROMPT) and runs[reader][0]["stored"] is None
    assert runs[reader][0]["loaded_from"] == str(files[0])
    for rs in runs.values():  # the second repetition reuses the engine's kept prefix: no file read or written
        assert rs[1] == {"loaded_tokens": 0, "loaded_from": None, "stored": None}
    ref = result["methods"]["autoregressive"]["token_ids"][0]
    assert all(r["token_ids"] == [ref, ref] for r in result["methods"].values())


@pytest.mark.parametrize("argv, option", [
    (["--prompt-cache", __file__], "--prompt-cache"),
    (["--synthetic", "llama2-7b", "--prompt-cache", "kv"], "--prompt-cache"),
])
def test_bad_prompt_cache_is_refused_before_the_run(argv, option, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option in err, err


def test_bench_table_shows_measured_first_and_labels_the_prediction():
    from triforce.lab.bench import format_table

    spread = lambda v: {"median": v, "min": v, "max": v, "iqr": 0.0}  # noqa: E731
    result = {"synthetic": False, "greedy": None,
              "settings": {"model": "m", "prompt_tokens": 8000, "prompt_source": "pg1342", "new_tokens": 64,
                           "temperature": 0.6, "top_p": 0.9, "top_k": 0, "dtype": "float32", "threads": 1, "reps": 3},
              "methods": {"retrieval": {"status": "ok", "mean_time_between_tokens_ms": spread(40.0),
                                        "tokens_per_second": spread(25.0), "time_to_first_token_s": spread(1.0),
                                        "speedup_vs_hf_ar": 1.5, "speedup_vs_autoregressive": 1.25,
                                        "predicted_speedup_vs_autoregressive": 0.8, "peak_memory_bytes": 2**30}}}
    table = format_table(result)
    row = next(line for line in table.splitlines() if line.startswith("retrieval"))
    assert row.endswith("; measured 1.25x vs ar (cost-model prediction 0.80x)")
    assert "not a measurement" in table
