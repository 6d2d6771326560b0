"""The operator's own Prometheus metrics (names fixed in docs/metrics.md), on a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter(
    "pagoda_operator_reconciles", "InferenceDeployment reconciles by result", ["result"], registry=REGISTRY
)
RECONCILE_ERRORS = Counter(
    "pagoda_operator_reconcile_errors", "Reconciles that failed or found an unservable spec, by reason", ["reason"],
    registry=REGISTRY,
)  # fmt: skip
RECONCILE_DURATION = Histogram(
    "pagoda_operator_reconcile_duration_seconds", "Time to reconcile one InferenceDeployment",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=REGISTRY,
)  # fmt: skip
DEPLOYMENTS = Gauge(
    "pagoda_operator_inference_deployments", "InferenceDeployments by condition and status", ["condition", "status"],
    registry=REGISTRY,
)  # fmt: skip
GPUS_REQUESTED = Gauge(
    "pagoda_operator_gpus_requested", "GPUs the engine pods request (replicas x gpu.count), by product", ["product"],
    registry=REGISTRY,
)  # fmt: skip


def publish(conditions: dict[object, dict[str, str]], gpus: dict[object, tuple[str, int]]) -> None:
    """Set the gauges from the operator's per-object view (every label combination, zeros included)."""
    for kind in ("Ready", "Progressing", "Degraded"):
        for status in ("True", "False", "Unknown"):
            count = sum(1 for conds in conditions.values() if conds.get(kind, "Unknown") == status)
            DEPLOYMENTS.labels(kind, status).set(count)
    totals: dict[str, int] = {}
    for product, count in gpus.values():
        totals[product] = totals.get(product, 0) + count
    for product in set(totals) | _seen_products:
        GPUS_REQUESTED.labels(product).set(totals.get(product, 0))
    _seen_products.update(totals)


_seen_products: set[str] = set()


def serve(port: int, addr: str = "0.0.0.0") -> None:
    start_http_server(port, addr=addr, registry=REGISTRY)
