"""The model: configuration, RoPE, the decoder forward, weight copies for the lower tiers, tensor parallelism,
CUDA graphs and continuous batching of forwards.

``transformer.py`` is the forward pass (one file, gpt-fast style); ``config.py`` the numbers it reads; ``rope.py``
the rotary embedding and its scaling variants; ``quant.py`` cheaper weight copies; ``parallel.py`` tensor
parallelism; ``cudagraph.py`` replayed forwards; ``batching.py`` ragged forwards of concurrent generations.
"""
