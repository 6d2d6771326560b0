"""crds/ is generated from the typed spec (operator/spec.py): the files match, the enums are the engine's,
the API server's defaults are the operator's, and every CEL rule agrees with its Python twin."""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

import celpy
import pytest
import yaml
from pagoda.engine.config import BLOCK_SIZES, KV_CACHE_DTYPES
from pagoda.operator import crd, schema, spec
from pagoda.operator.spec import InferenceSpec, SpecError, parse_spec
from pagoda_testkit import CRD_FILE, EXAMPLES, example

ROOT = CRD_FILE.parents[1]


def test_crd_files_are_what_the_spec_generates() -> None:
    assert crd.main(["--root", str(ROOT), "--check"]) == 0, "run `make crds`"
    assert CRD_FILE.read_text() == crd.crd_yaml()


def test_check_fails_on_a_hand_edited_copy(tmp_path) -> None:
    for target in crd.targets(tmp_path):
        target.parent.mkdir(parents=True)
        target.write_text(crd.crd_yaml())
    assert crd.main(["--root", str(tmp_path), "--check"]) == 0
    chart_copy = crd.targets(tmp_path)[1]
    chart_copy.write_text(chart_copy.read_text().replace("default: 60", "default: 30"))
    assert crd.main(["--root", str(tmp_path), "--check"]) == 1
    assert crd.main(["--root", str(tmp_path)]) == 0 and chart_copy.read_text() == crd.crd_yaml()


@functools.cache
def _spec_schema() -> dict[str, Any]:
    doc = yaml.safe_load(CRD_FILE.read_text())
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_enums_and_bounds_come_from_the_engine_config() -> None:
    engine = _spec_schema()["properties"]["engine"]["properties"]
    assert engine["kvCacheDtype"]["enum"] == list(KV_CACHE_DTYPES)
    [rule] = engine["blockSize"]["x-kubernetes-validations"]
    assert f"[{', '.join(map(str, BLOCK_SIZES))}]" in rule["rule"]
    for size in BLOCK_SIZES:
        assert parse_spec({"engine": {"blockSize": size}}).engine.block_size == size
    with pytest.raises(SpecError, match="blockSize"):
        parse_spec({"engine": {"blockSize": max(BLOCK_SIZES) * 2}})


