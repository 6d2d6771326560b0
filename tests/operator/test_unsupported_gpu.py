"""GPUs the engine image's torch build cannot run (compute capability below 7.5, e.g. V100) are refused by the
planner, and the operator says so with its own condition reason instead of creating pods that cannot start."""

from __future__ import annotations

import pytest
from pagoda.engine.sizing import (
    ENGINE_MIN_COMPUTE,
    GPU_CATALOGUE,
    Hints,
    UnsupportedGPUError,
    gpu_info,
    plan,
    well_known_shape,
)
from pagoda_testkit import INFD, STS, Cluster, example, running_operator

SMOL = well_known_shape("smollm2-135m")


@pytest.mark.parametrize("spec", GPU_CATALOGUE, ids=lambda s: s.name)
def test_the_planner_refuses_exactly_the_gpus_below_the_builds_compute_capability(spec):
    info = gpu_info(spec.name, 1)
    if spec.compute_capability >= ENGINE_MIN_COMPUTE:
        assert plan(SMOL, info, Hints()).num_gpu_blocks > 0
        return
    with pytest.raises(UnsupportedGPUError) as exc:
        plan(SMOL, info, Hints())
    message = str(exc.value)
    assert f"compute capability {spec.compute_capability[0]}.{spec.compute_capability[1]}" in message
    assert "torch 2.13.0 (CUDA 13.0, PyPI)" in message and "7.5" in message and "gpu.count: 0" in message
    assert "driver 580" in message


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_deployment_on_v100_nodes_gets_an_unsupported_gpu_condition(cluster: Cluster) -> None:
    await cluster.add_node("gpu-v100-1", "v100")
    await cluster.add_node("gpu-l4-1", "l4")
    on_v100 = example("qwen2.5-7b-l4-fp8.yaml")
    on_v100["metadata"]["name"] = "on-v100"
    on_v100["spec"]["gpu"]["product"] = "Tesla-V100-SXM2-32GB"
    anywhere = example("qwen2.5-7b-l4-fp8.yaml")
    anywhere["metadata"]["name"] = "anywhere"
    del anywhere["spec"]["gpu"]["product"]
    async with running_operator(cluster):
        await cluster.create(on_v100)
        await cluster.create(anywhere)
        ready = await cluster.wait_for(
            lambda: (c := cluster.condition("on-v100", "Ready")).get("reason") == "UnsupportedGPU" and c,
            what="Ready=False, UnsupportedGPU",
        )
        assert ready["status"] == "False" and "compute capability 7.0" in ready["message"]
        await cluster.wait_for(
            lambda: any(e["reason"] == "UnsupportedGPU" for e in cluster.events("on-v100")), what="an Event"
        )
        assert cluster.get(STS, "default", "on-v100") is None
        # with no product asked for, the V100 pool is ruled out and the L4 one chosen
        sts = await cluster.wait_for(lambda: cluster.get(STS, "default", "anywhere"), what="StatefulSet")
        assert sts["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-L4"
        # the status patch follows the StatefulSet's creation: wait for it rather than race it
        gpu = await cluster.wait_for(
            lambda: (cluster.get(INFD, "default", "anywhere").get("status") or {}).get("gpu"),
            what="status.gpu",
        )
        reason = gpu["reason"]
        assert "Tesla-V100-SXM2-32GB" in reason and "compute capability 7.0" in reason
        await cluster.settle()
