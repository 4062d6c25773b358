"""Serving through HTTP: throughput, time to first token (TTFT) and time between tokens (TBT) of concurrent
streaming clients, with continuous batching (``--max-batch 8``) against one request at a time (``--max-batch 1``).

    python bench/e2e/serving_http.py --threads 2 --out bench/results/serving_http.json

Each setting runs its own ``python -m triforce.serve`` subprocess (the default model unless ``--model``, the
server's default mode, T = 0.6 / top-p 0.9, every request its own seed), all started and warmed up with two
untimed requests before the measurements, which alternate between them: ``--reps`` interleaved repetitions (the
settings' order reversed every other one), each with fresh prompts, medians reported, and the throughput ratio
taken within each repetition. The clients are threads of this process
streaming ``/v1/completions`` with raw token-id prompts (distinct slices of a book, so no request reuses another's
prefix). Times are taken at the client: TTFT from sending the request to its first content chunk, TBT between a
stream's consecutive content chunks (one chunk per token).

Scenarios, run for each ``--max-batch`` setting:

* ``concurrent``: N clients (``--clients``, default 1 2 4 8) send a ``--prompt-tokens`` prompt (2,000) at once and
  stream ``--new-tokens`` (64); total throughput = all completion tokens / wall time from the first request sent
  to the last stream's end, prefill included.
* ``long_arrival``: 3 clients stream 96 tokens after 500-token prompts; once each has its first token, a fourth
  client sends a ``--long-tokens`` prompt (4,000). Reported: the long request's TTFT, and the running streams' TBT
  while it is prefilled (from its arrival to its first token): with batching its 512-token prefill chunks share
  forwards with their decode steps (chunked prefill), one at a time it waits for them.

* ``choices``: one request for ``--choices`` samples (``n``, 4) of a ``--prompt-tokens`` prompt, against one request
  for one sample of another prompt as long (non-streamed, fresh prompts, ``--new-tokens`` each): ``n`` samples
  share one prefill and decode as a batch, so ``choices_over_one`` (the wall times' ratio) is what the extra samples
  cost; ``llama.cpp`` does not run it.

``--scenarios concurrent`` runs the first only. ``--llama-server GGUF`` adds llama.cpp's OpenAI-compatible server
(``python -m llama_cpp.server``, llama-cpp-python's, which runs one request at a time) on that file as a setting of
its own, sent the same prompts as text (it is not sent token ids); ``vs_llama_cpp`` is then the first
``--max-batch`` setting's throughput over its, within each repetition.

Prints JSON (and writes ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import emit_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "..", "src")


def percentile(xs: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of xs, nearest rank; None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


class Server:
    """A ``triforce serve`` subprocess on a free port (or, with ``gguf``, llama-cpp-python's server on that file);
    ``url`` and ``model_id`` once healthy; ``text``: whether it is sent text prompts rather than token ids."""

    def __init__(self, args, max_batch: int, log: str, gguf: str | None = None) -> None:
        import socket

        import httpx

        env = dict(os.environ, PYTHONPATH=os.path.abspath(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.text = gguf is not None
        if gguf:
            with socket.socket() as sock:  # a free port (llama_cpp.server does not print the one it took)
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_threads", str(args.threads),
                   "--n_threads_batch", str(args.threads), "--n_ctx", "8192", "--port", str(port), "--host",
                   "127.0.0.1", "--verbose", "False", "--interrupt_requests", "False"]  # queued, not interrupted
        else:
            cmd = [sys.executable, "-m", "triforce.serve", "--port", "0", "--threads", str(args.threads),
                   "--max-batch", str(max_batch), "--log-level", "warning", "--queue-size", "64",
                   "--temperature", str(args.temperature), "--top-p", str(args.top_p)]
            if args.model:
                cmd += ["--model", args.model]
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        t0, self.url = time.monotonic(), None
        while time.monotonic() - t0 < 300:
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", open(log).read())
            url = f"http://127.0.0.1:{port}" if gguf else m and m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(open(log).read())
            if url:
                try:
                    models = httpx.get(url + "/v1/models", timeout=2)
                    if models.status_code == 200:
                        self.url, self.model_id = url, models.json()["data"][0]["id"]
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise RuntimeError("server not healthy:\n" + open(log).read())

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


SAMPLING = {}  # temperature and top_p of every request (main)
DECODE = [None]  # token ids -> text, for the servers sent text (main)


def stream(server: Server, prompt: list[int], max_tokens: int, seed: int, out: dict,
           started: threading.Event | None = None):
    """Stream one completion; fills ``out`` with ``sent``, ``times`` (each content chunk's arrival), ``tokens``."""
    import httpx

    body = {"model": server.model_id, "prompt": DECODE[0](prompt) if server.text else prompt, "max_tokens": max_tokens,
            "stream": True, "seed": seed, "stream_options": {"include_usage": True}, **SAMPLING}
    out["sent"], out["times"], out["tokens"] = time.monotonic(), [], None
    with httpx.Client(timeout=600) as h:
        with h.stream("POST", server.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                out["error"] = f"{r.status_code}: {r.read()[:200]!r}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    out["times"].append(time.monotonic())
                    if started is not None:
                        started.set()
    out["end"] = time.monotonic()


def run_clients(server: Server, prompts: list[list[int]], max_tokens: int, seed: int) -> dict:
    outs = [{} for _ in prompts]
    threads = [threading.Thread(target=stream, args=(server, p, max_tokens, seed + i, o)) for i, (p, o) in
               enumerate(zip(prompts, outs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        raise RuntimeError(errors)
    t0, t1 = min(o["sent"] for o in outs), max(o["end"] for o in outs)
    ttft = [o["times"][0] - o["sent"] for o in outs if o["times"]]
    tbt = [b - a for o in outs for a, b in zip(o["times"], o["times"][1:])]
    tokens = sum(o["tokens"] or len(o["times"]) for o in outs)
    return {"clients": len(prompts), "tokens": tokens, "seconds": t1 - t0, "tokens_per_second": tokens / (t1 - t0),
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "tbt_p50": percentile(tbt, 0.5), "tbt_p99": percentile(tbt, 0.99)}


def choices(server: Server, prompt: list[int], n: int, max_tokens: int, seed: int) -> dict:
    """One non-streamed request for ``n`` samples: its wall time, tokens, and each choice's reused prefix."""
    import httpx

    body = {"model": server.model_id, "prompt": prompt, "max_tokens": max_tokens, "seed": seed, "n": n, **SAMPLING}
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=600).json()
    seconds = time.monotonic() - t0
    stats = r["triforce"].get("choices", [r["triforce"]])
    return {"n": n, "seconds": seconds, "tokens": r["usage"]["completion_tokens"],
            "prefill_seconds": stats[0]["prefill_seconds"],
            "reused_prefix_tokens": [s["tiers"]["target"].get("reused_prefix_tokens") for s in stats]}


def long_arrival(server: Server, short: list[list[int]], long: list[int], seed: int) -> dict:
    outs = [{} for _ in short]
    firsts = [threading.Event() for _ in short]
    threads = [threading.Thread(target=stream, args=(server, p, 96, seed + i, o, e)) for i, (p, o, e) in
               enumerate(zip(short, outs, firsts))]
    for t in threads:
        t.start()
    for e in firsts:
        e.wait(600)
    lout: dict = {}
    lt = threading.Thread(target=stream, args=(server, long, 16, seed + 99, lout))
    lt.start()
    for t in threads + [lt]:
        t.join()
    arrive, first = lout["sent"], lout["times"][0]
    during = [b - a for o in outs for a, b in zip(o["times"], o["times"][1:]) if b > arrive and a < first]
    ran = [o for o in outs if o["times"] and o["times"][-1] > arrive]
    return {"long_prompt_tokens": len(long), "long_ttft": first - arrive,
            "streams_running_at_arrival": len(ran),
            "streams_tokens_during_long_prefill": sum(1 for o in outs for t in o["times"] if arrive < t < first),
            "streams_tbt_during_prefill_p50": percentile(during, 0.5),
            "streams_tbt_during_prefill_max": max(during) if during else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model source (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--book", default=os.path.join(HERE, "..", "..", "..", "shared", "data", "books", "pg1342.txt"))
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--long-tokens", type=int, default=4000)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--max-batch", type=int, nargs="+", default=[8, 1])
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions (medians reported)")
    p.add_argument("--scenarios", nargs="+", default=["concurrent", "long_arrival"],
                   choices=["concurrent", "long_arrival", "choices"])
    p.add_argument("--choices", type=int, default=4, help="samples of the choices scenario's request (n)")
    p.add_argument("--llama-server", metavar="GGUF", help="add llama-cpp-python's server on this GGUF file")
    p.add_argument("--out")
    args = p.parse_args()
    SAMPLING.update(temperature=args.temperature, top_p=args.top_p)
    sys.path.insert(0, SRC)
    from transformers import AutoTokenizer

    from triforce.formats.download import default_model_dir
    from triforce.text.prompts import strip_gutenberg

    tok = AutoTokenizer.from_pretrained(args.model or str(default_model_dir()))  # a local folder
    DECODE[0] = tok.decode
    with open(args.book, encoding="utf-8") as f:
        ids = tok(strip_gutenberg(f.read()), add_special_tokens=False)["input_ids"]
    cursor = [0]

    def take(n: int) -> list[int]:
        out = ids[cursor[0]:cursor[0] + n]
        cursor[0] += n
        if len(out) < n:
            raise SystemExit(f"--book has too few tokens for the prompts asked ({len(ids)})")
        return out

    n = args.prompt_tokens

    def new_plan() -> dict:  # fresh prompts for each repetition: no request reuses another's prefix
        return {"concurrent": [[take(n) for _ in range(c)] for c in args.clients],
                "short": [take(500) for _ in range(3)], "long": take(args.long_tokens),
                "choices": [take(n), take(n)] if "choices" in args.scenarios else None}

    result = {"machine": {"threads": args.threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")},
              "prompt_tokens": n, "new_tokens": args.new_tokens, "temperature": args.temperature,
              "top_p": args.top_p, "reps": args.reps, "settings": {}}
    servers = {}
    names = [str(mb) for mb in args.max_batch] + (["llama.cpp"] if args.llama_server else [])
    runs = {name: {"concurrent": {c: [] for c in args.clients}, "long_arrival": [], "choices": []} for name in names}
    try:
        for name in names:  # all loaded up front; an idle server sleeps
            gguf = args.llama_server if name == "llama.cpp" else None
            servers[name] = Server(args, 1 if gguf else int(name), f"/tmp/triforce_serving_http_{name}.log", gguf)
            warm = take(n)  # warm-up, not timed: a fresh server's first requests run slower
            run_clients(servers[name], [warm, warm[:300]], 8, args.seed)
        for rep in range(args.reps):
            plan = new_plan()
            order = names if rep % 2 == 0 else list(reversed(names))  # interleaved
            for c, prompts in zip(args.clients, plan["concurrent"]) if "concurrent" in args.scenarios else ():
                for name in order:
                    row = run_clients(servers[name], prompts, args.new_tokens, args.seed + rep)
                    runs[name]["concurrent"][c].append(row)
                    print(f"rep {rep} {name}: {row}", file=sys.stderr, flush=True)
            for name in order if "long_arrival" in args.scenarios else []:
                arrival = long_arrival(servers[name], plan["short"], plan["long"], args.seed + rep)
                runs[name]["long_arrival"].append(arrival)
                print(f"rep {rep} {name}: {arrival}", file=sys.stderr, flush=True)
            for name in [x for x in order if x != "llama.cpp"] if "choices" in args.scenarios else []:
                one, many = (choices(servers[name], prompt, k, args.new_tokens, args.seed + rep)
                             for prompt, k in zip(plan["choices"], (1, args.choices)))
                runs[name]["choices"].append({"one": one, "choices": many,
                                              "choices_over_one": many["seconds"] / one["seconds"]})
                print(f"rep {rep} {name}: {runs[name]['choices'][-1]}", file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.close()

    def medians(rows: list[dict]) -> dict:
        return {k: statistics.median(r[k] for r in rows) if isinstance(rows[0][k], (int, float)) else rows[0][k]
                for k in rows[0]} if rows else {}

    for name in names:
        arrivals = runs[name]["long_arrival"]
        result["settings"][name] = {
            "concurrent": [dict(medians(rows), runs=rows) for rows in runs[name]["concurrent"].values()],
            "long_arrival": dict(medians(arrivals), runs=arrivals) if arrivals else None,
            "choices": {"choices_over_one": statistics.median(r["choices_over_one"] for r in runs[name]["choices"]),
                        "runs": runs[name]["choices"]} if runs[name]["choices"] else None}

    def ratio(a: str, b: str) -> dict:  # throughput of setting a over b's, within each repetition
        return {str(c): statistics.median(x["tokens_per_second"] / y["tokens_per_second"]
                                          for x, y in zip(runs[a]["concurrent"][c], runs[b]["concurrent"][c]))
                for c in args.clients}

    if len(args.max_batch) == 2 and "concurrent" in args.scenarios:
        result["throughput_ratio"] = ratio(*names[:2])
    if args.llama_server and "concurrent" in args.scenarios:
        result["vs_llama_cpp"] = ratio(names[0], "llama.cpp")
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
