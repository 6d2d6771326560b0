"""Rendering without a cluster: every child validates against the Kubernetes schemas, every example against
the CRD's own schema, and `pagoda render` prints what the operator would apply."""

from __future__ import annotations

import copy
import json
from importlib.metadata import version
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from pagoda.engine.spec_decode.config import parse_speculative_config
from pagoda.operator.discovery import node_gpus, pools
from pagoda.operator.objects import DEFAULT_IMAGE_REPO, cpu_flavour
from pagoda.operator.planning import decide
from pagoda.operator.render import KV_DIR, children, default_image, engine_args
from pagoda.operator.render_cli import main as render_main
from pagoda.operator.spec import SpecError, parse_spec
from pagoda_testkit import CRD_FILE, EXAMPLES, example, node

K8S_VERSION = "1.30.0"
EXAMPLE_FILES = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
ALL_POOLS = pools(g for g in (node_gpus(node(f"n-{k}", k)) for k in ("h100", "l4", "a100", "l40s")) if g)


def crd_schema() -> dict[str, Any]:
    """The CRD's openAPIV3Schema as JSON Schema (int-or-string spelled out, the rest is already JSON Schema)."""
    crd = yaml.safe_load(CRD_FILE.read_text())
    schema = copy.deepcopy(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])

    def convert(node: Any) -> None:
        if isinstance(node, dict):
            if node.pop("x-kubernetes-int-or-string", False):
                node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            for key in [k for k in node if k.startswith("x-kubernetes")]:
                node.pop(key)
            for value in node.values():
                convert(value)
        elif isinstance(node, list):
            for value in node:
                convert(value)

    convert(schema)
    return schema


def rendered(name: str, service_monitor: bool = True) -> list[dict[str, Any]]:
    body = example(name)
    body["metadata"] |= {"namespace": "default", "uid": "0b8f6c2e-1111-2222-3333-444455556666"}
    spec = parse_spec(body["spec"])
    return children(body, spec, decide(spec, ALL_POOLS), with_service_monitor=service_monitor)


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_examples_validate_against_the_crd_schema(name: str) -> None:
    jsonschema.validate(example(name), crd_schema())


