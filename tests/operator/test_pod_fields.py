"""spec.pod: imagePullSecrets, env, envFrom, affinity, priorityClassName and runtimeClassName reach the engine
pods (and the router's where they apply), validate against Kubernetes' own schemas, and never override what
the operator sets."""

from __future__ import annotations

import kubernetes_validate
import pytest
from pagoda.operator import render
from pagoda.operator.discovery import node_gpus, pools
from pagoda.operator.planning import decide
from pagoda.operator.spec import SpecError, parse_spec
from pagoda_testkit import INFD, STS, Cluster, example, node, running_operator

POOLS = pools(g for g in (node_gpus(node("n-l40s", "l40s")),) if g)
AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]
        }
    }
}
POD = {
    "imagePullSecrets": [{"name": "registry-creds"}],
    "env": [{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
    "envFrom": [{"configMapRef": {"name": "engine-env"}}],
    "affinity": AFFINITY,
    "priorityClassName": "inference-high",
    "runtimeClassName": "nvidia",
}  # fmt: skip


def routed_body(pod: dict) -> dict:
    body = example("llama-3.1-8b-l40s-routed-autoscaled.yaml")
    body["metadata"] |= {"namespace": "default", "uid": "0b8f6c2e-1111-2222-3333-444455556666"}
    body["spec"]["pod"] = pod
    body["spec"]["apiKeySecretRef"] = {"name": "api"}
    return body


def test_pod_fields_reach_engine_and_router_pods() -> None:
    body = routed_body(POD)
    spec = parse_spec(body["spec"])
    objects = render.children(body, spec, decide(spec, POOLS), with_service_monitor=False)
    sts = objects[-1]
    [router] = [o for o in objects if o["kind"] == "Deployment"]
    for obj in (sts, router):
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    pod = sts["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert pod["affinity"] == AFFINITY and pod["priorityClassName"] == "inference-high"
    assert pod["runtimeClassName"] == "nvidia"
    # The operator's GPU placement stays: the affinity adds to it.
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-L40S"
    names = [e["name"] for e in engine["env"]]
    assert names == [
        "HF_HUB_OFFLINE",
        "PAGODA_NATIVE_KERNELS",
        "HF_HOME",
        "PAGODA_API_KEY",
        "PAGODA_KERNEL_CACHE",  # the deployment's kernels, compiled by the download Job, then the image's
        "NCCL_DEBUG",
        "FROM_SECRET",
    ]
    assert engine["envFrom"] == [{"configMapRef": {"name": "engine-env"}}]
    rpod = router["spec"]["template"]["spec"]
    assert rpod["imagePullSecrets"] == [{"name": "registry-creds"}]  # the same image
    assert rpod["priorityClassName"] == "inference-high" and rpod["affinity"] == AFFINITY
    assert "runtimeClassName" not in rpod  # the router needs no GPU runtime
    # Without spec.pod nothing of it is rendered.
    plain = parse_spec(routed_body({})["spec"])
    bare = render.statefulset(routed_body({}), plain, decide(plain, POOLS))["spec"]["template"]["spec"]
    assert not {"imagePullSecrets", "affinity", "priorityClassName", "runtimeClassName"} & set(bare)


@pytest.mark.parametrize(
    ("pod", "field", "reason"),
    [
        ({"env": [{"name": "PAGODA_API_KEY", "value": "x"}]}, "pod.env[0]", "InvalidPodFields"),
        ({"env": [{"name": "NCCL_DEBUG", "value": "1"}, {"name": "HF_HOME", "value": "/x"}]}, "pod.env[1]", "InvalidPodFields"),
        ({"env": [{"name": "1BAD", "value": "x"}]}, "pod.env", "InvalidSpec"),
        ({"priorityClassName": "Not_A_Name"}, "pod.priorityClassName", "InvalidSpec"),
        ({"runtimeClassName": "nvidia runtime"}, "pod.runtimeClassName", "InvalidSpec"),
        ({"affinity": {"nodeAfinity": {}}}, "pod.affinity", "InvalidSpec"),
        ({"imagePullSecrets": [{}]}, "pod.imagePullSecrets", "InvalidSpec"),
    ],
)  # fmt: skip
def test_bad_pod_fields_name_the_field(pod: dict, field: str, reason: str) -> None:
    with pytest.raises(SpecError) as info:
        spec = parse_spec(routed_body(pod)["spec"])
        render.check_pod_fields(spec)
    assert (info.value.field, info.value.reason) == (field, reason), str(info.value)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_operator_refuses_an_env_it_sets_with_a_condition_and_an_event(cluster: Cluster) -> None:
    await cluster.add_node("cpu-1", None)
    cr = {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "clash"},
          "spec": {"gpu": {"count": 0}, "pod": {"env": [{"name": "HF_HUB_OFFLINE", "value": "0"}]}}}  # fmt: skip
    async with running_operator(cluster):
        await cluster.create(cr)
        await cluster.wait_for(
            lambda: cluster.condition("clash", "Ready").get("reason") == "InvalidPodFields"
        )
        await cluster.settle()
    assert "spec.pod.env[0]: HF_HUB_OFFLINE" in cluster.condition("clash", "Ready")["message"]
    assert [e["reason"] for e in cluster.events("clash") if e["type"] == "Warning"] == ["InvalidPodFields"]
    assert cluster.get(STS, "default", "clash") is None
    assert (cluster.get(INFD, "default", "clash")["status"]["phase"]) == "InvalidPodFields"
