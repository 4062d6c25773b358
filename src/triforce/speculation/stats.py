"""The figures of one generation (:class:`GenerationStats`: speed, memory, the plan) and the counters of each tier in
it (:class:`TierStats`: forwards, acceptance, the run lengths of accepted drafts, what ``GenerationStats.tiers``
reports per tier; docs/usage.md, "JSON output"; the cost model reads the run lengths)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class TierStats:
    """Counters of one tier for one generation (definitions: docs/usage.md, "JSON output").

    Attributes:
        name: tier name (``target``, ``retrieval``, ``draft``).
        forward_passes: model forwards (prefill chunks included).
        forward_seconds: wall time inside those forwards, seconds (under a batch scheduler: of the batched forwards
            that ran them, each whole, without the time spent waiting for the batch).
        prefill_seconds: part of ``forward_seconds`` spent on the prompt (the retrieval tier: its first selection).
        prefill_passes: part of ``forward_passes`` that fed the prompt.
        verifications: steps that verified a drafter's block (0 for a tier without drafter).
        proposed: drafter tokens this tier verified.
        accepted: of those, accepted (recovered and bonus tokens not counted; none past an EOS).
        emitted: tokens this tier's verifications produced (accepted + recovered/bonus), before truncation.
        rebuilds: retrieval-cache selections (the first one after prefill included).
        accepted_lengths: ``accepted_lengths[j]`` = verifications that accepted exactly j drafted tokens (the
            observed run-length distribution the cost model uses, since acceptances are not independent).
        blocks: ``(start, proposed, accepted, emitted)`` of the verifications that reach past the committed
            sequence, ``start`` being the sequence position of the block's first token (for :meth:`discount_past`).
    """

    name: str
    forward_passes: int = 0
    forward_seconds: float = 0.0
    prefill_seconds: float = 0.0
    prefill_passes: int = 0
    verifications: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    rebuilds: int = 0
    accepted_lengths: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    blocks: list = field(default_factory=list, repr=False, compare=False)

    def discount_past(self, end: int) -> None:
        """Take out of the counters what the verifications in :attr:`blocks` produced at sequence positions >=
        ``end`` (the end of the output: a stop string completed, or the consumer stopped, mid-block), so that
        nothing past what the user got is counted; then forget the blocks.

        A block cut after j of its positions keeps min(k, j) proposed, min(a, j) accepted and min(m, j) emitted
        tokens; a block wholly past ``end`` is not counted at all (nor its verification).
        """
        for start, k, a, m in self.blocks:
            j = max(0, end - start)
            if j >= max(k, m):
                continue
            if a < len(self.accepted_lengths):  # the run-length histogram: the block's verification moves or goes
                self.accepted_lengths[a] -= 1
                if j:
                    self.accepted_lengths[min(a, j)] += 1
            if j == 0:
                self.verifications -= 1
            self.proposed -= k - min(k, j)
            self.accepted -= a - min(a, j)
            self.emitted -= m - min(m, j)
        self.blocks.clear()

    def to_dict(self) -> dict:
        """The counters plus acceptance_rate and mean_tokens_per_verification for a verifying tier."""
        d = {
            "forward_passes": self.forward_passes,
            "forward_seconds": round(self.forward_seconds, 6),
            "prefill_seconds": round(self.prefill_seconds, 6),
            "prefill_passes": self.prefill_passes,
        }
        if self.verifications:
            d.update(
                verifications=self.verifications,
                proposed=self.proposed,
                accepted=self.accepted,
                acceptance_rate=round(self.accepted / self.proposed, 6) if self.proposed else None,
                mean_tokens_per_verification=round(self.emitted / self.verifications, 6),
                accepted_lengths=list(self.accepted_lengths),
            )
        if self.rebuilds:
            d["rebuilds"] = self.rebuilds
        d.update(self.extra)
        return d


@dataclass
class GenerationStats:
    """Figures of one generation (schema documented in docs/usage.md, "JSON output").

    Times are seconds, rates tokens per second, memory bytes.
    """

    mode: str
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str
    prefill_seconds: float
    decode_seconds: float
    decode_tokens_per_second: float
    mean_time_between_tokens_ms: float
    peak_memory_bytes: int
    seed: int
    tiers: dict = field(default_factory=dict)
    retrieval_holds_full_cache: bool | None = None
    kv_placement: dict | None = None
    auto: dict | None = None
    prompt_cache: dict | None = None  # with a prompt cache directory: tokens loaded, file read, file written

    def to_dict(self) -> dict:
        """All fields as a JSON-ready dict."""
        return asdict(self)

    def summary(self) -> str:
        """One line: speed, then acceptance per verifying tier."""
        def tokens(n: int) -> str:
            return f"{n} token{'' if n == 1 else 's'}"

        cached = (self.prompt_cache or {}).get("loaded_tokens")
        loaded = f", {cached} loaded from the prompt cache" if cached else ""
        mode = self.mode if not self.auto else f"auto ({self.auto['hierarchy']}, " \
            f"{self.auto['speculative_tokens']} speculative / {self.auto['autoregressive_tokens']} plain tokens)"
        parts = [f"{mode}: {tokens(self.generated_tokens)}, {self.decode_tokens_per_second:.2f} tok/s, "
                 f"TBT {self.mean_time_between_tokens_ms:.1f} ms, prefill {self.prefill_seconds:.2f} s "
                 f"({tokens(self.prompt_tokens)}{loaded})"]
        for name, t in self.tiers.items():
            if t.get("verifications"):
                parts.append(f"{name}: acceptance {t['acceptance_rate']:.3f}, "
                             f"{t['mean_tokens_per_verification']:.2f} tokens/verification")
        if self.retrieval_holds_full_cache:
            parts.append("retrieval cache = whole cache (everything fit in the budget)")
        return "; ".join(parts)
