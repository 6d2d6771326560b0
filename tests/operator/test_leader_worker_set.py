"""A replica spanning nodes (issue 43, item 2): spec.parallelism, or a model that needs more GPUs than a node
has, renders a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) of groups instead of the StatefulSet: the leader
serves the API and meets the workers at $(LWS_LEADER_ADDRESS), the group restarts as one and scales by
groups, the Services and the router see leaders only. Against the emulator with LWS's CRD installed (created,
repaired, switched back) and without it (a condition and an Event, no engine pods)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from pagoda.engine.sizing import GPUInfo, lookup_gpu
from pagoda.operator import render
from pagoda.operator.discovery import RENDERED_NODE, GPUPool, node_gpus, pools
from pagoda.operator.planning import decide
from pagoda.operator.render_cli import main as render_main
from pagoda.operator.spec import SpecError, parse_spec
from pagoda_testkit import INFD, STS, Cluster, node, pod_of, running_operator

LWS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
SVC = "v1/services"
LWS_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "leaderworkersets.leaderworkerset.x-k8s.io"},
    "spec": {
        "group": "leaderworkerset.x-k8s.io",
        "scope": "Namespaced",
        "names": {"kind": "LeaderWorkerSet", "plural": "leaderworkersets", "singular": "leaderworkerset"},
        "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                      "schema": {"openAPIV3Schema": {"type": "object"}}}],
    },
}  # fmt: skip
NAME = "smollm-pp"


def cpu_pp(name: str = NAME, **parallelism: int) -> dict[str, Any]:
    """The default model on CPU pods, one replica of two stages on two pods unless told otherwise."""
    return {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"gpu": {"count": 0}, "replicas": 2, "parallelism": parallelism or {"pipeline": 2}},
    }


def h100_pool(nodes: int) -> dict[str, GPUPool]:
    return pools(g for g in (node_gpus(node(f"gpu-h100-{i}", "h100")) for i in range(nodes)) if g)


def llama(size: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "llama", "namespace": "default"},
        "spec": {"model": {"source": f"hf://meta-llama/Llama-3.1-{size}-Instruct"},
                 "gpu": {"product": "H100", "count": 8}, "workload": {"targetContext": 8192}},
    }  # fmt: skip


def engines(objects: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [
        (o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] in ("StatefulSet", "LeaderWorkerSet")
    ]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_spec_parallelism_renders_groups_with_the_leader_and_worker_commands() -> None:
    body = cpu_pp()
    spec = parse_spec(body["spec"])
    decision = decide(spec, {})
    objects = render.children(body, spec, decision, with_service_monitor=False)
    assert engines(objects) == [("LeaderWorkerSet", NAME)]
    [lws] = [o for o in objects if o["kind"] == "LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    group = lws["spec"]["leaderWorkerTemplate"]
    # two groups (spec.replicas) of two pods (nodes), restarted as one
    assert lws["spec"]["replicas"] == 2 and group["size"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = group["leaderTemplate"]["spec"]["containers"][0]
    worker = group["workerTemplate"]["spec"]["containers"][0]
    la, wa = leader["args"], worker["args"]
    assert flag(la, "--pipeline-parallel-size") == "2" and flag(la, "--nnodes") == "2"
    assert flag(la, "--node-rank") == "0" and "--headless" not in la
    assert flag(la, "--master-addr") == "$(LWS_LEADER_ADDRESS)" and flag(la, "--master-port") == "29501"
    assert flag(wa, "--node-rank") == "$(LWS_WORKER_INDEX)" and wa[-1] == "--headless"
    assert flag(wa, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
    # engine flags otherwise identical on every pod of a group
    strip = {"--node-rank", "--headless"}

    def common(args: list[str]) -> list[str]:
        out, skip = [], False
        for a in args:
            if skip:
                skip = False
            elif a in strip:
                skip = a == "--node-rank"
            else:
                out.append(a)
        return out

    assert common(la) == common(wa)
    # probes and the HTTP port on the leader; a worker serves nothing (its failure restarts the group)
    assert {"startupProbe", "readinessProbe", "livenessProbe", "ports"} <= set(leader)
    assert not {"startupProbe", "readinessProbe", "livenessProbe", "ports", "lifecycle"} & set(worker)
    assert group["leaderTemplate"]["metadata"]["labels"][render.LABEL_ROLE] == "leader"
    assert group["workerTemplate"]["metadata"]["labels"][render.LABEL_ROLE] == "worker"
    # a group is one replica: the Services (and the router through the headless one) see leaders only
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    assert services[f"{NAME}-headless"]["spec"]["selector"][render.LABEL_ROLE] == "leader"
    assert set(services) == {NAME, f"{NAME}-headless"}
    router = [o for o in objects if o["kind"] == "Deployment"][0]
    assert flag(router["spec"]["template"]["spec"]["containers"][0]["args"], "--backend-dns").startswith(
        f"{NAME}-headless.default.svc"
    )
    assert decision.status_plan()["nnodes"] == 2 and decision.status_plan()["pipeline_parallel_size"] == 2


def test_commands_expand_per_rank_as_the_kubelet_would() -> None:
    body = cpu_pp(pipeline=4)
    spec = parse_spec(body["spec"])
    commands = render.engine_commands(body, spec, decide(spec, {}))
    assert [what for what, _ in commands] == [
        "the group's leader", "worker 1 of the group", "worker 2 of the group", "worker 3 of the group"
    ]  # fmt: skip
    for rank, (_, args) in enumerate(commands):
        assert flag(args, "--node-rank") == str(rank)
        assert flag(args, "--master-addr") == f"{NAME}-0.{NAME}.default"
        assert not any("$(" in a for a in args)


def test_a_model_larger_than_a_node_is_a_group_of_nodes_and_a_smaller_one_is_not() -> None:
    """Llama-3.1-405B in bf16 does not fit 8 H100s: two nodes of 8, a stage per node; 70B stays one pod."""
    spec = parse_spec(llama("405B")["spec"])
    decision = decide(spec, h100_pool(2))
    assert (decision.plan.tensor_parallel_size, decision.pipeline_parallel_size, decision.nnodes) == (8, 2, 2)
    assert (
        decision.pod_gpus == 8
        and "2 stage(s) of 8 tensor-parallel rank(s) on 2 pod(s)" in decision.parallel_reason
    )
    objects = render.children(llama("405B"), spec, decision, with_service_monitor=False)
    assert engines(objects) == [("LeaderWorkerSet", "llama")]
    [lws] = [o for o in objects if o["kind"] == "LeaderWorkerSet"]
    for template in ("leaderTemplate", "workerTemplate"):
        pod = lws["spec"]["leaderWorkerTemplate"][template]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    # one replica, two pods on two nodes: the weights' cache claim is mounted by both
    claim = [
        o for o in render.model_objects(llama("405B"), spec, decision) if o["kind"] == "PersistentVolumeClaim"
    ]
    assert claim[0]["spec"]["accessModes"] == ["ReadWriteMany"]
    # one node: no group can be made, the model is too large
    with pytest.raises(SpecError) as err:
        decide(spec, h100_pool(1))
    assert err.value.reason == "ModelTooLarge"
    small = parse_spec(llama("70B")["spec"])
    assert decide(small, h100_pool(2)).nnodes == 1
    assert engines(
        render.children(llama("70B"), small, decide(small, h100_pool(2)), with_service_monitor=False)
    ) == [("StatefulSet", "llama")]


def test_explicit_parallelism_on_gpus_and_stages_in_one_pod() -> None:
    body = llama("70B")
    body["spec"]["parallelism"] = {"tensor": 4, "pipeline": 2}  # a stage of 4 GPUs per pod
    spec = parse_spec(body["spec"])
    decision = decide(spec, h100_pool(2))
    assert (decision.plan.tensor_parallel_size, decision.pipeline_parallel_size, decision.nnodes) == (4, 2, 2)
    assert decision.pod_gpus == 4
    body["spec"]["parallelism"] = {"pipeline": 2, "nodes": 1}  # both stages in one pod of 8: tensor 4
    spec = parse_spec(body["spec"])
    decision = decide(spec, h100_pool(1))
    assert (decision.plan.tensor_parallel_size, decision.pipeline_parallel_size, decision.nnodes) == (4, 2, 1)
    [sts] = [
        o
        for o in render.children(body, spec, decision, with_service_monitor=False)
        if o["kind"] == "StatefulSet"
    ]
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag(args, "--pipeline-parallel-size") == "2" and "--nnodes" not in args
    assert sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"


@pytest.mark.parametrize(
    ("parallelism", "field"),
    [
        ({"tensor": 3, "pipeline": 1, "nodes": 2}, "parallelism.nodes"),  # 3 ranks on 2 pods
        ({"pipeline": 200}, "parallelism.pipeline"),  # more stages than the 30 layers (CRD max is 64)
    ],
)
def test_splits_the_engine_cannot_run_are_refused_naming_the_field(parallelism: dict, field: str) -> None:
    body = cpu_pp(**parallelism)
    with pytest.raises(SpecError) as err:
        spec = parse_spec(body["spec"])
        decide(spec, {})
    assert err.value.field == field and err.value.reason == "InvalidParallelism"


def test_stages_beyond_the_layers_are_refused() -> None:
    spec = parse_spec(cpu_pp(pipeline=64, nodes=1)["spec"])  # SmolLM2-135M has 30 layers
    with pytest.raises(SpecError) as err:
        decide(spec, {})
    assert err.value.field == "parallelism.pipeline" and "30 layers" in str(err.value)


def test_pagoda_render_renders_the_group_by_default_and_says_it_needs_the_api(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cr.yaml"
    path.write_text(yaml.safe_dump(cpu_pp()))
    assert render_main([str(path)]) == 0
    out = capsys.readouterr().out
    kinds = [d["kind"] for d in yaml.safe_load_all(out) if d]
    assert "LeaderWorkerSet" in kinds and "StatefulSet" not in kinds
    assert "needs the LeaderWorkerSet API (leaderworkerset.x-k8s.io/v1)" in out.replace("\n# ", " ")


def test_a_render_without_a_cluster_may_span_any_number_of_nodes() -> None:
    gpu = lookup_gpu("H100")
    rendered = {gpu.labels[0]: GPUPool(gpu.labels[0], GPUInfo.from_spec(gpu, 8), [RENDERED_NODE], 8)}
    decision = decide(parse_spec(llama("405B")["spec"]), rendered)
    assert decision.nnodes == 2


def test_switching_shape_deletes_the_other_engines() -> None:
    body = cpu_pp()
    grouped = parse_spec(body["spec"])
    single = parse_spec({**body["spec"], "parallelism": None})
    gone = render.unwanted(body, grouped, with_keda=False, decision=decide(grouped, {}), with_lws=True)
    assert ("StatefulSet", NAME) in gone and ("LeaderWorkerSet", NAME) not in gone
    gone = render.unwanted(body, single, with_keda=False, decision=decide(single, {}), with_lws=True)
    assert ("LeaderWorkerSet", NAME) in gone and ("StatefulSet", NAME) not in gone
    # no LeaderWorkerSet API: none looked for
    gone = render.unwanted(body, single, with_keda=False, decision=decide(single, {}), with_lws=False)
    assert ("LeaderWorkerSet", NAME) not in gone


# -- against the emulator --------------------------------------------------------------------------------------


def lws_as_rendered(cluster: Cluster) -> dict[str, Any]:
    body = copy.deepcopy(cluster.get(INFD, "default", NAME))
    spec = parse_spec(body["spec"])
    return render.leader_worker_set(body, spec, decide(spec, {}))


def same(live: dict[str, Any] | None, want: dict[str, Any]) -> bool:
    return (
        live is not None
        and live["spec"] == want["spec"]
        and live["metadata"]["annotations"] == want["metadata"]["annotations"]
    )


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_operator_creates_repairs_and_replaces_a_leader_worker_set(cluster: Cluster) -> None:
    await cluster._call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", LWS_CRD)
    await cluster.add_node("cpu-1", None)
    async with running_operator(cluster):
        await cluster.create(cpu_pp())
        lws = await cluster.wait_for(lambda: cluster.get(LWS, "default", NAME), what="the LeaderWorkerSet")
        await cluster.settle()
        assert same(lws, lws_as_rendered(cluster))
        owner = lws["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["controller"]) == ("InferenceDeployment", True)
        assert cluster.get(STS, "default", NAME) is None
        status = cluster.get(INFD, "default", NAME)["status"]
        assert status["plan"]["nnodes"] == 2 and cluster.condition(NAME, "Ready")["reason"] == "PodsNotReady"
        assert status["selector"].endswith(",pagoda.dev/role=leader")  # an autoscaler averages over leaders
        headless = cluster.get(SVC, "default", f"{NAME}-headless")
        assert headless["spec"]["selector"][render.LABEL_ROLE] == "leader"

        # a hand edit (groups scaled by hand) and a deletion are put back
        await cluster.patch(LWS, "default", NAME, {"spec": {"replicas": 5}})
        await cluster.wait_for(
            lambda: (cluster.get(LWS, "default", NAME) or {}).get("spec", {}).get("replicas") == 2,
            what="the groups put back",
        )
        await cluster._call(
            "DELETE", f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/default/leaderworkersets/{NAME}"
        )
        await cluster.wait_for(
            lambda: cluster.get(LWS, "default", NAME), what="the LeaderWorkerSet recreated"
        )
        await cluster.settle()
        assert same(cluster.get(LWS, "default", NAME), lws_as_rendered(cluster))

        # scaling is by groups
        await cluster.patch(INFD, "default", NAME, {"spec": {"replicas": 3}})
        await cluster.wait_for(
            lambda: (cluster.get(LWS, "default", NAME) or {}).get("spec", {}).get("replicas") == 3,
            what="three groups",
        )

        # one pod per replica again: the StatefulSet comes, the LeaderWorkerSet goes
        await cluster.patch(INFD, "default", NAME, {"spec": {"parallelism": None}})
        await cluster.wait_for(
            lambda: cluster.get(STS, "default", NAME) and cluster.get(LWS, "default", NAME) is None,
            what="the StatefulSet instead",
        )
        await cluster.settle()
        assert render.LABEL_ROLE not in cluster.get(SVC, "default", f"{NAME}-headless")["spec"]["selector"]


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_without_the_api_a_group_is_a_condition_and_an_event(cluster: Cluster) -> None:
    await cluster.add_node("cpu-1", None)
    async with running_operator(cluster):
        await cluster.create(cpu_pp())
        ready = await cluster.wait_for(
            lambda: (c := cluster.condition(NAME, "Ready")).get("reason") == "LeaderWorkerSetNotServed" and c,
            what="Ready=False, LeaderWorkerSetNotServed",
        )
        assert ready["status"] == "False" and "leaderworkerset.x-k8s.io/v1" in ready["message"]
        assert "2 pods" in ready["message"]
        await cluster.wait_for(
            lambda: [e for e in cluster.events(NAME) if e["reason"] == "LeaderWorkerSetNotServed"],
            what="an Event",
        )
        await cluster.settle()
        assert cluster.get(STS, "default", NAME) is None  # no engine pods of the wrong shape either
        assert len([e for e in cluster.events(NAME) if e["reason"] == "LeaderWorkerSetNotServed"]) == 1


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_group_follows_once_the_api_is_installed(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No event announces a new API: the operator looks again once its answer expires (60 s; 0.5 s here)."""
    from pagoda.operator import handlers, reconcile

    monkeypatch.setattr(reconcile, "MONITORING_TTL", 0.5)
    monkeypatch.setattr(handlers, "MONITORING_TTL", 0.5)
    await cluster.add_node("cpu-1", None)
    async with running_operator(cluster):
        await cluster.create(cpu_pp())
        await cluster.wait_for(
            lambda: cluster.condition(NAME, "Ready").get("reason") == "LeaderWorkerSetNotServed",
            what="LeaderWorkerSetNotServed",
        )
        await cluster._call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", LWS_CRD)
        await cluster.wait_for(lambda: cluster.get(LWS, "default", NAME), what="the LeaderWorkerSet")
        await cluster.wait_for(
            lambda: cluster.condition(NAME, "Ready").get("reason") == "PodsNotReady", what="Ready follows"
        )


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_workers_out_of_memory_re_fits_the_group(cluster: Cluster) -> None:
    """A failure counts when its pod's plan is a live template's: a worker's, as the leader's."""
    await cluster._call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", LWS_CRD)
    await cluster.add_node("cpu-1", None)
    async with running_operator(cluster):
        await cluster.create(cpu_pp())
        lws = await cluster.wait_for(lambda: cluster.get(LWS, "default", NAME), what="the LeaderWorkerSet")
        await cluster.settle()
        group = lws["spec"]["leaderWorkerTemplate"]
        plan = group["leaderTemplate"]["metadata"]["annotations"][render.PLAN_ANNOTATION]
        crashed = {
            "restartCount": 1,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled", "finishedAt": "2025-01-01T00:00:01Z",
                                         "containerID": "containerd://1"}},
        }  # fmt: skip
        worker = pod_of({"metadata": {"name": f"{NAME}-0"}, "spec": {"template": group["workerTemplate"]}}, 1,
                        ready=False, container_status=crashed)  # fmt: skip
        await cluster._call("POST", "/api/v1/namespaces/default/pods", worker)
        new = await cluster.wait_for(
            lambda: (
                (g := (cluster.get(LWS, "default", NAME) or {}).get("spec", {}).get("leaderWorkerTemplate"))
                and g["leaderTemplate"]["metadata"]["annotations"][render.PLAN_ANNOTATION] != plan
                and g
            ),
            what="a re-planned group",
        )
        await cluster.settle()
        refit = cluster.get(INFD, "default", NAME)["status"]["refit"]
        assert refit["attempts"] == 1 and refit["lastFailure"]["pod"] == f"{NAME}-0-1"
        # leader and workers roll onto the same new settings
        leader_args = new["leaderTemplate"]["spec"]["containers"][0]["args"]
        worker_args = new["workerTemplate"]["spec"]["containers"][0]["args"]
        assert flag(leader_args, "--kv-cache-memory-bytes") == flag(worker_args, "--kv-cache-memory-bytes")
        assert flag(leader_args, "--kv-cache-memory-bytes") != flag(
            group["leaderTemplate"]["spec"]["containers"][0]["args"], "--kv-cache-memory-bytes"
        )
