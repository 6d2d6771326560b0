"""Scale to zero as rendered: minReplicas 0 is valid, keeps a router in front (it holds requests while no
engine is ready), and the KEDA ScaledObject scales from zero on the router's held requests and back to zero
after autoscaling.idleSeconds. The router side is tests/router/test_scale_to_zero.py."""

from __future__ import annotations

import kubernetes_validate
import pytest
from pagoda.operator import render
from pagoda.operator.discovery import node_gpus, pools
from pagoda.operator.planning import decide
from pagoda.operator.spec import SpecError, parse_spec
from pagoda.router.hold import Hold
from pagoda_testkit import example, node
from prometheus_client import CollectorRegistry, generate_latest

POOLS = pools(g for g in (node_gpus(node("n-l40s", "l40s")),) if g)


def body(autoscaling: dict, **spec) -> dict:
    cr = example("llama-3.1-8b-l40s-routed-autoscaled.yaml")
    cr["metadata"] |= {"namespace": "team-a", "uid": "0b8f6c2e-1111-2222-3333-444455556666"}
    del cr["spec"]["routing"]
    cr["spec"] |= {"autoscaling": autoscaling, "replicas": 0, **spec}
    return cr


def rendered(cr: dict, keda: bool) -> list[dict]:
    spec = parse_spec(cr["spec"])
    return render.children(cr, spec, decide(spec, POOLS), with_service_monitor=True, with_keda=keda)


def test_keda_scales_from_zero_on_held_requests_and_back_after_the_idle_period() -> None:
    cr = body({"minReplicas": 0, "maxReplicas": 1, "idleSeconds": 1200})
    objects = rendered(cr, keda=True)
    kinds = [o["kind"] for o in objects]
    assert "Deployment" in kinds  # the router, although at most one engine runs
    [scaled] = [o for o in objects if o["kind"] == "ScaledObject"]
    spec = scaled["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["cooldownPeriod"]) == (0, 1, 1200)
    kv, held = spec["triggers"]
    assert kv["metadata"]["query"].startswith("sum(vllm:kv_cache_usage_perc{")
    assert held["metadata"] | {} == {
        "serverAddress": render.prometheus_url(),
        "query": 'sum(pagoda:router_held_requests{namespace="team-a",app_kubernetes_io_instance="llama-3-1-8b-chat"})'
        " or vector(0)",
        "threshold": "1",
        "activationThreshold": "0",
    }
    assert kv["metadata"]["activationThreshold"] == "0" and held["metricType"] == "AverageValue"
    # The engines' StatefulSet follows spec.replicas down to 0; the router stays.
    assert objects[-1]["spec"]["replicas"] == 0
    [router] = [o for o in objects if o["kind"] == "Deployment"]
    assert router["spec"]["replicas"] == 1


def test_the_query_names_the_gauge_the_router_exports() -> None:
    registry = CollectorRegistry()
    Hold(300, registry)
    exported = generate_latest(registry).decode()
    assert f"# TYPE {render.HELD_REQUESTS} gauge" in exported


def test_without_keda_the_hpa_keeps_one_engine() -> None:
    objects = rendered(body({"minReplicas": 0, "maxReplicas": 3}), keda=False)
    [hpa] = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    kubernetes_validate.validate(hpa, "1.30.0", strict=True)
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)


def test_a_deployment_that_does_not_scale_to_zero_keeps_one_trigger_and_the_default_cooldown() -> None:
    cr = body({"minReplicas": 1, "maxReplicas": 3})
    [scaled] = [o for o in rendered(cr, keda=True) if o["kind"] == "ScaledObject"]
    assert len(scaled["spec"]["triggers"]) == 1 and scaled["spec"]["cooldownPeriod"] == 300


def test_scale_to_zero_needs_the_router() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(body({"minReplicas": 0, "maxReplicas": 2}, routing={"policy": "none"})["spec"])
    assert (info.value.field, info.value.reason) == ("routing.policy", "InvalidAutoscaling")
    with pytest.raises(SpecError) as info:
        parse_spec(body({"minReplicas": -1, "maxReplicas": 2})["spec"])
    assert info.value.field == "autoscaling.minReplicas"
