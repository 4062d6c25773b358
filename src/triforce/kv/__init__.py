"""KV caches: which keys and values each tier attends over, and what they cost in memory.

``caches.py`` defines the interface and the verifier's full cache; ``retrieval.py`` the middle tier's retrieval
cache (TriForce, arXiv 2404.11912, Sec. 4.1); ``streaming.py`` the draft's StreamingLLM cache (arXiv 2309.17453);
``promptcache.py`` a prompt's full cache kept on disk; ``memory.py`` memory accounting and KV offloading plans.
This package imports the kernels, never the model: the model's forward takes a cache.
"""
