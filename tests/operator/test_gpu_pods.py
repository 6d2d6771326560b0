"""Issue 22, item 5: GPU pods for real clusters. GPU discovery without GPU Feature Discovery (GKE's accelerator
label, well-known instance types) and a condition naming the nodes it cannot identify; CPU and memory that
follow tensor-parallel size and model by the stated rule, /dev/shm inside the memory; GPU pods never build or
load the CPU path's C kernels. (runtimeClassName: tests/operator/test_pod_fields.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pagoda.operator import planning, render
from pagoda.operator.discovery import node_gpus, pools
from pagoda.operator.planning import decide, decide_on_nodes
from pagoda.operator.quantity import parse_quantity
from pagoda.operator.spec import SpecError, parse_spec
from pagoda_testkit import STS, Cluster, example, node, running_operator

GiB = 1 << 30


def bare_node(name: str, labels: dict[str, str], gpus: int | None = None) -> dict:
    obj = node(name, None)
    obj["metadata"]["labels"] |= labels
    if gpus is not None:
        obj["status"]["allocatable"]["nvidia.com/gpu"] = str(gpus)
    return obj


@pytest.mark.parametrize(
    ("labels", "gpus", "product", "count", "cc"),
    [
        ({"cloud.google.com/gke-accelerator": "nvidia-l4"}, 2, "NVIDIA-L4", 2, (8, 9)),
        ({"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}, 8, "NVIDIA-H100-80GB-HBM3", 8, (9, 0)),
        ({"node.kubernetes.io/instance-type": "p5.48xlarge"}, None, "NVIDIA-H100-80GB-HBM3", 8, (9, 0)),
        ({"node.kubernetes.io/instance-type": "g6e.12xlarge"}, None, "NVIDIA-L40S", 4, (8, 9)),
        ({"node.kubernetes.io/instance-type": "g5.xlarge"}, None, "NVIDIA-A10G", 1, (8, 6)),
        ({"node.kubernetes.io/instance-type": "a3-highgpu-4g"}, None, "NVIDIA-H100-80GB-HBM3", 4, (9, 0)),
        ({"node.kubernetes.io/instance-type": "a2-ultragpu-2g"}, 2, "NVIDIA-A100-SXM4-80GB", 2, (8, 0)),
        ({"beta.kubernetes.io/instance-type": "Standard_ND96isr_H100_v5"}, 8, "NVIDIA-H100-80GB-HBM3", 8, (9, 0)),
        ({"node.kubernetes.io/instance-type": "Standard_NC4as_T4_v3"}, 1, "Tesla-T4", 1, (7, 5)),
    ],
)  # fmt: skip
def test_gpus_without_gfd_labels_are_found_from_other_labels(labels, gpus, product, count, cc) -> None:
    found = node_gpus(bare_node("n1", labels, gpus))
    assert found is not None and found.identified
    assert (found.product_label, found.count, (found.compute_major, found.compute_minor)) == (
        product,
        count,
        cc,
    )
    key, value = next(iter(labels.items()))
    assert found.source == f"{key}={value}"
    # Pods go where that label says, not to a GFD label the node does not have.
    [pool] = pools([found]).values()
    assert pool.selector == {key: value}


def test_gfd_labels_win_and_plain_cpu_nodes_are_no_gpu_nodes() -> None:
    gfd = node("n1", "l4")
    gfd["metadata"]["labels"]["node.kubernetes.io/instance-type"] = "p5.48xlarge"
    assert node_gpus(gfd).product_label == "NVIDIA-L4" and node_gpus(gfd).source == "GPU Feature Discovery"
    assert node_gpus(bare_node("cpu", {"node.kubernetes.io/instance-type": "m7i.4xlarge"})) is None


def test_a_gpu_node_nobody_can_name_is_a_condition_that_names_it() -> None:
    unknown = node_gpus(bare_node("gpu-x", {"node.kubernetes.io/instance-type": "custom-8gpu"}, 8))
    assert unknown is not None and not unknown.identified and pools([unknown]) == {}
    spec = parse_spec(example("llama-3.1-8b-h100-nvme.yaml")["spec"])
    with pytest.raises(SpecError) as info:
        decide_on_nodes(spec, [unknown])
    assert info.value.reason == "GPUUnidentified" and "gpu-x" in str(info.value)
    assert "nvidia.com/gpu.product=" in str(info.value)
    # Without such nodes the old reasons stand.
    with pytest.raises(SpecError) as info:
        decide_on_nodes(spec, [])
    assert info.value.reason == "NoMatchingNodes"


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_operator_names_the_node_then_serves_once_it_is_labelled(cluster: Cluster) -> None:
    await cluster._call("POST", "/api/v1/nodes", bare_node("gpu-x", {}, 4))
    cr = example("qwen2.5-7b-l4-fp8.yaml")
    cr["spec"]["gpu"] = {"count": 1}  # any GPU
    async with running_operator(cluster):
        await cluster.create(cr)
        name = cr["metadata"]["name"]
        await cluster.wait_for(lambda: cluster.condition(name, "Ready").get("reason") == "GPUUnidentified")
        assert "gpu-x" in cluster.condition(name, "Ready")["message"]
        labels = {"metadata": {"labels": {"cloud.google.com/gke-accelerator": "nvidia-l4"}}}
        await cluster._call("PATCH", "/api/v1/nodes/gpu-x", labels)
        sts = await cluster.wait_for(lambda: cluster.get(STS, "default", name), what="the StatefulSet")
        await cluster.settle()
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-accelerator": "nvidia-l4"
    }
    status = cluster.get("pagoda.dev/v1alpha1/inferencedeployments", "default", name)["status"]
    assert "identified from cloud.google.com/gke-accelerator=nvidia-l4" in status["gpu"]["reason"]
    assert [e["reason"] for e in cluster.events(name) if e["type"] == "Warning"] == ["GPUUnidentified"]


POOLS = pools(g for g in (node_gpus(node(f"n-{k}", k)) for k in ("h100", "l4")) if g)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_cpu_and_memory_follow_tensor_parallel_size_and_model(tp: int) -> None:
    """cpu = 2 + 2 x TP; memory = 6 GiB + TP x (3 GiB + max(1 GiB, 10% of the rank's weights) + 2 GiB of
    /dev/shm) + the host KV tier, rounded up to GiB; /dev/shm is 2 GiB x TP and inside that memory."""
    body = example("llama-3.1-70b-h100x2-tp.yaml")
    body["metadata"] |= {"namespace": "default"}
    body["spec"]["gpu"]["count"] = tp
    del body["spec"]["resources"]
    spec = parse_spec(body["spec"])
    d = decide(spec, POOLS)
    p = d.plan
    assert p.tensor_parallel_size == tp
    weights = max(GiB, int(0.1 * p.weights_bytes_per_gpu))
    want = 6 * GiB + tp * (3 * GiB + weights + 2 * GiB) + (p.kv_offload_host_bytes or 0)
    assert d.pod_memory_bytes == -(-want // GiB) * GiB
    container = render.statefulset(body, spec, d)["spec"]["template"]["spec"]
    resources = container["containers"][0]["resources"]
    assert resources["requests"]["cpu"] == str(2 + 2 * tp)
    assert parse_quantity(resources["limits"]["memory"]) == d.pod_memory_bytes
    [shm] = [v for v in container["volumes"] if v["name"] == "dshm"]
    assert parse_quantity(shm["emptyDir"]["sizeLimit"]) == 2 * GiB * tp
    assert planning.runtime_memory_bytes(p) >= 2 * GiB * tp + 6 * GiB


def test_a_bigger_model_asks_more_memory_and_a_users_limit_feeds_the_host_tier() -> None:
    small = parse_spec(
        {"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct"}, "gpu": {"product": "H100"}}
    )
    large = parse_spec({"model": {"source": "hf://meta-llama/Llama-3.1-70B-Instruct"}, "gpu": {"product": "H100", "count": 2}})  # fmt: skip
    assert decide(large, POOLS).pod_memory_bytes > decide(small, POOLS).pod_memory_bytes
    limited = parse_spec({"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct"}, "gpu": {"product": "H100"},
                          "resources": {"limits": {"memory": "64Gi"}}})  # fmt: skip
    d = decide(limited, POOLS)
    # The host tier is what 90% of the limit leaves after the rule's own part: never more than the pod has.
    assert planning.runtime_memory_bytes(d.plan) + d.plan.kv_offload_host_bytes <= 0.9 * 64 * GiB
    assert d.plan.kv_offload_host_bytes > 0 and not d.plan.warnings
    tight = parse_spec({"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct"}, "gpu": {"product": "H100"},
                        "resources": {"limits": {"memory": "8Gi"}}, "offload": {"host": {"size": "4Gi"}}})  # fmt: skip
    assert any("/dev/shm" in w and "OOM" in w for w in decide(tight, POOLS).plan.warnings)


def test_cpu_pods_keep_shm_out_of_the_kv_cache() -> None:
    spec = parse_spec({"gpu": {"count": 0}, "resources": {"limits": {"memory": "4Gi"}}})
    d = decide(spec, {})
    assert d.shm_bytes == planning.CPU_SHM and d.pod_cpu == 1
    assert d.plan.kv_cache_memory_bytes < 4 * GiB - planning.CPU_SHM


def test_gpu_pods_never_build_or_load_the_cpu_kernels(tmp_path) -> None:
    gpu = parse_spec(example("qwen2.5-7b-l4-fp8.yaml")["spec"])
    cpu = parse_spec(example("cpu-default-model.yaml")["spec"])
    assert {"name": "PAGODA_NATIVE_KERNELS", "value": "0"} in render.engine_env(gpu)
    assert all(e["name"] != "PAGODA_NATIVE_KERNELS" for e in render.engine_env(cpu))
    # ...and with it the engine builds and loads nothing: no compiler run, no library, no cache file.
    code = (
        "import ctypes, subprocess\n"
        "from pagoda.kernels.cpu import loader\n"
        "def refuse(what): raise AssertionError(what)\n"
        "subprocess.run = lambda *a, **k: refuse('the C compiler was run')\n"
        "ctypes.CDLL = lambda *a, **k: refuse('a library was loaded')\n"
        "assert loader.library() is None and loader.current().variant == 'torch'\n"
    )
    env = {**os.environ, "PAGODA_NATIVE_KERNELS": "0", "PAGODA_CACHE": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    assert not any(tmp_path.rglob("*.so"))
