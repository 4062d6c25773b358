"""A model-free bottom tier: n-gram (prompt-lookup) drafting over the prompt and the generated text.

Source: prompt-lookup decoding (Saxena, 2023; transformers' ``prompt_lookup_num_tokens``) and LLMA
(Yang et al., arXiv 2304.04487). The longest suffix of the sequence (up to ``n`` tokens, down to 1) that
occurred earlier is looked up, and the tokens that followed its most recent occurrence are proposed.

Losslessness: the proposal is deterministic given the sequence, i.e. drawn from the one-hot distribution q on the
proposed token. The tier above accepts it with probability min(1, p(x) / 1) = p(x) and on rejection draws from
norm(max(p - onehot(x), 0)) (p without x), which is exactly speculative sampling with that q, so the hierarchy
stays exact. Under greedy decoding x is accepted iff it is the argmax.
"""

from __future__ import annotations

from typing import Callable

import torch

from .stats import TierStats


class NGramDrafter:
    """Proposes continuations of the longest earlier match of the sequence's suffix.

    Args:
        vocab_size: V, the width of the returned one-hot distributions.
        n: longest suffix length matched (>= 1); shorter suffixes are tried down to ``min_n`` tokens.
        min_n: shortest suffix that may match (1 <= min_n <= n). A one-token match is often a common word whose
            earlier follower is a poor guess; requiring 2 or 3 tokens trades proposals for acceptance.
        eos_ids: proposals stop after one of these.
        device: where the one-hot distributions are made.

    Raises:
        ValueError: n < 1, or min_n outside [1, n].

    Only committed tokens (verified by the top tier) are indexed; the suffix itself may include uncommitted ones.
    """

    def __init__(self, vocab_size: int, n: int = 4, eos_ids: tuple[int, ...] = (), device: str | torch.device = "cpu",
                 min_n: int = 1):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"ngram_n must be an integer >= 1, got {n!r}")
        if not isinstance(min_n, int) or not 1 <= min_n <= n:
            raise ValueError(f"ngram_min must be an integer in [1, ngram_n={n}], got {min_n!r}")
        self.vocab_size, self.n, self.min_n, self.device = vocab_size, n, min_n, device
        self.eos_ids = frozenset(eos_ids)
        self.stats = TierStats("ngram")
        self.drafter = None
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> end position (exclusive) of its latest occurrence
        self._tokens: list[int] = []  # indexed tokens (a prefix of the committed sequence)

    def _extend_index(self, seq: list[int], upto: int) -> None:
        start = len(self._tokens)
        self._tokens.extend(seq[start:upto])
        toks = self._tokens
        for end in range(max(1, start + 1), upto + 1):
            for m in range(1, self.n + 1):
                if end - m < 0:
                    break
                self._index[tuple(toks[end - m:end])] = end

    def prefill(self, prompt: list[int], progress: Callable[[int], None] | None = None) -> None:
        self._index.clear()
        self._tokens = []
        self._extend_index(prompt, len(prompt) - 1)  # the last prompt token's follower is still unknown

    def propose(self, seq: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        """Up to ``n`` tokens following the latest earlier occurrence of the longest matching suffix (may be none)."""
        self.stats.forward_passes += 1
        out: list[int] = []
        for m in range(min(self.n, len(seq)), self.min_n - 1, -1):
            end = self._index.get(tuple(seq[-m:]))
            if end is not None and end < len(seq):
                for t in seq[end:end + n]:
                    out.append(t)
                    if t in self.eos_ids:
                        break
                break
        probs = torch.zeros((len(out), self.vocab_size), device=self.device)
        if out:
            probs[torch.arange(len(out)), torch.tensor(out)] = 1.0
        return out, probs

    def rollback(self, n: int) -> None:
        """Nothing cached beyond committed tokens, so nothing to undo."""

    def observe(self, accepted: int, proposed: int) -> None:
        """Acceptance feedback from the tier above (unused)."""

    def commit(self, seq: list[int]) -> None:
        self._extend_index(seq, len(seq) - 1)

    def resync(self, seq: list[int]) -> None:
        """After a bypass of the tier above: index the tokens committed meanwhile."""
        self._extend_index(seq, len(seq) - 1)

    def all_stats(self) -> list[TierStats]:
        return [self.stats]
