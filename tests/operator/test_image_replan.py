"""Re-plan on an engine image upgrade (issue 13): the first Ready pod of the new image reports the memory it
measured (GET /pagoda/memory through the API server's pod proxy); beyond the tolerance the operator re-plans
from it within the re-fit attempt bound, within it the plan simply carries on under the new image."""

from __future__ import annotations

from typing import Any

import pytest
from pagoda.engine.sizing.planner import FIT_SLACK
from pagoda.operator import profile, refit
from pagoda.operator.render import ENGINE_PORT, PLAN_ANNOTATION, default_image
from pagoda_testkit import INFD, STS, Cluster, example, pod_of, running_operator

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
NAME = "qwen2-5-7b"  # examples/qwen2.5-7b-l4-fp8.yaml on one L4
NEW_IMAGE = "registry.example/pagoda-engine:2.0"


def flag(sts: dict[str, Any], name: str) -> str | None:
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index(name) + 1] if name in args else None


def plan_of(sts: dict[str, Any]) -> str:
    return sts["spec"]["template"]["metadata"]["annotations"][PLAN_ANNOTATION]


def status(cluster: Cluster) -> dict[str, Any]:
    return cluster.get(INFD, "default", NAME)["status"]


def ready_pod(sts: dict[str, Any], n: int) -> dict[str, Any]:
    """What the kubelet reports for a Ready pod of this StatefulSet's current template."""
    return pod_of(sts, n, ready=True, container_status={"restartCount": 0, "state": {"running": {}}})


def oom_killed_pod(sts: dict[str, Any], n: int) -> dict[str, Any]:
    """What the kubelet reports for a pod of this template whose engine was OOMKilled."""
    pod = ready_pod(sts, n)
    terminated = {"exitCode": 137, "reason": "OOMKilled", "containerID": f"containerd://{n:064x}"}
    pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    pod["status"]["containerStatuses"] = [
        {
            "name": "engine",
            "ready": False,
            "restartCount": 1,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": terminated},
        }
    ]
    return pod


async def upgraded(cluster: Cluster, **spec: Any) -> dict[str, Any]:
    """The example running, then its image changed: the StatefulSet rolled to the new image."""
    await cluster.add_node("gpu-l4-1", "l4")
    cr = example("qwen2.5-7b-l4-fp8.yaml")
    cr["spec"].update(spec)
    await cluster.create(cr)
    await cluster.wait_for(lambda: cluster.get(STS, "default", NAME), what="StatefulSet")
    await cluster.settle()
    assert status(cluster)["planImage"] == default_image()
    await cluster.patch(INFD, "default", NAME, {"spec": {"image": NEW_IMAGE}})
    sts = await cluster.wait_for(
        lambda: (
            (s := cluster.get(STS, "default", NAME))
            and s["spec"]["template"]["spec"]["containers"][0]["image"] == NEW_IMAGE
            and s
        ),
        what="the new image rolled out",
    )
    await cluster.settle()
    assert status(cluster)["planImage"] == default_image()  # nothing measured yet
    return sts


def measured(plan: dict[str, Any], kv_share: float, weights_share: float) -> dict[str, Any]:
    """A /pagoda/memory answer: the plan's figures scaled, as a different image would measure them."""
    return {
        "device": "cuda",
        "weights_bytes": int(plan["weights_bytes_per_gpu"] * weights_share),
        "activation_peak_bytes": 1 << 30,
        "kv_cache_bytes": int(plan["kv_cache_bytes"] * kv_share),
        "kv_allocated_bytes": int(plan["kv_cache_bytes"] * kv_share),
        "block_size": plan["block_size"],
    }


async def add_pod(cluster: Cluster, pod: dict[str, Any]) -> None:
    await cluster._call("POST", "/api/v1/namespaces/default/pods", pod)


def serve_profile(cluster: Cluster, pod: str, body: dict[str, Any]) -> None:
    cluster.emulator.pod_proxy[("default", pod, ENGINE_PORT, profile.MEMORY_PATH)] = body


