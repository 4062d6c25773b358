"""How close each arithmetic is to the model a GGUF file's users run: ours with ``--precision file`` and ``exact``
against llama.cpp's own logits on the same file and tokens.

    python bench/loading/precision_fidelity.py ~/.cache/triforce/qwen2.5-coder/qwen-coder-1.5b.gguf \
        --book pg84.txt --tokens 512 --out bench/results/file_precision/fidelity_qwen15b_pg84.json

Reads ``--tokens`` tokens of a book (from character 20,000, past the front matter), runs one prefill of them with
our model in each precision (``load_model(..., precision=...)``, fp32 KV) and llama.cpp's (llama-cpp-python,
``logits_all``, f16 KV, its default), and writes per pair of the three: the share of positions whose argmax agrees
(top-1 agreement) and the mean KL divergence of the next-token distributions (nats, ``KL(first || second)``), and per
arithmetic the perplexity of the text's next tokens (exp of the mean negative log-likelihood over the positions 1..N-1,
computed here from each logits in float64; llama.cpp's ``llama-perplexity`` tool is not built by llama-cpp-python,
so its figure is computed the same way from llama.cpp's logits). llama.cpp is skipped (the JSON says why) where
llama-cpp-python is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from common import machine  # noqa: E402


def pair_stats(a: torch.Tensor, b: torch.Tensor) -> dict:
    """(N, V) logits a and b -> top-1 agreement and mean KL(softmax a || softmax b), float64."""
    la, lb = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
    kl = (la.exp() * (la - lb)).sum(-1)
    return {"top1_agree": round(float((a.argmax(-1) == b.argmax(-1)).double().mean()), 4),
            "mean_kl_nats": float(kl.mean()), "max_kl_nats": float(kl.max())}


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp(mean -log p(ids[i + 1] | ids[..i])) over i in [0, N - 1), float64."""
    lp = torch.log_softmax(logits[:-1].double(), -1)
    nll = -lp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return float(torch.exp(nll.mean()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf")
    p.add_argument("--tokens", type=int, default=512, help="tokens of the text (512)")
    p.add_argument("--book", default="pg84.txt", help="a book of ../shared/data/books (pg84.txt)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="JSON file (default: stdout only)")
    args = p.parse_args()
    if args.tokens < 2:
        p.error(f"--tokens must be >= 2, got {args.tokens}")
    torch.set_num_threads(args.threads)
    from triforce.formats.loading import load_model
    from triforce.kv.caches import FullKVCache

    text = (ROOT.parent / "shared" / "data" / "books" / args.book).read_text(encoding="utf-8", errors="replace")
    logits, ids = {}, None
    for precision in ("file", "exact"):
        lm = load_model(args.gguf, precision=precision)
        if ids is None:
            ids = lm.tokenizer(text[20000:20000 + 40 * args.tokens])["input_ids"][:args.tokens]
        with torch.no_grad():
            logits[precision] = lm.model(torch.tensor([ids]), torch.arange(len(ids)),
                                         FullKVCache(lm.model.cfg, len(ids)))[0].float()
        del lm
    skipped = None
    try:
        import numpy as np
        from llama_cpp import Llama

        llm = Llama(model_path=args.gguf, n_ctx=len(ids) + 8, n_batch=512, logits_all=True, n_threads=args.threads,
                    verbose=False)
        llm.eval(ids)
        logits["llama.cpp"] = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
        del llm
    except ImportError as e:
        skipped = f"llama-cpp-python is not installed ({e})"
    names = list(logits)
    out = {"gguf": os.path.basename(args.gguf), "book": args.book, "tokens": len(ids), "threads": args.threads,
           "perplexity": {n: round(perplexity(logits[n], ids), 4) for n in names},
           "pairs": {f"{a} vs {b}": pair_stats(logits[a], logits[b])
                     for i, a in enumerate(names) for b in names[i + 1:]},
           "llama.cpp_skipped": skipped, "machine": machine()}
    text_out = json.dumps(out, indent=1)
    print(text_out)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text_out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
