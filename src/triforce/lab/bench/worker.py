"""``triforce bench``: one worker subprocess per method (``python -m triforce.lab.bench.worker``) and the parent's
handle on it; line-based JSON over stdin/stdout."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from .methods import METHODS


# ---------------------------------------------------------------------------------------------------- workers
class Worker:
    """The parent's handle on one method's worker subprocess (line-based JSON over stdin/stdout).

    Its stderr goes to a log file, whose tail is quoted when the worker fails.
    """

    def __init__(self, method: str, config: dict, log_dir: str) -> None:
        self.method = method
        self.log_path = os.path.join(log_dir, f"{method}.log")
        self._log = open(self.log_path, "w")
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "triforce.lab.bench.worker", "--worker", method, "--config",
                                      json.dumps(config)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=env)

    def log_tail(self, lines: int = 3) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                tail = [x.strip() for x in f.read().strip().splitlines() if x.strip()][-lines:]
        except OSError:
            tail = []
        return " | ".join(tail)

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"worker exited with status {self.proc.returncode}: {self.log_tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def request(self, **msg) -> dict:
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # receive() reports the exit
        return self.receive()

    def close(self) -> dict:
        """Ask the worker to exit; returns its final report (peak memory), or ``{}`` if it is gone."""
        try:
            reply = self.request(cmd="exit")
        except (RuntimeError, ValueError):
            reply = {}
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()
        return reply

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()




def worker_main(method: str, config: str) -> int:
    """Body of ``python -m triforce.lab.bench.worker --worker METHOD --config JSON``: load once, answer requests, exit.

    Protocol (one JSON object per line; replies on the original stdout, everything else printed goes to stderr):
    the worker first sends ``{"ready": true, "load_seconds", "describe"}`` (or ``{"error"}``); then answers
    ``{"cmd": "encode", "text", "max_prompt_tokens"}`` with ``{"ids", "context"}``; ``{"cmd": "run", "ids",
    "new_tokens", "seed"}`` with ``{"tokens", "times", "stats"}`` (``times``: seconds since the call, one per
    token); ``{"cmd": "predict", "context", "acceptance", "reps"}`` with the cost model's figures; and
    ``{"cmd": "exit"}`` with ``{"peak_memory_bytes"}`` (``ru_maxrss``) before exiting. Any failure answers
    ``{"error": "..."}``.
    """
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints of libraries (C or Python) must not corrupt the protocol
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    cfg = json.loads(config)
    try:
        import torch

        if cfg.get("threads"):
            torch.set_num_threads(cfg["threads"])
        t = time.perf_counter()
        family = METHODS[method][0]
        from .runners import _HFRunner, _LlamaRunner, _OursRunner

        runner = {"ours": _OursRunner, "hf": _HFRunner, "llama": _LlamaRunner}[family](method, cfg)
        send({"ready": True, "load_seconds": round(time.perf_counter() - t, 3), "describe": runner.describe()})
    except Exception as e:  # reported to the parent as the method's failure reason
        send({"error": f"{type(e).__name__}: {e}"})
        return 1
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        try:
            if msg["cmd"] == "exit":
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                send({"peak_memory_bytes": int(peak if sys.platform == "darwin" else peak * 1024)})
                return 0
            if msg["cmd"] == "encode":
                from ...text.prompts import encode_prompt

                if runner.tokenizer is None:
                    raise ValueError("this worker has no tokenizer")
                ids = encode_prompt(runner.tokenizer, msg["text"], max_prompt_tokens=msg.get("max_prompt_tokens"))
                send({"ids": ids, "context": runner.context,
                      "dynamic_rope": bool(getattr(runner, "rope_dynamic", False))})
            elif msg["cmd"] == "run":
                send(runner.run(msg["ids"], msg["new_tokens"], msg["seed"]))
            elif msg["cmd"] == "predict":
                send(runner.predict(msg["context"], msg["acceptance"], msg.get("reps", 3)))
            else:
                send({"error": f"unknown command {msg['cmd']!r}"})
        except Exception as e:  # the parent records it as the method's failure
            send({"error": f"{type(e).__name__}: {e}"})
    return 0



def _worker_entry(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m triforce.lab.bench.worker")
    p.add_argument("--worker", required=True, choices=list(METHODS))
    p.add_argument("--config", required=True)
    a = p.parse_args(argv)
    return worker_main(a.worker, a.config)


if __name__ == "__main__":
    sys.exit(_worker_entry(sys.argv[1:]))
