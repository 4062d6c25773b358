"""Tensor parallelism across processes and GPUs with ``torch.distributed``.

Megatron-style sharding (Shoeybi et al., arXiv 1909.08053, Sec. 3): in every block, the q/k/v projections and
the MLP's gate/up projections are split by output columns (each rank owns ``nh / N`` query heads, ``nkv / N`` KV
heads and ``intermediate / N`` MLP channels), and the attention output and MLP down projections are split by input
rows, followed by one all-reduce each. Embeddings, norms and the LM head are replicated, so every rank ends a
forward with the same logits. Each rank's KV caches hold only its own KV heads; the retrieval cache scores chunks
per KV head, so every rank selects exactly what a single process would select for those heads.

Sampling: every random decision (a verification's accepted count and its recovered/bonus token) is taken on
rank 0 and broadcast (:meth:`TensorParallel.broadcast_decision`), so the ranks stay in lockstep even where
floating-point sums in a different order could tip a draw.

Launch with ``torchrun --nproc-per-node N -m triforce generate ... --tp N``: NCCL on GPUs, gloo on CPUs.
A draft model is replicated on every rank (it is tiny; its decisions are broadcast like every other tier's).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

import torch

from ..errors import ParameterError
from .config import ModelConfig


def valid_tp_sizes(cfg: ModelConfig) -> list[int]:
    """Tensor-parallel sizes N that divide the query heads, the KV heads and the MLP width of ``cfg``."""
    return [n for n in range(1, cfg.num_attention_heads + 1)
            if cfg.num_attention_heads % n == 0 and cfg.num_key_value_heads % n == 0 and cfg.intermediate_size % n == 0]


def check_tp_size(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError unless ``tp`` splits ``cfg``'s heads evenly (the message lists the valid sizes)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
    valid = valid_tp_sizes(cfg)
    if tp not in valid:
        raise ValueError(f"tp={tp} does not divide the model's {cfg.num_attention_heads} query heads, "
                         f"{cfg.num_key_value_heads} KV heads and MLP width {cfg.intermediate_size}; valid tp: "
                         f"{', '.join(map(str, valid))}")


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The configuration one rank runs: ``nh / tp`` query heads, ``nkv / tp`` KV heads, ``intermediate / tp``."""
    check_tp_size(cfg, tp)
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                               num_key_value_heads=cfg.num_key_value_heads // tp,
                               intermediate_size=cfg.intermediate_size // tp)


