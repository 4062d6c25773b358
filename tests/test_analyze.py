"""`triforce analyze`: attention recovery, contextual locality and acceptance (TriForce Sec. 3), on tiny models.

Reference values come from transformers (eager attention weights, greedy generate), from the retrieval cache itself,
and from exact properties (a budget covering every position keeps all of the mass; the oracle is the best choice).
"""

import json
import os

import pytest
import torch

from tiny import hf_model, ours
from triforce.cli import main
from triforce.kv.retrieval import CHUNK_SCORES, RetrievalCache
from triforce.lab.analyze import (
    acceptance_points,
    attention_probs,
    chunk_ranking,
    locality_after_prompt,
    prefill_recorded,
    recovery_at_query,
    run_acceptance,
    summarize_acceptance,
)

P = 96  # prompt tokens; n = P - 1 keys for the last prompt token's query
BUDGETS = [8, 16, 32, 64, 4096]


@pytest.fixture(scope="module")
def models():
    hf = hf_model(3, layers=3, vocab=96)
    hf.set_attn_implementation("eager")  # attention weights for the reference
    return hf, ours(hf)


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, 96, (P,), generator=g).tolist()


@pytest.fixture(scope="module")
def hf_attn(models, prompt):
    """transformers' attention weights over prompt + 12 greedy tokens (its own generate): (tokens, [L x (nh, T, T)])."""
    hf, _ = models
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        seq = out[0].tolist()
        att = hf(torch.tensor([seq]), output_attentions=True).attentions
    return seq[P:], [a[0].double() for a in att]


def _hf_rows(att, pos):
    """(L, nh, pos) attention of position ``pos`` over [0, pos), renormalised (its own key left out)."""
    rows = torch.stack([a[:, pos, :pos] for a in att])
    return rows / rows.sum(-1, keepdim=True)


def test_attention_probs_equal_transformers(models, prompt, hf_attn):
    _, model = models
    full, query, _ = prefill_recorded(model, prompt)
    probs = attention_probs(full, query, P - 1)  # (L, 1, nkv, g, n)
    L, _, nkv, g, n = probs.shape
    ref = _hf_rows(hf_attn[1], P - 1)
    assert torch.allclose(probs.reshape(L, nkv * g, n), ref, atol=1e-5)


def test_recovery_exact_values(models, prompt):
    _, model = models
    full, query, _ = prefill_recorded(model, prompt)
    n = P - 1
    rec = recovery_at_query(model, full, query, n, BUDGETS, chunk_size=4)
    assert set(rec) == set(CHUNK_SCORES) | {"oracle"}
    L = model.cfg.num_hidden_layers
    for s, by_budget in rec.items():
        assert by_budget[4096] == pytest.approx([1.0] * L, abs=1e-12)  # every position kept
        for small, big in zip(BUDGETS, BUDGETS[1:]):  # non-decreasing in the budget, layer by layer
            assert all(a <= b + 1e-12 for a, b in zip(by_budget[small], by_budget[big])), (s, small, big)
        assert all(0 < v <= 1 + 1e-12 for v in by_budget[8])
    for s in CHUNK_SCORES:  # the oracle keeps each head's best positions: never below a chunk rule
        for b in BUDGETS:
            assert all(o >= c - 1e-12 for o, c in zip(rec["oracle"][b], rec[s][b])), (s, b)
    assert rec["oracle"][8] > rec["mean"][8]  # and strictly better somewhere with 8 of 95 keys
    # each budget's value is exactly the mass on what a RetrievalCache of that budget selects
    probs = attention_probs(full, query, n)
    for b in (8, 32):
        cache = RetrievalCache(model.cfg, full, b, 4, "mean")
        cache.build(n, query)
        sel = cache.selected[..., :cache.n_selected]
        idx = sel[:, :, :, None, :].expand(*probs.shape[:4], sel.shape[-1])
        direct = torch.gather(probs, -1, idx).sum(-1).mean(dim=(1, 2, 3))
        assert rec["mean"][b] == pytest.approx(direct.tolist(), abs=1e-12)


def test_chunk_ranking_keeps_chunk_zero_first(models, prompt):
    _, model = models
    full, query, _ = prefill_recorded(model, prompt)
    rank = chunk_ranking(model, full, query, P - 1, 8, "mean", 32)
    assert rank.shape[-1] == 32
    assert (rank[..., :8] == torch.arange(8)).all()  # chunk 0, the attention sink, always first


