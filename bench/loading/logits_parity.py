"""Our forward against transformers' on a GGUF file: the loader and the model agree on a real checkpoint.

    python bench/loading/logits_parity.py ~/.cache/triforce/qwen2.5-coder/qwen-coder-0.5b.gguf [--tokens 200]

Reads the first ``--tokens`` tokens of a book (from character 5,000 of pg1342 by default), runs our model
(``triforce.formats.loading.load_model``, fp32, one prefill over a full KV cache) and transformers'
(``from_pretrained`` with ``gguf_file=``, fp32), and prints one JSON line: the largest absolute difference of the logits
and the share of positions whose argmax agrees. Used in docs/history.md to rule out a loading error behind a low
acceptance.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--book", default=str(ROOT.parent / "shared" / "data" / "books" / "pg1342.txt"))
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from triforce.formats.loading import load_model
    from triforce.kv.caches import FullKVCache

    lm = load_model(args.gguf)
    text = Path(args.book).read_text(encoding="utf-8", errors="replace")[5000:5000 + 40 * args.tokens]
    ids = lm.tokenizer(text)["input_ids"][:args.tokens]
    ours = lm.model(torch.tensor([ids]), torch.arange(len(ids)), FullKVCache(lm.model.cfg, len(ids)))[0]
    del lm
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(args.gguf)),
                                              gguf_file=os.path.basename(args.gguf), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    print(json.dumps({"gguf": args.gguf, "tokens": len(ids), "max_abs_diff": float((ours - ref).abs().max()),
                      "argmax_agree": float((ours.argmax(-1) == ref.argmax(-1)).float().mean())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
