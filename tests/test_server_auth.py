"""The server's API key (``--api-key``, ``$TRIFORCE_API_KEY``): every route but ``/health`` refused without it, with
OpenAI's error shape (checked with the official ``openai`` client against a server subprocess), never echoed."""

import os
import re
import subprocess
import sys
import time

import pytest

from servers import stop_server, wait_healthy
from support import clean_env


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
        wait_healthy(url, proc, log)  # open without a key
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
