"""A long document asked about twice by two `triforce generate` processes sharing a `--prompt-cache` directory.

    python bench/e2e/prompt_cache.py --chars 30000 --out bench/results/prompt_cache/smollm2_pg1342_7k.json

Writes the first ``--chars`` characters of ``--book`` (Project Gutenberg header and footer stripped) to a file, empties
``--cache-dir``, then runs, one after the other, ``triforce generate --prompt-file <document> --prompt <question>
--chat --prompt-cache <dir> --json`` for each ``--question``: the first prefills the document and writes its KV cache,
each later one loads it and prefills only its own question. Reports per run the process's wall seconds, the engine's
prefill seconds, tokens loaded from the cache and the file written or read (``stats.prompt_cache``), and the cache
file's size. Run it alone on the machine: it times whole processes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import emit_json  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model source (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--book", default="pg1342.txt", help="a book in triforce.lab.books.BOOKS_DIR")
    p.add_argument("--chars", type=int, default=30000, help="characters of the book the document keeps")
    p.add_argument("--question", action="append", default=None,
                   help="a question after the document (repeat; default: two questions)")
    p.add_argument("--cache-dir", default="/tmp/triforce-prompt-cache-bench", help="emptied first")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    questions = args.question or ["Who is Mr. Bingley?", "What does Mrs. Bennet want?"]

    from triforce.lab.books import BOOKS_DIR
    from triforce.text.prompts import strip_gutenberg

    cache = Path(args.cache_dir)
    shutil.rmtree(cache, ignore_errors=True)
    doc = cache.parent / (cache.name + "-document.txt")
    text = strip_gutenberg(open(f"{BOOKS_DIR}/{args.book}", encoding="utf-8").read())[:args.chars]
    doc.write_text(text, encoding="utf-8")
    runs = []
    for q in questions:
        cmd = [sys.executable, "-m", "triforce", "generate", "--prompt-file", str(doc), "--prompt", q, "--chat",
               "--prompt-cache", str(cache), "--max-new-tokens", str(args.max_new_tokens), "--temperature", "0",
               "--threads", str(args.threads), "--no-progress", "--json"]
        if args.model:
            cmd += ["--model", args.model]
        t = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t
        stats = json.loads(done.stdout)
        runs.append({"question": q, "wall_seconds": round(wall, 2), "prompt_tokens": stats["prompt_tokens"],
                     "prefill_seconds": stats["prefill_seconds"], "prompt_cache": stats["prompt_cache"],
                     "mean_time_between_tokens_ms": stats["mean_time_between_tokens_ms"]})
    files = {f.name: f.stat().st_size for f in cache.iterdir()}
    emit_json({"benchmark": "prompt_cache", "command": " ".join(["python", "bench/e2e/prompt_cache.py"] + sys.argv[1:]),
               "model": args.model or "embedded SmolLM2-135M-Instruct", "book": args.book, "chars": args.chars,
               "threads": args.threads, "runs": runs, "cache_files_bytes": files}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