async def test_a_new_image_that_measures_a_smaller_kv_cache_is_replanned_from_the_measurement(
    cluster: Cluster,
) -> None:
    async with running_operator(cluster):
        sts = await upgraded(cluster, workload={})  # no target context: the length may shrink to what fits
        plan = status(cluster)["plan"]
        assert flag(sts, "--max-model-len") == "32768"
        body = measured(plan, kv_share=0.1, weights_share=1.4)  # the new image loads 40% more weights
        serve_profile(cluster, f"{NAME}-0", body)
        await add_pod(cluster, ready_pod(sts, 0))
        new = await cluster.wait_for(
            lambda: (s := cluster.get(STS, "default", NAME)) and plan_of(s) != plan_of(sts) and s,
            what="a re-planned StatefulSet",
        )
        await cluster.settle()
        state = status(cluster)
        block_bytes = plan["kv_cache_bytes"] // plan["num_gpu_blocks"]
        blocks = body["kv_allocated_bytes"] // block_bytes
        assert state["plan"]["kv_cache_bytes"] == blocks * block_bytes < plan["kv_cache_bytes"] * 0.11
        assert state["plan"]["weights_bytes_per_gpu"] == body["weights_bytes"]
        fits = int(blocks * FIT_SLACK) * plan["block_size"]
        assert int(flag(new, "--max-model-len")) == min(fits, 32768) < 32768
        assert state["planImage"] == NEW_IMAGE
        assert state["refit"]["attempts"] == 1 and state["refit"]["lastFailure"]["reason"] == profile.REASON
        assert state["refit"]["lastFailure"]["profile"]["weights_bytes"] == body["weights_bytes"]
        [event] = [e for e in cluster.events(NAME) if e["reason"] == "Replanned"]
        assert event["type"] == "Warning" and "KV cache" in event["message"] and "-90%" in event["message"]
        assert cluster.condition(NAME, "Degraded")["reason"] == "Refitted"

        # Measured once: more pods of that image (and the same pod again) change nothing.
        mark = cluster.emulator.request_count
        serve_profile(cluster, f"{NAME}-1", body)
        await add_pod(cluster, ready_pod(new, 1))
        await cluster.settle()
        writes = [str(w.method) for w in cluster.emulator.writes(mark)]
        assert writes == ["method.POST"], writes  # the test's own pod


async def test_a_new_image_within_the_tolerance_keeps_the_plan(cluster: Cluster) -> None:
    async with running_operator(cluster):
        sts = await upgraded(cluster)
        before = status(cluster)["plan"]
        serve_profile(cluster, f"{NAME}-0", measured(before, kv_share=0.95, weights_share=1.05))
        # A Ready pod of the old image says nothing about the new one: not even asked.
        old = ready_pod(sts, 5)
        old["spec"]["containers"][0]["image"] = default_image()
        await add_pod(cluster, old)
        await add_pod(cluster, ready_pod(sts, 0))
        await cluster.wait_for(lambda: status(cluster).get("planImage") == NEW_IMAGE, what="planImage moved")
        await cluster.settle()
        assert status(cluster)["plan"] == before and "refit" not in status(cluster)
        assert plan_of(cluster.get(STS, "default", NAME)) == plan_of(sts)
        [event] = [e for e in cluster.events(NAME) if e["reason"] == "MemoryProfileChecked"]
        assert event["type"] == "Normal" and NEW_IMAGE in event["message"] and f"{NAME}-0" in event["message"]


async def test_the_image_replan_counts_against_the_refit_bound(cluster: Cluster) -> None:
    """Two out-of-memory re-fits of the new image, then a Ready pod that measures another profile: the third
    change in a row is one too many, RefitExhausted."""
    async with running_operator(cluster):
        sts = await upgraded(cluster)
        for n in (1, 2):
            before = plan_of(sts)
            await add_pod(cluster, oom_killed_pod(sts, 10 + n))
            sts = await cluster.wait_for(
                lambda b=before: (s := cluster.get(STS, "default", NAME)) and plan_of(s) != b and s,
                what=f"re-fit {n}",
            )
            await cluster.settle()
        assert status(cluster)["refit"]["attempts"] == 2
        serve_profile(
            cluster, f"{NAME}-0", measured(status(cluster)["plan"], kv_share=0.5, weights_share=1.0)
        )
        await add_pod(cluster, ready_pod(sts, 0))
        await cluster.wait_for(lambda: cluster.condition(NAME, "Ready").get("reason") == refit.EXHAUSTED)
        await cluster.settle()
        state = status(cluster)
        assert state["refit"]["exhausted"] is True and state["refit"]["attempts"] == 3
        assert state["refit"]["lastFailure"]["reason"] == profile.REASON
        assert plan_of(cluster.get(STS, "default", NAME)) == plan_of(sts)  # not rolled again


async def test_an_unreadable_profile_changes_nothing(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """No answer from the pod (a proxy error, a pod not listening yet): logged, nothing written, and the
    next Ready pod of the image is asked again."""
    async with running_operator(cluster):
        sts = await upgraded(cluster)
        mark = cluster.emulator.request_count
        await add_pod(cluster, ready_pod(sts, 0))  # the emulator's proxy has no answer for it: 503
        await cluster.settle()
        assert [str(w.method) for w in cluster.emulator.writes(mark)] == ["method.POST"]  # the test's pod
        assert status(cluster)["planImage"] == default_image() and "refit" not in status(cluster)
        assert any("could not read the memory profile" in r.getMessage() for r in caplog.records)
        serve_profile(
            cluster, f"{NAME}-1", measured(status(cluster)["plan"], kv_share=1.0, weights_share=1.0)
        )
        await add_pod(cluster, ready_pod(sts, 1))
        await cluster.wait_for(lambda: status(cluster).get("planImage") == NEW_IMAGE, what="checked on pod 1")
