"""Peak memory and time of loading one model, as ``triforce.formats.loading.load_model`` does it for every entry point.

    python bench/loading/load_memory.py ~/.cache/triforce/qwen2.5-coder/qwen-coder-1.5b.gguf \
        --out bench/results/load_memory_qwen1.5b.json

Loads the model once in this process (fp32 unless ``--dtype``) and writes one JSON object: ``load_seconds`` (wall
clock), ``peak_rss_bytes`` (``ru_maxrss`` of this process: the checkpoint as transformers reads it, our conversion
and the model, at their largest together), ``weights_bytes`` (the model's own tensors) and their ratio. Used in
docs/history.md for the loader's peak (``Transformer.from_state_dict(consume=True)``), which decides whether two
1.5B fp32 workers of ``triforce bench`` fit in this machine's 24 GiB.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import emit_json  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a local Hugging Face folder or a .gguf file")
    p.add_argument("--dtype", default="float32", help="the weights' dtype (float32, bfloat16, float16)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="write the JSON there")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from triforce.formats.loading import load_model

    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=args.dtype)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    weights = sum(t.numel() * t.element_size() for t in loaded.model.state_dict().values())
    emit_json({"model": args.model, "dtype": args.dtype, "load_seconds": round(seconds, 1), "peak_rss_bytes": peak,
               "weights_bytes": weights, "peak_over_weights": round(peak / weights, 2)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
