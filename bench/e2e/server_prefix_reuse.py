"""Time to first token of a second chat turn over a long document, through ``triforce serve``, with and without
the engine's prefix reuse.

The server runs in this process (uvicorn on a thread, the same app ``triforce serve`` builds) so that
``tf.engine.reuse_prefix`` can be switched between runs; the client is the official ``openai`` package, streaming,
and the time to first token (TTFT) is measured at the client, from sending the request to the first content chunk.

Scenario: turn 1 asks a question about the first N tokens of a book (default: Pride and Prejudice, 8,000 tokens);
turn 2 sends the whole history (document, question, the model's answer) plus a new question.

Runs, each on a fresh engine state:
  reuse:            reuse on (the default), turn 1 with ``--turn1-max-tokens`` of headroom
  no_reuse:         ``tf.engine.reuse_prefix = False``, same requests
  reuse_tight:      reuse on, but turn 1 asks for exactly as many tokens as its answer took, so the KV cache sized
                    for turn 1 (prompt + max_tokens + 1) is too small for turn 2 (see docs/server.md)

Usage:
    python bench/e2e/server_prefix_reuse.py [--doc-tokens 8000] [--threads 2] [--out results.json]
"""

import argparse
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import emit_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BOOK = os.path.join(HERE, "..", "..", "..", "shared", "data", "books", "pg1342.txt")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model source (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--book", default=BOOK)
    ap.add_argument("--doc-tokens", type=int, default=8000)
    ap.add_argument("--turn1-max-tokens", type=int, default=120)
    ap.add_argument("--turn2-max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--runs", default="reuse,no_reuse,reuse_tight")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()

    import openai
    import torch
    import uvicorn

    from triforce import TriForce
    from triforce.serve import ServerDefaults, create_app, model_id_for
    from triforce.text.prompts import strip_gutenberg

    if args.threads:
        torch.set_num_threads(args.threads)
    tf = TriForce.load(args.model)
    with open(args.book, encoding="utf-8") as f:
        text = strip_gutenberg(f.read())
    doc_ids = tf.tokenizer(text, add_special_tokens=False)["input_ids"][:args.doc_tokens]
    doc = tf.tokenizer.decode(doc_ids)
    q1 = "\n\nQuestion: who is Mr. Bennet's wife, in one sentence?"
    q2 = "And who is Elizabeth, in one sentence?"
    turn1 = [{"role": "user", "content": doc + q1}]

    model_id = model_id_for(args.model or tf.target.source)
    app = create_app(tf, ServerDefaults(model_id=model_id, temperature=0, max_tokens=args.turn1_max_tokens))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="unused",
                           max_retries=0, timeout=3600)

    def turn(messages, max_tokens):
        t0 = time.perf_counter()
        ttft, parts, stats, usage = None, [], None, None
        for chunk in client.chat.completions.create(model=model_id, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                stats = chunk.triforce
            if chunk.usage:
                usage = chunk.usage
        return {"ttft_s": round(ttft or float("nan"), 3), "total_s": round(time.perf_counter() - t0, 3),
                "text": "".join(parts), "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens, "finish_reason": stats["finish_reason"],
                "reused_prefix_tokens": stats["tiers"]["target"]["reused_prefix_tokens"],
                "prefill_s": stats["prefill_seconds"]}

    results = {"model": model_id, "doc_tokens": len(doc_ids), "threads": torch.get_num_threads(),
               "context": tf.target.model.cfg.max_position_embeddings, "runs": {}}
    answer_tokens = None
    for run in args.runs.split(","):
        tf.engine.reuse_prefix = run != "no_reuse"
        tf.engine.forget_prefix()  # start each run without a cache
        m1 = args.turn1_max_tokens if run != "reuse_tight" else answer_tokens
        if m1 is None:
            m1 = args.turn1_max_tokens
        r1 = turn(turn1, m1)
        answer_tokens = r1["completion_tokens"]
        turn2 = turn1 + [{"role": "assistant", "content": r1["text"]}, {"role": "user", "content": q2}]
        r2 = turn(turn2, args.turn2_max_tokens)
        results["runs"][run] = {"turn1_max_tokens": m1, "turn1": r1, "turn2": r2}
        print(f"{run:12s} turn 1: {r1['prompt_tokens']} prompt tokens, TTFT {r1['ttft_s']:.2f} s, "
              f"{r1['completion_tokens']} tokens ({r1['finish_reason']}); turn 2: {r2['prompt_tokens']} prompt tokens, "
              f"reused {r2['reused_prefix_tokens']}, TTFT {r2['ttft_s']:.2f} s (prefill {r2['prefill_s']:.2f} s)",
              file=sys.stderr, flush=True)
    texts = {r["turn2"]["text"] for r in results["runs"].values()}
    results["turn2_outputs_identical"] = len(texts) == 1
    server.should_exit = True
    thread.join(10)
    emit_json(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
