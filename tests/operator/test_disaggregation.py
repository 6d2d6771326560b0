"""Prefill/decode disaggregation from one InferenceDeployment (issue 43, item 3, the operator's half):
spec.disaggregation renders two engine pools (NAME-prefill as KV producers exposing the transfer port,
NAME-decode as consumers), a headless Service each, and the router with both pools; against the emulator the
pools are created, repaired, and replaced by one StatefulSet again when the spec drops them."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from pagoda.operator import render
from pagoda.operator.planning import decide
from pagoda.operator.spec import SpecError, parse_spec
from pagoda_testkit import INFD, STS, Cluster, running_operator

NAME = "smollm-pd"
SVC, DEPLOY = "v1/services", "apps/v1/deployments"


def pd(prefill: int = 1, decode: int = 2, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {
            "gpu": {"count": 0},
            "disaggregation": {"prefill": {"replicas": prefill}, "decode": {"replicas": decode}},
            **spec,
        },
    }


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def rendered(body: dict[str, Any]) -> list[dict[str, Any]]:
    spec = parse_spec(body["spec"])
    return render.children(body, spec, decide(spec, {}), with_service_monitor=False)


def test_two_pools_with_their_kv_roles_services_and_the_router_with_both() -> None:
    objects = {(o["kind"], o["metadata"]["name"]): o for o in rendered(pd())}
    assert ("StatefulSet", NAME) not in objects and ("Service", f"{NAME}-headless") not in objects
    prefill, decode = objects[("StatefulSet", f"{NAME}-prefill")], objects[("StatefulSet", f"{NAME}-decode")]
    assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (1, 2)
    roles = {}
    for role, sts in (("prefill", prefill), ("decode", decode)):
        assert sts["spec"]["selector"]["matchLabels"][render.LABEL_ROLE] == role
        assert sts["spec"]["template"]["metadata"]["labels"][render.LABEL_ROLE] == role
        assert sts["spec"]["serviceName"] == f"{NAME}-{role}-headless"
        container = sts["spec"]["template"]["spec"]["containers"][0]
        roles[role] = json.loads(flag(container["args"], "--kv-transfer-config"))
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == ({"http": 8000, "kv": 14579} if role == "prefill" else {"http": 8000})
        headless = objects[("Service", f"{NAME}-{role}-headless")]
        assert headless["spec"]["selector"][render.LABEL_ROLE] == role
    assert roles == {
        "prefill": {"kv_connector": "PagodaConnector", "kv_role": "kv_producer", "kv_port": 14579},
        "decode": {"kv_connector": "PagodaConnector", "kv_role": "kv_consumer"},
    }
    # the router (on by default: it is what sends a request to a prefill, then a decode engine)
    router = objects[("Deployment", f"{NAME}-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag(router, "--backend-dns") == f"{NAME}-decode-headless.default.svc.cluster.local:8000"
    assert flag(router, "--prefill-backend-dns") == f"{NAME}-prefill-headless.default.svc.cluster.local:8000"
    client = objects[("Service", NAME)]
    assert client["spec"]["selector"] == render.router_selector_labels(NAME)


def test_status_counts_the_engines_of_both_pools() -> None:
    spec = parse_spec(pd(prefill=2, decode=3)["spec"])
    assert spec.engine_replicas == 5 and spec.max_possible_replicas == 5


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"routing": {"policy": "none"}}, "routing.policy"),
        ({"autoscaling": {"maxReplicas": 4}}, "autoscaling"),
        ({"gateway": {}}, "gateway"),
        ({"parallelism": {"pipeline": 2}}, "parallelism.nodes"),
    ],
)
def test_what_two_pools_cannot_be_combined_with_is_refused(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(pd(**extra)["spec"])
    assert err.value.field == field and err.value.reason == "InvalidDisaggregation"


def live_differences(cluster: Cluster) -> list[str]:
    body = copy.deepcopy(cluster.get(INFD, "default", NAME))
    spec = parse_spec(body["spec"])
    out = []
    for want in render.engine_sets(body, spec, decide(spec, {})):
        live = cluster.get(STS, "default", want["metadata"]["name"])
        if live is None or live["spec"] != want["spec"]:
            out.append(want["metadata"]["name"])
    return out


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_operator_creates_repairs_and_removes_the_pools(cluster: Cluster) -> None:
    await cluster.add_node("cpu-1", None)
    async with running_operator(cluster):
        await cluster.create(pd())
        await cluster.wait_for(
            lambda: cluster.get(STS, "default", f"{NAME}-prefill") and cluster.get(STS, "default", f"{NAME}-decode"),
            what="both pools",
        )  # fmt: skip
        await cluster.settle()
        assert live_differences(cluster) == []
        assert cluster.get(STS, "default", NAME) is None
        for role in ("prefill", "decode"):
            assert cluster.get(SVC, "default", f"{NAME}-{role}-headless") is not None
        router = cluster.get(DEPLOY, "default", f"{NAME}-router")
        assert "--prefill-backend-dns" in router["spec"]["template"]["spec"]["containers"][0]["args"]
        status = cluster.get(INFD, "default", NAME)["status"]
        assert status["routing"]["router"] == f"{NAME}-router"
        assert cluster.condition(NAME, "Ready")["message"] == "0/3 engine pods ready"

        # a deleted pool and a hand-edited one are put back
        await cluster._call("DELETE", f"/apis/apps/v1/namespaces/default/statefulsets/{NAME}-decode")
        await cluster.patch(STS, "default", f"{NAME}-prefill", {"spec": {"replicas": 7}})
        await cluster.wait_for(lambda: live_differences(cluster) == [], what="the pools repaired")

        # the pools resized from the spec
        await cluster.patch(INFD, "default", NAME, {"spec": {"disaggregation": {"decode": {"replicas": 4}}}})
        await cluster.wait_for(
            lambda: (
                (cluster.get(STS, "default", f"{NAME}-decode") or {}).get("spec", {}).get("replicas") == 4
            ),
            what="four decode engines",
        )

        # disaggregation dropped: one StatefulSet and its headless Service again, the pools gone
        await cluster.patch(INFD, "default", NAME, {"spec": {"disaggregation": None, "replicas": 2}})
        await cluster.wait_for(
            lambda: (cluster.get(STS, "default", NAME) and cluster.get(STS, "default", f"{NAME}-prefill") is None
                     and cluster.get(STS, "default", f"{NAME}-decode") is None),
            what="one StatefulSet instead of the pools",
        )  # fmt: skip
        await cluster.settle()
        assert cluster.get(SVC, "default", f"{NAME}-prefill-headless") is None
        assert cluster.get(SVC, "default", f"{NAME}-headless") is not None
        router = cluster.get(DEPLOY, "default", f"{NAME}-router")
        assert "--prefill-backend-dns" not in router["spec"]["template"]["spec"]["containers"][0]["args"]