def test_locality_against_transformers(models, prompt, hf_attn):
    _, model = models
    tokens_hf, att = hf_attn
    full, query, logits = prefill_recorded(model, prompt, extra_capacity=12)
    n = P - 1
    rec = recovery_at_query(model, full, query, n, [16, 32, 4096], 4, scores=("mean",))
    loc = locality_after_prompt(model, full, query, logits, prompt, [16, 32, 4096], 12, 4, "mean", eos_ids=())
    assert loc["tokens"] == tokens_hf  # greedy with the full cache = transformers' greedy
    assert loc["steps"] == 13
    for b in (16, 32, 4096):  # step 0 is the recovery of the same selection
        mean0 = sum(rec["mean"][b]) / len(rec["mean"][b])
        assert loc["fixed"][b][0] == pytest.approx(mean0, abs=1e-12)
        assert loc["reselected"][b][0] == pytest.approx(mean0, abs=1e-12)
    assert loc["fixed"][4096] == pytest.approx([1.0] * 13, abs=1e-12)  # everything fits: nothing is lost
    # attention share of the positions generated since the selection, against transformers' attention weights
    for s in (1, 5, 12):
        rows = _hf_rows(att, n + s)
        assert loc["generated_share"][s] == pytest.approx(float(rows[..., n:].sum(-1).mean()), abs=1e-5)
    # budget 16, chunk 4: capacity for 16 - 4 = 12 generated tokens held, so steps up to 11 are valid
    assert loc["fixed"][16][11] is not None and loc["fixed"][16][12] is None
    # a re-chosen selection uses the step's own query: at some step it differs from the fixed one
    assert any(f != r for f, r in zip(loc["fixed"][32][1:], loc["reselected"][32][1:]))


def test_acceptance_values(models, prompt):
    from triforce import Engine

    _, model = models
    engine = Engine(model)
    base = {"budget": 512, "chunk_size": 4, "temperature": 0.0, "prompt_tokens": P}
    points = acceptance_points([24, 512], [4], [0.0, 1.0], [48, P], base)
    assert [(p["prompt_tokens"], p["budget"], p["temperature"]) for p in points] == \
        [(48, 512, 0.0), (P, 24, 0.0), (P, 512, 0.0), (P, 512, 1.0)]
    assert sorted(points[2]["sweeps"]) == ["budget", "chunk_size", "prompt_tokens", "temperature"]
    recs = run_acceptance(engine, prompt, points, new_tokens=12, gamma2=4, seed=0)
    by = {(r["prompt_tokens"], r["budget"], r["temperature"]): r for r in recs}
    # the retrieval cache holds every position: under greedy decoding it proposes exactly the target's tokens
    assert by[(P, 512, 0.0)]["acceptance_rate"] == 1.0 and by[(48, 512, 0.0)]["acceptance_rate"] == 1.0
    assert 0 <= by[(P, 24, 0.0)]["acceptance_rate"] < 1.0  # 24 of 96+ positions: this random model rejects some
    # at T = 1 with the full cache in reach the distributions are equal: every proposal is accepted
    assert by[(P, 512, 1.0)]["acceptance_rate"] == 1.0
    summ = summarize_acceptance([dict(r, book="b") for r in recs], base)
    assert [row["value"] for row in summ["budget"]] == [24, 512]
    assert summ["budget"][0]["acceptance_rate_mean"] == pytest.approx(by[(P, 24, 0.0)]["acceptance_rate"], abs=1e-4)


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    g = torch.Generator().manual_seed(1)
    words = "the cat sat on a mat and then it ran off to see the king of the old land".split()
    text = " ".join(words[i] for i in torch.randint(0, len(words), (300,), generator=g).tolist())
    path = tmp_path_factory.mktemp("books") / "tinybook.txt"
    path.write_text("*** START OF THE PROJECT GUTENBERG EBOOK X ***\n" + text + "\n*** END OF THE PROJECT GUTENBERG")
    return str(path)


