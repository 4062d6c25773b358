"""Token-list helpers shared by every layer that compares token sequences."""

from __future__ import annotations

from typing import Sequence


def common_prefix_length(a: Sequence, b: Sequence) -> int:
    """The number of leading positions at which ``a`` and ``b`` hold equal items (``==``), at most ``min(len(a),
    len(b))``: 0 when either is empty or their first items differ."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
