"""The router, the autoscaler and the drain hooks, against the emulated cluster with the operator under kopf:
what is rendered, that hand edits are put back, that the operator never fights the autoscaler over replicas,
and that a bad spec.routing / spec.autoscaling is a condition and an Event, not a crash loop."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pagoda.operator import render
from pagoda_testkit import INFD, STS, Cluster, example, running_operator

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
SVC = "v1/services"
DEPLOY = "apps/v1/deployments"
HPA = "autoscaling/v2/horizontalpodautoscalers"
SCALED = "keda.sh/v1alpha1/scaledobjects"
NAME = "llama-3-1-8b-chat"  # examples/llama-3.1-8b-l40s-routed-autoscaled.yaml
KEDA_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "scaledobjects.keda.sh"},
    "spec": {
        "group": "keda.sh",
        "scope": "Namespaced",
        "names": {"kind": "ScaledObject", "plural": "scaledobjects", "singular": "scaledobject"},
        "versions": [
            {
                "name": "v1alpha1",
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object"}},
            }
        ],
    },
}


def routed() -> dict[str, Any]:
    return example("llama-3.1-8b-l40s-routed-autoscaled.yaml")


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


async def started(cluster: Cluster, cr: dict[str, Any]) -> dict[str, Any]:
    await cluster.add_node("gpu-l40s-1", "l40s")
    await cluster.create(cr)
    await cluster.wait_for(lambda: cluster.get(STS, "default", cr["metadata"]["name"]), what="StatefulSet")
    await cluster.settle()
    return cluster.get(INFD, "default", cr["metadata"]["name"])


def operator_writes(cluster: Cluster, mark: int) -> list[tuple[str, str, str]]:
    """(method, resource, subresource) of each write since `mark`."""
    return [
        (str(w.method).split(".")[-1], w.resource.plural if w.resource else "", w.subresource or "")
        for w in cluster.emulator.writes(mark)
    ]


async def test_the_router_is_rendered_and_the_service_points_at_it(cluster: Cluster) -> None:
    async with running_operator(cluster):
        infd = await started(cluster, routed())
        uid = infd["metadata"]["uid"]
        router = await cluster.wait_for(
            lambda: cluster.get(DEPLOY, "default", f"{NAME}-router"), what="router"
        )
        container = router["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["pagoda", "router"]
        args = container["args"]
        assert flag(args, "--policy") == "tierAware"
        assert flag(args, "--backend-dns") == f"{NAME}-headless.default.svc.cluster.local:8000"
        assert flag(args, "--model") == "llama-3.1-8b-instruct"
        assert flag(args, "--tokenizer") == "backend"  # an hf:// model: the engines tokenize
        assert container["env"] == []  # no apiKeySecretRef
        assert router["metadata"]["ownerReferences"][0]["uid"] == uid
        assert (
            container["image"]
            == cluster.get(STS, "default", NAME)["spec"]["template"]["spec"]["containers"][0]["image"]
        )
        # Clients keep the InferenceDeployment's Service: it now selects the router; the engines keep the
        # headless Service the router resolves.
        client, headless = cluster.get(SVC, "default", NAME), cluster.get(SVC, "default", f"{NAME}-headless")
        assert client["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
        assert client["spec"]["selector"]["app.kubernetes.io/name"] == "pagoda-router"
        assert headless["spec"]["selector"]["app.kubernetes.io/name"] == "pagoda-engine"
        assert infd["status"]["routing"] == {"policy": "tierAware", "router": f"{NAME}-router"}
        assert infd["status"]["endpoint"] == f"http://{NAME}.default.svc.cluster.local:8000/v1"

        # Drain: a pause before SIGTERM, the engine's own grace period, and the kubelet's covering both.
        sts = cluster.get(STS, "default", NAME)
        pod = sts["spec"]["template"]["spec"]
        engine = pod["containers"][0]
        assert engine["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(render.PRESTOP_SECONDS)]
        assert flag(engine["args"], "--shutdown-grace-seconds") == "120"
        assert pod["terminationGracePeriodSeconds"] == render.PRESTOP_SECONDS + 120 + 10 == 135

        # The HPA targets the InferenceDeployment's scale subresource with the adapter's metric name.
        hpa = cluster.get(HPA, "default", NAME)
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "pagoda.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "name": NAME,
        }
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
        assert hpa["spec"]["metrics"] == [
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": "pagoda_kv_cache_usage"},
                    "target": {"type": "AverageValue", "averageValue": "750m"},
                },
            }
        ]
        down = hpa["spec"]["behavior"]["scaleDown"]["policies"]
        assert down == [{"type": "Pods", "value": 1, "periodSeconds": 125}]  # one engine per drain
        assert hpa["metadata"]["ownerReferences"][0]["uid"] == uid
        assert cluster.objects(SCALED) == []  # no KEDA in this cluster

        # Hand edits to the router and the HPA are put back.
        edited = copy.deepcopy(router["spec"]["template"]["spec"]["containers"])
        edited[0]["args"][edited[0]["args"].index("tierAware")] = "roundRobin"
        await cluster.patch(
            DEPLOY, "default", f"{NAME}-router", {"spec": {"template": {"spec": {"containers": edited}}}}
        )
        await cluster.patch(HPA, "default", NAME, {"spec": {"maxReplicas": 50}})
        await cluster.patch(INFD, "default", NAME, {"metadata": {"annotations": {"nudge": "1"}}})
        await cluster.wait_for(
            lambda: (
                cluster.get(HPA, "default", NAME)["spec"]["maxReplicas"] == 6
                and "tierAware"
                in cluster.get(DEPLOY, "default", f"{NAME}-router")["spec"]["template"]["spec"]["containers"][
                    0
                ]["args"]
            ),
            what="drift corrected",
        )
        await cluster.settle()

        # Routing and autoscaling turned off: the router and the HPA go, the Service selects the engines.
        await cluster.patch(
            INFD, "default", NAME, {"spec": {"routing": {"policy": "none"}, "autoscaling": None}}
        )
        await cluster.wait_for(
            lambda: (
                cluster.get(DEPLOY, "default", f"{NAME}-router") is None
                and cluster.get(HPA, "default", NAME) is None
            ),
            what="router and HPA deleted",
        )
        await cluster.settle()
        assert (
            cluster.get(SVC, "default", NAME)["spec"]["selector"]["app.kubernetes.io/name"] == "pagoda-engine"
        )
        assert cluster.get(INFD, "default", NAME)["status"]["routing"] == {"policy": "none"}


async def test_the_operator_follows_the_autoscaler_and_never_writes_replicas(cluster: Cluster) -> None:
    async with running_operator(cluster):
        await started(cluster, routed())
        assert cluster.get(STS, "default", NAME)["spec"]["replicas"] == 2
        for asked, expected in (
            (4, 4),
            (9, 6),
            (1, 2),
        ):  # the HPA's writes, and stale values outside its bounds
            mark = cluster.emulator.request_count
            await cluster.patch(INFD, "default", NAME, {"spec": {"replicas": asked}})
            await cluster.wait_for(
                lambda e=expected: cluster.get(STS, "default", NAME)["spec"]["replicas"] == e,
                what=f"{expected} replicas",
            )
            await cluster.settle()
            writes = operator_writes(cluster, mark)
            # The test's own PATCH of spec.replicas; the operator wrote the StatefulSet and status, never the
            # InferenceDeployment's spec (that would fight the HPA), and went quiet.
            spec_writes = [
                (w.data or {}).get("spec")
                for w in cluster.emulator.writes(mark)
                if w.resource and w.resource.plural == "inferencedeployments" and "spec" in (w.data or {})
            ]
            assert spec_writes == [{"replicas": asked}], writes  # kopf's own annotation writes carry no spec
            assert cluster.get(INFD, "default", NAME)["spec"]["replicas"] == asked
            assert ("PUT", "statefulsets", "") in writes
        # Nothing else moves: the router keeps one pod, the HPA its bounds, and the default stays tierAware.
        assert cluster.get(DEPLOY, "default", f"{NAME}-router")["spec"]["replicas"] == 1
        assert cluster.get(HPA, "default", NAME)["spec"]["minReplicas"] == 2


async def test_a_keda_scaledobject_where_the_keda_crd_exists(cluster: Cluster) -> None:
    await cluster._call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", KEDA_CRD)
    cr = routed()
    cr["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4, "metric": "ttftP90", "target": 1.5}
    async with running_operator(cluster):
        await started(cluster, cr)
        scaled = await cluster.wait_for(lambda: cluster.get(SCALED, "default", NAME), what="ScaledObject")
    assert cluster.objects(HPA) == []  # KEDA makes its own HPA from the ScaledObject
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["kind"] == "InferenceDeployment" and spec["scaleTargetRef"]["name"] == NAME
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 4)
    [trigger] = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    assert trigger["metadata"]["threshold"] == "1.5"
    assert trigger["metadata"]["serverAddress"] == render.prometheus_url()
    query = trigger["metadata"]["query"]
    assert query.startswith(
        "histogram_quantile(0.9, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket"
    )
    assert f'app_kubernetes_io_instance="{NAME}"' in query and 'namespace="default"' in query


INVALID = {
    "min-over-max": ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "InvalidAutoscaling", "autoscaling.minReplicas"),
    "bad-metric": ({"autoscaling": {"maxReplicas": 3, "metric": "gpuUtil"}}, "InvalidAutoscaling", "autoscaling.metric"),
    "kv-over-one": ({"autoscaling": {"maxReplicas": 3, "target": 1.5}}, "InvalidAutoscaling", "autoscaling.target"),
    "ttft-zero": (
        {"autoscaling": {"maxReplicas": 3, "metric": "ttftP90", "target": 0}},
        "InvalidAutoscaling",
        "autoscaling.target",
    ),
    "no-max": ({"autoscaling": {"minReplicas": 2}}, "InvalidAutoscaling", "autoscaling.maxReplicas"),
    "bad-policy": ({"routing": {"policy": "random"}}, "InvalidRouting", "routing.policy"),
}  # fmt: skip


async def test_invalid_routing_and_autoscaling_are_conditions_and_events(cluster: Cluster) -> None:
    async with running_operator(cluster) as operator:
        await cluster.add_node("gpu-l40s-1", "l40s")
        for name, (spec, _, _) in INVALID.items():
            cr = routed()
            cr["metadata"]["name"] = name
            del cr["spec"]["autoscaling"], cr["spec"]["routing"]
            cr["spec"].update(spec)
            await cluster.create(cr)
        for name in INVALID:
            await cluster.wait_for(lambda n=name: cluster.condition(n, "Ready").get("reason"), what=name)
        await cluster.settle()
        for name, (_, reason, field) in INVALID.items():
            ready = cluster.condition(name, "Ready")
            assert (ready["status"], ready["reason"]) == ("False", reason), name
            assert f"spec.{field}" in ready["message"], ready["message"]
            [event] = [e for e in cluster.events(name) if e["type"] == "Warning"]
            assert event["reason"] == reason and f"spec.{field}" in event["message"]
            assert cluster.get(STS, "default", name) is None and cluster.get(HPA, "default", name) is None
        # Nothing loops: no write while nothing changes, and the operator is still running.
        mark = cluster.emulator.request_count
        await cluster.settle(quiet=1.0)
        assert operator_writes(cluster, mark) == []
        assert not operator.done()


async def test_keda_installed_later_replaces_the_hpa_and_autoscaling_off_removes_both(
    cluster: Cluster,
) -> None:
    """The reconciler alone (no kopf), so the test decides when the KEDA API is looked up again."""
    from pagoda.operator.discovery import node_gpus
    from pagoda.operator.kube import Kube
    from pagoda.operator.metrics import OperatorMetrics
    from pagoda.operator.reconcile import Reconciler
    from pagoda_testkit import node

    nodes = [node_gpus(node("gpu-l40s-1", "l40s"))]
    created = await cluster.create(routed())
    kube = Kube(cluster.url)
    try:
        rec = Reconciler(kube, OperatorMetrics())
        await rec.reconcile("default", NAME, nodes, created)
        assert cluster.get(HPA, "default", NAME) is not None
        await cluster._call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", KEDA_CRD)
        rec._apis.clear()  # the 60 s cache of discovered APIs, expired
        outcome = await rec.reconcile("default", NAME, nodes)
        assert cluster.get(SCALED, "default", NAME) is not None and cluster.get(HPA, "default", NAME) is None
        assert f"deleted HorizontalPodAutoscaler default/{NAME}" in outcome.writes
        assert (await rec.reconcile("default", NAME, nodes)).writes == []  # idempotent
        await cluster.patch(INFD, "default", NAME, {"spec": {"autoscaling": None}})
        outcome = await rec.reconcile("default", NAME, nodes)
        assert cluster.get(SCALED, "default", NAME) is None
        assert f"deleted ScaledObject default/{NAME}" in outcome.writes
        # an HPA someone else made under that name is not ours to delete
        foreign = {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": NAME},
        }
        foreign["spec"] = {"scaleTargetRef": {"kind": "Deployment", "name": "x"}, "maxReplicas": 2}
        await cluster._call(
            "POST", "/apis/autoscaling/v2/namespaces/default/horizontalpodautoscalers", foreign
        )
        await rec.reconcile("default", NAME, nodes)
        assert cluster.get(HPA, "default", NAME) is not None
    finally:
        await kube.close()
