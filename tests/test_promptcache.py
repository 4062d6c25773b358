"""Prompt caches on disk (promptcache.py) and honest long inputs (a cut prompt reported, limits named).

A prompt cache is right when a later process that loads it generates exactly what a fresh prefill gives (greedy,
token for token), and when every bad file (corrupted, truncated, another model) is skipped with a warning rather than
read into the cache.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest

from triforce import SamplingParams, SpeculationConfig, TriForce
from triforce.kv.promptcache import PromptCache

GREEDY = SamplingParams(temperature=0)
AR = SpeculationConfig(mode="autoregressive")


def fresh(folder, cache_dir=None, **kw):
    """A TriForce as a new process has it: nothing kept in memory."""
    return TriForce.load(folder, threads=1, prompt_cache=cache_dir, prompt_cache_min_tokens=1, **kw)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [3 + (seed + 7 * i * i + i) % 90 for i in range(n)]


@pytest.mark.parametrize("spec", [AR, SpeculationConfig(mode="retrieval", budget=24, chunk_size=4, gamma1=3,
                                                        gamma2=5)], ids=["autoregressive", "retrieval"])
def test_a_later_process_loads_the_document_and_generates_what_a_fresh_prefill_gives(tiny_folder, tmp_path, spec):
    doc, follow_up = prompt(200), prompt(200) + prompt(12, seed=5)
    first = fresh(tiny_folder, tmp_path).generate(doc, max_new_tokens=8, sampling=GREEDY, spec=spec)
    written = first.stats.prompt_cache["stored"]
    assert first.stats.prompt_cache["loaded_tokens"] == 0 and written is not None
    later = fresh(tiny_folder, tmp_path).generate(follow_up, max_new_tokens=16, sampling=GREEDY, spec=spec)
    assert later.stats.prompt_cache["loaded_tokens"] == 200  # the document, not the first answer
    assert later.stats.prompt_cache["loaded_from"] == written
    assert later.token_ids == fresh(tiny_folder).generate(follow_up, max_new_tokens=16, sampling=GREEDY,
                                                          spec=spec).token_ids
    same = fresh(tiny_folder, tmp_path).generate(doc, max_new_tokens=8, sampling=GREEDY, spec=spec)
    assert same.stats.prompt_cache["loaded_tokens"] == 200 and same.token_ids == first.token_ids


def test_the_longest_prefix_wins_and_covered_entries_are_replaced(tiny_folder, tmp_path):
    fresh(tiny_folder, tmp_path).generate(prompt(100), max_new_tokens=2, sampling=GREEDY, spec=AR)
    fresh(tiny_folder, tmp_path).generate(prompt(60, seed=9), max_new_tokens=2, sampling=GREEDY, spec=AR)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    tf = fresh(tiny_folder, tmp_path)
    hit = tf.generate(prompt(100) + [5, 6], max_new_tokens=2, sampling=GREEDY, spec=AR)
    assert hit.stats.prompt_cache["loaded_tokens"] == 100  # of the 100-token entry, not the 60-token one
    assert len(list(tmp_path.glob("*.safetensors"))) == 3  # the entries hold their answers too: none covers another
    held = tf.engine.prefix_tokens  # what the last file holds: a chat's next turn starts with all of it
    turn = fresh(tiny_folder, tmp_path).generate(held + [7, 8], max_new_tokens=2, sampling=GREEDY, spec=AR)
    assert turn.stats.prompt_cache["loaded_tokens"] == len(held)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3  # the new entry covers the one it loaded, deleted


def corrupt(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF  # a byte of the keys and values: the checksum sees it
    elif how == "truncate":
        data = data[:len(data) // 2]
    elif how == "short":  # a well-formed file (checksum right) with fewer positions than tokens listed
        from safetensors import safe_open
        from safetensors.torch import save_file

        from triforce.kv.promptcache import _crc

        with safe_open(str(path), framework="pt") as f:
            meta, t = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}
        k, v = t["k"][:, :, :, :10].contiguous(), t["v"][:, :, :, :10].contiguous()
        save_file({"k": k, "v": v, "tokens": t["tokens"]}, str(path), metadata={**meta, "crc32": _crc(k, v)})
        return
    else:  # garbage header
        data[:16] = b"\xff" * 16
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate", "header", "short"])
def test_a_damaged_file_is_skipped_with_one_warning_and_the_output_is_unchanged(tiny_folder, tmp_path, how):
    doc = prompt(150)
    want = fresh(tiny_folder, tmp_path).generate(doc, max_new_tokens=8, sampling=GREEDY, spec=AR)
    (path,) = tmp_path.glob("*.safetensors")
    corrupt(path, how)
    tf = fresh(tiny_folder, tmp_path)
    tf.prompt_cache.min_new_tokens = 10**9  # keep the damaged file for a second request
    with pytest.warns(UserWarning, match="ignored") as caught:
        got = tf.generate(doc, max_new_tokens=8, sampling=GREEDY, spec=AR)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert got.stats.prompt_cache["loaded_tokens"] == 0 and got.token_ids == want.token_ids
    tf.engine.forget_prefix()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per file, not at every request
        tf.generate(doc, max_new_tokens=2, sampling=GREEDY, spec=AR)


def test_another_model_or_dtype_never_reads_the_file(tiny_folder, tiny_draft_folder, tmp_path):
    fresh(tiny_folder, tmp_path).generate(prompt(80), max_new_tokens=2, sampling=GREEDY, spec=AR)
    other = fresh(tiny_draft_folder, tmp_path)
    assert other.generate(prompt(80), max_new_tokens=2, sampling=GREEDY,
                          spec=AR).stats.prompt_cache["loaded_tokens"] == 0
    bf16_kv = fresh(tiny_folder, tmp_path, kv_dtype="bfloat16")
    assert bf16_kv.prompt_cache.key != fresh(tiny_folder, tmp_path).prompt_cache.key
    # a file renamed to this model's key still carries the other model's key inside: refused
    (path,) = [p for p in tmp_path.glob("*.safetensors") if not p.name.startswith(other.prompt_cache.key)]
    path.rename(tmp_path / f"{other.prompt_cache.key}-renamed.safetensors")
    with pytest.warns(UserWarning, match="another model"):
        r = other.generate(prompt(80), max_new_tokens=2, sampling=GREEDY, spec=AR)
    assert r.stats.prompt_cache["loaded_tokens"] == 0


def test_the_directory_stays_under_its_cap_least_recently_used_first(tiny_folder, tmp_path):
    tf = fresh(tiny_folder, tmp_path)
    tf.generate(prompt(100), max_new_tokens=2, sampling=GREEDY, spec=AR)
    size = next(tmp_path.glob("*.safetensors")).stat().st_size
    tf.prompt_cache.max_bytes = int(2.5 * size)
    for seed in (1, 2, 3):
        tf.engine.forget_prefix()
        tf.generate(prompt(100, seed=seed), max_new_tokens=2, sampling=GREEDY, spec=AR)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    held = [PromptCache(tmp_path, tf.prompt_cache.key)._tokens(p)[:100] for p in tmp_path.glob("*.safetensors")]
    assert sorted(held) == sorted([prompt(100, seed=2), prompt(100, seed=3)])


def test_bad_prompt_cache_arguments_are_named(tiny_folder, tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="prompt_cache"):
        fresh(tiny_folder, tmp_path / "f")
    with pytest.raises(ValueError, match="max_bytes"):
        TriForce.load(tiny_folder, prompt_cache=tmp_path, prompt_cache_max_bytes=-1)


def run(*args):
    proc = subprocess.run([sys.executable, "-m", "triforce", *args], capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_a_cut_document_is_reported_on_stderr_and_in_json(tiny_folder, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("abcdefghij" * 40)  # 400 characters: 400 tokens of the character tokenizer
    code, out, err = run("generate", "--model", tiny_folder, "--prompt-file", str(doc), "--prompt", "why?",
                         "--max-prompt-tokens", "100", "--max-new-tokens", "2", "--json", "--threads", "1")
    assert code == 0, err
    cut = json.loads(out)["prompt_cut"]
    assert json.loads(out)["prompt_tokens"] == cut["kept_tokens"] == 100
    assert cut["dropped_tokens"] == 400 - (100 - len("\n\nwhy?")) - 1  # the BOS token is the template's
    assert "the question" in cut["kept"] and "cut to 100 of" in err


def test_max_prompt_tokens_limit_and_binary_files_are_named(tiny_folder, tmp_path):
    code, out, err = run("generate", "--model", tiny_folder, "--prompt", "x" * 600, "--max-prompt-tokens", "511",
                         "--max-new-tokens", "1", "--json", "--threads", "1", "--mode", "autoregressive")
    assert code == 0, err  # the context (512) less one token to generate
    code, _, err = run("generate", "--model", tiny_folder, "--prompt", "x" * 600, "--max-prompt-tokens", "512")
    assert code == 2 and "--max-prompt-tokens must be at most 511" in err, err
    code, _, err = run("generate", "--model", tiny_folder, "--prompt", "x", "--max-prompt-tokens", "500",
                       "--max-new-tokens", "20")
    assert code == 2 and "at most 492" in err and "--max-new-tokens 20" in err, err
    binary = tmp_path / "a.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    code, out, err = run("generate", "--model", tiny_folder, "--prompt-file", str(binary), "--max-prompt-tokens", "50")
    assert code == 2 and "not a text file" in err and out == "" and len(err.strip().splitlines()) == 1, err
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\t\n")
    for argv in (["--prompt-file", str(blank)], ["--prompt-file", str(blank), "--prompt", "Who?"]):
        code, out, err = run("generate", "--model", tiny_folder, *argv)
        assert code == 2 and "holds no text" in err and out == "", err


def test_a_restarted_server_loads_the_document_its_previous_run_wrote(tiny_folder, tmp_path):
    """Through the HTTP server (its forks share the directory): the first server writes the prompt's file, a second
    server (a restart: nothing in memory) loads it, and both answers equal a fresh prefill's."""
    import httpx

    from servers import serve_in_thread
    from triforce.serve import ServerDefaults, create_app

    def serve_once(question: list[int]) -> str:
        """One server process's life: load with the directory, answer one completion, stop."""
        tf = TriForce.load(tiny_folder, threads=1, prompt_cache=tmp_path)  # writes after >= 64 new tokens
        app = create_app(tf, ServerDefaults(model_id="t", temperature=0, max_batch=2, spec=AR))
        with serve_in_thread(app) as url:
            r = httpx.post(url + "/v1/completions", json={"model": "t", "prompt": doc + question, "max_tokens": 8,
                                                          "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    doc, first_q, second_q = prompt(150), prompt(6, seed=9), prompt(6, seed=10)
    assert serve_once(first_q) == fresh(tiny_folder).generate(doc + first_q, max_new_tokens=8, sampling=GREEDY,
                                                              spec=AR).text
    (written,) = tmp_path.glob("*.safetensors")
    os.utime(written, (1e9, 1e9))  # marked old: a load marks it used now (least-recently-used order)
    assert serve_once(second_q) == fresh(tiny_folder).generate(doc + second_q, max_new_tokens=8, sampling=GREEDY,
                                                               spec=AR).text
    assert list(tmp_path.glob("*.safetensors")) == [written]  # too few new tokens to write a file of its own
    assert written.stat().st_mtime > 1e9 + 1  # the restarted server read it


def test_bad_cache_options_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    import triforce.api as api

    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    for kwargs, fragment in (({"prompt_cache": 123}, "prompt_cache must be a directory path"),
                             ({"prompt_cache": ""}, "prompt_cache must be a directory path"),
                             ({"prompt_cache": __file__}, "prompt_cache must be a directory, got the file"),
                             ({"prompt_cache": "/proc/triforce-no"}, "cannot be created or written"),
                             ({"prompt_cache": tmp_path, "prompt_cache_max_bytes": -1}, "prompt_cache_max_bytes"),
                             ({"prompt_cache": tmp_path, "prompt_cache_min_tokens": "x"}, "prompt_cache_min_tokens")):
        with pytest.raises(ValueError, match=fragment):
            TriForce.load(None, **kwargs)


def test_a_failed_write_warns_and_keeps_the_answer(tiny_folder, tmp_path):
    """A cache directory that disappears (or a full disk) after the checks: the request still returns its tokens."""
    import shutil

    tf = fresh(tiny_folder, tmp_path / "gone")
    shutil.rmtree(tmp_path / "gone")
    (tmp_path / "gone").write_text("now a file")  # mkdir and mkstemp fail
    want = fresh(tiny_folder).generate(prompt(80), max_new_tokens=6, sampling=GREEDY, spec=AR)
    with pytest.warns(UserWarning, match="prompt cache not written"):
        got = tf.generate(prompt(80), max_new_tokens=6, sampling=GREEDY, spec=AR)
    assert got.token_ids == want.token_ids and got.stats.prompt_cache["stored"] is None


def test_concurrent_capped_stores_do_not_trip_over_each_others_deletions(tiny_folder, tmp_path):
    """Processes writing the same capped directory at once: no store fails because another deleted a file."""
    code = ("import sys, torch; from triforce.kv.promptcache import PromptCache;"
            "from triforce.kv.caches import FullKVCache;"
            "from triforce.formats.loading import load_model; cfg = load_model(sys.argv[1]).model.cfg;"
            "c = PromptCache(sys.argv[2], 'k', max_bytes=0); cache = FullKVCache(cfg, 40); cache.length = 40\n"
            "for i in range(60): c.store(cache, [int(sys.argv[3]) * 1000 + i] * 40)")
    procs = [subprocess.Popen([sys.executable, "-W", "error", "-c", code, tiny_folder, str(tmp_path), str(r)],
                              stderr=subprocess.PIPE, text=True) for r in range(3)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
