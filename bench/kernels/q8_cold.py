"""The file's arithmetic (``blockcode_linear_q8``) over one cold LM-head-sized matrix per GGUF type, against an
earlier build of csrc/blockcodes.c, interleaved.

    python bench/kernels/q8_cold.py --threads 2 --reps 15 \\
        --baseline-source <(git show b6b7fb8:src/triforce/kernels/csrc/blockcodes.c) \\
        --out bench/results/file_precision/q8_cold_prefetch.json

A (151,936 x 1,536) matrix of random Q4_K and one of Q6_K blocks (Qwen2.5-1.5B's LM head shape,
``tests/test_ggufcodes.random_blocks``; 135 and 250 MB, more than the L3 cache holds), one row, each call
reading the matrix from memory; GB/s = the codes' bytes (codes, scales, minima) per median second. With
``--baseline-source`` the same calls run on the kernel built from that file, interleaved with ours, and the outputs are
compared bitwise (a prefetch change must not change a value). JSON on stdout (and to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1] / "tests"))

import triforce  # noqa: E402,F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch  # noqa: E402

from common import machine  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--baseline-source", help="another csrc/blockcodes.c to build and time beside ours")
    p.add_argument("--out")
    args = p.parse_args()
    if args.threads < 1 or args.reps < 1:
        p.error("--threads and --reps must be >= 1")
    torch.set_num_threads(args.threads)
    from gguf import GGMLQuantizationType as QT

    from test_ggufcodes import random_blocks
    from triforce.formats.download import cache_dir
    from triforce.formats.ggufcodes import codes_from_gguf
    from triforce.kernels import blockcodes

    ours = blockcodes._blockcodes
    if ours.load() is None:
        p.error(f"block-code kernel: {ours.status}")
    libs = {"ours": ours}
    if args.baseline_source:
        src = Path(args.baseline_source)
        if not src.exists():
            p.error(f"--baseline-source: no such file {args.baseline_source!r}")
        copy = cache_dir() / "kernels" / "blockcodes_q8_baseline.c"  # a process substitution can be read only once
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(src.read_text())
        base = blockcodes._Library(str(copy), ours.switch, ours.cpu_needs, ours.flags, ours.symbols)
        if base.load() is None:
            p.error(f"--baseline-source: the kernel from {src} is {base.status}")
        libs["baseline"] = base
    out = {"matrix": [151936, 1536], "rows": 1, "threads": args.threads, "reps": args.reps,
           "baseline": args.baseline_source, "types": {}}
    x = torch.randn(1, 1536, generator=torch.Generator().manual_seed(0))
    for qtype in (QT.Q4_K, QT.Q6_K):
        codes = codes_from_gguf(random_blocks(qtype, 151936, 1536, seed=1), qtype, 1536)
        times: dict[str, list[float]] = {name: [] for name in libs}
        ys = {}
        for r in range(args.reps + 1):
            for name in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
                blockcodes._blockcodes = libs[name]
                try:
                    t = time.perf_counter()
                    ys[name] = blockcodes.blockcode_linear_q8(x, codes)
                    if r:  # the first round warms up
                        times[name].append(time.perf_counter() - t)
                finally:
                    blockcodes._blockcodes = ours
        row = {"mb": round(codes.nbytes / 1e6, 1)}
        for name, ts in times.items():
            med = statistics.median(ts)
            row[name] = {"median_ms": round(1000 * med, 3), "gb_per_s": round(codes.nbytes / med / 1e9, 1)}
        if "baseline" in libs:
            row["bitwise_equal"] = bool(torch.equal(ys["ours"], ys["baseline"]))
        out["types"][qtype.name] = row
    out["machine"] = machine()
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
