"""``triforce serve``: the Prometheus metrics of one server (``GET /metrics``)."""

from __future__ import annotations


# ---------------------------------------------------------------------------------------------------- metrics
class ServerMetrics:
    """The Prometheus metrics of one server, in their own registry.

    Metrics: ``triforce_requests_total{endpoint,status}``, ``triforce_request_latency_seconds{endpoint}``
    (histogram, to the last byte of a streamed answer), ``triforce_generated_tokens_total``,
    ``triforce_prompt_tokens_total``, ``triforce_reused_prefix_tokens_total``, ``triforce_queue_depth`` (requests
    waiting), ``triforce_requests_running`` (the running batch size, 0 to ``--max-batch``),
    ``triforce_prefix_cache_bytes`` (KV kept for prefix reuse, bounded by ``--prefix-cache-gib``),
    ``triforce_time_to_first_token_seconds`` (histogram, from arrival), ``triforce_time_between_tokens_seconds``
    (histogram, between a request's consecutive tokens), ``triforce_tier_proposed_tokens_total{tier}`` and
    ``triforce_tier_accepted_tokens_total{tier}`` (their ratio is a tier's acceptance),
    ``triforce_forwards_total`` and ``triforce_forward_sequences_total`` (batched forwards, and the sequences' forwards
    they held), ``triforce_generations_ended_early_total{reason}`` (``disconnect``, ``timeout``). Tokens/s is the rate
    of ``triforce_generated_tokens_total``; p50/p99 come from the histograms (``histogram_quantile``).
    """

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
        self.requests = Counter("triforce_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.latency = Histogram("triforce_request_latency_seconds", "Request latency (streams: to the last chunk)",
                                 ["endpoint"], buckets=buckets, registry=r)
        self.generated = Counter("triforce_generated_tokens", "Tokens generated", registry=r)
        self.prompt = Counter("triforce_prompt_tokens", "Prompt tokens of generations run", registry=r)
        self.reused = Counter("triforce_reused_prefix_tokens", "Prompt tokens whose KV cache was reused", registry=r)
        self.queue_depth = Gauge("triforce_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge("triforce_requests_running", "Requests the engine is running (the batch size)", registry=r)
        self.prefix_cache_bytes = Gauge("triforce_prefix_cache_bytes", "KV cache bytes kept by idle requests for "
                                        "prefix reuse (bounded by --prefix-cache-gib)", registry=r)
        self.tbt = Histogram("triforce_time_between_tokens_seconds", "Between a request's consecutive tokens",
                             buckets=(0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5),
                             registry=r)
        self.forwards = Counter("triforce_forwards", "Batched model forwards run", registry=r)
        self.forward_sequences = Counter("triforce_forward_sequences", "Sequences' forwards those held (their ratio "
                                         "to triforce_forwards_total is the mean batch)", registry=r)
        self.tier_proposed = Counter("triforce_tier_proposed_tokens", "Tokens proposed to a verifying tier", ["tier"],
                                     registry=r)
        self.tier_accepted = Counter("triforce_tier_accepted_tokens", "Of those, accepted", ["tier"], registry=r)
        self.ttft = Histogram("triforce_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=buckets, registry=r)
        self.ended_early = Counter("triforce_generations_ended_early", "Generations stopped by the server",
                                   ["reason"], registry=r)

    def render(self) -> tuple[bytes, str]:
        """``(body, content type)`` of the Prometheus text exposition."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