def shard_state_dict(cfg: ModelConfig, state: Mapping[str, torch.Tensor], rank: int,
                     tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slice of a Hugging Face Llama state dict (weights (out, in), names as in LlamaForCausalLM).

    Column-parallel (split by output rows of the HF weight): q/k/v projections by heads, gate/up by channels, with
    their biases. Row-parallel (split by input columns): o_proj and down_proj; their biases are kept on rank 0 only
    (zero elsewhere), so the all-reduce adds them once. Everything else is replicated.

    Raises:
        ValueError: ``tp`` does not divide the heads (see :func:`check_tp_size`) or ``rank`` is outside [0, tp).
    """
    check_tp_size(cfg, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank}")
    hs = cfg.head_dim
    q_rows = cfg.num_attention_heads // tp * hs
    kv_rows = cfg.num_key_value_heads // tp * hs
    mlp_rows = cfg.intermediate_size // tp
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        base = name.removeprefix("model.")
        if base.endswith(("q_proj.weight", "q_proj.bias")):
            w = w[rank * q_rows:(rank + 1) * q_rows]
        elif base.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            w = w[rank * kv_rows:(rank + 1) * kv_rows]
        elif base.endswith(("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias")):
            w = w[rank * mlp_rows:(rank + 1) * mlp_rows]
        elif base.endswith("o_proj.weight"):
            w = w[:, rank * q_rows:(rank + 1) * q_rows]
        elif base.endswith("down_proj.weight"):
            w = w[:, rank * mlp_rows:(rank + 1) * mlp_rows]
        elif base.endswith(("o_proj.bias", "down_proj.bias")) and rank != 0:
            w = torch.zeros_like(w)
        out[name] = w.contiguous() if w.dim() else w
    return out


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group.

    Attributes:
        rank: 0 .. world_size - 1 (rank 0 decides every random draw and is the only one that prints).
        world_size: N, the number of ranks.
        device: the device this rank computes on.
        group: the ``torch.distributed`` process group (None: the default group).
    """

    rank: int
    world_size: int
    device: torch.device
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def broadcast_decision(self, n_accepted: torch.Tensor,
                           next_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0's verification outcome on every rank: ``n_accepted`` (B,) and ``next_token`` (B,) int64."""
        import torch.distributed as dist

        both = torch.stack([n_accepted.to(torch.long), next_token.to(torch.long)]).to(self.device)  # (2, B)
        dist.broadcast(both, src=0, group=self.group)
        return both[0].to(n_accepted.device), both[1].to(next_token.device)

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (e.g. the random seed)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.broadcast(t, src=0, group=self.group)
        return int(t.item())


T = TypeVar("T")

#: seconds a rank waits at exit for the other ranks before it destroys the gloo group anyway
TEARDOWN_BARRIER_S = 60


def agree_on_fit(tp: TensorParallel | None, check: Callable[[], T]) -> T:
    """Run a memory check on every rank and make its verdict common: every rank raises when any rank refuses.

    Free memory differs from rank to rank, so each rank's own check may disagree with the others'; a rank that refused
    alone would leave the others waiting forever in the next collective. After ``check`` each rank all-reduces a
    refusal flag (one collective, so every rank of the group must call this at the same point).

    Args:
        tp: this process's tensor-parallel group, or None (one process: ``check`` runs as is).
        check: the check; it returns a value (returned here) or raises
            :class:`~triforce.kv.memory.InsufficientMemoryError`. Any other exception passes through without the
            agreement, so it must be one every rank raises alike (a bad argument).

    Returns:
        ``check()``'s value.

    Raises:
        InsufficientMemoryError: on a refusing rank its own message, prefixed with its rank; on the others, which ranks
            refused.
    """
    from ..kv.memory import InsufficientMemoryError

    if tp is None:
        return check()
    result, error = None, None
    try:
        result = check()
    except InsufficientMemoryError as e:
        error = e
    refused = torch.zeros(tp.world_size, dtype=torch.long, device=tp.device)
    refused[tp.rank] = int(error is not None)
    tp.all_reduce(refused)
    if error is not None:
        raise InsufficientMemoryError(f"rank {tp.rank}: {error.template}") from error
    ranks = refused.nonzero().flatten().tolist()
    if ranks:
        raise InsufficientMemoryError(f"rank {', '.join(map(str, ranks))} of {tp.world_size} refused for lack of "
                                      "memory (its own message says how much); every rank stops")
    return result


def init_tensor_parallel(tp: int, device: str | torch.device = "cpu") -> TensorParallel | None:
    """Join the tensor-parallel group a launcher (torchrun) set up in the environment; None when ``tp == 1``.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` (set by ``torchrun``) and
    initialises ``torch.distributed`` with NCCL for CUDA devices and gloo for the CPU. On CUDA, rank r computes on
    ``cuda:LOCAL_RANK``. The process group it creates is destroyed at interpreter exit (an ``atexit`` handler, while
    Python is still alive): a gloo group left to the C++ destructors aborts the process at finalization now and then
    ("terminate called without an active exception", pytorch/pytorch#190489), which torchrun reports as a failed rank
    after the output was complete.

    Raises:
        ValueError: ``tp`` < 1, or the process was not launched with ``tp`` ranks (the message shows the torchrun
            command line).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp == 1:
        if world > 1:
            raise ParameterError(f"`tp`=1 but this process is one of {world} launched ranks: pass `tp`={world}")
        return None
    if world != tp:
        raise ValueError(f"tp={tp} needs {tp} processes, one per rank: launch with "
                         f"`torchrun --nproc-per-node {tp} -m triforce generate ... --tp {tp}` "
                         f"(this process sees WORLD_SIZE={world})")
    import torch.distributed as dist

    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        atexit.register(_destroy_process_group)
    return TensorParallel(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)


def _destroy_process_group() -> None:
    """Destroy the default process group if it still exists (registered by :func:`init_tensor_parallel`).

    Under gloo every rank first waits for the others (a monitored barrier, :data:`TEARDOWN_BARRIER_S` at most): a rank
    that tore its group down while its peer was still finishing closes the connections under the peer's gloo threads,
    and the peer aborts ("terminate called without an active exception"). A rank that is gone (the barrier times out or
    fails) does not stop the others' teardown."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=TEARDOWN_BARRIER_S))
        except RuntimeError:
            pass
    dist.destroy_process_group()
