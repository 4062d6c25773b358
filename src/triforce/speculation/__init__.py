"""Speculation: where a token is drafted, verified and accepted.

``rule.py`` is the verification rule (accepted, recovered and bonus tokens); ``sampling.py`` turns logits into the
distribution every tier samples from; ``tiers.py`` holds the tiers that draft and verify; ``hierarchy.py`` describes
a hierarchy; ``ngram.py`` is the model-free proposer; ``auto.py`` and ``steptimes.py`` choose a hierarchy from
measured step costs; ``grammar.py`` masks every tier's distribution alike; ``logprobs.py`` reports the verifier's
log-probabilities; ``stats.py`` counts what each tier did.

Source: TriForce (Sun et al., arXiv 2404.11912), Sec. 4; speculative sampling (Leviathan et al., arXiv 2211.17192;
Chen et al., arXiv 2302.01318).
"""