def apply_defaults(node: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it: a missing field with a default gets it, then its
    own fields are defaulted (only objects that exist, or were defaulted, are walked)."""
    if not isinstance(value, dict) or node.get("type") != "object":
        return value
    out = dict(value)
    for name, child in (node.get("properties") or {}).items():
        if name not in out and "default" in child:
            out[name] = copy.deepcopy(child["default"])
        if name in out:
            out[name] = apply_defaults(child, out[name])
    return out


@pytest.mark.parametrize(
    "name", sorted(p.name for p in EXAMPLES.glob("*.yaml")) + ["gateway/inferencedeployment.yaml", "{}"]
)
def test_the_api_servers_defaults_are_the_operators(name: str) -> None:
    raw = {} if name == "{}" else example(name)["spec"]
    defaulted = apply_defaults(_spec_schema(), raw)
    assert defaulted != raw or name != "{}"
    assert parse_spec(defaulted) == parse_spec(raw)


def _rules() -> list[tuple[str, tuple[str, ...], schema.Rule]]:
    """(class, path of the object or field the rule sits on, rule) for every rule of the typed spec."""
    found: list[tuple[str, tuple[str, ...], schema.Rule]] = []

    def walk(cls: type, path: tuple[str, ...]) -> None:
        for rule in getattr(cls, "RULES", ()):
            found.append((cls.__name__, path, rule))
        for f in schema.spec_fields(cls):
            kind = f.metadata["kind"]
            where = (*path, f.metadata["name"])
            for rule in f.metadata["rules"]:
                found.append((cls.__name__, where, rule))
            if isinstance(kind, schema.Obj):
                walk(kind.cls, where)

    walk(InferenceSpec, ())
    return found


SAMPLES: list[dict[str, Any]] = [
    {},
    {"gpu": {"product": "H100", "count": 0}},
    {"gpu": {"product": "H100", "count": 2}},
    {"gpu": {"count": 0}, "engine": {"kvCacheDtype": "fp8"}},
    {"gpu": {"count": 1}, "engine": {"kvCacheDtype": "fp8_e5m2", "gpuMemoryUtilization": 0.9}},
    {"engine": {"gpuMemoryUtilization": 1.5}},
    {"engine": {"gpuMemoryUtilization": 0}},
    {"model": {"source": "hf://Qwen/Qwen2.5-7B-Instruct@main"}},
    {"model": {"source": "hf://Qwen/Qwen2.5-7B-Instruct", "revision": "v1"}},
    {"model": {"source": "hf://Qwen/Qwen2.5-7B-Instruct@main", "revision": "v1"}},
    {"model": {"source": "s3://models-bucket/llama/8b"}},
    {"model": {"source": "s3://models-bucket/llama/../../other"}},
    {"model": {"source": "hf://org/name@../../x"}},
    {"model": {"source": "pvc://models/../x"}},
    {"adapters": [{"name": "a", "source": "s3://models-bucket/lora/../../x"}]},
    {"adapters": [{"name": "a", "source": "s3://models-bucket/lora/v1.2/"}]},
    {"model": {"source": "s3://Bad_Bucket/x"}},
    {"model": {"source": "pvc://models/llama", "revision": "main"}},
    {"model": {"source": "pvc://Models/llama"}},
    {"model": {"source": "file:///opt/model"}},
    {"model": {"source": "ftp://host/model"}},
    {"model": {"source": "default"}},
    {"workload": {"qualityFirst": True, "preferCapacity": True}},
    {"workload": {"qualityFirst": True, "preferCapacity": False}},
    {"offload": {"nvme": {"enabled": True, "size": 0}}},
    {"offload": {"nvme": {"enabled": True, "size": "auto"}}},
    {"offload": {"nvme": {"enabled": True, "size": 1024}}},
    {"autoscaling": {"maxReplicas": 3, "minReplicas": 5}},
    {"autoscaling": {"maxReplicas": 3, "minReplicas": 0}},
    {"autoscaling": {"maxReplicas": 3, "target": 1.5}},
    {"autoscaling": {"maxReplicas": 3, "metric": "ttftP90", "target": 700.0}},
    {"autoscaling": {"maxReplicas": 3, "metric": "ttftP90", "target": 1.5}},
    {"autoscaling": {"maxReplicas": 3, "metric": "waitingRequests", "target": 50.0}},
    {"autoscaling": {"maxReplicas": 3, "target": 0.0}},
    {"engine": {"maxModelLen": 8}},
    {"engine": {"maxModelLen": "auto", "blockSize": 24}},
    {"engine": {"maxModelLen": 4096, "blockSize": 32}},
    {"gateway": {}},
    {"gateway": {"pickerPort": 8000}},
    {"gateway": {"pickerPort": 9002, "failureMode": "FailOpen"}},
]


def _typed(node: dict[str, Any], value: Any) -> Any:
    """`value` as the API server hands it to CEL: integers in `number` fields are doubles."""
    if node.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        props = node.get("properties") or {}
        return {k: _typed(props.get(k, {}), v) for k, v in value.items()}
    return value


def _at(obj: Any, path: tuple[str, ...]) -> Any:
    """The value at `path` of a sample, typed as the API server would (None where absent)."""
    node = _spec_schema()
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj, node = obj[key], (node.get("properties") or {}).get(key, {})
    return _typed(node, obj)


def test_every_cel_rule_agrees_with_its_python_twin() -> None:
    env = celpy.Environment()
    checked = 0
    for owner, path, rule in _rules():
        program = env.program(env.compile(rule.cel))
        for sample in SAMPLES:
            value = _at(sample, path)
            if value is None:
                continue  # the API server runs a rule only where its field is present
            cel = bool(program.evaluate({"self": celpy.json_to_cel(value)}))
            assert cel == bool(rule.check(value)), (owner, path, rule.cel, value)
            checked += 1
    assert checked > 40


def test_the_crd_and_the_operator_refuse_the_same_samples() -> None:
    """A sample the CRD's CEL rules refuse is a SpecError for the operator, with the rule's field."""
    env = celpy.Environment()
    rules = [(path, rule, env.program(env.compile(rule.cel))) for _, path, rule in _rules()]
    for sample in SAMPLES:
        refused = [
            (path, rule)
            for path, rule, program in rules
            if _at(sample, path) is not None
            and not program.evaluate({"self": celpy.json_to_cel(_at(sample, path))})
        ]
        if refused:
            with pytest.raises(SpecError):
                parse_spec(sample)


def test_spec_module_imports_without_torch() -> None:
    import subprocess
    import sys

    code = "import sys, pagoda.operator.crd, pagoda.operator.spec; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert spec.KV_DTYPES is KV_CACHE_DTYPES


DOT_DOT = [
    "s3://models-bucket/llama/../../other",
    "s3://models-bucket/..",
    "s3://models-bucket/a/..",
    "s3://models-bucket/a..b",
    "hf://org/name@../../../x",
    "pvc://models/../other",
    "file:///models/../etc",
]
PLAIN = [
    "s3://models-bucket/llama/8b",
    "s3://models-bucket/a.b/.c/d.",
    "hf://org/name@v1.2",
    "pvc://models/x.y",
]


def _source_rules(node: dict[str, Any]) -> list[Any]:
    env = celpy.Environment()
    return [env.program(env.compile(r["rule"])) for r in node["x-kubernetes-validations"]]


def test_the_crd_refuses_dot_dot_in_every_source() -> None:
    """The CRD's own rules (as the API server runs them, from crds/) refuse `..` in the model's and each
    adapter's source, and so does the operator; the s3:// pattern alone refuses it in the prefix too."""
    model = _spec_schema()["properties"]["model"]["properties"]["source"]
    adapter = _spec_schema()["properties"]["adapters"]["items"]["properties"]["source"]
    for node in (model, adapter):
        rules = _source_rules(node)
        for source in DOT_DOT:
            results = [bool(p.evaluate({"self": celpy.json_to_cel(source)})) for p in rules]
            assert not all(results), source
            assert results[0] is False  # the dedicated rule, with its message
        for source in PLAIN:
            assert all(bool(p.evaluate({"self": celpy.json_to_cel(source)})) for p in rules), source
        assert "must not contain '..'" in node["x-kubernetes-validations"][0]["message"]
    pattern = re.compile(spec.SOURCE_PATTERN)
    for source in DOT_DOT:
        if source.startswith("s3://"):
            assert pattern.fullmatch(source) is None, source
    for source in DOT_DOT:
        with pytest.raises(SpecError, match=r"must not contain '\.\.'") as info:
            parse_spec({"model": {"source": source}})
        assert info.value.reason == "InvalidModelSource"
        with pytest.raises(SpecError, match=r"must not contain '\.\.'") as info:
            parse_spec({"adapters": [{"name": "a", "source": source}]})
        assert info.value.reason == "InvalidAdapter"
    for source in PLAIN:
        assert parse_spec({"model": {"source": source}}).model.source == source
