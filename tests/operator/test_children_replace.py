"""Children are replaced, not merge-patched: a key the operator stops rendering leaves the live object.

A JSON merge patch only adds and changes keys, so a deployment switched from GPU to CPU kept its GPU
nodeSelector, toleration and GPU limit, while the spec-hash annotation (which the patch did update) said
"in sync" ever after. These tests switch GPU -> CPU -> GPU and compare the live children with what the
operator renders for the current spec, key for key.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pagoda.operator import render
from pagoda.operator.discovery import node_gpus, pools
from pagoda.operator.planning import decide
from pagoda.operator.spec import parse_spec
from pagoda_testkit import INFD, STS, Cluster, example, node, running_operator

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
RESOURCES = {
    "StatefulSet": STS,
    "Service": "v1/services",
    "PodDisruptionBudget": "policy/v1/poddisruptionbudgets",
}
# Fields the API server owns; everything else must be exactly what the operator rendered.
SERVER_METADATA = ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields")


def rendered_children(cluster: Cluster, name: str, kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    body = copy.deepcopy(cluster.get(INFD, "default", name))
    spec = parse_spec(body["spec"])
    gpus = pools(g for g in (node_gpus(node(f"gpu-{k}-1", k)) for k in kinds) if g)
    return render.children(body, spec, decide(spec, gpus), with_service_monitor=False)


def live_as_rendered(obj: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj.pop("status", None)
    for key in SERVER_METADATA:
        obj["metadata"].pop(key, None)
    return obj


def differences(cluster: Cluster, name: str, kinds: tuple[str, ...]) -> list[str]:
    out = []
    for want in rendered_children(cluster, name, kinds):
        meta = want["metadata"]
        live = cluster.get(RESOURCES[want["kind"]], "default", meta["name"])
        if live is None or live_as_rendered(live) != want:
            out.append(f"{want['kind']}/{meta['name']}")
    return out


async def wait_in_sync(cluster: Cluster, name: str, generation: int, kinds: tuple[str, ...]) -> None:
    await cluster.wait_for(
        lambda: (
            (cluster.get(INFD, "default", name).get("status") or {}).get("observedGeneration") == generation
        ),
        what=f"status for generation {generation}",
    )
    await cluster.settle()
    assert differences(cluster, name, kinds) == []


async def test_gpu_to_cpu_and_back_leaves_no_stale_keys(cluster: Cluster) -> None:
    await cluster.add_node("cpu-1", None)
    await cluster.add_node("gpu-l4-1", "l4")
    cr = example("cpu-default-model.yaml")
    cr["metadata"]["name"] = "switch"
    cr["spec"]["gpu"] = {
        "product": "NVIDIA-L4",
        "count": 1,
        "nodeSelector": {"pool": "inference"},
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
    }
    async with running_operator(cluster):
        await cluster.create(cr)
        await wait_in_sync(cluster, "switch", 1, ("l4",))
        pod = cluster.get(STS, "default", "switch")["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"pool": "inference", "nvidia.com/gpu.product": "NVIDIA-L4"}
        assert len(pod["tolerations"]) == 2

        # GPU -> CPU: the GPU nodeSelector, tolerations and GPU limits must go, not linger.
        await cluster.patch(
            INFD, "default", "switch", {"spec": {"gpu": {"product": None, "count": 0, "nodeSelector": None,
                                                         "tolerations": None}}},
        )  # fmt: skip
        await wait_in_sync(cluster, "switch", 2, ("l4",))
        pod = cluster.get(STS, "default", "switch")["spec"]["template"]["spec"]
        assert "nodeSelector" not in pod and "tolerations" not in pod
        assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]
        assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["requests"]

        # A fresh reconcile finds nothing to do: the hash and the objects agree.
        mark = cluster.emulator.request_count
        async with running_operator(cluster):
            await cluster.settle()
        assert cluster.emulator.writes(mark) == []

        # ...and back to the GPU.
        await cluster.patch(
            INFD, "default", "switch", {"spec": {"gpu": {"product": "NVIDIA-L4", "count": 1}}}
        )
        await wait_in_sync(cluster, "switch", 3, ("l4",))
        pod = cluster.get(STS, "default", "switch")["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


async def test_a_hand_added_node_selector_is_drift(cluster: Cluster) -> None:
    """A key added by hand where the operator owns the whole map is drift, even though the hash agrees."""
    await cluster.add_node("cpu-1", None)
    async with running_operator(cluster):
        await cluster.create(example("cpu-default-model.yaml"))
        await wait_in_sync(cluster, "smollm2-cpu", 1, ())
        await cluster.patch(
            STS, "default", "smollm2-cpu", {"spec": {"template": {"spec": {"nodeSelector": {"gpu": "yes"}}}}}
        )
        await cluster.wait_for(
            lambda: (
                "nodeSelector" not in cluster.get(STS, "default", "smollm2-cpu")["spec"]["template"]["spec"]
            ),
            what="the hand-added nodeSelector to be removed",
        )
        await cluster.settle()
        assert differences(cluster, "smollm2-cpu", ()) == []


async def test_the_emulator_replaces_with_optimistic_concurrency(cluster: Cluster) -> None:
    """PUT replaces the whole object and refuses a stale resourceVersion, as a real API server does."""
    obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "s", "namespace": "default", "labels": {"a": "1", "b": "2"}},
        "spec": {"selector": {"x": "y"}, "ports": [{"port": 80}]},
    }
    created = await cluster._call("POST", "/api/v1/namespaces/default/services", obj)
    replacement = copy.deepcopy(obj)
    replacement["metadata"]["labels"] = {"a": "1"}
    replacement["metadata"]["resourceVersion"] = created["metadata"]["resourceVersion"]
    replaced = await cluster._call("PUT", "/api/v1/namespaces/default/services/s", replacement)
    assert replaced["metadata"]["labels"] == {"a": "1"}
    assert replaced["metadata"]["uid"] == created["metadata"]["uid"]
    assert replaced["metadata"]["resourceVersion"] != created["metadata"]["resourceVersion"]
    assert cluster.get("v1/services", "default", "s")["metadata"]["labels"] == {"a": "1"}
    # The same (now stale) resourceVersion again: 409 Conflict, nothing changes.
    replacement["metadata"]["labels"] = {"c": "3"}
    async with cluster.session.put(
        cluster.url + "/api/v1/namespaces/default/services/s", json=replacement
    ) as resp:
        assert resp.status == 409, await resp.text()
    assert cluster.get("v1/services", "default", "s")["metadata"]["labels"] == {"a": "1"}
    async with cluster.session.put(
        cluster.url + "/api/v1/namespaces/default/services/missing", json=replacement
    ) as resp:
        assert resp.status == 404
