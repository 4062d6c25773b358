"""The request plan: every request is sized and placed once, before anything is allocated.

:func:`size_request` gives a request's capacities in positions; :func:`size_caches` the bytes of every cache and
weight copy the engine will make and, with KV offloading, where the full cache's layers live
(:func:`~triforce.kv.memory.place_kv`); :func:`check_plan_fits` refuses a plan that does not fit in free memory.
:meth:`~triforce.engine.Engine.plan` makes the :class:`RequestPlan` with these and
:meth:`~triforce.engine.Engine.build_hierarchy` allocates from it, so nothing is recomputed in between.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Mapping

import torch

from .kv.caches import KV_DTYPES, kv_bytes
from .kv.memory import KVPlacement, check_fits, place_kv
from .model.transformer import Transformer
from .speculation.auto import AutoPlan
from .speculation.hierarchy import SpeculationConfig, gamma_cap

#: tokens per prefill forward of a StreamingLLM tier (its cache holds one such chunk beyond sink + window)
DRAFT_PREFILL_CHUNK = 256
#: bytes per weight of the lower tiers' weight copies (int4: 4 bits + a bf16 scale and zero per 32 weights)
BYTES_PER_WEIGHT = {"int8": 1.0, "int4": 0.625, "bfloat16": 2.0, "codes": 1.0}  # codes: none on block codes
FULL_CACHE = "full KV cache"


@dataclass(frozen=True)
class RequestPlan:
    """The sizes and placement of one request (all counts in tokens, sizes in bytes).

    Attributes:
        prompt_tokens, max_new_tokens: the request's lengths.
        spec: the hierarchy the request runs (``auto`` resolved, every gamma capped at ``max_new_tokens - 1``).
        full_capacity: positions of the verifier's full KV cache: prompt + new tokens + the largest block the
            verifier checks at once (at most ``max_new_tokens - 1``) + 1.
        lookahead: most positions any tier may run ahead of the committed sequence (sum of the tiers' largest
            gammas + one per tier + 1).
        draft_capacity: slots of a StreamingLLM tier's cache: sink + window + ``lookahead`` + one prefill chunk.
        cache_bytes: bytes each cache (and each lower-precision weight copy still to make) will allocate, by name.
        placement: with KV offloading, where the full cache's layers live; None otherwise.
        auto: what ``mode='auto'`` chose for the request (None for any other mode).
    """

    prompt_tokens: int
    max_new_tokens: int
    spec: SpeculationConfig
    full_capacity: int
    lookahead: int
    draft_capacity: int
    cache_bytes: Mapping[str, int] = field(default_factory=dict)
    placement: KVPlacement | None = None
    auto: AutoPlan | None = None

    @property
    def streaming_extra(self) -> int:
        """Slots a StreamingLLM cache keeps beyond sink + window (rollback room and one prefill chunk)."""
        return self.lookahead + DRAFT_PREFILL_CHUNK


def draft_kv_dtype(target: Transformer, draft: Transformer, kv_dtype: torch.dtype) -> torch.dtype:
    """dtype of a draft model's StreamingLLM cache without ``lower_kv_dtype``: the full cache's ``kv_dtype`` when the
    draft computes in the target's dtype, else the draft's own dtype."""
    return kv_dtype if draft.dtype == target.dtype else draft.dtype


def size_request(prompt_tokens: int, max_new_tokens: int, spec: SpeculationConfig) -> tuple[int, int, int]:
    """``(full_capacity, lookahead, draft_capacity)`` of a request (see :class:`RequestPlan`), in positions.

    Each tier's gamma counts at most ``max_new_tokens - 1`` (at least 1): no verification asks for more proposals
    than the request has tokens left (:meth:`~triforce.speculation.hierarchy.SpeculationConfig.for_request`), so a huge
    gamma does not size the caches."""
    cap = gamma_cap(max_new_tokens)
    chain = [(kind, min(g, cap)) for kind, g in spec.max_chain]
    block = chain[-1][1] if chain else 0  # the largest block the verifier checks at once
    lookahead = sum(g for _, g in chain) + len(chain) + 1
    draft = spec.draft_sink + spec.draft_window + lookahead + DRAFT_PREFILL_CHUNK
    return prompt_tokens + max_new_tokens + block + 1, lookahead, draft


def cache_capacity(prompt_tokens: int, max_new_tokens: int, spec: SpeculationConfig) -> int:
    """Positions of a full cache that a request fits whatever hierarchy ``spec`` resolves to: :func:`size_request`'s,
    and with ``mode='auto'`` room for the largest block any plan may verify (``gamma_cap``), so that a cache made
    before planning (a prompt cache's file loaded into it) is never copied into a larger one."""
    auto = spec.mode == "auto" and spec.tiers is None
    return size_request(prompt_tokens, max_new_tokens, spec)[0] + (gamma_cap(max_new_tokens) if auto else 0)


def size_caches(target: Transformer, draft: Transformer | None, spec: SpeculationConfig, prompt_tokens: int,
                max_new_tokens: int, kv_dtype: torch.dtype, *, existing_copies: Collection[tuple[int, str]] = (),
                offload_kv: bool = False, on_chip_layers: int | None = None) -> RequestPlan:
    """Size a request's caches and, with ``offload_kv``, place the full cache's layers.

    Args:
        target, draft: the models (the draft only matters for a hierarchy with a ``draft`` tier).
        spec: the request's hierarchy (``auto`` already resolved).
        prompt_tokens, max_new_tokens: lengths, tokens.
        kv_dtype: dtype of the full cache (and of the lower caches without ``spec.lower_kv_dtype``).
        existing_copies: ``(id(model), scheme)`` of the lower-precision weight copies already made (not counted).
        offload_kv: keep the full cache in host memory, streamed layer by layer.
        on_chip_layers: with ``offload_kv``, leading layers kept on the device (None: chosen from free memory).

    Returns:
        :class:`RequestPlan` (its ``auto`` None).

    Raises:
        ValueError, InsufficientMemoryError: from :func:`~triforce.kv.memory.place_kv` (offloading only).
    """
    full_capacity, lookahead, draft_capacity = size_request(prompt_tokens, max_new_tokens, spec)
    lower = KV_DTYPES.get(spec.lower_kv_dtype)
    kinds = [k for k, _ in spec.chain]
    out = {FULL_CACHE: kv_bytes(target.cfg, full_capacity, kv_dtype)}
    if "retrieval" in kinds:
        out["retrieval cache"] = kv_bytes(target.cfg, spec.budget, lower or kv_dtype)
    if "draft" in kinds and draft is not None:
        out["draft cache"] = kv_bytes(draft.cfg, draft_capacity, lower or draft_kv_dtype(target, draft, kv_dtype))
    if "self" in kinds:
        out["self-draft cache"] = kv_bytes(target.cfg, draft_capacity, lower or kv_dtype)
    copies = [(m, spec.lower_weights) for m in ([target] if "retrieval" in kinds else [])
              + ([draft] if "draft" in kinds and draft is not None else []) if spec.lower_weights]
    copies += [(target, spec.self_weights)] if "self" in kinds else []
    for m, scheme in dict.fromkeys(copies):
        if (id(m), scheme) not in existing_copies and not (scheme == "codes" and m.layers_on_codes()):
            key = f"{scheme} copies of the lower tiers' weights"
            out[key] = out.get(key, 0) + int(m.weight_bytes() // m.dtype.itemsize * BYTES_PER_WEIGHT[scheme])
    placement = None
    if offload_kv:
        L = target.cfg.num_hidden_layers
        others = sum(v for k, v in out.items() if k != FULL_CACHE)
        placement = place_kv(L, out[FULL_CACHE] // L, target.device, others, on_chip_layers)
    return RequestPlan(prompt_tokens, max_new_tokens, spec, full_capacity, lookahead, draft_capacity, out, placement)


def check_plan_fits(plan: RequestPlan, device: torch.device, weight_bytes: int) -> None:
    """Refuse a plan whose caches do not fit beside the weights already loaded.

    Without offloading everything is on ``device``; with it, the on-chip layers, stream buffers and lower caches
    are on the device and the whole full cache in host memory (one pool on a CPU).

    Raises:
        InsufficientMemoryError: with the figures (bytes by cache, weights, free memory).
    """
    weights = {"weights": weight_bytes}
    needed = dict(plan.cache_bytes)
    if plan.placement is None:
        check_fits(needed, device, "this request", already=weights)
        return
    full = needed.pop(FULL_CACHE)
    on_device = dict(needed, **{"on-chip KV layers and stream buffers": plan.placement.device_bytes})
    if torch.device(device).type == "cpu":  # one memory pool
        check_fits(dict(on_device, **{"offloaded full KV cache": full}), "cpu", "this request", already=weights)
    else:
        check_fits(on_device, device, "this request", already=weights)
        check_fits({"offloaded full KV cache": full}, "cpu", "this request's host memory")
