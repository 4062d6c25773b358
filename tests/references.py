"""Independent references the kernels and caches are checked against: ggml's Q4_1 / Q8_0 round trips and a
transformers model on those grids, the Q8-activation integer dot product's definition, and the retrieval cache's chunk
selection by brute force."""

import math

import torch


def q4_1(w: torch.Tensor) -> torch.Tensor:
    """ggml's Q4_1 round trip of an (out, in) matrix along in (llama.cpp quantize_row_q4_1_ref, gguf-py dequantize):
    fp16 scale (max - min) / 15 and fp16 minimum per block of 32; returns the dequantized fp32 weights."""
    b = w.float().reshape(w.shape[0], -1, 32)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    q = torch.where(d > 0, ((b - lo) / torch.where(d > 0, d, 1) + 0.5).floor(), 0).clamp(0, 15)
    return (d.half().float() * q + lo.half().float()).reshape(w.shape)


def q8_0(w: torch.Tensor) -> torch.Tensor:
    """ggml's Q8_0 round trip (quantize_row_q8_0_ref): fp16 scale max |w| / 127 per block of 32."""
    b = w.float().reshape(w.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.round(b / torch.where(d > 0, d, 1)).clamp(-127, 127)
    return (d.half().float() * q).reshape(w.shape)


def gguf_like(hf, embed=q8_0, proj=q4_1):
    """Replace a transformers model's matrices by their GGUF round trips, as a Q4_1 file with a Q8_0 embedding."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2 and p.shape[1] % 32 == 0:
                p.copy_(embed(p) if "embed" in name else proj(p))
    return hf


def q8_dot_reference(x: torch.Tensor, codes) -> torch.Tensor:
    """The integer dot products' definition (blockcodes.blockcode_linear_q8, llama.cpp's Q8_0 activations) in float64:
    per block b of 32 inputs, dx = max |x| / 127 (fp32), xq = round(x * (127 / max |x|)) (fp32, half to even), and
    y_o = sum_g d_go dx_b sum_i q_io xq_i + m_go sum_i x_i over the scale groups g of ``codes.group`` inputs (32, or
    16: Q6_K) with the inputs' fp32 sums; ``codes`` with fp16 or fp32 scales."""
    m, n_in = x.shape
    group = codes.group
    xg = x.reshape(m, n_in // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.full_like(amax, 127.0) / amax  # a true division (torch's 127 / t multiplies by t's reciprocal)
    xq = torch.round(xg * torch.where(amax > 0, inv, torch.zeros_like(amax))).double().reshape(m, n_in // group, group)
    dx = (amax / 127).double().repeat_interleave(32 // group, dim=1)
    w = codes.dequantize().double()  # (in, out) = d q + m
    deq_m = codes.m.double().permute(1, 0, 2).reshape(n_in // group, -1) if codes.m is not None else None
    d = codes.d.double().permute(1, 0, 2).reshape(n_in // group, -1)  # (groups, out)
    q = w.reshape(n_in // group, group, -1)
    if deq_m is not None:
        q = q - deq_m[:, None]
    dg = d[:, None]  # the codes back from d q (exact: d q was exact in fp32); a zero scale's codes count for nothing
    q = torch.where(dg != 0, torch.round(q / torch.where(dg != 0, dg, torch.ones_like(dg))), torch.zeros_like(q))
    y = torch.einsum("mgi,gio->mgo", xq, q).mul(dx).mul(d[None]).sum(1)
    if deq_m is not None:
        sums = torch.stack([x[:, i:i + group].sum(-1) for i in range(0, n_in, group)], dim=1)  # fp32, in order
        y = y + (sums.double()[..., None] * deq_m[None]).sum(1)
    return y


def reference_selection(keys, query, length: int, budget: int, chunk: int) -> torch.Tensor:
    """The retrieval cache's selection by brute force (TriForce Sec. 4.1): per layer and KV head, chunks ranked by
    the sum over the group's query heads of q . mean(K_chunk), chunk 0 first, ties to the earlier chunk.

    keys (L, 1, nkv, >= length, hs) post-RoPE, query (L, 1, nh, hs); returns (L, nkv, budget) int64 positions, the
    first ``budget`` of the ranked chunks' positions, -1 where fewer."""
    L, NKV, NH = keys.shape[0], keys.shape[2], query.shape[2]
    sel = torch.full((L, NKV, budget), -1, dtype=torch.long)
    for layer in range(L):
        for h in range(NKV):
            scores = []
            for c in range(math.ceil(length / chunk)):
                mean = keys[layer, 0, h, c * chunk:min(length, (c + 1) * chunk)].mean(0)
                s = sum(float(query[layer, 0, h * (NH // NKV) + j] @ mean) for j in range(NH // NKV))
                scores.append(math.inf if c == 0 else s)
            order = sorted(range(len(scores)), key=lambda c: (-scores[c], c))
            tokens = [p for c in order for p in range(c * chunk, min(length, (c + 1) * chunk))][:budget]
            sel[layer, h, :len(tokens)] = torch.tensor(tokens)
    return sel
