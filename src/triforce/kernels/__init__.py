"""CPU kernels and the rules they keep: C sources (``csrc/``), their build, the product dispatch, the row rule.

``build.py`` compiles and loads ``csrc/*.c``; ``cpu.py`` wraps the attention, product, norm and RoPE kernels with
PyTorch's ops as fallback; ``blockcodes.py`` the products on a GGUF file's block codes; ``decode_step.py`` a whole
decode step in one C call; ``rows.py`` the row-invariance rule every verifier path keeps; ``sdpa.py`` attention
through PyTorch; ``threads.py`` and ``hugepages.py`` the CPU runtime they run in.
This package imports nothing of triforce's but ``defaults`` and ``errors``.
"""
