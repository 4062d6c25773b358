"""Weights kept as a file stores them, put into a built model: a Linear's :class:`~triforce.kernels.codes.BlockCodes`
in place of its fp32 ``weight_t``, and a token embedding's rows (a :class:`StoredRows`) in place of ``nn.Embedding``.
"""

from __future__ import annotations

import torch

from .codes import BlockCodes


class StoredRows(torch.nn.Module):
    """A token embedding kept as a file stores it, each looked-up row widened or dequantized to fp32 exactly: the rows
    the fp32 model's ``nn.Embedding`` would return. Subclasses give :attr:`shape`, :attr:`nbytes` and :meth:`rows`
    (:class:`Rows16`; ``formats.ggufcodes.GGUFRows``).
    """

    @property
    def shape(self) -> tuple[int, int]:
        """(V, d), as the dense embedding's."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes held here."""
        raise NotImplementedError

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(n,) int64 row ids -> (n, d) fp32 on the CPU."""
        raise NotImplementedError

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) int64 -> (B, T, d) fp32 on ids' device
        return self.rows(ids).reshape(*ids.shape, self.shape[1]).to(ids.device)


class Rows16(StoredRows):
    """A bf16 or fp16 checkpoint's token embedding at 2 bytes a weight, each row widened exactly to fp32.

    Attributes:
        table: (V, d) bf16 or fp16, the checkpoint's rows; or None where ``codes`` (a tied LM head's
            :class:`~triforce.kernels.codes.BlockCodes` of width 16, (V / 8, d, 8)) hold them: row v is
            ``codes[v // 8, :, v % 8]``, no second copy.

    Raises:
        ValueError: (on construction) neither or both of ``table`` and ``codes``, or codes of another width.
    """

    def __init__(self, table: torch.Tensor | None = None, codes: BlockCodes | None = None) -> None:
        super().__init__()
        if (table is None) == (codes is None) or (codes is not None and codes.bits != 16):
            raise ValueError("Rows16: give a (V, d) 2-byte table or a tied head's 2-byte codes, not both")
        self.table, self.codes = table, codes

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.table.shape) if self.table is not None else (self.codes.out_features, self.codes.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes held here (0 where the LM head's codes hold the rows: counted there)."""
        return 0 if self.table is None else self.table.numel() * self.table.element_size()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.reshape(-1)
        if self.table is not None:
            return self.table.index_select(0, ids).float()
        return self.codes.codes[ids // 8, :, ids % 8].float()


def place_stored(model: torch.nn.Module, stored: dict) -> None:
    """Put weights kept as a file stores them into a built model: ``"<module>.weight_t"`` -> :class:`BlockCodes`
    (the Linear keeps no fp32 ``weight_t``), ``"<attribute>.weight"`` -> a :class:`StoredRows` that replaces the
    attribute.

    Raises:
        TypeError: a value that is neither.
    """
    for name, value in stored.items():
        owner = name.rpartition(".")[0]
        if isinstance(value, BlockCodes):
            module = model.get_submodule(owner)
            module.weight_t, module.codes = None, value
        elif isinstance(value, StoredRows):
            setattr(model, owner, value)
        else:
            raise TypeError(f"place_stored: {name!r} is a {type(value).__name__}, not BlockCodes or StoredRows")


def dense_weight_t(linear) -> torch.Tensor:
    """A Linear's (in, out) fp32 weights: its ``weight_t``, or its codes dequantized (a GGUF file read as stored)."""
    return linear.weight_t if linear.weight_t is not None else linear.codes.dequantize()