def test_the_crd_schema_rejects_what_it_should() -> None:
    schema = crd_schema()
    bad = example("cpu-default-model.yaml")
    bad["spec"]["gpu"]["count"] = -1
    with pytest.raises(jsonschema.ValidationError, match="-1"):
        jsonschema.validate(bad, schema)
    bad = example("cpu-default-model.yaml")
    bad["spec"]["engine"] = {"kvCacheDtype": "int4"}
    with pytest.raises(jsonschema.ValidationError, match="int4"):
        jsonschema.validate(bad, schema)


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_every_rendered_child_validates_against_kubernetes_schemas(name: str) -> None:
    objects = rendered(name)
    kinds = [o["kind"] for o in objects]
    spec = parse_spec(example(name)["spec"])
    routed = ["Deployment"] if spec.max_possible_replicas > 1 else []  # tierAware by default, else none
    scaled = ["HorizontalPodAutoscaler"] if spec.autoscaling is not None else []
    assert kinds == [
        "Service",
        "Service",
        "PodDisruptionBudget",
        "ServiceMonitor",
        *routed,
        *scaled,
        "StatefulSet",
    ]
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":  # a Prometheus Operator CRD: not in the Kubernetes schemas
            assert (
                obj["apiVersion"] == "monitoring.coreos.com/v1"
                and obj["spec"]["endpoints"][0]["port"] == "http"
            )
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        owner = obj["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "InferenceDeployment" and owner["controller"] is True


def _container(sts: dict[str, Any]) -> dict[str, Any]:
    return sts["spec"]["template"]["spec"]["containers"][0]


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_pod_security_probes_and_scrape_annotations() -> None:
    sts = rendered("llama-3.1-8b-h100-nvme.yaml")[-1]
    pod = sts["spec"]["template"]
    c = _container(sts)
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert c["command"] == ["pagoda", "serve"]
    assert c["args"][0] == "meta-llama/Llama-3.1-8B-Instruct"
    assert _flag(c["args"], "--served-model-name") == "llama-3.1-8b-instruct"


def test_nvme_offload_is_the_only_way_to_a_claim_template() -> None:
    with_nvme = rendered("llama-3.1-8b-h100-nvme.yaml")[-1]
    [template] = with_nvme["spec"]["volumeClaimTemplates"]
    assert template["spec"]["storageClassName"] == "local-nvme"
    assert any(m["mountPath"] == KV_DIR for m in _container(with_nvme)["volumeMounts"])
    args = _container(with_nvme)["args"]
    assert _flag(args, "--kv-offload-disk-dir") == KV_DIR
    assert int(_flag(args, "--kv-offload-disk-bytes")) > 0
    for name in ("cpu-default-model.yaml", "llama-3.1-70b-h100x2-tp.yaml", "qwen2.5-7b-l4-fp8.yaml"):
        sts = rendered(name)[-1]
        assert "volumeClaimTemplates" not in sts["spec"]
        assert "--kv-offload-disk-dir" not in _container(sts)["args"]


def test_spec_errors_name_the_field() -> None:
    cases = {
        "model.source": {"model": {"source": "ftp://host/model"}},
        "engine.gpuMemoryUtilization": {"engine": {"gpuMemoryUtilization": 1.5}},
        "engine.blockSize": {"engine": {"blockSize": 24}},
        "offload.nvme.size": {"offload": {"nvme": {"enabled": True, "size": "lots"}}},
        "gpu.count": {"gpu": {"product": "H100", "count": 0}},
        "replicas": {"replicas": "two"},
    }
    for field, spec in cases.items():
        with pytest.raises(SpecError) as info:
            parse_spec(spec)
        assert info.value.field == field, (field, str(info.value))
        assert f"spec.{field}" in str(info.value)


def test_render_cli_prints_children_and_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert render_main([str(EXAMPLES / "qwen2.5-7b-l4-fp8.yaml")]) == 0
    out = capsys.readouterr().out
    assert "# InferenceDeployment qwen2-5-7b" in out and "kv_cache_dtype: fp8" in out
    assert "#   max_num_queued_reqs: " in out
    docs = [d for d in yaml.safe_load_all(out) if d]
    # a hub model: the cache claim and the download Job first, as the operator creates them
    assert [d["kind"] for d in docs] == [
        "PersistentVolumeClaim",
        "Job",
        "Service",
        "Service",
        "PodDisruptionBudget",
        "StatefulSet",
    ]
    assert docs[-1]["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-L4"
    job = docs[1]["spec"]["template"]["spec"]
    assert job["initContainers"][0]["args"][:2] == ["--source", "hf://Qwen/Qwen2.5-7B-Instruct"]
    engine = _container(docs[-1])
    [warm] = job["containers"]  # the kernels of the planned GPU, compiled with the engine's own flags
    assert (
        warm["args"][:2] == ["--gpu", "L4"] and warm["args"][warm["args"].index("--") + 1 :] == engine["args"]
    )
    volumes = docs[-1]["spec"]["template"]["spec"]["volumes"]
    claim = next(v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v)
    assert claim == docs[0]["metadata"]["name"] == "qwen2-5-7b-model-cache"
    # the default model ships in the image: nothing to download, no claim
    assert render_main([str(EXAMPLES / "cpu-default-model.yaml")]) == 0
    kinds = [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert "PersistentVolumeClaim" not in kinds and "Job" not in kinds and kinds[-1] == "StatefulSet"


def test_render_cli_is_told_what_the_cluster_has(capsys: pytest.CaptureFixture[str]) -> None:
    """KEDA, the Prometheus Operator, LWS and the Gateway API: what the operator discovers, a render is told."""
    path = str(EXAMPLES / "llama-3.1-8b-l40s-routed-autoscaled.yaml")

    def kinds(*flags: str) -> list[str]:
        assert render_main([path, *flags]) == 0
        return [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out) if d]

    plain = kinds()
    assert (
        "HorizontalPodAutoscaler" in plain and "ScaledObject" not in plain and "ServiceMonitor" not in plain
    )
    keda = kinds("--keda")
    assert "ScaledObject" in keda and "HorizontalPodAutoscaler" not in keda
    assert [k if k != "ScaledObject" else "HorizontalPodAutoscaler" for k in keda] == plain
    assert kinds("--prometheus-operator") == kinds("--service-monitor")
    monitored = kinds("--prometheus-operator", "--keda")
    assert monitored.count("ServiceMonitor") == 1 and [k for k in monitored if k != "ServiceMonitor"] == keda
    # --lws: no object of the operator uses it yet; --gateway-api: only spec.gateway's (test_gateway.py)
    assert kinds("--lws", "--gateway-api") == plain
    assert render_main([path, "--keda", "-o", "json"]) == 0
    [result] = json.loads(capsys.readouterr().out)
    [scaled] = [c for c in result["children"] if c["kind"] == "ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "llama-3-1-8b-chat"
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (2, 6)


def test_render_cli_plans_against_a_nodes_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(
        yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [node("a", "a100"), node("c", None)]})
    )
    cr = example("llama-3.1-8b-h100-nvme.yaml")
    del cr["spec"]["gpu"]["product"]  # let the operator choose from the nodes
    del cr["spec"]["workload"]
    cr_file = tmp_path / "cr.yaml"
    cr_file.write_text(yaml.safe_dump(cr))
    assert render_main([str(cr_file), "--nodes", str(nodes), "-o", "json"]) == 0
    [result] = json.loads(capsys.readouterr().out)
    assert result["gpu"]["product"] == "NVIDIA-A100-SXM4-80GB"
    assert result["plan"]["kv_cache_dtype"] == "auto"  # compute capability 8.0: no FP8
    # And with --gpu, an L4 gives a different, FP8 plan for the same file.
    assert render_main([str(cr_file), "--gpu", "L4", "-o", "json"]) == 0
    [l4] = json.loads(capsys.readouterr().out)
    assert l4["plan"]["kv_cache_dtype"] == "fp8"
    assert l4["plan"]["num_gpu_blocks"] != result["plan"]["num_gpu_blocks"]


def test_render_cli_fails_clearly_on_an_unservable_spec(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    cr = example("qwen2.5-7b-l4-fp8.yaml")
    cr_file = tmp_path / "cr.yaml"
    cr_file.write_text(yaml.safe_dump(cr))
    assert render_main([str(cr_file), "--gpu", "A100"]) == 1
    err = capsys.readouterr().err
    assert "spec.engine.kvCacheDtype" in err and "8.9" in err


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_engine_pods_get_no_service_account_token(name: str) -> None:
    """The engine never calls the Kubernetes API: a mounted token would only be something to steal."""
    sts = rendered(name)[-1]
    assert sts["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_cpu_deployments_run_the_cpu_flavour_of_the_engine_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """make image-check tags the CPU engine image VERSION-cpu, make image-gpu the GPU one VERSION: a CPU
    deployment must not pull gigabytes of CUDA wheels, nor a GPU one get an engine without CUDA."""
    assert default_image() == f"{DEFAULT_IMAGE_REPO}:{version('pagoda')}"
    for chart_image in (None, "registry.example/ml/pagoda-engine:1.2.3"):
        if chart_image:  # the chart passes its engine.image as $PAGODA_ENGINE_IMAGE
            monkeypatch.setenv("PAGODA_ENGINE_IMAGE", chart_image)
        gpu_image = default_image()
        assert not gpu_image.endswith("-cpu")
        assert _container(rendered("cpu-default-model.yaml")[-1])["image"] == gpu_image + "-cpu"
        for name in ("llama-3.1-8b-h100-nvme.yaml", "qwen2.5-7b-l4-fp8.yaml"):
            assert _container(rendered(name)[-1])["image"] == gpu_image
    # a routed CPU deployment: its router runs the engines' (CPU) image too
    body = example("cpu-default-model.yaml")
    body["metadata"] |= {"namespace": "default"}
    body["spec"]["replicas"] = 2
    spec = parse_spec(body["spec"])
    objects = children(body, spec, decide(spec, ALL_POOLS), with_service_monitor=False)
    images = {
        o["kind"]: _container(o)["image"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")
    }
    assert images == {"Deployment": gpu_image + "-cpu", "StatefulSet": gpu_image + "-cpu"}
    # spec.image is used as given, whatever the flavour
    body["spec"]["image"] = "registry.example/custom-engine:7"
    spec = parse_spec(body["spec"])
    assert (
        _container(children(body, spec, decide(spec, ALL_POOLS), with_service_monitor=False)[-1])["image"]
        == "registry.example/custom-engine:7"
    )
    # where no flavour can be derived, the image stays as named
    digest = "registry.example/pagoda-engine@sha256:" + "a" * 64
    assert cpu_flavour(digest) == digest
    assert cpu_flavour("registry.example:5000/pagoda-engine") == "registry.example:5000/pagoda-engine"
    assert cpu_flavour("localhost/pagoda-engine:0.1.0-cpu") == "localhost/pagoda-engine:0.1.0-cpu"
    assert cpu_flavour("registry.example:5000/pagoda-engine:2") == "registry.example:5000/pagoda-engine:2-cpu"


def test_the_crd_says_what_creating_an_inference_deployment_allows() -> None:
    """spec.image, apiKeySecretRef and pvc:// sources are powers: the CRD's descriptions must say so."""
    crd = yaml.safe_load(CRD_FILE.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert "allow-list" in spec["image"]["description"] and "any code" in spec["image"]["description"]
    assert "any Secret" in spec["apiKeySecretRef"]["description"]
    assert "any PersistentVolumeClaim" in spec["model"]["properties"]["source"]["description"]


def _queue_rule(plan: dict[str, Any], pod_memory: int) -> int:
    """docs/operator.md: two batches deep, bounded by 1/16 of the memory the KV cache leaves in the pod."""
    ram_kv = plan["kv_cache_memory_bytes"] if plan["device"] == "cpu" else plan["kv_offload_host_bytes"]
    budget = (pod_memory - ram_kv) // 16
    per_request = plan["max_model_len"] * 64 + 16 * 1024
    return max(1, min(2 * plan["max_num_seqs"], budget // per_request))


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_every_engine_pod_gets_a_queue_limit_from_the_plan(name: str) -> None:
    """Unbounded queues grow until the pod is OOM-killed: the operator always sets --max-num-queued-reqs."""
    body = example(name)
    spec = parse_spec(body["spec"])
    decision = decide(spec, ALL_POOLS)
    sts = rendered(name)[-1]
    args = _container(sts)["args"]
    limit = int(_flag(args, "--max-num-queued-reqs"))
    memory = _container(sts)["resources"]["limits"]["memory"]
    from pagoda.operator.quantity import parse_quantity

    assert limit == _queue_rule(decision.plan.to_dict(), parse_quantity(memory))
    assert 1 <= limit <= 2 * decision.plan.max_num_seqs
    # extraArgs come last, so a user's own --max-num-queued-reqs wins (argparse keeps the last one).
    assert args.index("--max-num-queued-reqs") < len(args) - len(spec.engine.extra_args)


def test_the_queue_limit_shrinks_with_the_memory_and_grows_with_the_batch() -> None:
    small = parse_spec({"gpu": {"count": 0}, "resources": {"limits": {"memory": "3Gi"}}})
    large = parse_spec({"gpu": {"count": 0}, "resources": {"limits": {"memory": "32Gi"}}})
    few = parse_spec({"gpu": {"count": 0}, "resources": {"limits": {"memory": "32Gi"}},
                      "engine": {"maxNumSeqs": 4}})  # fmt: skip
    limits = {}
    for key, spec in (("small", small), ("large", large), ("few", few)):
        d = decide(spec, {})
        limits[key] = d.max_num_queued_reqs
        assert "503" in d.queue_reason
    assert limits["small"] < limits["large"]
    assert limits["few"] == 8  # two batches of 4: memory is no limit here


def test_docs_state_the_queue_rule_the_operator_uses() -> None:
    from pagoda.operator import planning
    from pagoda_testkit import ROOT

    text = (ROOT / "docs" / "operator.md").read_text()
    assert f"min({planning.QUEUE_BATCHES} × max_num_seqs" in text
    assert f"/ {planning.QUEUE_MEMORY_DIVISOR} /" in text
    per_request = planning.QUEUED_BYTES_PER_REQUEST // 1024
    assert f"(max_model_len × {planning.QUEUED_BYTES_PER_TOKEN} B + {per_request} KiB)" in text


def test_docs_and_crd_state_what_the_operator_renders() -> None:
    """docs/operator.md's adapter names, drain numbers and targets, and the CRD's defaults, are render.py's
    and spec.py's (a change to one without the other fails here)."""
    import yaml
    from pagoda.operator import render
    from pagoda.operator.spec import AUTOSCALING_METRICS, DEFAULT_DRAIN_SECONDS
    from pagoda_testkit import ROOT

    text = " ".join((ROOT / "docs" / "operator.md").read_text().split())
    for metric, (kind, name) in render.ADAPTER_METRICS.items():
        low, high, default = AUTOSCALING_METRICS[metric]
        assert f"| `{metric}` |" in text and f"| {kind} `{name}` |" in text, metric
        assert f"({low:g}, {high:g}] ({default:g})" in text, metric
        assert f'as: "{name}"' in text, name  # the adapter rule exposing it
    assert f"`preStop` pause of {render.PRESTOP_SECONDS} s" in text
    assert f"(default {DEFAULT_DRAIN_SECONDS}, rendered as `--shutdown-grace-seconds`)" in text
    assert f"{render.PRESTOP_SECONDS} + the drain timeout + {render.GRACE_MARGIN_SECONDS}" in text
    spec = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    props = spec["properties"]["spec"]["properties"]
    assert props["drain"]["properties"]["timeoutSeconds"]["default"] == DEFAULT_DRAIN_SECONDS
    assert props["autoscaling"]["properties"]["metric"]["enum"] == list(AUTOSCALING_METRICS)
    assert props["routing"]["properties"]["policy"]["enum"] == [
        "roundRobin",
        "leastLoaded",
        "prefix",
        "tierAware",
        "none",
    ]
    grace = render.PRESTOP_SECONDS + render.GRACE_MARGIN_SECONDS
    assert f"this plus {grace}" in props["drain"]["properties"]["timeoutSeconds"]["description"]


# ---- spec.engine.speculative: the engine's --speculative-config (vLLM's JSON) ----
H100_POOLS = pools(g for g in (node_gpus(node("n-h100", "h100")),) if g)


def _spec(speculative: dict | None) -> dict:
    body = example("llama-3.1-8b-h100-nvme.yaml")
    if speculative is not None:
        body["spec"].setdefault("engine", {})["speculative"] = speculative
    return body


def test_speculative_renders_the_engines_flag():
    body = _spec({"numSpeculativeTokens": 3, "promptLookupMin": 2, "promptLookupMax": 4})
    spec = parse_spec(body["spec"])
    args = engine_args(spec, decide(spec, H100_POOLS))
    value = args[args.index("--speculative-config") + 1]
    assert json.loads(value) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    assert parse_speculative_config(value).prompt_lookup_max == 4
    plain = parse_spec(_spec(None)["spec"])
    assert "--speculative-config" not in engine_args(plain, decide(plain, H100_POOLS))


@pytest.mark.parametrize(
    "bad",
    [{"numSpeculativeTokens": 0}, {"numSpeculativeTokens": 17}, {"method": "eagle"}, {"promptLookupMin": 0}],
)
def test_the_crd_schema_refuses_bad_speculative_settings(bad):
    schema = crd_schema()
    jsonschema.validate(_spec({"numSpeculativeTokens": 2}), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(_spec(bad), schema)
