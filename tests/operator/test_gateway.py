"""spec.gateway (issue 42, item 3): where the cluster serves inference.networking.k8s.io/v1, an
InferenceDeployment gets an InferencePool and our router as its endpoint picker (a Deployment and a Service),
owned and repaired like the other children; without that API it gets a Degraded condition and an Event, and
nothing of it is rendered. `pagoda render --gateway-api` prints the same objects, and the example HTTPRoute
names the pool the operator renders."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from pagoda.operator import render
from pagoda.operator.contract import check_router_args
from pagoda.operator.discovery import Capabilities, node_gpus, pools
from pagoda.operator.render_cli import main as render_main
from pagoda.operator.render_cli import render_document
from pagoda.operator.spec import SpecError, parse_spec
from pagoda_testkit import EXAMPLES, INFD, STS, Cluster, node, running_operator

POOLS = "inference.networking.k8s.io/v1/inferencepools"
DEPLOY, SVC = "apps/v1/deployments", "v1/services"
RESOURCES = {"InferencePool": POOLS, "Deployment": DEPLOY, "Service": SVC}
NAME = "llama-3-1-8b-gw"  # examples/gateway/inferencedeployment.yaml
SERVER_METADATA = ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields")
POOL_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "inferencepools.inference.networking.k8s.io"},
    "spec": {
        "group": "inference.networking.k8s.io",
        "scope": "Namespaced",
        "names": {"kind": "InferencePool", "plural": "inferencepools", "singular": "inferencepool"},
        "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                      "schema": {"openAPIV3Schema": {"type": "object"}}}],
    },
}  # fmt: skip


def deployment() -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / "gateway" / "inferencedeployment.yaml").read_text())


def l40s() -> dict:
    return pools(g for g in (node_gpus(node("gpu-l40s-1", "l40s")),) if g)


def gateway_children(body: dict[str, Any], served: bool = True) -> list[dict[str, Any]]:
    body = {**body, "metadata": {"namespace": "default", **body["metadata"]}}
    _, objects = render_document(body, l40s(), Capabilities(gateway_api=served))
    return [
        o
        for o in objects
        if o["metadata"]["name"] == render.picker_name(NAME) or o["kind"] == "InferencePool"
    ]


def test_the_pool_selects_the_engines_and_names_the_picker() -> None:
    body = deployment()
    spec = parse_spec(body["spec"])
    service, picker, pool = gateway_children(body)
    assert [o["kind"] for o in (service, picker, pool)] == ["Service", "Deployment", "InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["metadata"]["name"] == NAME
    assert pool["spec"] == {
        "selector": {"matchLabels": {"app.kubernetes.io/name": "pagoda-engine", "app.kubernetes.io/instance": NAME}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"group": "", "kind": "Service", "name": f"{NAME}-epp", "port": {"number": 9002},
                              "failureMode": "FailClose"},
    }  # fmt: skip
    # the pool selects exactly the engine pods (the StatefulSet's template), not the router's or the picker's
    _, objects = render_document(
        {**body, "metadata": {"namespace": "default", **body["metadata"]}},
        l40s(),
        Capabilities(gateway_api=True),
    )
    [sts] = [o for o in objects if o["kind"] == "StatefulSet"]
    assert sts["spec"]["selector"]["matchLabels"] == pool["spec"]["selector"]["matchLabels"]
    # the picker's replicas (the headless Service's DNS) are the pool's pods
    [headless] = [o for o in objects if o["metadata"]["name"] == f"{NAME}-headless"]
    assert headless["spec"]["selector"] == pool["spec"]["selector"]["matchLabels"]
    assert picker["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "pagoda-epp"
    # the picker: our router with the ext_proc port, found by the pool through its Service's gRPC port
    [container] = picker["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert container["command"] == ["pagoda", "router"]
    assert (
        args[args.index("--ext-proc-port") + 1] == "9002" and args[args.index("--policy") + 1] == "tierAware"
    )
    assert args[args.index("--backend-dns") + 1] == f"{NAME}-headless.default.svc.cluster.local:8000"
    check_router_args(args)  # the router's own parser takes them
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc-ext-proc")
    assert grpc == {"name": "grpc-ext-proc", "port": 9002, "targetPort": "grpc-ext-proc", "protocol": "TCP",
                    "appProtocol": "http2"}  # fmt: skip
    assert service["spec"]["selector"] == picker["spec"]["selector"]["matchLabels"]
    assert service["metadata"]["labels"][render.LABEL_SCRAPE] == "true"  # the ServiceMonitor's "http" port
    assert {"name": "grpc-ext-proc", "containerPort": 9002, "protocol": "TCP"} in container["ports"]
    # another port and FailOpen follow the spec; the router's own HTTP port is refused
    body["spec"]["gateway"] = {"pickerPort": 9100, "failureMode": "FailOpen"}
    service, picker, pool = gateway_children(body)
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9100}
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert "9100" in picker["spec"]["template"]["spec"]["containers"][0]["args"]
    body["spec"]["gateway"] = {"pickerPort": 8000}
    with pytest.raises(SpecError) as refused:
        parse_spec(body["spec"])
    assert refused.value.reason == "InvalidGateway" and "8000" in str(refused.value)
    # without spec.gateway, or where the API is not served, none of it
    assert gateway_children(deployment(), served=False) == []
    del body["spec"]["gateway"]
    assert gateway_children(body) == []
    assert spec.gateway is not None and spec.gateway.picker_port == 9002


def test_render_gateway_api_flag_prints_the_pool_and_picker(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(EXAMPLES / "gateway" / "inferencedeployment.yaml")

    def kinds(*flags: str) -> list[tuple[str, str]]:
        assert render_main([path, *flags]) == 0
        return [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(capsys.readouterr().out) if d]

    plain, gateway = kinds(), kinds("--gateway-api")
    added = [("Service", f"{NAME}-epp"), ("Deployment", f"{NAME}-epp"), ("InferencePool", NAME)]
    assert [k for k in gateway if k not in added] == plain and all(k in gateway for k in added)
    assert not any(k in plain for k in added)


def test_the_example_httproute_points_at_the_pool_the_operator_renders() -> None:
    route = yaml.safe_load((EXAMPLES / "gateway" / "httproute.yaml").read_text())
    assert (route["apiVersion"], route["kind"]) == ("gateway.networking.k8s.io/v1", "HTTPRoute")
    [rule] = route["spec"]["rules"]
    [backend] = rule["backendRefs"]
    [pool] = [o for o in gateway_children(deployment()) if o["kind"] == "InferencePool"]
    assert backend == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": pool["metadata"]["name"],
    }
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"


def live_as_rendered(obj: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj.pop("status", None)
    for key in SERVER_METADATA:
        obj["metadata"].pop(key, None)
    return obj


def differences(cluster: Cluster) -> list[str]:
    """The gateway children whose live copy is not what `pagoda render --gateway-api` prints (owner aside)."""
    out = []
    for want in gateway_children(cluster.get(INFD, "default", NAME)):
        live = cluster.get(RESOURCES[want["kind"]], "default", want["metadata"]["name"])
        if live is None:
            out.append(f"{want['kind']}/{want['metadata']['name']} missing")
            continue
        live = live_as_rendered(live)
        owners = live["metadata"].pop("ownerReferences", None)
        want["metadata"].pop("ownerReferences", None)
        if live != want or not owners:
            out.append(f"{want['kind']}/{want['metadata']['name']}")
    return out


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_operator_renders_and_repairs_the_pool(cluster: Cluster) -> None:
    await cluster._call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", POOL_CRD)
    await cluster.add_node("gpu-l40s-1", "l40s")
    async with running_operator(cluster):
        created = await cluster.create(deployment())
        uid = created["metadata"]["uid"]
        pool = await cluster.wait_for(lambda: cluster.get(POOLS, "default", NAME), what="the InferencePool")
        await cluster.wait_for(lambda: cluster.get(STS, "default", NAME), what="the engines")
        await cluster.settle()
        assert differences(cluster) == []  # exactly what `pagoda render --gateway-api` prints
        for resource, name in ((POOLS, NAME), (DEPLOY, f"{NAME}-epp"), (SVC, f"{NAME}-epp")):
            [owner] = cluster.get(resource, "default", name)["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["uid"], owner["controller"]) == ("InferenceDeployment", uid, True)
        status = cluster.get(INFD, "default", NAME)["status"]
        assert status["gateway"] == {"apiServed": True, "inferencePool": NAME, "picker": f"{NAME}-epp"}
        assert cluster.condition(NAME, "Degraded")["status"] == "False"
        assert pool["spec"]["endpointPickerRef"]["name"] == f"{NAME}-epp"

        # Hand edits and a deleted pool are put back at the next reconcile.
        await cluster._call(
            "DELETE", f"/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools/{NAME}"
        )
        assert cluster.get(POOLS, "default", NAME) is None
        await cluster.patch(
            SVC, "default", f"{NAME}-epp", {"spec": {"ports": [{"name": "grpc-ext-proc", "port": 1}]}}
        )
        await cluster.patch(INFD, "default", NAME, {"metadata": {"annotations": {"nudge": "1"}}})
        await cluster.wait_for(lambda: differences(cluster) == [], what="the pool and picker repaired")
        await cluster.settle()
        assert differences(cluster) == []

        # spec.gateway removed: the pool and the picker go, the engines stay.
        await cluster.patch(INFD, "default", NAME, {"spec": {"gateway": None}})
        await cluster.wait_for(
            lambda: (cluster.get(POOLS, "default", NAME) is None and cluster.get(DEPLOY, "default", f"{NAME}-epp") is None
                     and cluster.get(SVC, "default", f"{NAME}-epp") is None),
            what="the pool and picker deleted",
        )  # fmt: skip
        await cluster.settle()
        assert cluster.get(STS, "default", NAME) is not None
        assert "gateway" not in cluster.get(INFD, "default", NAME)["status"]


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_without_the_api_spec_gateway_is_a_condition_and_an_event(cluster: Cluster) -> None:
    await cluster.add_node("gpu-l40s-1", "l40s")
    async with running_operator(cluster):
        await cluster.create(deployment())
        degraded = await cluster.wait_for(
            lambda: (c := cluster.condition(NAME, "Degraded")).get("reason") == "GatewayAPINotServed" and c,
            what="Degraded=True, GatewayAPINotServed",
        )
        assert degraded["status"] == "True" and "inference.networking.k8s.io/v1" in degraded["message"]
        await cluster.wait_for(
            lambda: [e for e in cluster.events(NAME) if e["reason"] == "GatewayAPINotServed"], what="an Event"
        )
        await cluster.wait_for(
            lambda: cluster.get(STS, "default", NAME), what="the engines, served as without it"
        )
        await cluster.settle()
        assert cluster.get(DEPLOY, "default", f"{NAME}-epp") is None
        assert cluster.get(SVC, "default", f"{NAME}-epp") is None
        assert cluster.get(INFD, "default", NAME)["status"]["gateway"] == {"apiServed": False}
        assert (
            len([e for e in cluster.events(NAME) if e["reason"] == "GatewayAPINotServed"]) == 1
        )  # not repeated


def test_only_a_deployment_that_had_a_gateway_looks_for_its_pool_and_picker() -> None:
    body = {**deployment(), "metadata": {"namespace": "default", "name": NAME}}
    with_gateway, without = parse_spec(body["spec"]), parse_spec({**body["spec"], "gateway": None})
    gone = [("Deployment", f"{NAME}-epp"), ("Service", f"{NAME}-epp")]

    def found(spec: Any, **flags: bool) -> list[tuple[str, str]]:
        return [
            u
            for u in render.unwanted(body, spec, with_keda=False, **flags)
            if u in [*gone, ("InferencePool", NAME)]
        ]

    assert found(without, with_gateway=True) == []  # never had one: no lookups per reconcile
    assert found(without, with_gateway=True, had_gateway=True) == [*gone, ("InferencePool", NAME)]
    assert found(with_gateway, with_gateway=False, had_gateway=True) == gone  # the API went away
    assert found(with_gateway, with_gateway=True, had_gateway=True) == []
