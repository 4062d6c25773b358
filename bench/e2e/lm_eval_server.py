"""lm-evaluation-harness through ``triforce serve`` against the same harness on transformers: the same scores.

    python bench/e2e/lm_eval_server.py --items 100 --threads 2 --out bench/results/lm_eval/book_cloze_smollm2.json

The harness scores multiple-choice tasks with loglikelihood requests: ``/v1/completions`` with ``echo: true``,
``logprobs: 1``, ``max_tokens: 0`` (its ``local-completions`` model, token-id prompts, the model's tokenizer). No
network here, so the task is local: ``book_cloze``, built from a book (pg1342 by default) as LAMBADA is from
novels: ``--items`` passages of about 150 tokens, each ending before a word of at least 4 letters; the choices are
that word and 3 other words of 4 letters or more from the same passage (so every choice fits its topic), the
answer the word the text has (a fixed seed). The
task's YAML and JSONL are written to a temporary folder that the harness includes.

Runs, in this process, ``lm_eval.simple_evaluate`` twice: ``local-completions`` against a ``triforce serve``
subprocess (the default model unless ``--model``, ``--max-batch 1``), and ``hf`` on the same weights (the model
folder, fp32). Reported: each accuracy, the number of items whose chosen answer differs, and the largest difference
of a choice's log-likelihood between the two. JSON on stdout (and to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from serving_http import Server  # noqa: E402

from common import emit_json, positive_int  # noqa: E402

TASK_YAML = """task: book_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


def build_items(text: str, tokenizer, n: int, seed: int) -> list[dict]:
    """``n`` cloze items from ``text`` (module docstring)."""
    rng = random.Random(seed)
    items, spans = [], [m for m in re.finditer(r"(?<=\s)([A-Za-z]{4,})(?=[\s.,;!?])", text)]
    for m in rng.sample(spans[200:], 4 * n):
        context = text[max(0, m.start() - 700):m.start()].rstrip()
        context = context[context.find(" ") + 1:]  # start at a word
        if len(tokenizer(context)["input_ids"]) < 60:
            continue
        answer = m.group(1)
        pool = sorted({w for w in re.findall(r"[A-Za-z]{4,}", context) if w.lower() != answer.lower()})
        if len(pool) < 3:
            continue
        choices = rng.sample(pool, 3) + [answer]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "label": choices.index(answer)})
        if len(items) == n:
            break
    return items


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder or GGUF file (default: the embedded SmolLM2-135M-Instruct); a GGUF "
                   "file's tokenizer is saved to a folder for the harness, and transformers dequantizes it")
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--book", default=os.path.join(here, "..", "..", "..", "shared", "data", "books", "pg1342.txt"))
    p.add_argument("--items", type=positive_int, default=100)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from triforce.formats.download import default_model_dir
    from triforce.text.prompts import strip_gutenberg

    folder = args.model or str(default_model_dir())
    gguf = os.path.basename(folder) if folder.endswith(".gguf") else None
    if gguf:
        folder = os.path.dirname(os.path.abspath(folder))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    with open(args.book, encoding="utf-8") as f:
        items = build_items(strip_gutenberg(f.read()), tokenizer, args.items, args.seed)
    tmp = tempfile.mkdtemp(prefix="triforce_lm_eval_")
    data = os.path.join(tmp, "book_cloze.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(item) + "\n" for item in items)
    with open(os.path.join(tmp, "book_cloze.yaml"), "w", encoding="utf-8") as f:
        f.write(TASK_YAML.format(data=data))
    tasks = TaskManager(include_path=tmp)
    tokenizer_folder = folder
    if gguf:  # the harness's tokenizer= takes a folder
        tokenizer_folder = os.path.join(tmp, "tokenizer")
        tokenizer.save_pretrained(tokenizer_folder)

    def evaluate(model: str, model_args: str) -> dict:
        out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["book_cloze"], task_manager=tasks,
                                      log_samples=True, batch_size=1)
        samples = sorted(out["samples"]["book_cloze"], key=lambda s: s["doc_id"])
        return {"acc": out["results"]["book_cloze"]["acc,none"],
                "logliks": [[r[0] for r in s["filtered_resps"]] for s in samples]}

    server_args = argparse.Namespace(threads=args.threads, temperature=0.0, top_p=1.0, model=args.model)
    server = Server(server_args, 1, "/tmp/triforce_lm_eval_server.log")
    try:
        ours = evaluate("local-completions", f"model={server.model_id},base_url={server.url}/v1/completions,"
                                             f"tokenizer_backend=huggingface,tokenizer={tokenizer_folder},num_concurrent=1,"
                                             "max_retries=1,tokenized_requests=True")
    finally:
        server.close()
    hf = evaluate("hf", f"pretrained={folder},dtype=float32,device=cpu" + (f",gguf_file={gguf}" if gguf else ""))
    pick = [max(range(len(x)), key=x.__getitem__) for x in ours["logliks"]]
    pick_hf = [max(range(len(x)), key=x.__getitem__) for x in hf["logliks"]]
    diff = max(abs(a - b) for xs, ys in zip(ours["logliks"], hf["logliks"]) for a, b in zip(xs, ys))
    emit_json({"task": "book_cloze", "book": os.path.basename(args.book), "items": len(items), "choices": 4,
               "model": args.model or folder, "triforce_serve_acc": ours["acc"], "transformers_acc": hf["acc"],
               "items_choosing_differently": sum(a != b for a, b in zip(pick, pick_hf)),
               "max_abs_loglikelihood_difference": diff, "lm_eval_version": lm_eval.__version__}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
