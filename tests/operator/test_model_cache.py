"""Weights into the cluster, as the operator drives it: the cache claim, the download Job (no token in it),
progress in status.model while it runs, engine pods only once it succeeded, and a condition plus an Event
when it fails for good. The Job's pods are written as the Job controller and kubelet would report them."""

from __future__ import annotations

import json

import pytest
import yaml
from pagoda.operator import model_cache
from pagoda.operator.download.progress import progress_line
from pagoda.operator.download.result import Result
from pagoda.operator.render_cli import main as render_main
from pagoda_testkit import INFD, STS, Cluster, example, node, running_operator

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
JOBS, PVCS, PODS = "batch/v1/jobs", "v1/persistentvolumeclaims", "v1/pods"
GiB = 1 << 30


def qwen(name: str, source: str = "hf://Qwen/Qwen2.5-7B-Instruct") -> dict:
    cr = example("qwen2.5-7b-l4-fp8.yaml")
    cr["metadata"]["name"] = name
    cr["spec"]["model"] = {"source": source, "secretRef": {"name": "hf-token"}}
    return cr


def job_of(cluster: Cluster, name: str) -> dict | None:
    jobs = [j for j in cluster.objects(JOBS) if j["metadata"]["name"].startswith(f"{name}-download-")]
    return jobs[0] if jobs else None


async def download_pod(cluster: Cluster, job: dict, *, running: bool, terminated: dict | None = None) -> str:
    name = job["metadata"]["name"] + "-x1"
    state = {"terminated": terminated} if terminated else {"running": {}}
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "labels": {**job["spec"]["template"]["metadata"]["labels"],
                                                 "job-name": job["metadata"]["name"]}},
           "spec": job["spec"]["template"]["spec"],
           "status": {"phase": "Running" if running else "Failed",
                      "containerStatuses": [{"name": model_cache.CONTAINER, "ready": running, "state": state}]}}  # fmt: skip
    await cluster._call("POST", "/api/v1/namespaces/default/pods", pod)
    return name


async def test_download_job_then_engine_pods_with_progress_on_the_way(cluster: Cluster) -> None:
    cluster.emulator.jobs_succeed = False
    await cluster.add_node("gpu-l4-1", "l4")
    async with running_operator(cluster):
        await cluster.create(qwen("qwen"))
        job = await cluster.wait_for(lambda: job_of(cluster, "qwen"), what="the download Job")
        await cluster.wait_for(lambda: cluster.condition("qwen", "Ready").get("reason") == "Downloading")
        # The claim, sized from the model (7.6B parameters of bf16: 15.2 GB x 1.2 + 2 GiB), owned by the CR.
        [pvc] = cluster.objects(PVCS)
        assert pvc["metadata"]["name"] == "qwen-model-cache" and pvc["spec"]["accessModes"] == [
            "ReadWriteOnce"
        ]
        size = pvc["spec"]["resources"]["requests"]["storage"]
        assert size.endswith("Gi") and 18 <= int(size[:-2]) <= 22, size
        assert pvc["metadata"]["ownerReferences"][0]["name"] == "qwen"
        # The Job: the operator's image, the claim read-write, the token only as an optional secretKeyRef; the
        # download is its init container (the deployment's kernels are compiled after it, below).
        container = job["spec"]["template"]["spec"]["initContainers"][0]
        assert container["command"] == ["pagoda-model-download"]
        assert container["args"][:2] == ["--source", "hf://Qwen/Qwen2.5-7B-Instruct"]
        assert container["args"][-2:] == ["--revision", "main"]
        token = next(e for e in container["env"] if e["name"] == "HF_TOKEN")
        assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN", "optional": True}
        assert job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [4, 5, 6]
        assert cluster.get(STS, "default", "qwen") is None  # no engine before the weights are there

        # Running, half-way: status.model shows the progress from the pod's log.
        pod = await download_pod(cluster, job, running=True)
        cluster.emulator.pod_logs[("default", pod)] = "model:  50%|#####\n" + progress_line(
            8 * GiB, 16 * GiB, 2, 4
        )
        await cluster.patch(JOBS, "default", job["metadata"]["name"], {"status": {"active": 1}})
        await cluster.wait_for(
            lambda: (
                (cluster.get(INFD, "default", "qwen")["status"].get("model") or {}).get("bytes") == 8 * GiB
            ),
            what="progress in status.model",
        )
        status = cluster.get(INFD, "default", "qwen")["status"]
        assert status["model"]["phase"] == "Downloading" and status["model"]["totalBytes"] == 16 * GiB
        assert "8.00 of 16.00 GiB (50%)" in cluster.condition("qwen", "Ready")["message"]
        assert status["plan"]["kv_cache_dtype"] == "fp8"  # the plan is shown while downloading

        # Done: the engine pods start, reading the claim read-only from the hub cache layout.
        await cluster.patch(JOBS, "default", job["metadata"]["name"],
                            {"status": {"active": 0, "succeeded": 1,
                                        "conditions": [{"type": "Complete", "status": "True"}]}})  # fmt: skip
        sts = await cluster.wait_for(lambda: cluster.get(STS, "default", "qwen"), what="the StatefulSet")
        await cluster.settle()
    pod_spec = sts["spec"]["template"]["spec"]
    engine = pod_spec["containers"][0]
    assert engine["args"][0] == "Qwen/Qwen2.5-7B-Instruct"
    assert {"name": "HF_HOME", "value": model_cache.HF_HOME} in engine["env"]
    assert {"name": "model-cache", "mountPath": model_cache.CACHE_DIR, "readOnly": True} in engine[
        "volumeMounts"
    ]
    [vol] = [v for v in pod_spec["volumes"] if v["name"] == "model-cache"]
    assert vol["persistentVolumeClaim"] == {"claimName": "qwen-model-cache", "readOnly": True}
    assert cluster.get(INFD, "default", "qwen")["status"]["model"]["phase"] == "Ready"
    # After the download the Job compiled the engine's kernels into the cache volume, from the engine image,
    # for the planned GPU and with the engine's own serve flags; the engine reads them before the image's.
    [warm] = job["spec"]["template"]["spec"]["containers"]
    assert warm["name"] == model_cache.KERNEL_CONTAINER and warm["image"] == engine["image"]
    assert warm["command"][:2] == ["sh", "-c"] and "pagoda kernels warm" in warm["command"][2]
    args = warm["args"]
    assert args[:2] == ["--gpu", "L4"] and args[args.index("--") + 1 :] == engine["args"]
    folder = args[args.index("--cache-dir") + 1]
    assert folder == model_cache.kernel_dir(engine["image"], "L4", engine["args"])
    assert folder.startswith(model_cache.KERNELS_DIR + "/")
    assert {"name": "model-cache", "mountPath": model_cache.CACHE_DIR} in warm["volumeMounts"]
    assert {"name": "HF_HOME", "value": model_cache.HF_HOME} in warm["env"]
    assert {"name": "PAGODA_KERNEL_CACHE", "value": f"{folder}:{model_cache.IMAGE_KERNEL_CACHE}"} in engine[
        "env"
    ]
    assert "resources" in warm and "nvidia.com/gpu" not in json.dumps(
        warm["resources"]
    )  # compiles without one
    # The token's value was never anywhere: only the Secret's name.
    everything = json.dumps([cluster.objects(r) for r in (JOBS, PVCS, STS, INFD, PODS)])
    assert "hf-token" in everything and "HF_TOKEN" in everything


