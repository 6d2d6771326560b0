"""spec.adapters: parsed and refused like the model's source, rendered into the engine's LoRA flags with each
adapter where the pod finds it (the model cache for hf:// and s3://, its claim for pvc://, the image for
file://), and downloaded by the model's Job. The example's engine command passes the engine's dry run in
tests/contract/test_rendered_args.py (every example does)."""

from __future__ import annotations

import pytest
from pagoda.operator import model_cache, render
from pagoda.operator.discovery import node_gpus, pools
from pagoda.operator.planning import decide
from pagoda.operator.spec import SpecError, parse_spec
from pagoda_testkit import GPU_NODES, example, node

POOLS = pools(g for g in (node_gpus(node(f"n-{k}", k)) for k in GPU_NODES) if g)
SMOLLM_SHAPE = {"numLayers": 30, "numAttentionHeads": 9, "numKeyValueHeads": 3, "headDim": 64, "hiddenSize": 576,
                "intermediateSize": 1536, "vocabSize": 49152, "maxPositionEmbeddings": 8192}  # fmt: skip

ADAPTERS = [
    {"name": "sql", "source": "hf://org/sql-lora@v2"},
    {"name": "support", "source": "s3://bucket/adapters/support"},
    {"name": "legal", "source": "pvc://adapters/legal"},
    {"name": "baked", "source": "file:///opt/adapters/baked"},
]


def cpu_spec(**spec):
    return {"model": {"source": "default"}, "gpu": {"count": 0}, **spec}


def rendered(spec_json: dict, name: str = "svc"):
    body = {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": "default", "uid": "u1"}, "spec": spec_json}  # fmt: skip
    spec = parse_spec(spec_json)
    decision = decide(spec, [])
    sts = render.statefulset(body, spec, decision)
    pod = sts["spec"]["template"]["spec"]
    return spec, decision, body, pod, pod["containers"][0]


def flag_values(args: list[str], name: str) -> list[str]:
    i = args.index(name) + 1
    out = []
    while i < len(args) and not args[i].startswith("--"):
        out.append(args[i])
        i += 1
    return out


def test_adapters_become_lora_flags_with_paths_the_pod_has():
    spec, decision, body, pod, engine = rendered(cpu_spec(adapters=ADAPTERS))
    args = engine["args"]
    assert "--enable-lora" in args
    assert flag_values(args, "--max-loras") == ["4"] and flag_values(args, "--max-lora-rank") == ["16"]
    assert flag_values(args, "--lora-modules") == [
        "sql=org/sql-lora@v2",  # found in HF_HOME of the model cache, as the engine finds hub ids
        "support=/models/cache/s3/bucket/adapters/support",
        "legal=/models/adapters/legal",
        "baked=/opt/adapters/baked",
    ]
    mounts = {m["mountPath"]: m for m in engine["volumeMounts"]}
    assert mounts["/models/cache"]["readOnly"] and mounts["/models/adapters"]["readOnly"]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"svc-model-cache", "adapters"}
    assert {"name": "HF_HOME", "value": model_cache.HF_HOME} in engine["env"]
    # the embedded model is not downloaded, the adapters are: one Job for them
    job = model_cache.download_job(body, spec)
    job_args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--source" not in job_args
    assert flag_values(job_args, "--adapter") == ["hf://org/sql-lora@v2"]
    assert job_args.count("--adapter") == 2 and "s3://bucket/adapters/support" in job_args


def test_the_models_download_job_also_fetches_the_adapters_and_a_new_adapter_is_a_new_job():
    base = example("qwen2.5-7b-l4-fp8.yaml")["spec"]
    base["model"] = {"source": "hf://Qwen/Qwen2.5-7B-Instruct", "secretRef": {"name": "hf-token"}}
    plain = parse_spec(base)
    with_lora = parse_spec({**base, "adapters": ADAPTERS[:2], "engine": {"maxLoras": 1, "maxLoraRank": 64}})
    body = {"metadata": {"name": "q", "namespace": "default", "uid": "u"}}
    args = model_cache.download_job(body, with_lora)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--source") + 1] == "hf://Qwen/Qwen2.5-7B-Instruct"
    assert args[args.index("--adapter") + 1] == "hf://org/sql-lora@v2"
    env = model_cache.download_job(body, with_lora)["spec"]["template"]["spec"]["containers"][0]["env"]
    names = {e["name"] for e in env}
    assert {"HF_TOKEN", "AWS_ACCESS_KEY_ID"} <= names  # an s3:// adapter beside an hf:// model
    assert model_cache.job_name("q", plain) != model_cache.job_name("q", with_lora)
    engine_args = render.engine_args(with_lora, decide(with_lora, POOLS))
    assert flag_values(engine_args, "--max-loras") == ["1"] and flag_values(
        engine_args, "--max-lora-rank"
    ) == ["64"]


def test_one_claim_for_a_pvc_model_and_its_pvc_adapters():
    spec_json = cpu_spec(adapters=[{"name": "a", "source": "pvc://weights/lora/a"}])
    spec_json["model"] = {"source": "pvc://weights/base", "shape": SMOLLM_SHAPE}
    _, _, _, pod, engine = rendered(spec_json)
    assert [v for v in pod["volumes"] if "persistentVolumeClaim" in v] == [
        {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}
    ]
    assert flag_values(engine["args"], "--lora-modules") == ["a=/models/weights/lora/a"]


def test_without_adapters_nothing_changes():
    _, _, _, _, engine = rendered(cpu_spec())
    assert not any(a.startswith("--enable-lora") or a.startswith("--lora") for a in engine["args"])


@pytest.mark.parametrize(
    ("adapters", "field", "words"),
    [
        ([{"name": "a", "source": "default"}], "adapters[0].source", "source must be hf://"),
        ([{"name": "a", "source": "http://x/y"}], "adapters[0].source", "source must be hf://"),
        ([{"name": "a b", "source": "hf://o/n"}], "adapters[0].name", "does not match"),
        ([{"source": "hf://o/n"}], "adapters[0].name", "is required"),
        ([{"name": "a", "source": "hf://o/n"}, {"name": "a", "source": "hf://o/m"}], "adapters[1].name", "repeated"),
        ({"name": "a"}, "adapters", "must be a list"),
    ],
)  # fmt: skip
def test_bad_adapters_name_the_field(adapters, field, words):
    with pytest.raises(SpecError, match=words) as err:
        parse_spec(cpu_spec(adapters=adapters))
    assert err.value.field == field
