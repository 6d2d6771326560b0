"""The operator running for real under kopf against kmock's Kubernetes emulator over HTTP."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pagoda.operator.metrics import OperatorMetrics
from pagoda.operator.render import HASH_ANNOTATION, KV_DIR
from pagoda_testkit import INFD, STS, Cluster, example, running_operator

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
PDB = "policy/v1/poddisruptionbudgets"
SVC = "v1/services"


def args_of(sts: dict[str, Any]) -> list[str]:
    return sts["spec"]["template"]["spec"]["containers"][0]["args"]


def flag(sts: dict[str, Any], name: str) -> str | None:
    args = args_of(sts)
    return args[args.index(name) + 1] if name in args else None


def llama8b(name: str, product: str) -> dict[str, Any]:
    cr = example("llama-3.1-8b-h100-nvme.yaml")
    cr["metadata"]["name"] = name
    cr["spec"]["gpu"]["product"] = product
    cr["spec"]["replicas"] = 1
    del cr["spec"]["workload"], cr["spec"]["offload"]
    return cr


async def wait_sts(cluster: Cluster, name: str) -> dict[str, Any]:
    return await cluster.wait_for(lambda: cluster.get(STS, "default", name), what=f"StatefulSet {name}")


async def test_examples_become_children_with_plans_for_the_gpus_on_the_nodes(cluster: Cluster) -> None:
    await cluster.add_node("cpu-1", None)
    await cluster.add_node("gpu-h100-1", "h100")
    await cluster.add_node("gpu-l4-1", "l4")
    m = OperatorMetrics()  # a registry only this operator writes to: its values are this test's alone
    async with running_operator(cluster, metrics=m):
        for file in ("cpu-default-model.yaml", "llama-3.1-8b-h100-nvme.yaml", "llama-3.1-70b-h100x2-tp.yaml",
                     "qwen2.5-7b-l4-fp8.yaml"):  # fmt: skip
            await cluster.create(example(file))
        cpu, l8b, l70b, qwen = [
            await wait_sts(cluster, n) for n in ("smollm2-cpu", "llama-3-1-8b", "llama-3-1-70b", "qwen2-5-7b")
        ]
        await cluster.settle()

    # CPU, default model: no model argument, no GPU, KV sized from the memory limit.
    assert args_of(cpu)[0] == "--host"
    assert "--kv-cache-memory-bytes" in args_of(cpu) and "--gpu-memory-utilization" not in args_of(cpu)
    assert "nvidia.com/gpu" not in cpu["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "nodeSelector" not in cpu["spec"]["template"]["spec"]
    # Llama-3.1-8B on an H100 with NVMe offload: FP8 KV (CC 9.0), one GPU, a claim template on local-nvme.
    pod = l8b["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert flag(l8b, "--kv-cache-dtype") == "fp8" and flag(l8b, "--max-model-len") == "32768"
    assert flag(l8b, "--kv-offload-disk-dir") == KV_DIR
    assert l8b["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "local-nvme"
    assert l8b["spec"]["replicas"] == 2
    # Llama-3.1-70B: two H100s per pod, tensor parallel 2, no NVMe.
    assert flag(l70b, "--tensor-parallel-size") == "2"
    assert l70b["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert "volumeClaimTemplates" not in l70b["spec"]
    # Qwen2.5-7B on an L4 with FP8 KV.
    assert qwen["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-L4"
    assert flag(qwen, "--kv-cache-dtype") == "fp8"

    for name in ("smollm2-cpu", "llama-3-1-8b", "llama-3-1-70b", "qwen2-5-7b"):
        infd = cluster.get(INFD, "default", name)
        status = infd["status"]
        assert {c["type"] for c in status["conditions"]} == {"Ready", "Progressing", "Degraded"}
        assert cluster.condition(name, "Degraded")["status"] == "False"
        assert cluster.condition(name, "Ready")["reason"] == "PodsNotReady"  # no kubelet in the emulator
        assert status["plan"]["max_model_len"] > 0 and status["plan"]["reasons"]["max_model_len"]
        # The queue limit is planned, shown with its reason, and given to every engine pod.
        sts = cluster.get(STS, "default", name)
        assert int(flag(sts, "--max-num-queued-reqs")) == status["plan"]["max_num_queued_reqs"] >= 1
        assert "503" in status["plan"]["reasons"]["max_num_queued_reqs"]
        assert status["observedGeneration"] == 1 and status["selector"].startswith("app.kubernetes.io/")
        uid = infd["metadata"]["uid"]
        for resource, child in ((SVC, name), (SVC, f"{name}-headless"), (PDB, name), (STS, name)):
            obj = cluster.get(resource, "default", child)
            assert obj is not None, (resource, child)
            assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
        assert any(e["reason"] == "Planned" for e in cluster.events(name))
    assert cluster.get(INFD, "default", "llama-3-1-8b")["status"]["gpu"]["nodes"] == ["gpu-h100-1"]
    # No Prometheus Operator in this cluster: no ServiceMonitor.
    assert cluster.objects("monitoring.coreos.com/v1/servicemonitors") == []
    # The operator's own metrics saw it all, and nothing else.
    successes = m.value("pagoda_operator_reconciles_total", {"result": "success"})
    assert successes >= 4  # each object once, plus no-op reconciles on StatefulSet events
    assert m.value("pagoda_operator_reconciles_total", {"result": "error"}) == 0
    assert m.value("pagoda_operator_reconcile_duration_seconds_count") == successes
    # 8B: 2 replicas x 1 GPU, 70B: 1 replica x 2 GPUs; Qwen: 1 x 1 L4; the CPU pods request none.
    assert m.value("pagoda_operator_gpus_requested", {"product": "NVIDIA-H100-80GB-HBM3"}) == 4
    assert m.value("pagoda_operator_gpus_requested", {"product": "NVIDIA-L4"}) == 1
    assert m.value("pagoda_operator_gpus_requested", {"product": "cpu"}) == 0
    deployments = "pagoda_operator_inference_deployments"
    assert m.value(deployments, {"condition": "Degraded", "status": "False"}) == 4
    assert m.value(deployments, {"condition": "Ready", "status": "False"}) == 4  # no kubelet: not ready
    assert m.value(deployments, {"condition": "Ready", "status": "True"}) == 0


async def test_h100_l4_and_a100_get_different_correct_plans(cluster: Cluster) -> None:
    for kind in ("h100", "l4", "a100"):
        await cluster.add_node(f"gpu-{kind}", kind)
    async with running_operator(cluster):
        for name, product in (("on-h100", "H100"), ("on-l4", "NVIDIA-L4"), ("on-a100", "A100-80GB")):
            await cluster.create(llama8b(name, product))
        h100, l4, a100 = [await wait_sts(cluster, n) for n in ("on-h100", "on-l4", "on-a100")]
        await cluster.settle()
    selector = lambda s: s["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"]  # noqa: E731
    assert (selector(h100), selector(l4), selector(a100)) == (
        "NVIDIA-H100-80GB-HBM3",
        "NVIDIA-L4",
        "NVIDIA-A100-SXM4-80GB",
    )
    # FP8 only where the compute capability is 8.9 or newer.
    assert (flag(h100, "--kv-cache-dtype"), flag(l4, "--kv-cache-dtype"), flag(a100, "--kv-cache-dtype")) == (
        "fp8",
        "fp8",
        "auto",
    )
    plans = {n: cluster.get(INFD, "default", n)["status"]["plan"] for n in ("on-h100", "on-l4", "on-a100")}
    assert "below 8.9" in plans["on-a100"]["reasons"]["kv_cache_dtype"]
    blocks = {n: p["num_gpu_blocks"] for n, p in plans.items()}
    assert blocks["on-h100"] > blocks["on-a100"] > blocks["on-l4"]  # 80 GB FP8 > 80 GB bf16 > 24 GB FP8
    assert len({flag(s, "--gpu-memory-utilization") for s in (h100, l4)}) == 2


async def test_update_rolls_the_statefulset_and_an_unchanged_reconcile_writes_nothing(
    cluster: Cluster,
) -> None:
    await cluster.add_node("gpu-h100-1", "h100")
    async with running_operator(cluster):
        await cluster.create(llama8b("chat", "H100"))
        await wait_sts(cluster, "chat")
        await cluster.settle()
        await cluster.patch(
            INFD, "default", "chat", {"spec": {"replicas": 3, "engine": {"maxModelLen": 8192}}}
        )
        await cluster.wait_for(
            lambda: (
                (s := cluster.get(STS, "default", "chat"))
                and s["spec"]["replicas"] == 3
                and flag(s, "--max-model-len") == "8192"
            ),
            what="the StatefulSet to follow the spec",
        )
        await cluster.wait_for(
            lambda: cluster.get(INFD, "default", "chat")["status"].get("observedGeneration") == 2,
            what="status",
        )
        await cluster.settle()
        assert cluster.get(INFD, "default", "chat")["status"]["plan"]["max_model_len"] == 8192
    # A fresh operator reconciles everything it finds on start-up: with nothing changed, it must not write.
    mark = cluster.emulator.request_count
    async with running_operator(cluster):
        await cluster.settle()
    after = cluster.emulator._requests[mark:]
    assert any(r.url.path.endswith("/statefulsets/chat") for r in after), "no reconcile happened"
    writes = cluster.emulator.writes(mark)
    assert writes == [], [f"{r.method} {r.url.path}" for r in writes]
    assert len(cluster.objects(STS)) == 1 and len(cluster.objects(SVC)) == 2  # and no duplicates


async def test_a_hand_edited_statefulset_is_put_back(cluster: Cluster) -> None:
    await cluster.add_node("gpu-h100-1", "h100")
    async with running_operator(cluster):
        await cluster.create(llama8b("chat", "H100"))
        original = copy.deepcopy(await wait_sts(cluster, "chat"))
        await cluster.settle()
        edited = copy.deepcopy(original["spec"]["template"]["spec"]["containers"])
        edited[0]["image"] = "example.com/not-pagoda:latest"
        await cluster.patch(
            STS, "default", "chat", {"spec": {"replicas": 7, "template": {"spec": {"containers": edited}}}}
        )
        await cluster.wait_for(
            lambda: (
                (s := cluster.get(STS, "default", "chat"))["spec"]["replicas"] == 1
                and s["spec"]["template"]["spec"]["containers"][0]["image"]
                == original["spec"]["template"]["spec"]["containers"][0]["image"]
            ),
            what="the StatefulSet to be restored",
        )
        restored = cluster.get(STS, "default", "chat")
        assert (
            restored["metadata"]["annotations"][HASH_ANNOTATION]
            == original["metadata"]["annotations"][HASH_ANNOTATION]
        )
        await cluster.settle()


async def test_an_l40s_node_joining_replans_a_deployment_waiting_for_one(cluster: Cluster) -> None:
    await cluster.add_node("gpu-h100-1", "h100")
    async with running_operator(cluster):
        await cluster.create(llama8b("wants-l40s", "NVIDIA-L40S"))
        await cluster.wait_for(
            lambda: cluster.condition("wants-l40s", "Ready").get("reason") == "NoMatchingNodes",
            what="NoMatchingNodes",
        )
        assert cluster.get(STS, "default", "wants-l40s") is None
        await cluster.wait_for(
            lambda: any(
                e["type"] == "Warning" and e["reason"] == "NoMatchingNodes"
                for e in cluster.events("wants-l40s")
            ),
            what="a NoMatchingNodes Event",
        )
        await cluster.add_node("gpu-l40s-1", "l40s")
        sts = await wait_sts(cluster, "wants-l40s")
        assert sts["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-L40S"
        await cluster.wait_for(
            lambda: cluster.condition("wants-l40s", "Degraded").get("status") == "False",
            what="Degraded=False",
        )
        status = cluster.get(INFD, "default", "wants-l40s")["status"]
        assert status["gpu"]["product"] == "NVIDIA-L40S" and status["gpu"]["nodes"] == ["gpu-l40s-1"]
        await cluster.settle()


INVALID = {
    "bad-source": ({"model": {"source": "ftp://host/llama"}}, "InvalidModelSource"),
    "unknown-gpu": ({"gpu": {"product": "NVIDIA-Z9000", "count": 1}}, "UnknownGPUProduct"),
    "too-large": (
        {
            "model": {"source": "hf://meta-llama/Llama-3.1-405B-Instruct"},
            "gpu": {"product": "NVIDIA-L4", "count": 1},
        },
        "ModelTooLarge",
    ),
    "fp8-on-a100": (
        {
            "model": {"source": "hf://Qwen/Qwen2.5-7B-Instruct"},
            "gpu": {"product": "A100-80GB", "count": 1},
            "engine": {"kvCacheDtype": "fp8"},
        },
        "UnsupportedKVCacheDtype",
    ),  # fmt: skip
    "unknown-model": ({"model": {"source": "pvc://models/my-finetune"}, "gpu": {"count": 1}}, "UnknownModel"),
}


async def test_invalid_specs_get_a_condition_and_an_event_and_no_hot_loop(cluster: Cluster) -> None:
    await cluster.add_node("gpu-l4-1", "l4")
    await cluster.add_node("gpu-a100-1", "a100")
    m = OperatorMetrics()
    async with running_operator(cluster, metrics=m) as operator:
        for name, (spec, _) in INVALID.items():
            await cluster.create(
                {
                    "apiVersion": "pagoda.dev/v1alpha1",
                    "kind": "InferenceDeployment",
                    "metadata": {"name": name},
                    "spec": spec,
                }
            )
        for name, (_, reason) in INVALID.items():
            await cluster.wait_for(
                lambda n=name, r=reason: cluster.condition(n, "Ready").get("reason") == r,
                what=f"{name}: {reason}",
            )
            assert cluster.condition(name, "Ready")["status"] == "False"
            assert cluster.condition(name, "Degraded")["status"] == "True"
            assert "spec." in cluster.condition(name, "Ready")["message"]
            assert cluster.get(STS, "default", name) is None
        await cluster.settle()
        for name, (_, reason) in INVALID.items():  # one Warning each, not one per retry
            assert [e["reason"] for e in cluster.events(name) if e["type"] == "Warning"] == [reason]
        # No hot loop: nothing at all happens while nothing changes.
        mark = cluster.emulator.request_count
        await cluster.settle(quiet=2.0)
        assert cluster.emulator.request_count == mark
        # ...and the operator still serves other objects.
        assert not operator.done()
        await cluster.create(llama8b("fine", "NVIDIA-L4"))
        await wait_sts(cluster, "fine")
        await cluster.settle()
    # One reconcile per invalid object, each counted under its reason; the valid one has no error.
    for _, reason in INVALID.values():
        assert m.value("pagoda_operator_reconcile_errors_total", {"reason": reason}) == 1, reason
    deployments = "pagoda_operator_inference_deployments"
    assert m.value(deployments, {"condition": "Degraded", "status": "True"}) == len(INVALID)
    assert m.value(deployments, {"condition": "Degraded", "status": "False"}) == 1


SERVICEMONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {"kind": "ServiceMonitor", "plural": "servicemonitors", "singular": "servicemonitor"},
        "versions": [
            {"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {"type": "object"}}}
        ],
    },
}


async def test_a_servicemonitor_only_where_the_prometheus_operator_crd_exists(cluster: Cluster) -> None:
    await cluster._call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", SERVICEMONITOR_CRD)
    async with running_operator(cluster):
        await cluster.create(example("cpu-default-model.yaml"))
        monitor = await cluster.wait_for(
            lambda: cluster.get("monitoring.coreos.com/v1/servicemonitors", "default", "smollm2-cpu"),
            what="ServiceMonitor",
        )
        await cluster.settle()
    assert monitor["spec"]["endpoints"][0] == {"port": "http", "path": "/metrics", "interval": "30s"}
    # The engines are scraped through the headless Service (it always selects them); the client Service only
    # when it fronts a router (one replica here: none), so no pod is scraped twice.
    selected = monitor["spec"]["selector"]["matchLabels"]
    headless = cluster.get(SVC, "default", "smollm2-cpu-headless")
    assert headless["metadata"]["labels"]["pagoda.dev/service"] == "headless"
    assert all(headless["metadata"]["labels"].get(k) == v for k, v in selected.items())
    client = cluster.get(SVC, "default", "smollm2-cpu")
    assert not all(client["metadata"]["labels"].get(k) == v for k, v in selected.items())


async def test_a_namespace_scoped_operator_leaves_other_namespaces_alone(cluster: Cluster) -> None:
    # kmock 0.8 cannot take POST /api/v1/namespaces (nor GET, see the emulator): store them directly.
    for ns in ("team-a", "default"):
        cluster.emulator.objects["v1/namespaces", None, ns] = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": ns},
        }
    async with running_operator(cluster, namespaces=["team-a"]):
        await cluster.create(example("cpu-default-model.yaml"), namespace="team-a")
        await cluster.create(example("cpu-default-model.yaml"), namespace="default")
        await cluster.wait_for(
            lambda: cluster.get(STS, "team-a", "smollm2-cpu"), what="StatefulSet in team-a"
        )
        await cluster.settle()
    assert cluster.get(STS, "default", "smollm2-cpu") is None
    assert "status" not in cluster.get(INFD, "default", "smollm2-cpu")
