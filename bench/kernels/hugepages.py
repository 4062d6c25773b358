"""Does the verifier's decode step read its KV cache faster from 2 MiB pages? (issue 11, item 2: decode at its floor)

A decode step at 8K tokens streams about 369 MB of keys and values of the embedded SmolLM2 (plus 100 MB of
weights) through 4 KiB pages on this project's machine: transparent huge pages are on for ``madvise`` only
(``/sys/kernel/mm/transparent_hugepage/enabled``), and PyTorch's CPU allocator asks for them only with
``THP_MEM_ALLOC_ENABLE=1``. Fewer TLB misses could shorten the stream. In one process, two full KV caches of the
same context hold the same random keys and values (``triforce.lab.synthetic.fill_random_kv``), one allocated as
PyTorch does, one whose buffers were given ``madvise(MADV_HUGEPAGE)`` before their first write (so the kernel backs
them with 2 MiB pages where it can); decode steps over the two alternate, rolled back after each.

    OMP_WAIT_POLICY=PASSIVE python bench/kernels/hugepages.py --context 8000 --reps 40 --threads 2 \
        --out bench/results/hugepages_8000_2026-12-04.json

JSON on stdout (and to ``--out``): the median step over each cache (ms), their ratio, and the process's
``AnonHugePages`` (how much memory the kernel really backed with huge pages). Linux only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import add_run_options, emit_json  # noqa: E402

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <linux/mman.h>


def _huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros of ``shape`` in a buffer aligned to 2 MiB and advised MADV_HUGEPAGE before the first write."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # not touched yet: no page is backed
    start = -(-raw.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    if libc.madvise(start, nbytes // HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")
    off = start - raw.data_ptr()
    out = raw[off:off + nbytes].view(dtype).view(shape)
    out.zero_()
    return out


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=8000, help="tokens in the KV cache (8000)")
    add_run_options(p, None, reps=40, sampling=False)
    args = p.parse_args()

    from triforce.api import TriForce
    from triforce.kv.caches import FullKVCache
    from triforce.lab.synthetic import fill_random_kv

    tf = TriForce.load(threads=args.threads)
    model, n = tf.engine.target, args.context
    before = _anon_huge_kib()
    caches = {}
    for name in ("4k_pages", "huge_pages"):
        cache = FullKVCache(model.cfg, n + 16)
        if name == "huge_pages":
            cache.k, cache.v = _huge_zeros(tuple(cache.k.shape), cache.k.dtype), _huge_zeros(tuple(cache.v.shape),
                                                                                             cache.v.dtype)
        fill_random_kv(cache, n, 0)
        caches[name] = cache
    ids, pos = torch.tensor([[42]]), torch.tensor([n])
    times: dict[str, list[float]] = {name: [] for name in caches}
    for r in range(args.reps + 2):  # the first two rounds are warm-up
        for name in (list(caches) if r % 2 == 0 else list(caches)[::-1]):
            t0 = time.perf_counter()
            model(ids, pos, caches[name])
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
            caches[name].rollback(n)
    med = {name: round(1000 * statistics.median(v), 3) for name, v in times.items()}
    kv_mib = 2 * caches["4k_pages"].k.numel() * 4 / 2**20
    emit_json({"context": n, "threads": args.threads, "reps": args.reps, "kv_cache_mib_each": round(kv_mib, 1),
               "median_step_ms": med, "huge_over_4k": round(med["huge_pages"] / med["4k_pages"], 4),
               "anon_huge_pages_mib": round((_anon_huge_kib() - before) / 1024, 1),
               "steps_ms": {name: [round(1000 * t, 2) for t in v] for name, v in times.items()}}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
