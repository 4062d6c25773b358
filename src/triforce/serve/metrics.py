"""``triforce serve``: the Prometheus metrics of one server (``GET /metrics``)."""

from __future__ import annotations


# ---------------------------------------------------------------------------------------------------- metrics
class ServerMetrics:
    """The Prometheus metrics of one server, in their own registry.

    Metrics: ``triforce_requests_total{endpoint,status}``, ``triforce_request_latency_seconds{endpoint}``
    (histogram, to the last byte of a streamed answer), ``triforce_generated_tokens_total``,
    ``triforce_prompt_tokens_total``, ``triforce_reused_prefix_tokens_total``, ``triforce_queue_depth`` (requests
    waiting), ``triforce_requests_running`` (0 or 1), ``triforce_time_to_first_token_seconds`` (histogram, from
    arrival), ``triforce_generations_ended_early_total{reason}`` (``disconnect``, ``timeout``).
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
        self.running = Gauge("triforce_requests_running", "Requests the engine is running (0 or 1)", registry=r)
        self.ttft = Histogram("triforce_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=buckets, registry=r)
        self.ended_early = Counter("triforce_generations_ended_early", "Generations stopped by the server",
                                   ["reason"], registry=r)

    def render(self) -> tuple[bytes, str]:
        """``(body, content type)`` of the Prometheus text exposition."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