def test_cli_writes_json_and_png(tiny_folder, book, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["analyze", "--model", tiny_folder, "--books", book, "--prompt-tokens", "200", "--new-tokens", "10",
               "--budgets", "16", "64", "--chunk-size", "4", "--chunk-sizes", "4", "8", "--temperatures", "0", "0.6",
               "--lengths", "100", "200", "--base-budget", "64", "--gamma2", "4", "--threads", "1",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    rec = json.loads((out / "recovery.json").read_text())
    assert rec["books"] == ["tinybook"] and rec["budgets"] == [16, 64]
    assert len(rec["per_layer"]["mean"]["16"]) == 3
    for s in ("mean", "max", "bound", "attn"):
        assert rec["mean_recovery"]["oracle"]["16"] >= rec["mean_recovery"][s]["16"]
        assert rec["mean_recovery"][s]["16"] <= rec["mean_recovery"][s]["64"]
    loc = json.loads((out / "locality.json").read_text())
    assert loc["fixed"]["16"][0] == pytest.approx(rec["mean_recovery"]["mean"]["16"], abs=1e-4)
    acc = json.loads((out / "acceptance.json").read_text())
    assert len(acc["records"]) == 5  # the base (64, 4, 0.6, 200) + budget 16, chunk size 8, T 0, length 100
    assert all(0 <= r["acceptance_rate"] <= 1 for r in acc["records"])
    assert [row["value"] for row in acc["summary"]["prompt_tokens"]] == [100, 200]
    assert "triforce analyze" in acc["command"] and "--budgets 16 64" in acc["command"]
    printed = capsys.readouterr().out
    assert "| budget | mean | max | bound | attn | oracle |" in printed
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    for name in ("recovery", "locality", "acceptance"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_without_matplotlib_writes_json(tiny_folder, book, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "out"
    rc = main(["analyze", "--model", tiny_folder, "--books", book, "--prompt-tokens", "100", "--analyses", "recovery",
               "--budgets", "16", "--chunk-size", "4", "--out", str(out), "--no-progress"])
    assert rc == 0
    assert json.loads((out / "recovery.json").read_text())["budgets"] == [16]
    assert not (out / "recovery.png").exists()
    err = capsys.readouterr().err
    assert "recovery.png skipped" in err and "triforce[bench]" in err


def test_cli_prompt_cache_loads_the_prefix_and_gives_the_same_recovery(tiny_folder, book, tmp_path):
    # the first run prefills and writes the prompt's KV; the second loads all of it but the last token, whose forward
    # records the query: the recovery values equal the first run's to fp32 rounding (one prefill chunk vs two)
    argv = ["analyze", "--model", tiny_folder, "--books", book, "--prompt-tokens", "120", "--analyses", "recovery",
            "--budgets", "16", "64", "--chunk-size", "4", "--threads", "1", "--no-progress",
            "--prompt-cache", str(tmp_path / "pc")]
    runs = []
    for name in ("first", "second"):
        assert main(argv + ["--out", str(tmp_path / name)]) == 0
        runs.append(json.loads((tmp_path / name / "recovery.json").read_text()))
    assert runs[0]["prompt_cache"]["tinybook"]["loaded_tokens"] == 0
    assert runs[1]["prompt_cache"]["tinybook"]["loaded_tokens"] == 119
    assert "--prompt-cache" in runs[1]["command"]
    for score in ("mean", "max", "bound", "attn", "oracle"):
        for b in ("16", "64"):
            assert runs[1]["mean_recovery"][score][b] == pytest.approx(runs[0]["mean_recovery"][score][b], abs=1e-5)
            assert runs[0]["mean_recovery"][score][b] < 1  # a budget below the prompt: not every position kept
    # a longer prompt loads the 120 tokens, prefills 80 (>= 64, the prompt cache's threshold) and is written: the
    # next run of it loads all but its last token
    argv[argv.index("--prompt-tokens") + 1] = "200"
    for name, loaded in (("third", 120), ("fourth", 199)):
        assert main(argv + ["--out", str(tmp_path / name)]) == 0
        got = json.loads((tmp_path / name / "recovery.json").read_text())["prompt_cache"]["tinybook"]
        assert got["loaded_tokens"] == loaded, name


@pytest.mark.parametrize("argv, option", [
    (["--prompt-cache", "FILE"], "--prompt-cache"),
    (["--prompt-cache", ""], "--prompt-cache"),
    (["--analyses", "sparsity"], "--analyses"),
    (["--budgets", "4", "--chunk-size", "8"], "--budgets"),
    (["--budgets", "x"], "--budgets"),
    (["--books", "no-such-book"], "--books"),
    (["--prompt-tokens", "1"], "--prompt-tokens"),
    (["--new-tokens", "0"], "--new-tokens"),
    (["--temperatures", "-1"], "--temperatures"),
    (["--chunk-sizes", "1020"], "--chunk-sizes"),
    (["--threads", "0"], "--threads"),
    (["--lengths", "1"], "--lengths"),
    (["--reselect-every", "0"], "--reselect-every"),
    (["--acceptance-tokens", "0"], "--acceptance-tokens"),
])
def test_cli_bad_options_exit_2_before_loading(argv, option, book, tmp_path, capsys):
    # the model does not exist: the option must be reported first, so nothing was loaded
    args = ["analyze", "--model", os.path.join(str(tmp_path), "missing"), "--books", book, "--out", str(tmp_path / "o")]
    argv = [book if a == "FILE" else a for a in argv]  # a file where a directory is wanted
    try:
        code = main(args + argv)
    except SystemExit as e:  # argparse's own checks (types, choices)
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert option in err and err.count("\n") == 1, err
