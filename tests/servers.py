"""Servers for the HTTP tests: a ``triforce serve`` subprocess, an app served by uvicorn on a thread of this process,
waiting on their health and reading their Prometheus metrics.

Every wait here ends on an event (a log line, a health answer, a predicate) and raises after a generous ``timeout``
in seconds, which guards against a hang and asserts nothing about speed."""

import contextlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from support import source_env

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")


def wait_until(predicate, what: str, timeout: float = 60.0, every: float = 0.02) -> None:
    """Poll ``predicate()`` until it is true; AssertionError ``what`` if it is still false after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(every)


def stop_server(proc) -> None:
    """Stop a ``triforce serve`` subprocess as Ctrl-C would (SIGINT), killing it after 15 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(url: str, proc=None, log=None, timeout: float = 90.0) -> None:
    """Wait until ``url/health`` answers 200; RuntimeError (with the log) if ``proc`` exits or ``timeout`` s pass."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{open(log).read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server not healthy after {timeout} s")


@contextlib.contextmanager
def server_process(folder: str, log: str, *options: str):
    """A ``triforce serve`` subprocess on ``folder`` with ``options``, its output in ``log``; yields
    ``(base URL, process)`` once healthy and stops it after."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "triforce.serve", "--model", folder, "--host", "127.0.0.1",
                                 "--port", "0", "--threads", "1", "--log-level", "warning", *options],
                                stdout=out, stderr=subprocess.STDOUT, env=source_env())
    try:
        url = None
        t0 = time.monotonic()
        while url is None and time.monotonic() - t0 < 90:
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", open(log).read())
            if m:
                url = m.group(1)
            elif proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{open(log).read()}")
            else:
                time.sleep(0.1)
        assert url, open(log).read()
        wait_healthy(url, proc, log)
        yield url, proc
    finally:
        stop_server(proc)


@contextlib.contextmanager
def serve_in_thread(app):
    """Run ``app`` with uvicorn on a thread of this process; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_healthy(url)
        yield url
    finally:
        srv.should_exit = True
        thread.join(10)
        sock.close()


def metric(url: str, name: str, labels: str = "") -> float:
    """The value of Prometheus sample ``name{labels}`` at ``url/metrics``; 0.0 when absent."""
    text = httpx.get(url + "/metrics", timeout=5).text
    m = re.search(r"^" + re.escape(name + (("{" + labels + "}") if labels else "")) + r" (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def is_idle(url: str) -> bool:
    """Whether the server runs no request and has none queued."""
    h = httpx.get(url + "/health", timeout=5).json()
    return not h["busy"] and h["queue_depth"] == 0


def wait_idle(url: str, timeout: float = 60.0) -> None:
    """Wait until the server runs no request and has none queued (AssertionError after ``timeout`` s)."""
    wait_until(lambda: is_idle(url), "server still busy", timeout)


def chat_ids(tf, messages) -> list[int]:
    """The prompt token ids of chat ``messages`` under ``tf``'s chat template, with the generation prompt."""
    ids = tf.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
