"""Every CPU kernel's status in one dict: what ``triforce generate --json`` and ``triforce bench`` report."""

from __future__ import annotations

from .blockcodes import blockcodes_status
from .cpu import linear_status, norm_rope_status, status
from .sampling import sampling_status


def kernel_status() -> dict[str, str]:
    """Each kernel's 'on (...)', 'off (...)' or 'unavailable: <reason>' (loads those nobody has yet).

    Returns:
        ``attention_kernel`` (csrc/attention.c), ``linear_kernel`` (qlinear.c), ``norm_rope_kernel`` (norm_rope.c),
        ``block_code_kernel`` (blockcodes.c), ``sampling_kernel`` (sampling.c), in this order.
    """
    return dict(attention_kernel=status(), linear_kernel=linear_status(), norm_rope_kernel=norm_rope_status(),
                block_code_kernel=blockcodes_status(), sampling_kernel=sampling_status())
