"""The operator's metrics count exactly what happened: read before, act, read after.

The process-wide registry (the one `pagoda-operator` serves) is shared by every test in the session, so its
absolute values say nothing about one test; these tests assert exact deltas, reconciling through the real
HTTP client against the emulator without kopf, so the number of reconciles is the number of calls.
"""

from __future__ import annotations

import socket

import pytest
from pagoda.operator import metrics
from pagoda.operator.kube import Kube
from pagoda.operator.reconcile import Reconciler
from pagoda_testkit import Cluster, example

pytestmark = [pytest.mark.timeout(60)]
RECONCILES = "pagoda_operator_reconciles_total"
ERRORS = "pagoda_operator_reconcile_errors_total"
DURATION = "pagoda_operator_reconcile_duration_seconds_count"
DEPLOYMENTS = "pagoda_operator_inference_deployments"


def counters() -> dict[str, float]:
    m = metrics.DEFAULT
    return {
        "success": m.value(RECONCILES, {"result": "success"}),
        "error": m.value(RECONCILES, {"result": "error"}),
        "duration": m.value(DURATION),
        "InvalidModelSource": m.value(ERRORS, {"reason": "InvalidModelSource"}),
        "ClientConnectorError": m.value(ERRORS, {"reason": "ClientConnectorError"}),
    }


def delta(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in counters().items() if v != before[k]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.asyncio
async def test_reconcile_counters_move_by_exactly_what_happened(cluster: Cluster) -> None:
    kube = Kube(cluster.url, token="test-token")
    rec = Reconciler(kube)  # the process-wide metrics, as `pagoda-operator` uses them
    try:
        await cluster.create(example("cpu-default-model.yaml"))
        bad = example("cpu-default-model.yaml")
        bad["metadata"]["name"] = "bad"
        bad["spec"]["model"]["source"] = "ftp://host/model"
        await cluster.create(bad)

        before = counters()
        await rec.reconcile("default", "smollm2-cpu", [])
        assert delta(before) == {"success": 1, "duration": 1}

        before = counters()
        await rec.reconcile("default", "smollm2-cpu", [])  # nothing to do is still one reconcile
        await rec.reconcile("default", "bad", [])
        assert delta(before) == {"success": 2, "duration": 2, "InvalidModelSource": 1}

        # This reconciler's view, published whole: one served, one unservable.
        m = metrics.DEFAULT
        assert m.value(DEPLOYMENTS, {"condition": "Degraded", "status": "False"}) == 1
        assert m.value(DEPLOYMENTS, {"condition": "Degraded", "status": "True"}) == 1
        rec.forget("default", "bad")
        assert m.value(DEPLOYMENTS, {"condition": "Degraded", "status": "True"}) == 0
    finally:
        await kube.close()

    unreachable = Kube(f"http://127.0.0.1:{free_port()}", timeout=5)
    try:
        before = counters()
        with pytest.raises(OSError):
            await Reconciler(unreachable).reconcile("default", "smollm2-cpu", [])
        assert delta(before) == {"error": 1, "duration": 1, "ClientConnectorError": 1}
    finally:
        await unreachable.close()


def test_a_fresh_metrics_object_starts_from_zero() -> None:
    metrics.DEFAULT.reconciles.labels("success").inc()
    fresh = metrics.OperatorMetrics()
    assert fresh.value(RECONCILES, {"result": "success"}) == 0
    fresh.reconciles.labels("success").inc()
    assert fresh.value(RECONCILES, {"result": "success"}) == 1
    assert fresh.registry is not metrics.REGISTRY
