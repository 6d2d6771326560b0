"""Re-fit instead of crash loops, against the emulated cluster: an engine pod that runs out of memory gets a
plan with a margin, an Event and a rolled StatefulSet; three in a row end in RefitExhausted and silence."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pagoda.engine.exit_codes import REASON_CUDA_OOM, REASON_KV_TOO_SMALL, termination_message
from pagoda.operator import refit
from pagoda.operator.render import PLAN_ANNOTATION
from pagoda.operator.spec import parse_spec
from pagoda_testkit import INFD, STS, Cluster, example, pod_of, running_operator

pytestmark = pytest.mark.timeout(120)
NAME = "qwen2-5-7b"  # examples/qwen2.5-7b-l4-fp8.yaml: one L4, gpu-memory-utilization 0.92 as planned


def flag(sts: dict[str, Any], name: str) -> str | None:
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index(name) + 1] if name in args else None


def plan_of(sts: dict[str, Any]) -> str:
    return sts["spec"]["template"]["metadata"]["annotations"][PLAN_ANNOTATION]


def failed_pod(sts: dict[str, Any], n: int, *, oom_killed: bool = True, message: str | None = None) -> dict:
    """What the kubelet reports for a pod of this StatefulSet whose engine ran out of memory (`n` tells the
    pods of one test apart, as new uids would)."""
    terminated: dict[str, Any] = {
        "exitCode": 137 if oom_killed else 3,
        "reason": "OOMKilled" if oom_killed else "Error",
        "finishedAt": f"2025-01-01T00:00:{n:02d}Z",
        "containerID": f"containerd://{n:064x}",
    }
    if message is not None:
        terminated["message"] = message
    crashed = {
        "restartCount": 1,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": terminated},
    }
    return pod_of(sts, n, ready=False, container_status=crashed)


async def add_pod(cluster: Cluster, pod: dict[str, Any]) -> None:
    await cluster._call("POST", "/api/v1/namespaces/default/pods", pod)


def refit_status(cluster: Cluster) -> dict[str, Any]:
    return (cluster.get(INFD, "default", NAME) or {}).get("status", {}).get("refit") or {}


async def started(cluster: Cluster, **spec: Any) -> dict[str, Any]:
    await cluster.add_node("gpu-l4-1", "l4")
    cr = example("qwen2.5-7b-l4-fp8.yaml")
    cr["spec"].update(spec)
    await cluster.create(cr)
    sts = await cluster.wait_for(lambda: cluster.get(STS, "default", NAME), what="StatefulSet")
    await cluster.settle()
    return sts


@pytest.mark.asyncio
async def test_oom_killed_gives_a_lower_utilization_an_event_and_a_rolled_statefulset(
    cluster: Cluster,
) -> None:
    async with running_operator(cluster):
        sts = await started(cluster)
        assert flag(sts, "--gpu-memory-utilization") == "0.92"
        await add_pod(cluster, failed_pod(sts, 1))
        new = await cluster.wait_for(
            lambda: (s := cluster.get(STS, "default", NAME)) and plan_of(s) != plan_of(sts) and s,
            what="a re-planned StatefulSet",
        )
        await cluster.settle()
        assert flag(new, "--gpu-memory-utilization") == "0.87"
        assert cluster.get("v1/pods", "default", f"{NAME}-1") is None  # rolled: the StatefulSet recreates it
        assert flag(new, "--kv-offload-host-bytes") == str(
            8 << 30
        )  # OOMKilled: the pod's RAM ran out too (half of 16 GiB)
        state = refit_status(cluster)
        assert state["attempts"] == 1
        assert state["settings"] == {"gpu_memory_utilization": 0.87, "kv_offload_host_bytes": 8 << 30}
        assert state["lastFailure"]["reason"] == "OOMKilled" and state["lastFailure"]["pod"] == f"{NAME}-1"
        plan = cluster.get(INFD, "default", NAME)["status"]["plan"]
        assert (
            plan["gpu_memory_utilization"] == 0.87 and "re-fit" in plan["reasons"]["gpu_memory_utilization"]
        )
        degraded = cluster.condition(NAME, "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "Refitted"
        [event] = [e for e in cluster.events(NAME) if e["reason"] == "Refit"]
        assert (
            event["type"] == "Warning"
            and "0.92 -> 0.87" in event["message"]
            and "OOMKilled" in event["message"]
        )

        # The same failure seen again, and a failure of a pod of the old plan, change nothing.
        mark = cluster.emulator.request_count
        stale = failed_pod(sts, 2)
        await add_pod(cluster, stale)
        await cluster.settle()
        assert [str(w.method) for w in cluster.emulator.writes(mark)] == ["method.POST"]  # the test's own


@pytest.mark.asyncio
async def test_three_in_a_row_end_in_refit_exhausted_and_no_further_writes(cluster: Cluster) -> None:
    async with running_operator(cluster):
        sts = await started(cluster)
        measured = {"weights_bytes": 15 << 30, "activation_peak_bytes": 1 << 30, "kv_cache_bytes": 0}
        cuda_oom = termination_message(
            REASON_CUDA_OOM, "CUDA out of memory. Tried to allocate 1.00 GiB", measured
        )
        for n, kind in enumerate((dict(oom_killed=True), dict(oom_killed=False, message=cuda_oom)), start=1):
            before = plan_of(sts)
            await add_pod(cluster, failed_pod(sts, n, **kind))
            sts = await cluster.wait_for(
                lambda b=before: (s := cluster.get(STS, "default", NAME)) and plan_of(s) != b and s,
                what=f"re-fit {n}",
            )
            await cluster.settle()
        assert flag(sts, "--gpu-memory-utilization") == "0.82"
        assert refit_status(cluster)["lastFailure"]["reason"] == REASON_CUDA_OOM
        assert refit_status(cluster)["lastFailure"]["profile"] == measured

        await add_pod(cluster, failed_pod(sts, 3))
        await cluster.wait_for(lambda: cluster.condition(NAME, "Ready").get("reason") == refit.EXHAUSTED)
        await cluster.settle()
        ready = cluster.condition(NAME, "Ready")
        assert ready["status"] == "False" and "3 time(s) in a row" in ready["message"]
        assert refit_status(cluster)["exhausted"] is True and refit_status(cluster)["attempts"] == 3
        assert [e["reason"] for e in cluster.events(NAME) if e["type"] == "Warning"] == [
            "Refit",
            "Refit",
            refit.EXHAUSTED,
        ]
        assert (
            flag(cluster.get(STS, "default", NAME), "--gpu-memory-utilization") == "0.82"
        )  # not rolled again

        # Silence: more failures, a StatefulSet event, nothing written by the operator.
        mark = cluster.emulator.request_count
        await add_pod(cluster, failed_pod(sts, 4))
        await cluster.patch(STS, "default", NAME, {"metadata": {"labels": {"touched": "yes"}}})
        await cluster.settle(quiet=1.5)
        writes = [
            (str(w.method), w.resource.plural if w.resource else "") for w in cluster.emulator.writes(mark)
        ]
        assert writes == [("method.POST", "pods"), ("method.PATCH", "statefulsets")], writes

        # A new replica count (an autoscaler's write) is no new spec: the re-fit holds, nothing is written.
        mark = cluster.emulator.request_count
        await cluster.patch(INFD, "default", NAME, {"spec": {"replicas": 2}})
        await cluster.settle(quiet=1.0)
        writes = [
            (w.resource.plural if w.resource else "", w.subresource or "", sorted(w.data or {}))
            for w in cluster.emulator.writes(mark)
        ]
        # the test's PATCH of the spec and kopf's own bookkeeping (metadata only): no child, no status
        assert [w for w in writes if w[2] != ["metadata"]] == [
            ("inferencedeployments", "", ["metadata", "spec"])
        ], writes
        assert refit_status(cluster)["exhausted"] is True

        # Any other spec change starts over: a fresh plan, no re-fit settings.
        await cluster.patch(INFD, "default", NAME, {"spec": {"drain": {"timeoutSeconds": 30}}})
        await cluster.wait_for(lambda: cluster.condition(NAME, "Ready").get("reason") == "PodsNotReady")
        await cluster.settle()
        assert "refit" not in cluster.get(INFD, "default", NAME)["status"]
        assert flag(cluster.get(STS, "default", NAME), "--gpu-memory-utilization") == "0.92"


@pytest.mark.asyncio
async def test_a_measured_refusal_lowers_the_context_to_what_fits(cluster: Cluster) -> None:
    """KVCacheTooSmall: the engine measured less than planned; a smaller budget cannot help, a shorter
    context can, and the engine said how long."""
    async with running_operator(cluster):
        sts = await started(cluster, workload={})  # no target context: the planner's length may shrink
        assert flag(sts, "--max-model-len") == "32768"
        said = (
            "max_model_len=32768 does not fit in the KV cache: one sequence of 16384 tokens needs 896.00 MiB of KV "
            "cache (57344 B/token, block size 16), but only 700.00 MiB is available for the KV cache after 14.19 GiB "
            "of weights and 1.02 GiB of activations; the largest max_model_len that fits is 12800. Lower "
            "--max-model-len (or pass --max-model-len auto) or raise --gpu-memory-utilization."
        )
        message = termination_message(REASON_KV_TOO_SMALL, said, {"kv_cache_bytes": 700 << 20})
        await add_pod(cluster, failed_pod(sts, 1, oom_killed=False, message=message))
        new = await cluster.wait_for(
            lambda: (s := cluster.get(STS, "default", NAME)) and plan_of(s) != plan_of(sts) and s,
            what="re-fit",
        )
        await cluster.settle()
        assert flag(new, "--gpu-memory-utilization") == "0.92"  # untouched
        assert int(flag(new, "--max-model-len")) == 12800 * 9 // 10 // 16 * 16
        assert refit_status(cluster)["lastFailure"]["reason"] == REASON_KV_TOO_SMALL


# ------------------------------------------------------------------------------------- the rules, alone


def _plan(**over: Any):
    from pagoda.operator.discovery import node_gpus, pools
    from pagoda.operator.planning import decide
    from pagoda_testkit import node

    spec = parse_spec({**example("qwen2.5-7b-l4-fp8.yaml")["spec"], **over})
    decision = decide(spec, pools([node_gpus(node("n", "l4"))]))
    return spec, decision.plan, decision.gpu.memory_bytes


FAILURE = refit.Failure("k", "p-0", "OOMKilled", 137, "h")
CUDA_OOM = refit.Failure("k", "p-0", REASON_CUDA_OOM, 3, "h")


def test_the_order_is_utilization_then_length_then_sequences() -> None:
    spec, p, memory = _plan()
    settings, change = refit.next_settings(spec, p, memory, CUDA_OOM, {})
    assert settings == {"gpu_memory_utilization": 0.87} and "0.92 -> 0.87" in change
    settings, change = refit.next_settings(spec, p, memory, FAILURE, {})  # OOMKilled: the host tier too
    assert settings == {"gpu_memory_utilization": 0.87, "kv_offload_host_bytes": 8 << 30}
    # utilization set by the spec: it is a bound, the context goes next
    spec, p, memory = _plan(engine={"kvCacheDtype": "fp8", "gpuMemoryUtilization": 0.92}, workload={})
    settings, change = refit.next_settings(spec, p, memory, CUDA_OOM, {})
    assert list(settings) == ["max_model_len"] and settings["max_model_len"] < p.max_model_len
    # context set by the spec too: the sequences go last
    spec, p, memory = _plan(engine={"kvCacheDtype": "fp8", "gpuMemoryUtilization": 0.9, "maxModelLen": 8192})
    settings, _ = refit.next_settings(spec, p, memory, CUDA_OOM, {})
    assert settings == {"max_num_seqs": p.max_num_seqs // 2}
    # and with everything pinned there is nothing left to lower
    engine = {"kvCacheDtype": "fp8", "gpuMemoryUtilization": 0.9, "maxModelLen": 8192, "maxNumSeqs": 4}
    spec, p, memory = _plan(engine=engine)
    assert refit.next_settings(spec, p, memory, CUDA_OOM, {}) is None


def test_the_context_never_drops_below_the_workloads_target() -> None:
    spec, p, memory = _plan(engine={"kvCacheDtype": "fp8", "gpuMemoryUtilization": 0.9})
    assert p.max_model_len == spec.workload.target_context == 16384
    settings, _ = refit.next_settings(spec, p, memory, CUDA_OOM, {})
    assert "max_model_len" not in settings  # the target is a bound: the sequences go instead
    assert settings == {"max_num_seqs": p.max_num_seqs // 2}


def test_the_failure_is_read_from_the_pod_status() -> None:
    sts = {
        "metadata": {"name": "x"},
        "spec": {
            "template": {"metadata": {"labels": {}, "annotations": {PLAN_ANNOTATION: "abc"}}, "spec": {}}
        },
    }
    oom = refit.failure_of(failed_pod(sts, 7), PLAN_ANNOTATION)
    assert oom is not None and oom.reason == "OOMKilled" and oom.plan == "abc" and oom.exit_code == 137
    message = termination_message(REASON_CUDA_OOM, "CUDA out of memory", {"weights_bytes": 1})
    cuda = refit.failure_of(failed_pod(sts, 8, oom_killed=False, message=message), PLAN_ANNOTATION)
    assert cuda.reason == REASON_CUDA_OOM and cuda.profile == {"weights_bytes": 1} and cuda.key != oom.key
    other = failed_pod(sts, 9, oom_killed=False, message="Traceback ...")
    other["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] = 1
    assert refit.failure_of(other, PLAN_ANNOTATION) is None  # not a memory failure: no re-fit
    assert json.loads(message)["exitCode"] == 3


def test_docs_state_the_rules_the_operator_uses() -> None:
    from pagoda.engine.exit_codes import EXIT_OUT_OF_MEMORY
    from pagoda_testkit import ROOT

    text = " ".join((ROOT / "docs" / "operator.md").read_text().split())
    assert f"exits with code **{EXIT_OUT_OF_MEMORY}**" in text
    assert (
        f"`gpu-memory-utilization` by {refit.UTILIZATION_STEP}, not below {refit.UTILIZATION_FLOOR}" in text
    )
    assert f"by {100 - int(refit.KV_CACHE_FACTOR * 100)}%" in text
    assert f"else {refit.MIN_MODEL_LEN}" in text and "by a quarter" in text and refit.LENGTH_FACTOR == 0.75
    assert refit.MAX_ATTEMPTS == 3 and "After three starts in a row" in text
    assert f"reason `{refit.EXHAUSTED}`" in text


def test_a_status_written_in_camel_case_reads_the_same() -> None:
    """Re-fit settings are stored under EngineConfig's field names; an older operator's camelCase status
    (maxModelLen) is read the same, so an upgrade mid-re-fit keeps what was lowered."""
    spec, p, memory = _plan(engine={"kvCacheDtype": "fp8", "gpuMemoryUtilization": 0.92}, workload={})
    old = refit.apply(p, {"maxModelLen": p.max_model_len // 2, "gpuMemoryUtilization": 0.87}, memory, "old")
    new = refit.apply(
        p, {"max_model_len": p.max_model_len // 2, "gpu_memory_utilization": 0.87}, memory, "new"
    )
    assert (old.max_model_len, old.gpu_memory_utilization) == (new.max_model_len, new.gpu_memory_utilization)
    assert refit.settings_of({"kvOffloadHostBytes": 1, "measuredKvCacheBytes": 2}) == {
        "kv_offload_host_bytes": 1,
        "measured_kv_cache_bytes": 2,
    }
