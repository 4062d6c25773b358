"""What the benchmark scripts share: the options every timed run takes (defaults from ``triforce.defaults``),
writing the JSON result (with the machine it was measured on), interleaved timing, and the machine's two ceilings
(the large-GEMV bandwidth and the large-GEMM FLOP rate)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from triforce.defaults import DEFAULTS


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (row counts, repetitions, threads, contexts), refused before any model loads."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def add_prompt_options(p: argparse.ArgumentParser, prompt_tokens: int, new_tokens: int, book: str = "pg1342") -> None:
    """Add ``--book`` (a name in the books folder or a path), ``--prompt-tokens`` and ``--new-tokens`` (tokens)."""
    p.add_argument("--book", default=book)
    p.add_argument("--prompt-tokens", type=int, default=prompt_tokens)
    p.add_argument("--new-tokens", type=int, default=new_tokens)


def add_run_options(p: argparse.ArgumentParser, out: str | None, reps: int = 1, threads: int | None = 2,
                    sampling: bool = True, out_help: str = "also write the JSON here") -> None:
    """Add ``--temperature`` / ``--top-p`` (with ``sampling``; defaults: ``triforce.defaults``), ``--reps``,
    ``--threads`` and ``--out`` (default ``out``; None: stdout only)."""
    if sampling:
        p.add_argument("--temperature", type=float, default=DEFAULTS["temperature"])
        p.add_argument("--top-p", type=float, default=DEFAULTS["top_p"])
    p.add_argument("--reps", type=positive_int, default=reps)
    p.add_argument("--threads", type=positive_int, default=threads)
    p.add_argument("--out", default=out, help=out_help if out is None else f"JSON output ({out})")


def machine() -> dict:
    """The CPU a result was measured on and the code that measured it: ``kernels.cpu.cpu()``, ``{"cpu", "cores",
    "isa"}`` (the kernels' builds differ by ISA, and figures differ between this project's machines), and
    ``git_commit`` / ``git_dirty`` (``triforce.lab.provenance``)."""
    from triforce.kernels.cpu import cpu
    from triforce.lab.provenance import git_commit

    return {**cpu(), **git_commit()}


def emit_json(obj, path: str | None) -> str:
    """Print ``obj`` as indented JSON (a dict gains a ``machine`` entry, :func:`machine`) and, with ``path``, write it
    there too; returns the text."""
    if isinstance(obj, dict):
        obj = {**obj, "machine": obj.get("machine", machine())}
    text = json.dumps(obj, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    return text


def _timed(fn) -> float:
    """Wall seconds of one call of ``fn``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _interleaved(fns: dict, reps: int) -> dict[str, float]:
    """Median seconds of each callable, one untimed warm-up each, order rotated between repetitions."""
    names = list(fns)
    for n in names:
        fns[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(_timed(fns[n]))
    return {n: statistics.median(v) for n, v in times.items()}


def gemv_probe():
    """A large fp32 GEMV (1 x 576 by 576 x 9216, 30 distinct matrices, 637 MB) as (callable, bytes it reads): the
    rate at which PyTorch's product streams weights (below the memory's: :func:`stream_probe`)."""
    import torch

    w = torch.randn(30, 576, 9216)
    x = torch.randn(1, 576)
    return (lambda: [x @ w[i] for i in range(30)]), w.numel() * 4


def stream_probe():
    """A sum over 640 MB of fp32 (every byte read once, the threads each streaming a half) as (callable, bytes it
    reads): the memory's read bandwidth, the floor of a step that reads its weights and KV cache once. On this
    project's 2-core EPYC it streams about 1.9x as fast as :func:`gemv_probe` (49-52 against 26 GB/s), which the
    rooflines before 2026-12-05 took for the floor."""
    import torch

    x = torch.rand(160_000_000)
    return (lambda: x.sum()), x.numel() * 4


def gemm_probe():
    """A large fp32 matrix product (1024^3) as (callable, FLOPs it does): the compute ceiling. Through oneDNN over
    prepacked weights where PyTorch has it (it runs AVX-512 FMAs on any CPU that has them: 412-451 GFLOP/s on this
    project's 2-core EPYC), else MKL through ``@``, which on AMD CPUs runs its AVX2 code (about 200 GFLOP/s there, the
    ceiling the rooflines before 2026-12-05 used)."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(b.T.contiguous(), None)
        torch.ops.mkldnn._linear_pointwise(a[:2], packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return (lambda: a @ b), 2 * 1024 ** 3
    return (lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")), 2 * 1024 ** 3


def floor_bandwidth(reps: int) -> float:
    """Bytes per second of :func:`stream_probe` (median of ``reps``): the memory floor's bandwidth."""
    fn, nbytes = stream_probe()
    return nbytes / _interleaved({"stream": fn}, reps)["stream"]


def peak_flops(reps: int) -> float:
    """FLOP per second of :func:`gemm_probe` (median of ``reps``)."""
    fn, flops = gemm_probe()
    return flops / _interleaved({"gemm": fn}, reps)["gemm"]


def random_kv_steps(context: int, budget: int, capacity: int, lower_kv: str = "bfloat16", model: str | None = None,
                    precision: str | None = None):
    """The embedded SmolLM2 (its verifier on its GGUF block codes), or the GGUF file ``model``, and the retrieval
    tier ``auto`` gives it under sampling (the same codes with int8 activations, ``--lower-weights codes``), over
    ``context`` tokens of random KV (``triforce.lab.synthetic.fill_random_kv``, no prefill): ``(model, codes, full,
    retrieval)``, the full cache of ``capacity`` slots and a ``budget``-slot retrieval cache in ``lower_kv`` (a torch
    dtype name), chunks of the default chunk size. Both models are sized for ``capacity`` positions; roll each
    forward back to ``context``. ``precision``: the verifier's arithmetic (``load_model``'s; None: its default)."""
    import torch

    from triforce.formats.loading import load_model
    from triforce.kv.caches import FullKVCache
    from triforce.kv.retrieval import RetrievalCache
    from triforce.lab.synthetic import fill_random_kv
    from triforce.model.quant import lower_precision_copy

    model = load_model(model, precision=precision).model
    codes = lower_precision_copy(model, "codes")
    for m in (model, codes):
        m.set_request_length(capacity)
    full = FullKVCache(model.cfg, capacity, model.dtype, model.device)
    fill_random_kv(full, context, 0)
    retrieval = RetrievalCache(model.cfg, full, budget, DEFAULTS["chunk_size"], dtype=getattr(torch, lower_kv))
    fill_random_kv(retrieval, context, 1)
    return model, codes, full, retrieval


def timed_load(path):
    """``formats.loading.load_model(path)`` timed: (the LoadedModel, ``{"seconds", "peak_rss_mib", "weight_mib"}``):
    wall seconds, this process's peak resident set so far (MiB) and the model's weight bytes (MiB)."""
    import resource

    from triforce.formats.loading import load_model

    t = time.perf_counter()
    lm = load_model(path)
    return lm, {"seconds": time.perf_counter() - t,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                "weight_mib": lm.model.weight_bytes() / 2**20}
