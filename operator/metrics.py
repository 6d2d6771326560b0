"""The operator's own Prometheus metrics (names fixed in docs/metrics.md), on a registry of their own.

One `OperatorMetrics` per registry: the process serves `DEFAULT` (on `REGISTRY`); a test gives its operator a
fresh one, so what it reads was counted by that operator alone and can be asserted exactly.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

CONDITION_TYPES = ("Ready", "Progressing", "Degraded")
CONDITION_STATUSES = ("True", "False", "Unknown")


class OperatorMetrics:
    """The reconcile counters and the per-deployment gauges, registered on `registry`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.reconciles = Counter(
            "pagoda_operator_reconciles", "InferenceDeployment reconciles by result", ["result"], registry=r
        )
        self.reconcile_errors = Counter(
            "pagoda_operator_reconcile_errors", "Reconciles that failed or found an unservable spec, by reason",
            ["reason"], registry=r,
        )  # fmt: skip
        self.reconcile_duration = Histogram(
            "pagoda_operator_reconcile_duration_seconds", "Time to reconcile one InferenceDeployment",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r,
        )  # fmt: skip
        self.deployments = Gauge(
            "pagoda_operator_inference_deployments", "InferenceDeployments by condition and status",
            ["condition", "status"], registry=r,
        )  # fmt: skip
        self.gpus_requested = Gauge(
            "pagoda_operator_gpus_requested", "GPUs the engine pods request (replicas x gpu.count), by product",
            ["product"], registry=r,
        )  # fmt: skip
        self._seen_products: set[str] = set()

    def publish(self, conditions: dict[object, dict[str, str]], gpus: dict[object, tuple[str, int]]) -> None:
        """Set the gauges from the operator's per-object view (every label combination, zeros included)."""
        for kind in CONDITION_TYPES:
            for status in CONDITION_STATUSES:
                count = sum(1 for conds in conditions.values() if conds.get(kind, "Unknown") == status)
                self.deployments.labels(kind, status).set(count)
        totals: dict[str, int] = {}
        for product, count in gpus.values():
            totals[product] = totals.get(product, 0) + count
        for product in set(totals) | self._seen_products:
            self.gpus_requested.labels(product).set(totals.get(product, 0))
        self._seen_products.update(totals)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value; 0 for a series not (yet) exported."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0


DEFAULT = OperatorMetrics(CollectorRegistry(auto_describe=True))
REGISTRY = DEFAULT.registry


def serve(port: int, addr: str = "0.0.0.0", metrics: OperatorMetrics = DEFAULT) -> None:
    start_http_server(port, addr=addr, registry=metrics.registry)
