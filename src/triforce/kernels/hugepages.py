"""2 MiB pages for PyTorch's CPU memory (Linux transparent huge pages).

A decode step on the CPU streams every weight and the whole KV cache once, hundreds of MB, through 4 KiB pages:
one TLB entry covers 4 KiB, so the step walks page tables all along its stream (on a virtual machine, two levels of
them). With ``THP_MEM_ALLOC_ENABLE=1`` PyTorch's CPU allocator (c10's ``alloc_cpu``) aligns every allocation of
2 MiB or more to 2 MiB and advises ``MADV_HUGEPAGE``, so where the kernel's transparent huge pages are on for
``madvise`` (``/sys/kernel/mm/transparent_hugepage/enabled``: ``[madvise]`` or ``[always]``) it backs those
buffers with 2 MiB pages: decoding a few per cent faster (docs/usage.md, "Tuning"). So triforce sets it unless the
user chose.

c10 reads the variable once, at the process's first CPU allocation: :func:`configure_huge_pages` must run before
any tensor is made. ``import triforce`` calls it first thing (``import torch`` alone allocates nothing), which
covers the ``triforce`` command, the server and Python programs that import triforce before they make tensors.
``THP_MEM_ALLOC_ENABLE=0`` keeps 4 KiB pages. Not on the CUDA path: device memory and pinned host buffers come
from CUDA's allocators.

Sources: PyTorch's ``c10/core/impl/alloc_cpu.cpp`` (``THP_MEM_ALLOC_ENABLE``); the Linux kernel's
``Documentation/admin-guide/mm/transhuge.rst`` (``madvise`` mode, ``AnonHugePages``).
"""

from __future__ import annotations

import os
import sys

#: the environment variable PyTorch's CPU allocator reads (c10/core/impl/alloc_cpu.cpp)
HUGE_PAGES_VAR = "THP_MEM_ALLOC_ENABLE"


def configure_huge_pages() -> bool:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` for this process on Linux unless the user set it.

    Returns:
        True when the variable was set now; False off Linux or when the environment already has it (the user's
        choice, ``0`` included, stands). It takes effect only if no CPU tensor was allocated before (see the module
        docstring).

    Raises:
        nothing: it only reads and writes ``os.environ``.
    """
    if not sys.platform.startswith("linux") or HUGE_PAGES_VAR in os.environ:
        return False
    os.environ[HUGE_PAGES_VAR] = "1"
    return True