async def test_pagoda_render_shows_the_claim_and_the_job_the_operator_creates(
    cluster: Cluster, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pagoda render` of the same InferenceDeployment for the same node: the cache claim, the download Job
    (its kernel step included) and the engines' StatefulSet the operator created, in the order it did."""
    await cluster.add_node("gpu-l4-1", "l4")
    cr = qwen("qwen")
    async with running_operator(cluster):
        await cluster.create(cr)
        sts = await cluster.wait_for(lambda: cluster.get(STS, "default", "qwen"), what="the StatefulSet")
        await cluster.settle()
    job = job_of(cluster, "qwen")
    [pvc] = cluster.objects(PVCS)
    (tmp_path / "cr.yaml").write_text(yaml.safe_dump(cr))
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump(node("gpu-l4-1", "l4")))
    assert render_main([str(tmp_path / "cr.yaml"), "--nodes", str(tmp_path / "nodes.yaml")]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert [d["kind"] for d in docs][:2] == ["PersistentVolumeClaim", "Job"]
    assert docs[-1]["kind"] == "StatefulSet"
    for live, shown in zip((pvc, job, sts), (docs[0], docs[1], docs[-1]), strict=True):
        assert shown["metadata"]["name"] == live["metadata"]["name"]
        assert shown["spec"] == live["spec"], live["kind"]


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        ("ModelAccessDenied", "hf://meta-llama/Llama-3.1-8B-Instruct is gated and no token was given"),
        ("ModelNotFound", "hf://meta-llama/Llama-3.1-8B-Instruct has no revision 'v9'"),
        ("ModelVolumeFull", "the model cache volume is full (OSError): give spec.model.cache.size more room"),
    ],
)
async def test_a_failed_download_is_a_condition_and_one_event(
    cluster: Cluster, reason: str, message: str
) -> None:
    cluster.emulator.jobs_succeed = False
    await cluster.add_node("gpu-l4-1", "l4")
    async with running_operator(cluster) as operator:
        await cluster.create(qwen("gated", "hf://meta-llama/Llama-3.1-8B-Instruct"))
        job = await cluster.wait_for(lambda: job_of(cluster, "gated"), what="the download Job")
        terminated = {"exitCode": 4, "reason": "Error", "message": Result(reason, message).to_json() + "\n"}
        await download_pod(cluster, job, running=False, terminated=terminated)
        await cluster.patch(JOBS, "default", job["metadata"]["name"],
                            {"status": {"failed": 1, "conditions": [{"type": "Failed", "status": "True",
                                                                     "reason": "PodFailurePolicy"}]}})  # fmt: skip
        await cluster.wait_for(
            lambda: cluster.condition("gated", "Ready").get("reason") == reason, what=reason
        )
        await cluster.settle()
        mark = cluster.emulator.request_count
        await cluster.settle(quiet=1.0)
        assert cluster.emulator.request_count == mark and not operator.done()  # no loop
    ready = cluster.condition("gated", "Ready")
    assert message in ready["message"] and cluster.condition("gated", "Degraded")["status"] == "True"
    assert [e["reason"] for e in cluster.events("gated") if e["type"] == "Warning"] == [reason]
    assert cluster.get(STS, "default", "gated") is None
    assert cluster.get(INFD, "default", "gated")["status"]["model"]["phase"] == "Failed"


async def test_s3_sources_and_per_pod_caches_render_without_a_job(cluster: Cluster) -> None:
    """s3:// reads the downloaded directory; cache.perPod downloads in an init container of every pod."""
    cluster.emulator.jobs_succeed = False
    await cluster.add_node("gpu-l4-1", "l4")
    cr = qwen("froms3", "s3://models/qwen/7b")
    cr["spec"]["model"]["shape"] = {"numLayers": 28, "numAttentionHeads": 28, "numKvHeads": 4, "hiddenSize": 3584,
                                    "intermediateSize": 18944, "vocabSize": 152064, "dtype": "bfloat16"}  # fmt: skip
    cr["spec"]["model"]["cache"] = {"perPod": True, "size": "40Gi", "storageClassName": "local-nvme"}
    async with running_operator(cluster):
        await cluster.create(cr)
        sts = await cluster.wait_for(lambda: cluster.get(STS, "default", "froms3"), what="the StatefulSet")
        await cluster.settle()
    assert job_of(cluster, "froms3") is None and cluster.objects(PVCS) == []
    pod_spec = sts["spec"]["template"]["spec"]
    [init, warm] = pod_spec["initContainers"]  # download, then the kernels into the pod's own cache
    assert init["args"][:2] == ["--source", "s3://models/qwen/7b"]
    engine = pod_spec["containers"][0]
    assert (
        warm["name"] == model_cache.KERNEL_CONTAINER
        and warm["args"][warm["args"].index("--") + 1 :] == engine["args"]
    )
    keys = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in init["env"] if "valueFrom" in e}
    assert set(keys) == set(model_cache.SECRET_KEYS["s3"]) and all(k["optional"] for k in keys.values())
    assert pod_spec["containers"][0]["args"][0] == f"{model_cache.S3_DIR}/models/qwen/7b"
    [template] = [t for t in sts["spec"]["volumeClaimTemplates"] if t["metadata"]["name"] == "model-cache"]
    assert template["spec"]["resources"]["requests"]["storage"] == "40Gi"
    assert template["spec"]["storageClassName"] == "local-nvme"


async def test_a_failed_kernel_compile_fails_nothing_and_the_download_stays_the_jobs_verdict() -> None:
    """The kernels step exits 0 whatever `pagoda kernels warm` did (the engine then compiles at start-up), and
    the Job's final-failure rule and result still name the download, now its init container."""
    import subprocess

    from pagoda.operator.spec import parse_spec

    cr = qwen("q")
    spec = parse_spec(cr["spec"])
    kernels = model_cache.kernel_container("engine:1", "L4", ["Qwen/Qwen2.5-7B-Instruct"], spec)
    job = model_cache.download_job(cr, spec, kernels)
    pod = job["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == [model_cache.CONTAINER]
    assert [c["name"] for c in pod["containers"]] == [model_cache.KERNEL_CONTAINER]
    rule = job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]
    assert rule["containerName"] == model_cache.CONTAINER
    script = kernels["command"][2]
    failing = subprocess.run(
        ["sh", "-c", script.replace("pagoda kernels warm", "false"), "x"], capture_output=True, text=True
    )
    assert failing.returncode == 0 and "the engine compiles its kernels when it starts" in failing.stderr
    # the download's result is read from the init container's status
    message = Result("ModelNotFound", "no such revision").to_json() + "\n"
    status = {
        "initContainerStatuses": [
            {"name": model_cache.CONTAINER, "state": {"terminated": {"message": message}}}
        ]
    }
    state = model_cache.download_state(
        spec, {"metadata": {"name": "j"}, "status": {}}, [{"status": status}], "", "c"
    )
    assert state["lastError"] == "ModelNotFound: no such revision"
    # a GPU deployment's folder changes with the image, the GPU or any serve flag
    base = model_cache.kernel_dir("engine:1", "L4", ["m"])
    assert (
        len(
            {
                base,
                model_cache.kernel_dir("engine:2", "L4", ["m"]),
                model_cache.kernel_dir("engine:1", "H100-SXM", ["m"]),
                model_cache.kernel_dir("engine:1", "L4", ["m", "--kv-cache-dtype", "fp8"]),
            }
        )
        == 4
    )
