"""Our forward pass for Llama-family decoders (Llama 2/3/3.1, Mistral, Qwen2).

One block: ``x = x + Attn(RMSNorm(x)); x = x + MLP(RMSNorm(x))`` with RoPE on q/k, grouped-query attention and a
SwiGLU MLP (Touvron et al., arXiv 2302.13971 / 2307.09288). The forward takes an explicit KV cache object and
explicit absolute positions, so each speculation tier decides which keys a query sees (see ``kv/caches.py``).

Weights load from Hugging Face names (``model.layers.{i}.self_attn.q_proj.weight`` ...); q/k/v and gate/up
projections are fused at load time into one matmul each, which halves the kernel launches of a decode step.
"""

from __future__ import annotations

import functools
from typing import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..defaults import DEFAULTS
from ..kernels.codes import BlockCodes, concat_outputs
from ..kernels.cpu import apply_rope, rms_norm
from ..kernels.linear import linear_forward
from ..kernels.rows import exact_forward, exact_rows, split_exact
from ..kernels.stored import StoredRows, place_stored
from ..kv.caches import KVCache, RaggedCache
from .config import ModelConfig
from .cudagraph import graphs_apply, run_graphed
from .rope import RotaryEmbedding


class Linear(nn.Module):
    """``y = x W^T + b`` with W stored transposed, (in, out) contiguous.

    A decode step multiplies one row vector by each weight matrix, reading the whole matrix; PyTorch's CPU product
    reads the (in, out) layout faster than ``nn.Linear``'s (out, in) one. On GPU both layouts run the same cuBLAS
    kernels.

    Args:
        in_features, out_features: sizes; ``bias`` adds a bias of ``out_features``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))  # (in, out)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed = None  # oneDNN-prepacked copy for multi-row products on CPU (see Transformer.pack_weights)
        self.codes = None  # exact GGUF block codes (kernels/blockcodes.py), read instead of weight_t (None: codes only)
        self.q8 = False  # multiply the codes by int8-quantized activations (model/precision.py's file; lower tiers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return linear_forward(self, x, exact_rows())  # the path this forward's rows need (kernels/rows.py)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, arXiv 1910.07467), computed in fp32 like transformers."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        if not torch.compiler.is_compiling():
            y = rms_norm(x, self.weight, self.eps)  # csrc/norm_rope.c: one call (None where it does not apply)
            if y is not None:
                return y
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def compile_forward(fn, mode: str):
    """``torch.compile(fn, mode=mode, dynamic=False)``; with ``reduce-overhead`` each output is cloned as it returns.

    ``reduce-overhead`` replays CUDA graphs (PyTorch's CUDA graph trees), which reuse a graph's output memory at a
    later replay; a block's norm output still read after that fails with "accessing tensor output of CUDAGraphs that
    has been overwritten by a subsequent run" (``bench/gpu/gpu_check.py --stages compiled`` runs it on a GPU). The
    clone (one activation-sized copy) is the remedy PyTorch's message names.

    Args:
        fn: a block's norm or MLP ``forward`` (bound method) returning one tensor, e.g. (B, T, d).
        mode: a ``torch.compile`` mode (:attr:`Transformer.COMPILE_MODES`).

    Returns:
        The compiled callable; with ``reduce-overhead`` a plain function wrapping it (``functools.wraps(fn)``, but
        no ``__self__``) whose result is a fresh tensor.
    """
    compiled = torch.compile(fn, mode=mode, dynamic=False)
    if mode != "reduce-overhead":
        return compiled

    @functools.wraps(fn)
    def cloned(*args, **kwargs):
        return compiled(*args, **kwargs).clone()
    return cloned


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads; the cache object computes the attention itself."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.nh + 2 * self.nkv) * self.hs, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.nh * self.hs, cfg.hidden_size, bias=cfg.o_bias)
        self.tp = None  # TensorParallel: this rank holds nh, nkv local heads; o_proj's output is all-reduced

    def forward(self, x, cos, sin, cache: KVCache, layer: int) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv_proj(x)  # (B, T, (nh + 2 nkv) hs)
        q, k, v = qkv.split([self.nh * self.hs, self.nkv * self.hs, self.nkv * self.hs], dim=-1)
        q_pre = q.view(b, t, self.nh, self.hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(b, t, self.nkv, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(b, t, self.nkv, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        q = apply_rope(q_pre, cos, sin)
        k = apply_rope(k, cos, sin)
        out = cache.attend(layer, q, k, v, q_pre)  # (B, nh, T, hs)
        out = self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hs))  # (B, T, d), partial sum under TP
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.tp = None  # TensorParallel: this rank holds intermediate channels; down_proj's output is all-reduced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        out = self.down_proj(F.silu(gate) * up)  # (B, T, d), partial sum under TP
        return out if self.tp is None else self.tp.all_reduce(out)


class Block(nn.Module):
    """One decoder block: pre-norm attention and pre-norm SwiGLU MLP, each with a residual connection."""
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache, layer):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """A Llama-family decoder-only language model.

    Args:
        cfg: :class:`~triforce.model.config.ModelConfig`.

    Use :meth:`from_state_dict` to build one from Hugging Face weights.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # tied embeddings keep one matrix, the LM head's (d, V); token embeddings are its columns
        self.embed_tokens = None if cfg.tie_word_embeddings else nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None  # built on first use, on the weights' device
        self.tp = None  # TensorParallel when this model is one rank's shard (see model/parallel.py)
        self.compile_mode: str | None = None  # set by compile_blocks (lower-precision copies compile their own MLPs)
        # (x, cos, sin, cache) -> hidden state after the last layer, or None: set on int8 copies (model/quant.py)
        self.decode_step = None
        self.precision = "exact"  # the products' arithmetic (model/precision.py: set_precision)
        # replay fixed-shape forwards as CUDA graphs on a GPU (model/cudagraph.py; --cuda-graphs)
        self.cuda_graphs = DEFAULTS["cuda_graphs"] == "on"

    @property
    def dtype(self) -> torch.dtype:
        """Activations dtype (the weights' dtype, except in a lower-precision copy, see ``model/quant.py``)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        """Weights device."""
        return self.norm.weight.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (B, T) int64 -> (B, T, d)."""
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        b, t = input_ids.shape
        table = self.lm_head.weight_t if isinstance(self.lm_head, Linear) else self.tied_embedding  # (d, V)
        return table.index_select(1, input_ids.reshape(-1)).T.reshape(b, t, -1)

    def set_request_length(self, total_tokens: int) -> None:
        """Fix RoPE for a request of ``total_tokens`` positions (only dynamic NTK depends on it: ``rope.py``)."""
        self.rope = RotaryEmbedding(self.cfg, total_tokens, self.device)

    def rope_fits(self, total_tokens: int) -> bool:
        """Whether the current RoPE is the one of a request of ``total_tokens`` positions: always, except dynamic
        NTK's, whose frequencies depend on that length (a KV cache rotated for another length cannot be reused)."""
        return self.cfg.rope_type != "dynamic" or getattr(self.rope, "seq_len", None) == total_tokens

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                num_logits: int | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run the model on a block of tokens, reading and extending ``cache``.

        On a GPU with :attr:`cuda_graphs` set, a forward whose cache keeps its shapes from step to step (the retrieval
        tier's) replays a CUDA graph of it (``model/cudagraph.py``): the same kernels and logits, one launch.

        Args:
            input_ids: (B, T) int64 token ids.
            positions: (T,) int64 absolute positions, ``cache.length .. cache.length + T - 1``.
            cache: the KV cache the block attends over and is written into.
            num_logits: compute logits for the last ``num_logits`` positions only (None: all T).
            rows: (R,) int64 indices into T: compute logits for these positions only (overrides ``num_logits``).

        Returns:
            logits, fp32, shape (B, num_logits or R or T, V).

        Raises:
            CacheError: positions that do not continue the cache, or a block that does not fit.
        """
        if self.rope is None:
            self.rope = RotaryEmbedding(self.cfg, device=self.device)
        cache.begin_forward(positions)
        key = cache.graph_key() if rows is None and graphs_apply(self, cache) else None
        logits = None if key is None else run_graphed(self, cache, key, input_ids, positions, num_logits)
        if logits is None:
            logits = self.forward_begun(input_ids, positions, cache, num_logits, rows)
        cache.end_forward()
        return logits

    def forward_begun(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                      num_logits: int | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward` between ``cache.begin_forward`` and ``cache.end_forward``, which the caller makes (what a
        CUDA graph captures, ``model/cudagraph.py``); same arguments and result."""
        x = self.embed(input_ids)  # (B, T, d)
        cos, sin = self.rope.cos_sin(positions, x.dtype)  # (T, hs) each
        with exact_forward(cache.exact_rows(positions.numel())):  # the verifier's rows: row-invariant paths
            y = self.decode_step(x, cos, sin, cache) if self.decode_step is not None else None
            if y is not None:  # every layer in one call (csrc/decode_step.c: int8 lower tiers' decode steps)
                x = y
            else:
                for i, layer in enumerate(self.layers):
                    x = layer(x, cos, sin, cache, i)
            if rows is not None:
                x = x.index_select(1, rows)
            elif num_logits is not None:
                x = x[:, -num_logits:]
            return self.lm_head(self.norm(x)).float()

    def forward_ragged(self,
                       blocks: list[tuple[torch.Tensor, torch.Tensor, KVCache, int | None]]) -> list[torch.Tensor]:
        """One forward over the blocks of several sequences, each with its own cache (continuous batching).

        The blocks are laid one after another on the time axis, (1, sum T_i): the projections, MLPs and LM head
        read the weights once for every row, and each sequence attends over its own cache
        (:class:`~triforce.kv.caches.RaggedCache`). The verifier's blocks (decode steps and verification blocks of its
        full cache) get bitwise the logits :meth:`forward` gives each alone: they run on row-invariant paths, in a
        forward apart from any prefill chunk (``kernels/rows.py``); other blocks, up to the rounding of the products
        over more rows.

        Args:
            blocks: ``(input_ids (1, T_i) int64, positions (T_i,) int64, cache, num_logits or None)`` per sequence,
                as :meth:`forward` takes them.

        Returns:
            per block, its logits (1, num_logits or T_i, V) fp32.

        Raises:
            CacheError: a block's positions do not continue its cache, or it does not fit.
            ValueError: a block whose ``input_ids`` are not (1, T_i) with T_i = len(positions).
        """
        for ids, pos, _, _ in blocks:
            if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] != pos.numel():
                raise ValueError(f"blocks: input_ids must be (1, T) with T = len(positions), got "
                                 f"{tuple(ids.shape)} for {pos.numel()} positions")
        return split_exact(blocks, self._ragged)  # the verifier's blocks in forwards apart from prefill chunks

    def _ragged(self, blocks: list[tuple]) -> list[torch.Tensor]:
        """:meth:`forward_ragged` of blocks that all keep the rule, or none does (``exact.split_exact``)."""
        if len(blocks) == 1:
            ids, pos, cache, n = blocks[0]
            return [self(ids, pos, cache, num_logits=n)]
        lengths = [pos.numel() for _, pos, _, _ in blocks]
        rows, start, outs = [], 0, []
        for (_, _, _, n), t in zip(blocks, lengths):
            k = t if n is None else min(n, t)
            rows.append(torch.arange(start + t - k, start + t))
            outs.append(k)
            start += t
        logits = self(torch.cat([ids for ids, _, _, _ in blocks], dim=1), torch.cat([pos for _, pos, _, _ in blocks]),
                      RaggedCache([c for _, _, c, _ in blocks], lengths), rows=torch.cat(rows).to(self.device))
        return list(logits.split(outs, dim=1))  # each (1, k_i, V)

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu", tp=None, consume: bool = False) -> "Transformer":
        """Build a model from a Hugging Face state dict (names as in ``LlamaForCausalLM``).

        The weights are converted one layer at a time (q/k/v and gate/up concatenated, every projection stored
        transposed as ``(in, out)`` in ``dtype``), so the conversion needs one layer's temporaries on top of the
        checkpoint and the model, not a second copy of the checkpoint.

        Args:
            cfg, state: the whole model's configuration and weights.
            dtype, device: of the weights.
            tp: a :class:`~triforce.model.parallel.TensorParallel`: build this rank's shard (``model.cfg`` then has
                the local head counts and MLP width; see ``model/parallel.py``).
            consume: empty ``state`` (a dict) first and free each checkpoint tensor as soon as it is converted, so
                the peak memory is about one copy of the weights (the loader's choice). The caller must hold no other
                reference to the tensors for this to free anything.

        Raises:
            ValueError: a weight is missing or has the wrong shape (the name is in the message), or ``tp`` does not
                divide the heads (the valid sizes are in the message).
        """
        if tp is not None:
            from .parallel import shard_config, shard_state_dict

            sharded = shard_state_dict(cfg, state, tp.rank, tp.world_size)
            if consume:
                state.clear()
            state = sharded
            cfg = shard_config(cfg, tp.world_size)
        with torch.device("meta"):
            model = cls(cfg)
        renamed = {k.removeprefix("model."): v for k, v in state.items()}
        if consume:
            state.clear()  # from here on `renamed` holds the only references, and `take` drops them one by one
        del state
        new: dict[str, torch.Tensor] = {}

        def take(name: str) -> torch.Tensor:  # runs before `del renamed` below (F821: pyflakes sees the del)
            if name not in renamed:  # noqa: F821
                raise ValueError(f"checkpoint is missing weight {name!r}")
            return renamed.pop(name)  # noqa: F821

        def weight_t(*names: str) -> torch.Tensor:
            """The named (out, in) weights stacked along out, as our Linear stores them: (in, sum of out)."""
            parts = [take(n) for n in names]
            if isinstance(parts[0], BlockCodes):  # a GGUF file read as stored (formats/ggufcodes.py): no fp32 copy
                return concat_outputs(parts)
            w = parts[0] if len(parts) == 1 else torch.cat(parts)
            del parts
            return w.to(dtype).T.contiguous()

        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            new[a + "qkv_proj.weight_t"] = weight_t(*(a + f"{n}_proj.weight" for n in "qkv"))
            if cfg.qkv_bias:
                new[a + "qkv_proj.bias"] = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"])
            new[a + "o_proj.weight_t"] = weight_t(a + "o_proj.weight")
            if cfg.o_bias:
                new[a + "o_proj.bias"] = take(a + "o_proj.bias")
            new[m + "gate_up_proj.weight_t"] = weight_t(m + "gate_proj.weight", m + "up_proj.weight")
            new[m + "down_proj.weight_t"] = weight_t(m + "down_proj.weight")
            if cfg.mlp_bias:
                new[m + "gate_up_proj.bias"] = torch.cat([take(m + "gate_proj.bias"), take(m + "up_proj.bias")])
                new[m + "down_proj.bias"] = take(m + "down_proj.bias")
            for n in ("input_layernorm", "post_attention_layernorm"):
                new[p + n + ".weight"] = take(p + n + ".weight")
        new["norm.weight"] = take("norm.weight")
        if cfg.tie_word_embeddings and isinstance(renamed.get("embed_tokens.weight"), torch.Tensor):  # one matrix:
            # the LM head's (d, V), whose columns are the token embeddings (a GGUF file read as stored: codes, rows)
            new["lm_head.weight_t"] = weight_t("embed_tokens.weight")
        else:
            new["embed_tokens.weight"] = take("embed_tokens.weight")
            new["lm_head.weight_t"] = weight_t("lm_head.weight")
        del renamed
        coded = {k: new.pop(k) for k in [k for k, v in new.items() if not isinstance(v, torch.Tensor)]}
        params = dict(model.named_parameters())
        for name, tensor in new.items():
            if name not in params or tuple(params[name].shape) != tuple(tensor.shape):
                expected = tuple(params[name].shape) if name in params else None
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
        model.load_state_dict(new, strict=False, assign=True)
        place_stored(model, coded)  # block codes in place of weight_t, a GGUF embedding's rows (formats/ggufcodes.py)
        model = model.to(device=device, dtype=dtype)
        model.rope = RotaryEmbedding(cfg, device=device)
        if tp is not None:
            model.tp = tp
            for block in model.layers:
                block.self_attn.tp = block.mlp.tp = tp
        model.eval()
        return model

    def attach_block_codes(self) -> int:
        """Give every projection whose fp32 weights are a GGUF file's exact block codes its
        :class:`~triforce.kernels.codes.BlockCodes` (``Linear.codes``; the fp32 ``weight_t`` stays for prefill and
        for the lower tiers' copies), and, where every layer has them, a one-call decode step
        (:class:`~triforce.kernels.decode_step.DecodeStep`: decode steps and verification blocks over the full cache).

        Returns:
            how many projections got codes: 0 off the CPU, for dtypes other than fp32, under tensor parallelism,
            where the kernel is off or unavailable (``blockcodes_status()``), or where no matrix is block codes.
        """
        from ..kernels.blockcodes import blockcodes_status
        from ..kernels.codes import find_block_codes
        from ..kernels.decode_step import DecodeStep

        if (self.device.type != "cpu" or self.dtype != torch.float32 or self.tp is not None
                or not blockcodes_status().startswith("on")):
            return 0
        count = 0
        for module in self.modules():
            if isinstance(module, Linear):
                if module.weight_t is not None:  # else codes read from the file as stored (formats/ggufcodes.py)
                    module.codes = find_block_codes(module.weight_t)
                count += module.codes is not None
        try:  # every layer on codes: its decode steps and verification blocks in one call where the cache offers it
            self.decode_step = DecodeStep(self)
        except ValueError:
            self.decode_step = None
        return count

    def pack_weights(self) -> bool:
        """Add a oneDNN-prepacked copy of every projection, for products of several rows on the CPU outside the
        verifier's decode steps and blocks, which keep our kernel (``kernels/rows.py``): prefill, a lower tier's blocks.

        A speculative verification multiplies gamma + 1 rows by each weight matrix; oneDNN with weights reordered for
        its kernels (``torch.ops.mkldnn``, what ``torch.compile``'s CPU freezing uses) runs such products faster than
        MKL's general matrix product. One-row decode steps keep the (in, out) layout. Costs one more copy of the
        weights.

        Returns:
            True when packed; False (nothing changed) off the CPU, for dtypes other than fp32, or where oneDNN's
            linear kernels are unavailable (feature detection with a fallback).
        """
        if self.device.type != "cpu" or self.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
            return False
        try:
            probe = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 8), None)
            torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), probe, None, "none", [], "")
        except (RuntimeError, AttributeError, NotImplementedError):
            return False
        for module in self.modules():
            if isinstance(module, Linear) and module.weight_t is not None:
                module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight_t.detach().T.contiguous(), None)
        return True

    def packing_pays(self) -> bool:
        """The ``auto`` rule of ``--packed-weights``: a CPU model in fp32 whose weights take at most a quarter of the
        free memory (the packed copy doubles them), where our fp32 kernel for a few rows (``kernels.f32_linear``) cannot
        run or is slower than oneDNN's packed product (the AVX2 build, :func:`~triforce.kernels.cpu.f32_beats_onednn`).
        Not where the weights are block codes (``kernels/blockcodes.py``): 2-64 rows read the codes."""
        from ..kernels.cpu import f32_beats_onednn
        from ..kv.memory import available_bytes

        return (self.device.type == "cpu" and self.dtype == torch.float32 and isinstance(self.lm_head, Linear)
                and self.lm_head.codes is None and not f32_beats_onednn()
                and 4 * self.weight_bytes() <= available_bytes("cpu"))

    COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")

    def compile_blocks(self, mode: str = "default") -> None:
        """``torch.compile`` the fixed-shape tensor code of every block (norms, MLP), leaving the cache calls eager.

        A decode step and a verification of gamma tokens run the same few shapes every time, so the compiled
        kernels (fused SiLU-gate and RMSNorm; with ``reduce-overhead``, CUDA graphs of those segments) are reused;
        the caches' indexing stays in eager mode because its shapes change with the context length.

        Args:
            mode: a ``torch.compile`` mode, one of :attr:`COMPILE_MODES`.

        Raises:
            ValueError: an unknown mode (the allowed ones are in the message).
        """
        if mode not in self.COMPILE_MODES:
            raise ValueError(f"compile mode must be one of {', '.join(self.COMPILE_MODES)}, got {mode!r}")
        for block in self.layers:
            for module in (block.input_layernorm, block.post_attention_layernorm, block.mlp):
                module.forward = compile_forward(module.forward, mode)
        self.compile_mode = mode

    def weight_bytes(self) -> int:
        """Bytes of the model's parameters (tied weights counted once)."""
        return (sum(p.numel() * p.element_size() for p in self.parameters())
                + sum(m.codes.nbytes for m in self.modules() if isinstance(m, Linear) and m.weight_t is None)
                + (self.embed_tokens.nbytes if isinstance(self.embed_tokens, StoredRows) else 0))

    def layers_on_codes(self) -> bool:
        """Whether every layer's projections read GGUF block codes in one-call decode steps
        (:meth:`attach_block_codes`), so that a ``codes`` lower tier (``model/quant.py``) needs no copy of the
        weights."""
        return self.decode_step is not None and all(getattr(lin, "codes", None) is not None for block in self.layers
                                                    for lin in (block.self_attn.qkv_proj, block.mlp.down_proj))

    def step_weight_bytes(self) -> int:
        """Bytes of weights a decode step reads: a projection's block codes where it has them
        (``kernels/blockcodes.py``), else its parameters (:meth:`weight_bytes` without the codes' fp32 copies; the
        embedding row is not counted apart from the tied LM head)."""
        coded = [m for m in self.modules() if isinstance(m, Linear) and m.codes is not None and m.weight_t is not None]
        return self.weight_bytes() - sum(m.weight_t.numel() * m.weight_t.element_size() - m.codes.nbytes for m in coded)
