"""Research tools: benchmarks, the paper's analyses, the cost model, paper-shaped random models, the books.

Nothing in the library imports this package; the command line imports it lazily for ``triforce bench`` and
``triforce analyze``.

==============  ===============================================================================================
``bench/``      ``triforce bench``: side-by-side decode speed (transformers, llama.cpp, our modes), interleaved
``analyze/``    ``triforce analyze``: attention recovery, contextual locality, acceptance sweeps (Sec. 3, 4.1)
``costmodel``   measured tier latencies and the predicted speedup of a hierarchy
``batchcost``   the batched roofline model (MagicDec): the speedup of speculation at batch > 1
``synthetic``   random-weight models of the paper's shapes, random KV (timing only)
``books``       the books folder, a book by name, its first N tokens
``provenance``  the git commit of the code behind a result (every result JSON names it)
==============  ===============================================================================================
"""
