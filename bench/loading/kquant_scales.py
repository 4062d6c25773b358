"""K-quant scales kept as the file stores them (int8 per group, fp16 per 256 inputs) against fp32 products per group.

    python bench/loading/kquant_scales.py --model ~/.cache/triforce/qwen2.5-coder/qwen-coder-1.5b.gguf \
        --threads 2 --runs 2 --reps 11 --base 69ebf7a --out bench/results/gguf/kquant_scales_qwen15b.json
    python bench/loading/kquant_scales.py --model ~/.cache/triforce/qwen2.5-coder/qwen-coder-1.5b.gguf \
        --threads 2 --reps 41 --products-only --out bench/results/gguf/kquant_scales_products_qwen15b.json

``before`` is this tree with ``src/triforce/{blockcodes.py,ggufcodes.py,csrc/blockcodes.c}`` as at ``--base`` (HEAD
by default; the commit before ``BC_KS``: fp32 ``d sc`` and ``-(dmin mc)`` per group, ``BC_F32``), imported from a
copy; ``after`` is this tree (``BC_KS``). For each, ``--runs`` fresh processes, alternated: ``TriForce.load(model)``,
then 16 greedy tokens in autoregressive mode after a ``--prompt-tokens`` prompt (the first tokens of Python's
``textwrap`` source); each reports its peak RSS (``ru_maxrss``), the bytes of the model's coded products (every
Linear's ``codes.nbytes``) and the tokens, which must agree. Then (alone with ``--products-only``), in this process
over the ``after`` model, every product of a decode step (one row, each Linear's codes once, in order) with the stored
scales and with the same codes as fp32 scales (``promoted``: the ``before`` layout), interleaved, ``--reps`` sweeps
each, medians, outputs compared bitwise. JSON on stdout (and to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FILES = ("src/triforce/kernels/blockcodes.py", "src/triforce/formats/ggufcodes.py",
         "src/triforce/kernels/csrc/blockcodes.c")


def child(model: str, threads: int, prompt_tokens: int, new_tokens: int) -> None:
    """One load and generation; prints a JSON line."""
    import inspect
    import resource
    import textwrap

    import triforce
    from triforce import SamplingParams, SpeculationConfig, TriForce
    from triforce.model.transformer import Linear

    t0 = time.perf_counter()
    tf = TriForce.load(model, threads=threads)
    load_s = time.perf_counter() - t0
    model_obj = tf.target.model
    coded = sum(m.codes.nbytes for m in model_obj.modules() if isinstance(m, Linear) and m.codes is not None)
    rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ids = tf.encode(inspect.getsource(textwrap) * 4)[:prompt_tokens]
    t0 = time.perf_counter()
    out = tf.generate(ids, max_new_tokens=new_tokens, sampling=SamplingParams(temperature=0),
                      spec=SpeculationConfig(mode="autoregressive"))
    gen_s = time.perf_counter() - t0
    print(json.dumps({"triforce": triforce.__file__, "coded_bytes": coded, "weight_bytes": model_obj.weight_bytes(),
                      "peak_rss_after_load": rss_load,
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "prompt_tokens": len(ids), "tokens": list(out.token_ids), "load_s": load_s, "generate_s": gen_s}))


def before_tree(base: str) -> Path:
    """A copy of this tree's src/ with FILES as at ``base``."""
    root = Path(tempfile.mkdtemp(prefix="kquant_before_"))
    shutil.copytree(REPO / "src", root / "src", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for f in FILES:
        text = subprocess.run(["git", "show", f"{base}:{f}"], cwd=REPO, check=True, capture_output=True).stdout
        (root / f).write_bytes(text)
    return root / "src"


def product_sweeps(model: str, threads: int, reps: int) -> dict:
    """Every Linear's one-row product, stored K-quant scales against their fp32 products, interleaved."""
    import torch

    from triforce import TriForce
    from triforce.kernels.blockcodes import blockcode_linear
    from triforce.model.transformer import Linear

    torch.set_num_threads(threads)
    tf = TriForce.load(model, threads=threads)
    ours = [m.codes for m in tf.target.model.modules() if isinstance(m, Linear) and m.codes is not None]
    fp32 = [c.promoted(c.bits, True, c.group, c.m is not None) if c.d_super is not None else c for c in ours]
    gen = torch.Generator().manual_seed(0)
    xs = {n: torch.randn(1, n, generator=gen) for n in {c.in_features for c in ours}}
    sets = {"after": ours, "before": fp32}

    def sweep(cs):
        return [blockcode_linear(xs[c.in_features], c) for c in cs]

    equal = all(torch.equal(a, b) for a, b in zip(sweep(ours), sweep(fp32)))
    times = {k: [] for k in sets}
    for r in range(reps):
        for k in (("after", "before") if r % 2 else ("before", "after")):
            t0 = time.perf_counter()
            sweep(sets[k])
            times[k].append(time.perf_counter() - t0)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"matrices": len(ours), "bitwise_equal": equal,
            "bytes": {k: sum(c.nbytes for c in v) for k, v in sets.items()},
            "kernel_bits": sorted({c.kernel_bits for c in ours}),
            "step_ms": ms, "step_ms_all": {k: [t * 1e3 for t in v] for k, v in times.items()},
            "speedup": ms["before"] / ms["after"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=2, help="processes per variant (alternated)")
    p.add_argument("--reps", type=int, default=11, help="product sweeps per variant (interleaved)")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--base", default="HEAD", help="the commit whose FILES make the 'before' variant")
    p.add_argument("--products-only", action="store_true", help="only the in-process product sweeps")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args()
    if args.child:
        child(args.model, args.threads, args.prompt_tokens, args.new_tokens)
        return 0
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    if args.products_only:
        result = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "commit": commit,
                  "model": os.path.basename(args.model), "threads": args.threads,
                  "note": "2 CPU cores shared with other work while it ran",
                  "products": product_sweeps(args.model, args.threads, args.reps)}
        text = json.dumps(result, indent=1)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return 0
    before_src = before_tree(args.base)
    runs: dict[str, list] = {"before": [], "after": []}
    try:
        for r in range(args.runs):
            for variant in (("before", "after") if r % 2 == 0 else ("after", "before")):
                env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
                src = before_src if variant == "before" else REPO / "src"
                env["PYTHONPATH"] = str(src) + os.pathsep + env.get("PYTHONPATH", "")
                cmd = [sys.executable, __file__, "--child", "--model", args.model, "--threads", str(args.threads),
                       "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
                res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                rec = json.loads(res.stdout.strip().splitlines()[-1])
                if not rec["triforce"].startswith(str(src)):
                    raise RuntimeError(f"{variant}: imported {rec['triforce']}, not from {src}")
                runs[variant].append(rec)
                print(variant, {k: v for k, v in rec.items() if k != "tokens"}, file=sys.stderr)
    finally:
        shutil.rmtree(before_src.parent, ignore_errors=True)
    med = lambda v, k: statistics.median(r[k] for r in runs[v])  # noqa: E731
    tokens = {v: [r["tokens"] for r in runs[v]] for v in runs}
    result = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "commit": commit, "base": args.base,
        "model": os.path.basename(args.model), "threads": args.threads,
        "note": "2 CPU cores shared with other work while it ran",
        "coded_bytes": {v: med(v, "coded_bytes") for v in runs},
        "weight_bytes": {v: med(v, "weight_bytes") for v in runs},
        "peak_rss": {v: med(v, "peak_rss") for v in runs},
        "peak_rss_after_load": {v: med(v, "peak_rss_after_load") for v in runs},
        "peak_rss_all": {v: [r["peak_rss"] for r in runs[v]] for v in runs},
        "generate_s": {v: med(v, "generate_s") for v in runs},
        "tokens_equal": all(t == tokens["before"][0] for v in tokens for t in tokens[v]),
        "tokens": tokens["after"][0],
        "products": product_sweeps(args.model, args.threads, args.reps),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
