"""RMSNorm and RoPE in one C call each (``csrc/norm_rope.c``) against PyTorch's small ops, in whole forwards.

    python bench/kernels/norm_rope.py --contexts 256 8000 --rows 1 7 --reps 15 --threads 2 \
        --out bench/results/norm_rope.json

The embedded SmolLM2 (fp32) over a FullKVCache of random KV at each context: forwards of 1 token (an
autoregressive decode step) and 7 (a verification block), with ``kernels.rms_norm`` / ``kernels.rope`` (the
default) and with PyTorch's ops (the kernels patched out), interleaved, medians; the logits' largest difference
between the two. Every other kernel is the same in both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import add_run_options, emit_json, positive_int  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 8000])
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 7])
    add_run_options(p, "bench/results/norm_rope.json", reps=15, sampling=False)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from triforce.formats.loading import load_model
    from triforce.kernels import cpu as kernels
    from triforce.kv.caches import FullKVCache
    from triforce.lab.synthetic import fill_random_kv
    from triforce.model import transformer as model_module

    model = load_model(None).model
    on = {"rms_norm": kernels.rms_norm, "rope": kernels.rope}

    def use(kernel: bool) -> None:
        model_module.rms_norm = on["rms_norm"] if kernel else (lambda *a: None)
        kernels.rope = on["rope"] if kernel else (lambda *a: None)  # apply_rope calls it by name

    results = []
    gen = torch.Generator().manual_seed(0)
    for n in args.contexts:
        cache = FullKVCache(model.cfg, n + max(args.rows) + 1)
        fill_random_kv(cache, n)

        def forward(kernel: bool, ids: torch.Tensor) -> torch.Tensor:
            use(kernel)
            try:
                return model(ids, torch.arange(n, n + ids.shape[1]), cache, num_logits=ids.shape[1])
            finally:
                use(True)
                cache.rollback(n)

        for t in args.rows:
            ids = torch.randint(0, model.cfg.vocab_size, (1, t), generator=gen)
            diff = (forward(True, ids) - forward(False, ids)).abs().max().item()
            times = {True: [], False: []}
            for rep in range(args.reps):
                for kernel in ((True, False) if rep % 2 else (False, True)):
                    t0 = time.perf_counter()
                    forward(kernel, ids)
                    times[kernel].append(time.perf_counter() - t0)
            ours, torch_ms = (round(1e3 * statistics.median(times[k]), 2) for k in (True, False))
            results.append({"context": n, "tokens": t, "kernels_ms": ours, "pytorch_ops_ms": torch_ms,
                            "saved_ms": round(torch_ms - ours, 2), "speedup": round(torch_ms / ours, 3),
                            "max_logit_difference": diff})
    emit_json({"model": "SmolLM2-135M-Instruct", "threads": args.threads, "reps": args.reps,
               "norm_rope_kernel": kernels.norm_rope_status(), "results": results,
               "command": "python " + " ".join(sys.argv)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
