"""Our CPU kernels, built on first use, each with PyTorch's op as fallback: attention over the verifier's full KV cache
(``csrc/attention.c``, SDPA otherwise: :mod:`triforce.kernels.sdpa`) and products of a few activation rows with a
weight matrix (``csrc/qlinear.c``): the lower tiers' int8 weight-only projections, stored (out, in)
(``aten._weight_int8pack_mm`` otherwise), and the fp32 projections of verification blocks and batched steps, stored (in,
out) (PyTorch's products otherwise).

A decode step of the verifier attends g query rows per KV head (grouped-query attention, g = nh / nkv) over the
whole cache; PyTorch's CPU SDPA parallelises it over the KV heads only. ``csrc/attention.c`` streams each key and
value row once for all rows of its head, split into key chunks that every thread shares (flash-decoding), and merges the
chunks with the log-sum-exp rule (see the C file's header for the equations and sources). Measured by
``bench/kernels/attention_kernel.py`` (docs/history.md, "Attention kernel").

The kernel is C with AVX2/FMA intrinsics (and an AVX-512 path for head sizes that are multiples of 16, built where the
CPU has AVX-512: 16 lanes, the values' weighted sum for 6 query rows at once), reads fp32 or bf16 caches (a lower
tier's, half the bytes; each element widened exactly) and uses OpenMP, compiled once per machine with the system C
compiler (``cc``, ``$CC`` overrides) into ``<triforce cache>/kernels/`` (``kernels/build.py``: one compile under a file
lock, a per-user temporary directory where the cache cannot be used, the AVX2 build where the compiler rejects AVX-512
flags); the library links the ``libgomp`` torch already loaded, so both share one OpenMP thread pool. On a CPU without
AVX2/FMA (or aarch64) every C file is built with no ISA flags (the portable builds, :data:`PORTABLE_CFLAGS`: plain C
branches with the same row-independence; ``TRIFORCE_KERNEL_ISA=portable`` forces them). Feature detection with a
fallback: where there is no compiler, the build fails, or ``TRIFORCE_ATTENTION_KERNEL=0`` is set,
:func:`gqa_attention_kernel` returns None and the caller uses SDPA (``status()`` says which and why; a kernel that is
off for any reason but its variable is named once on stderr).

The linear kernels stream each weight row once for up to :data:`LINEAR_MAX_ROWS` activation rows (int8:
:data:`INT8_LINEAR_MAX_ROWS`): :func:`int8_linear` dequantises 16 int8 weights per AVX-512 vector (a lower tier's decode
step and proposal blocks; ``aten._weight_int8pack_mm`` otherwise); :func:`f32_linear` multiplies fp32 weights stored
(in, out), the verifier's blocks and batched steps (``bench/kernels/qlinear.py``, docs/history.md). They are built for
AVX-512 (F, BW, VL) where the CPU has it, and otherwise for AVX2 and FMA (8-lane versions of the same kernels, with the
same row-independence), and where the CPU has neither, portable (plain C loops: one multiply-add chain per output, as
the vector lanes compute); where there is no compiler, or ``TRIFORCE_LINEAR_KERNEL=0`` is set, they return None
(``linear_status()`` says why). The verifier's decode steps and blocks run every fp32 product on our kernel, with either
build, any number of rows and any width, so that a row rounds alike wherever it is (:mod:`triforce.kernels.rows`,
:func:`f32_one_row_exact`); elsewhere the product is decided per build: with AVX-512 our kernel for 2-64 rows and for
one row (:func:`f32_one_row_pays`), with AVX2 oneDNN's product over packed weights where the model has them
(:func:`f32_beats_onednn`), else our kernel for 2-64 rows, and MKL's GEMV for one row; a GGUF model's projections with
exact block codes read those instead (:mod:`triforce.kernels.blockcodes`, ``csrc/blockcodes.c``).

A decode step of an int8 lower tier or of a model on block codes runs every layer in one call
(:func:`triforce.kernels.decode_step.decode_layers`, ``csrc/decode_step.c``): the same kernels back to back from C,
without a Python call between them, so the gaps between two products stay shorter than OpenMP's spin;
``TRIFORCE_DECODE_STEP_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import math
import os

import torch

# _build: for bench/kernels/step_source.py
from .build import _build, _cpu_flags, _Library, best_build, forced_build  # noqa: F401

#: environment variable: "0" turns the attention kernel off (SDPA everywhere)
ENV_SWITCH = "TRIFORCE_ATTENTION_KERNEL"
#: environment variable: "0" turns the linear kernels off (PyTorch's products everywhere)
LINEAR_ENV_SWITCH = "TRIFORCE_LINEAR_KERNEL"
#: environment variable: where a decode step's one-row products run: "1" our fp32 kernel, "0" MKL's GEMV, unset the
#: build's default (:func:`f32_one_row_pays`; the verifier's: :func:`f32_one_row_exact`, which "0" gives up); for A/B
#: runs of the same code (bench/kernels/rows.py, ``triforce bench``)
ONE_ROW_ENV_SWITCH = "TRIFORCE_ONE_ROW_KERNEL"
#: compiler flags; the build is cached per (source, flags, compiler) hash
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
#: the linear kernels' flags (AVX-512 foundation, byte/word and 128/256-bit forms for the masked tail)
LINEAR_CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-fopenmp", "-shared", "-fPIC")
#: the linear kernels' flags where the CPU has AVX2 and FMA but no AVX-512 (8-lane versions of the same kernels)
LINEAR_AVX2_CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
#: the portable builds' flags (csrc/*.c's branches for a CPU with neither AVX2 nor AVX-512, or aarch64): no ISA flags,
#: the compiler's default target, loops it vectorises; no contraction, so a multiply and an add round as the C says
#: (fused only where the C asks for fmaf, csrc/qlinear.c's MADD) and a row rounds alike at every width
PORTABLE_CFLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC")
#: environment variable: "0" turns the RMSNorm and RoPE kernels off (PyTorch's ops everywhere)
NORM_ROPE_ENV_SWITCH = "TRIFORCE_NORM_ROPE_KERNEL"
#: their flags: no FMA contraction, so RoPE rounds as PyTorch's x * cos + rotate_half(x) * sin does
NORM_ROPE_CFLAGS = ("-O3", "-mavx2", "-ffp-contract=off", "-shared", "-fPIC")
#: environment variable: "0" turns the one-call decode step of int8 lower tiers off (one Python call per operation)
DECODE_STEP_ENV_SWITCH = "TRIFORCE_DECODE_STEP_KERNEL"
#: its flags: plain C that calls the other kernels through pointers (SiLU's vector paths carry target attributes; no
#: contraction, so a lane rounds alike at every width)
DECODE_STEP_CFLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC")
#: environment variable: "0" turns the top-p selection and inverse-CDF draw kernel off (PyTorch's ops,
#: speculation/sampling.py)
SAMPLING_ENV_SWITCH = "TRIFORCE_SAMPLING_KERNEL"
#: its flags: AVX2 compares and maxima, no FMA (nothing to contract)
SAMPLING_CFLAGS = ("-O3", "-mavx2", "-shared", "-fPIC")
#: environment variable: "0" keeps a GGUF model's weights fp32 only (no exact block codes, ``kernels/blockcodes.py``)
BLOCKCODES_ENV_SWITCH = "TRIFORCE_BLOCK_CODES"
#: their flags: no FMA contraction, so d * q + m rounds twice, as the check of every weight in kernels/blockcodes.py
#: does
BLOCKCODES_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
#: most activation rows of one linear kernel call: a decode step, a verification block, a batch of them (8 sequences
#: verifying 7 tokens each are 56 rows; bench/kernels/qlinear.py); prefill chunks take PyTorch's op
LINEAR_MAX_ROWS = 64
#: most rows of one :func:`f32_linear` call (csrc/qlinear.c's F32_MAX_ROWS): a row's value is the same for any number of
#: rows, so the verifier's batches past :data:`LINEAR_MAX_ROWS` rows (``kernels/rows.py``) take one pass over the
#: weights instead of several calls of 64 rows (docs/performance.md)
F32_MAX_ROWS = 1024
#: most rows of one int8 kernel call (a lower tier's decode step or proposal block, a small batch of them): from about
#: 7 rows on, aten's bf16 int8 product is faster (bench/kernels/qlinear.py --rows 7 14 28), and it takes more
INT8_LINEAR_MAX_ROWS = 16
#: largest head_dim the kernel handles (checked in the C file)
MAX_HEAD_DIM = 256
#: keys per work item, whatever the block: the same chunks for a decode step and a verification block, so a query
#: row's result does not depend on the rows beside it (each thread's scores of a chunk: rows * CHUNK floats)
CHUNK = 256

def cpu() -> dict:
    """The CPU the kernels are built for: ``{"cpu": model name, "cores": logical CPUs, "isa": "AVX-512" | "AVX2" |
    "portable"}`` ("AVX-512": F, BW and VL, the linear kernels' wide build; "AVX2": AVX2 and FMA, the 8-lane builds;
    "portable": neither, the plain C builds; read from /proc/cpuinfo, "unknown" and "portable" where it cannot be
    read; ``TRIFORCE_KERNEL_ISA`` hides flags as for the builds). Benchmarks record it: the kernels' builds,
    and so the figures, differ by ISA."""
    name = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    flags = _cpu_flags()
    isa = ("AVX-512" if set(_LINEAR_BUILDS["AVX-512"][0]) <= flags
           else "AVX2" if set(_LINEAR_BUILDS["AVX2"][0]) <= flags else "portable")
    return {"cpu": name, "cores": os.cpu_count(), "isa": isa}


def _cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= _cpu_flags()


#: the builds of csrc/attention.c: its AVX-512 path (head sizes multiple of 16) and its AVX2 one
_ATTENTION_BUILDS = {"AVX-512": (("avx2", "fma", "avx512f"), CFLAGS + ("-mavx512f",)),
                     "AVX2": (("avx2", "fma"), CFLAGS),
                     "portable": ((), PORTABLE_CFLAGS + ("-fopenmp",))}


def _attention_flags():
    return best_build(_ATTENTION_BUILDS)


_I, _I64, _F, _P = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_ATTENTION_SYMBOLS = {
    "triforce_gqa_attention": (_I, [_P] * 5 + [_I] * 5 + [_I64] * 2 + [_I] * 2 + [_F, _I, _P]),
    "triforce_gqa_attention_bf16": (_I, [_P] * 5 + [_I] * 5 + [_I64] * 2 + [_I] * 2 + [_F, _I, _P])}
_attention = _Library("attention.c", ENV_SWITCH, (), _attention_flags, _ATTENTION_SYMBOLS, _ATTENTION_BUILDS)
_LINEAR_BUILDS = {"AVX-512": (("avx512f", "avx512bw", "avx512vl"), LINEAR_CFLAGS),
                  "AVX2": (("avx2", "fma"), LINEAR_AVX2_CFLAGS),  # the branches of csrc/qlinear.c
                  "portable": ((), PORTABLE_CFLAGS + ("-fopenmp",))}
_LINEAR_SYMBOLS = {"triforce_int8_linear": (_I, [_P] * 4 + [_I] * 4),
                   "triforce_f32_linear": (_I, [_P] * 3 + [_I] * 4)}


def attention_build(isa: str) -> "_Library":
    """The attention kernel built for ``isa`` (:func:`forced_build`): tests swap the portable build of
    ``csrc/attention.c`` in as ``kernels._attention`` on an AVX2 or AVX-512 machine.

    Args:
        isa: "AVX-512", "AVX2" or "portable".

    Raises:
        ValueError: for another ``isa``.
    """
    return forced_build(_ATTENTION_BUILDS, isa, "attention.c", ENV_SWITCH, _ATTENTION_SYMBOLS)


def linear_build(isa: str) -> "_Library":
    """The linear kernels built for ``isa`` (:func:`forced_build`): tests and ``bench/kernels/qlinear.py`` swap the AVX2
    (or portable) build of ``csrc/qlinear.c`` in as ``kernels._linear`` on an AVX-512 (or AVX2) machine.

    Args:
        isa: "AVX-512", "AVX2" or "portable".

    Raises:
        ValueError: for another ``isa``.
    """
    return forced_build(_LINEAR_BUILDS, isa, "qlinear.c", LINEAR_ENV_SWITCH, _LINEAR_SYMBOLS)


_linear = _Library("qlinear.c", LINEAR_ENV_SWITCH, (), lambda: best_build(_LINEAR_BUILDS), _LINEAR_SYMBOLS,
                   _LINEAR_BUILDS)
#: the builds of csrc/norm_rope.c (plain C either way: the compiler vectorises it for the ISA it is given)
_NORM_ROPE_BUILDS = {"AVX2": (("avx2",), NORM_ROPE_CFLAGS), "portable": ((), PORTABLE_CFLAGS)}
_norm_rope = _Library("norm_rope.c", NORM_ROPE_ENV_SWITCH, (), lambda: best_build(_NORM_ROPE_BUILDS), {
    "triforce_rms_norm": (None, [_P] * 3 + [_I64, _I, _F]),
    "triforce_rope": (None, [_P] + [_I64] * 3 + [_P] * 3 + [_I] * 4)}, _NORM_ROPE_BUILDS)


def status() -> str:
    """'on (...)', 'off (...)' or 'unavailable: <reason>' for the attention kernel (loads it if nobody has yet)."""
    _attention.load()
    return _attention.status


def gqa_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_keys: int,
                         lse: torch.Tensor | None = None) -> torch.Tensor | None:
    """Causal GQA attention of a block of T queries that ends the sequence, over keys [0, n_keys), or None.

    The attention of :func:`triforce.kernels.sdpa.gqa_attention` with the full KV cache's mask (query i of the block, at
    position n_keys - T + i, sees keys j <= n_keys - T + i), computed by ``csrc/attention.c`` (split-key
    flash-decoding; module docstring). Softmax with our AVX2 ``expf`` (relative error < 2e-7; the portable build:
    libm's); outputs agree with SDPA's to about 1e-6 relative.

    Args:
        q: (B, nh, T, hs) fp32 queries (after RoPE).
        k, v: (B, nkv, capacity, hs) views of one layer's cache whose last dim is contiguous, capacity >= n_keys; both
            fp32, or both bf16 (a lower tier's cache: each element widened to fp32 exactly, so the result is bitwise
            the kernel's over the fp32 copy of the cache, from half the bytes).
        n_keys: keys the block sees, the cache length after this block's tokens were written.
        lse: None, or a (B, nh, T) fp32 contiguous tensor that receives each query's log-sum-exp of its scaled
            scores, log sum_j exp(q . k_j / sqrt(hs)), to merge this attention with one over other keys (the
            flash-decoding rule, :func:`merge_attention`).

    Returns:
        (B, nh, T, hs) fp32, or None when the kernel does not apply (not CPU, q not fp32, k and v not both fp32 or
        both bf16, hs not a multiple of 8 or over
        :data:`MAX_HEAD_DIM`, shapes that do not match, nh not a multiple of nkv, or the kernel unavailable): the caller
        then uses SDPA, which raises on bad shapes.
    """
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return None
    b, nh, t, hs = q.shape
    nkv = k.shape[1]
    if (q.device.type != "cpu" or q.dtype != torch.float32 or k.dtype not in (torch.float32, torch.bfloat16)
            or v.dtype != k.dtype
            or k.shape[0] != b or k.shape[3] != hs or nkv < 1 or nh % nkv or t < 1
            or hs % 8 or hs > MAX_HEAD_DIM or k.stride(-1) != 1 or v.stride() != k.stride() or k.stride(2) != hs
            or n_keys < t or n_keys > k.shape[2]):
        return None
    if lse is not None and (lse.shape != (b, nh, t) or lse.dtype != torch.float32 or not lse.is_contiguous()
                            or lse.device.type != "cpu"):
        return None
    rows = nh // nkv * t  # (g * T) query rows per KV head
    chunk = CHUNK
    fns = _attention.load()
    if fns is None:
        return None
    fn = fns["triforce_gqa_attention_bf16" if k.dtype == torch.bfloat16 else "triforce_gqa_attention"]
    q = q.contiguous()  # (B, nh, T, hs) == (B, nkv, g*T, hs): head h = kv * g + j, rows ordered (j, token)
    out = torch.empty_like(q)
    threads = torch.get_num_threads()
    # the chunks' partial results, then each thread's scores (csrc/attention.c)
    scratch = torch.empty(b * nkv * -(-n_keys // chunk) * rows * (hs + 2) + threads * rows * chunk, dtype=torch.float32)
    rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), scratch.data_ptr(), b, nkv, rows, t, hs,
            k.stride(0), k.stride(1), n_keys, chunk, 1.0 / math.sqrt(hs), threads,
            lse.data_ptr() if lse is not None else None)
    return out if rc == 0 else None


def merge_attention(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from the attention over each and its log-sum-exp (the merge
    of flash-decoding's split-key partial results; Dao et al. 2023, as in ``csrc/attention.c``):
    out = (e^(lse1 - m) out1 + e^(lse2 - m) out2) / (e^(lse1 - m) + e^(lse2 - m)), m = max(lse1, lse2).

    Args:
        out1, out2: (B, nh, T, hs) fp32 attention outputs.
        lse1, lse2: (B, nh, T) fp32 log-sum-exps of their scaled scores.

    Returns:
        (B, nh, T, hs) fp32.
    """
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m)[..., None], torch.exp(lse2 - m)[..., None]  # (B, nh, T, 1)
    return (w1 * out1 + w2 * out2) / (w1 + w2)


def linear_status() -> str:
    """'on (...)', 'off (...)' or 'unavailable: <reason>' for the linear kernels, int8 and fp32 (loads them if nobody
    has yet)."""
    _linear.load()
    return _linear.status


def f32_one_row_pays() -> bool:
    """Whether a one-row fp32 product (a decode step's projections) runs on :func:`f32_linear` rather than MKL's GEMV.

    By default True with the AVX-512 build, where one row on our kernel beats MKL's GEMV; False with the AVX2 build
    (slower than MKL's GEMV there) or without the kernels (docs/performance.md, "Kernels (EPYC)").
    ``TRIFORCE_ONE_ROW_KERNEL`` (:data:`ONE_ROW_ENV_SWITCH`) = "1" or "0" overrides the default, for A/B runs. The
    verifier's decode steps follow :func:`f32_one_row_exact` instead (our kernel with either build).

    Returns:
        bool; loads the linear kernels and reads the variable on the first call, then answers from the library's
        cached choice (one attribute read: a decode step makes ~150 calls).

    Raises:
        ValueError: ``TRIFORCE_ONE_ROW_KERNEL`` set to something other than "0" or "1" (on the first call).
    """
    pays = _linear.one_row  # None until decided
    if pays is None:
        choice = os.environ.get(ONE_ROW_ENV_SWITCH, "")
        if choice not in ("", "0", "1"):
            raise ValueError(f"{ONE_ROW_ENV_SWITCH} must be '0', '1' or unset, got {choice!r}")
        loaded = _linear.load() is not None
        pays = _linear.one_row = loaded and (choice == "1" or (choice == "" and _linear.status.endswith("AVX-512)")))
    return pays


def f32_one_row_exact() -> bool:
    """Whether the verifier's one-row fp32 products (its decode steps, inside :func:`~.rows.exact_forward`)
    run on :func:`f32_linear`, the kernel its verification blocks run on, so that the two round alike: True wherever
    the linear kernels are on, with any build (AVX-512, AVX2, portable; on an AVX2 CPU MKL's GEMV is faster for one
    row, :func:`f32_one_row_pays`, and the tiers below the verifier keep it), unless ``TRIFORCE_ONE_ROW_KERNEL`` is
    "0" (the A/B switch, which then gives up the rule).

    Returns:
        bool; decided on the first call (loads the kernels, reads the variable), then one attribute read.

    Raises:
        ValueError: ``TRIFORCE_ONE_ROW_KERNEL`` set to something other than "0" or "1" (on the first call).
    """
    exact = _linear.one_row_exact  # None until decided
    if exact is None:
        f32_one_row_pays()  # checks the variable
        exact = _linear.one_row_exact = (_linear.load() is not None
                                         and os.environ.get(ONE_ROW_ENV_SWITCH, "") != "0")
    return exact


def f32_beats_onednn() -> bool:
    """Whether :func:`f32_linear` is faster than oneDNN's product over prepacked weights for 2 to
    :data:`LINEAR_MAX_ROWS` fp32 rows (a verification block, a batch of decode steps or verifications).

    True with the AVX-512 build, within a few percent of oneDNN's packed product at most row counts, so
    ``--packed-weights auto`` does not spend memory on a packed copy. False with the AVX2 build, where oneDNN's packed
    product (its own AVX2 kernels) is faster at every row count, so the model packs its weights
    (:meth:`~triforce.model.transformer.Transformer.packing_pays`) and multi-row products run on oneDNN; our kernel
    still runs them where the weights are not packed (``--packed-weights off``, too little memory). False without the
    kernels. Measurements: docs/performance.md, "Kernels (EPYC)".

    Returns:
        bool; loads the linear kernels on the first call, then answers from the library's cached choice.
    """
    beats = _linear.beats_onednn
    if beats is None:
        beats = _linear.beats_onednn = _linear.load() is not None and _linear.status.endswith("AVX-512)")
    return beats


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """Weight-only int8 product ``y = x (scale * q)^T`` for a few rows, or None where the kernel does not apply.

    The scheme of :class:`~triforce.model.quant.Int8Linear` (one scale per output channel, gpt-fast's and torchao's int8
    weight-only scheme), computed by ``csrc/qlinear.c`` in fp32: each output's sum in the same order whatever the
    other rows, so a row's result does not depend on the rows beside it.

    Args:
        x: (M, in) fp32 activations, 1 <= M <= :data:`INT8_LINEAR_MAX_ROWS`.
        q: (out, in) int8 weights, contiguous.
        scale: (out,) fp32 scales, contiguous.

    Returns:
        (M, out) fp32, or None when the kernel does not apply (not CPU, other dtypes or shapes, more rows, the kernel
        unavailable): the caller then uses PyTorch's op.
    """
    if (x.dim() != 2 or q.dim() != 2 or scale.dim() != 1 or x.device.type != "cpu" or q.device.type != "cpu"
            or x.dtype != torch.float32 or q.dtype != torch.int8 or scale.dtype != torch.float32
            or x.shape[1] != q.shape[1] or scale.shape[0] != q.shape[0] or not 1 <= x.shape[0] <= INT8_LINEAR_MAX_ROWS
            or not q.is_contiguous() or not scale.is_contiguous()):
        return None
    fns = _linear.load()
    if fns is None:
        return None
    fn = fns["triforce_int8_linear"]
    x = x.contiguous()
    m, n_in = x.shape
    y = torch.empty(m, q.shape[0], dtype=torch.float32)
    rc = fn(x.data_ptr(), q.data_ptr(), scale.data_ptr(), y.data_ptr(), m, n_in, q.shape[0], torch.get_num_threads())
    return y if rc == 0 else None


def f32_linear(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor | None:
    """fp32 product ``y = x W`` of a few rows with weights stored (in, out), or None where the kernel does not apply.

    What :class:`~triforce.model.transformer.Linear` computes for a verification block or a batched decode step (bias
    excluded), computed by ``csrc/qlinear.c``: column blocks of the output whose accumulators stay in registers while
    the weight rows stream past, each weight vector loaded once for all rows. Each output is one chain of FMAs over the
    inputs in order, whatever the other rows, so a row's result is bitwise the same alone and in a block (the
    attention kernel's property too: a verification computes the logits a decode step would). Its speed against
    oneDNN's and MKL's products: docs/performance.md, "Kernels (EPYC)".

    Args:
        x: (M, in) fp32 activations, 1 <= M <= :data:`F32_MAX_ROWS` (callers outside the verifier's exact forwards
            keep it for 2-:data:`LINEAR_MAX_ROWS` rows, where it is about as fast as oneDNN's packed product).
        w_t: (in, out) fp32 weights, contiguous, any out >= 1: the columns past the last multiple of 16 (an LM head
            over a 32,001-token vocabulary) are one ``fmaf`` chain each, bitwise what a vector lane computes, so they
            keep the row-independence too.

    Returns:
        (M, out) fp32, or None when the kernel does not apply (not CPU, other dtypes or shapes, more rows, the kernel
        unavailable): the caller then uses PyTorch's product (:func:`triforce.kernels.rows.linear_forward` chunks more
        rows).
    """
    if (x.dim() != 2 or w_t.dim() != 2 or x.device.type != "cpu" or w_t.device.type != "cpu"
            or x.dtype != torch.float32 or w_t.dtype != torch.float32 or x.shape[1] != w_t.shape[0]
            or not 1 <= x.shape[0] <= F32_MAX_ROWS or w_t.shape[1] == 0 or not w_t.is_contiguous()):
        return None
    fns = _linear.load()
    if fns is None:
        return None
    x = x.contiguous()
    m, n_in = x.shape
    y = torch.empty(m, w_t.shape[1], dtype=torch.float32)
    rc = fns["triforce_f32_linear"](x.data_ptr(), w_t.data_ptr(), y.data_ptr(), m, n_in, w_t.shape[1],
                                    torch.get_num_threads())
    return y if rc == 0 else None


def norm_rope_status() -> str:
    """'on (...)', 'off (...)' or 'unavailable: <reason>' for the RMSNorm and RoPE kernels (loads them if nobody has
    yet)."""
    _norm_rope.load()
    return _norm_rope.status


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm ``weight * (x / sqrt(mean(x^2) + eps))`` over the last dim (Zhang & Sennrich, arXiv 1910.07467; what
    :class:`~triforce.model.transformer.RMSNorm` computes), by ``csrc/norm_rope.c`` in one call instead of PyTorch's
    6-8 small ops; or None where the kernel does not apply.

    Args:
        x: (..., d) fp32 on the CPU.
        weight: (d,) fp32, contiguous.
        eps: added to the mean square.

    Returns:
        x's shape, fp32, contiguous; or None (not CPU/fp32, shapes that do not match, the kernel unavailable): the
        caller then uses PyTorch's ops.
    """
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 1
            or x.dim() < 1 or x.shape[-1] != weight.shape[0] or x.numel() == 0 or not weight.is_contiguous()):
        return None
    fns = _norm_rope.load()
    if fns is None:
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    fns["triforce_rms_norm"](x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
                             eps)
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotary embedding ``x * cos + rotate_half(x) * sin`` (Su et al., arXiv 2104.09864; what
    :func:`apply_rope` computes, with the same roundings), by ``csrc/norm_rope.c`` in one call; or None
    where the kernel does not apply.

    Args:
        x: (B, h, T, hs) fp32 on the CPU, any strides with the last dim contiguous (a view of the fused projection).
        cos, sin: (T, hs) fp32, contiguous.

    Returns:
        (B, h, T, hs) fp32, contiguous; or None (not CPU/fp32, shapes that do not match, hs odd, the kernel
        unavailable): the caller then uses PyTorch's ops.
    """
    if (x.dim() != 4 or cos.dim() != 2 or x.device.type != "cpu" or x.dtype != torch.float32
            or cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.shape != (x.shape[2], x.shape[3])
            or sin.shape != cos.shape or x.shape[3] % 2 or x.numel() == 0 or x.stride(3) != 1
            or not cos.is_contiguous() or not sin.is_contiguous()):
        return None
    fns = _norm_rope.load()
    if fns is None:
        return None
    b, h, t, hs = x.shape
    y = torch.empty(b, h, t, hs, dtype=torch.float32)
    fns["triforce_rope"](x.data_ptr(), x.stride(0), x.stride(1), x.stride(2), y.data_ptr(), cos.data_ptr(),
                         sin.data_ptr(), b, h, t, hs)
    return y


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, h, T, hs) by cos/sin (T, hs), all one dtype: ``x * cos + rotate_half(x) * sin``, the
    "rotate half" RoPE layout of Hugging Face checkpoints (Su et al., RoFormer, arXiv 2104.09864, Sec. 3.4.2).

    Returns a new (B, h, T, hs) tensor: :func:`rope`'s single call where it applies, else the same expression in
    PyTorch (the same roundings). Shapes are not checked beyond broadcasting (PyTorch raises on a mismatch)."""
    if not torch.compiler.is_compiling():
        y = rope(x, cos, sin)  # csrc/norm_rope.c: one call, the same roundings (None where it does not apply)
        if y is not None:
            return y
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
