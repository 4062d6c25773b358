"""Tool calls on a real model through the server and the official ``openai`` client: does the model call the tool
when one fits, answer in text when none does, and do the calls parse and validate against the tools' schemas.

    python bench/e2e/tool_calls.py --model ~/.cache/triforce/qwen2.5-coder/qwen-coder-0.5b.gguf --threads 2 \
        --out bench/results/tools/qwen_coder_0.5b.json

``triforce serve``'s app runs in this process (uvicorn on a thread, greedy by default). Each question of
``QUESTIONS`` is asked with ``tools`` = ``TOOLS`` under ``tool_choice`` ``auto``, and those meant for a tool also under
``required``; reported per request: whether it returned ``tool_calls``, each call's name and whether its arguments
validate (``jsonschema``) against the tool's ``parameters``, the finish reason, ``auto``'s speculation and the time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import threading
import time

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import add_run_options, emit_json, positive_int  # noqa: E402

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount of money from one currency to another",
        "parameters": {"type": "object", "properties": {"amount": {"type": "number"},
                                                        "from": {"type": "string", "description": "ISO code"},
                                                        "to": {"type": "string", "description": "ISO code"}},
                       "required": ["amount", "from", "to"]}}},
]
#: (question, the tool it calls for or None)
QUESTIONS = [
    ("What's the weather like in Paris right now?", "get_weather"),
    ("Is it raining in Tokyo? Tell me in fahrenheit.", "get_weather"),
    ("How much is 250 US dollars in euros?", "convert_currency"),
    ("Convert 99.5 GBP to Japanese yen.", "convert_currency"),
    ("Write a Python function that reverses a string.", None),
    ("What is a linked list?", None),
]


@contextlib.contextmanager
def serving(app):
    """Base URL of ``app`` served by uvicorn on a thread of this process."""
    import httpx
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        time.sleep(0.2)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model whose chat template has Hermes tool calls (Qwen2.5)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    add_run_options(p, out=None, threads=2, sampling=False)
    args = p.parse_args()
    import jsonschema
    import openai
    import torch

    from triforce import TriForce
    from triforce.serve import ServerDefaults, create_app

    torch.set_num_threads(args.threads)
    app = create_app(TriForce.load(args.model), ServerDefaults(model_id="m", temperature=0))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rows = []
    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        for question, expected in QUESTIONS:
            for choice in ("auto", "required") if expected else ("auto",):
                t0 = time.perf_counter()
                r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}],
                                                   tools=TOOLS, tool_choice=choice, max_tokens=args.max_new_tokens)
                seconds = time.perf_counter() - t0
                message = r.choices[0].message
                calls = []
                for call in message.tool_calls or []:
                    arguments = json.loads(call.function.arguments)
                    valid = call.function.name in schemas
                    with contextlib.suppress(jsonschema.ValidationError):
                        valid = valid and jsonschema.validate(arguments, schemas[call.function.name]) is None
                    calls.append({"name": call.function.name, "arguments": arguments, "valid": valid})
                stats = r.triforce
                rows.append({"question": question, "expected_tool": expected, "tool_choice": choice, "calls": calls,
                             "content": message.content, "finish_reason": r.choices[0].finish_reason,
                             "seconds": round(seconds, 2), "completion_tokens": r.usage.completion_tokens,
                             "mode": stats.get("mode"), "tiers": stats.get("tiers")})
                got = [(c["name"], c["arguments"], c["valid"]) for c in calls] or repr((message.content or "")[:40])
                print(f"{choice:8s} {question[:48]:48s} -> {got} ({seconds:.1f} s)", flush=True)
    auto = [r for r in rows if r["tool_choice"] == "auto"]
    summary = {
        "auto_called_when_a_tool_fits": sum(bool(r["calls"]) for r in auto if r["expected_tool"]),
        "auto_questions_for_a_tool": sum(bool(r["expected_tool"]) for r in auto),
        "auto_text_when_none_fits": sum(not r["calls"] for r in auto if not r["expected_tool"]),
        "auto_questions_for_no_tool": sum(not r["expected_tool"] for r in auto),
        "right_tool": sum(bool(r["calls"]) and r["calls"][0]["name"] == r["expected_tool"] for r in rows),
        "calls": sum(len(r["calls"]) for r in rows),
        "valid_calls": sum(c["valid"] for r in rows for c in r["calls"]),
    }
    print(json.dumps(summary))
    emit_json({"model": args.model, "threads": args.threads, "summary": summary, "requests": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
