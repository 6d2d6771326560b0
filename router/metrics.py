"""The router's own Prometheus metrics (``pagoda:router_*``), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter(
            "pagoda:router_decisions",
            "Routing decisions by policy and reason.",
            ("policy", "reason"),
            registry=r,
        )
        self.routed = Counter(
            "pagoda:router_routed", "Requests sent to each replica.", ("backend",), registry=r
        )
        self.prefill_routed = Counter(
            "pagoda:router_prefill_routed",
            "Requests whose prompt each prefill replica was named to prefill (x-prefiller-host-port).",
            ("backend",),
            registry=r,
        )
        self.predicted_cached = Counter(
            "pagoda:router_predicted_cached_tokens",
            "Prompt tokens the router expected the chosen replica to find cached.",
            ("backend",),
            registry=r,
        )
        self.observed_cached = Counter(
            "pagoda:router_observed_cached_tokens",
            "Cached prompt tokens the replica reported (usage.prompt_tokens_details.cached_tokens).",
            ("backend",),
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pagoda:router_prompt_tokens",
            "Prompt tokens of answered requests (usage).",
            ("backend",),
            registry=r,
        )
        self.requests = Counter(
            "pagoda:router_requests",
            "Completion requests by the HTTP status the client got (499: the client left first).",
            ("code",),
            registry=r,
        )
        self.stream_errors = Counter(
            "pagoda:router_stream_errors",
            "Streams a replica failed after the client had its first event: ended with an error event.",
            ("backend", "reason"),
            registry=r,
        )
        self.retries = Counter(
            "pagoda:router_retries",
            "Requests re-sent to another replica, by reason.",
            ("reason",),
            registry=r,
        )
        self.overhead = Histogram(
            "pagoda:router_routing_overhead_seconds",
            "Time from the request body to the chosen replica (tokenize, hash, score).",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.healthy = Gauge(
            "pagoda:router_backend_healthy",
            "1 if the replica passes health checks.",
            ("backend",),
            registry=r,
        )
        self.draining = Gauge(
            "pagoda:router_backend_draining", "1 while the replica drains.", ("backend",), registry=r
        )
        self.load = Gauge(
            "pagoda:router_backend_load", "running + waiting + in flight.", ("backend",), registry=r
        )
        self.blocks = Gauge(
            "pagoda:router_backend_kv_blocks",
            "Blocks the router knows the replica holds.",
            ("backend", "tier"),
            registry=r,
        )
        self.resyncs = Gauge(
            "pagoda:router_backend_kv_resyncs",
            "Snapshots loaded for the replica's KV events.",
            ("backend",),
            registry=r,
        )

    def refresh(self, pool) -> None:
        """Backend gauges from the pool's state (after every health round)."""
        for b in pool.backends.values():
            self.healthy.labels(b.url).set(1 if b.healthy else 0)
            self.draining.labels(b.url).set(1 if b.draining else 0)
            self.load.labels(b.url).set(b.load)
            self.resyncs.labels(b.url).set(b.index.resyncs)
            for tier, n in b.index.counts().items():
                self.blocks.labels(b.url, tier).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
