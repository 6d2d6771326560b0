"""What the operator renders for the router is what `pagoda router` accepts: every routed example as a real
process, and every policy x model kind x API key combination through the router's own parser, each with
`--dry-run` (parse and validate, print the config, exit 0)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagoda.operator import render
from pagoda.operator.spec import AUTOSCALING_METRICS, ROUTING_POLICIES, SpecError, parse_spec
from pagoda_testkit import EXAMPLES, example

PAGODA = str(Path(sys.executable).parent / "pagoda")
ROUTED = [
    p.name for p in sorted(EXAMPLES.glob("*.yaml")) if parse_spec(example(p.name)["spec"]).routing.policy
]


def router_container(body: dict[str, Any]) -> dict[str, Any]:
    body = {**body, "metadata": {"namespace": "team-a", **body["metadata"]}}
    deployment = render.router_deployment(body, parse_spec(body["spec"]))
    return deployment["spec"]["template"]["spec"]["containers"][0]


def dry_run(container: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """The container's command with --dry-run appended, as a process; the config it printed."""
    assert container["command"] == ["pagoda", "router"]
    argv = [PAGODA, *container["command"][1:], *container["args"], "--dry-run"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, f"{argv}: {r.stderr}"
    return json.loads(r.stdout)


def test_the_examples_include_a_routed_one() -> None:
    assert "llama-3.1-8b-l40s-routed-autoscaled.yaml" in ROUTED
    assert "llama-3.1-8b-h100-nvme.yaml" in ROUTED  # two replicas: tierAware by default


@pytest.mark.parametrize("name", ROUTED)
def test_every_routed_example_passes_the_routers_dry_run_as_a_process(name: str) -> None:
    body = example(name)
    config = dry_run(router_container(body))
    spec = parse_spec(body["spec"])
    assert config["policy"] == spec.routing.policy
    assert config["backend_dns"] == [f"{body['metadata']['name']}-headless.team-a.svc.cluster.local:8000"]
    assert config["port"] == render.ROUTER_PORT and config["model"] == spec.model.served_model_name
    assert config["tokenizer"] == "backend"  # hf:// models: the router pod has no tokenizer of its own


def test_every_policy_model_kind_and_api_key_passes_the_routers_dry_run() -> None:
    """In process through pagoda.router.cli (the same parser and validation the process runs)."""
    from pagoda.router import cli

    sources = ("default", "hf://Qwen/Qwen2.5-7B-Instruct", "pvc://models/llama", "file:///models/m")
    seen = 0
    for policy, source, key in itertools.product(ROUTING_POLICIES, sources, (None, "s")):
        spec: dict[str, Any] = {"model": {"source": source}, "routing": {"policy": policy}}
        if source.startswith(("pvc", "file")):
            spec["model"]["shape"] = {
                "numLayers": 2,
                "numAttentionHeads": 2,
                "hiddenSize": 64,
                "vocabSize": 100,
            }
        if key:
            spec["apiKeySecretRef"] = {"name": key}
        container = router_container({"metadata": {"name": "m"}, "spec": spec})
        args = cli.build_parser().parse_args([*container["args"], "--dry-run"])
        config = cli.config_from_args(args)
        assert config.policy == policy and config.backend_dns == ["m-headless.team-a.svc.cluster.local:8000"]
        assert (config.tokenizer == "backend") == (source != "default")
        env = {e["name"] for e in container["env"]}
        assert env == ({"PAGODA_API_KEY"} if key else set())
        seen += 1
    assert seen == len(ROUTING_POLICIES) * len(sources) * 2


def test_a_refused_router_command_exits_2() -> None:
    """The check has teeth: a policy the router lacks is refused by the same dry run."""
    container = router_container(example("llama-3.1-8b-l40s-routed-autoscaled.yaml"))
    args = list(container["args"])
    args[args.index("--policy") + 1] = "random"
    r = subprocess.run([PAGODA, "router", *args, "--dry-run"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--policy" in r.stderr


@st.composite
def routed_specs(draw: st.DrawFn) -> dict[str, Any]:
    """Specs with and without a policy, autoscaling, an API key, over the model kinds."""
    source = draw(st.sampled_from(["default", "hf://meta-llama/Llama-3.1-8B-Instruct", "pvc://models/m"]))
    spec: dict[str, Any] = {
        "model": {"source": source},
        "replicas": draw(st.integers(0, 4)),
        "gpu": {"count": 0},
    }
    if source.startswith("pvc"):
        spec["model"]["shape"] = {"numLayers": 2, "numAttentionHeads": 2, "hiddenSize": 64, "vocabSize": 100}
    policy = draw(st.none() | st.sampled_from([*ROUTING_POLICIES, "none"]))
    if policy is not None:
        spec["routing"] = {"policy": policy}
    if draw(st.booleans()):
        metric = draw(st.sampled_from(sorted(AUTOSCALING_METRICS)))
        low, high, _ = AUTOSCALING_METRICS[metric]
        least = draw(st.integers(1, 5))
        spec["autoscaling"] = {
            "minReplicas": least,
            "maxReplicas": draw(st.integers(least, 20)),
            "metric": metric,
            "target": draw(
                st.floats(low, high, exclude_min=True).map(lambda t: round(t, 3)).filter(lambda t: t > 0)
            ),
        }
    if draw(st.booleans()):
        spec["apiKeySecretRef"] = {"name": "key"}
    return spec


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routed_specs())
def test_generated_specs_render_a_router_the_router_accepts_and_a_valid_autoscaler(
    spec: dict[str, Any],
) -> None:
    from pagoda.router import cli

    try:
        parsed = parse_spec(spec)
    except SpecError as exc:  # a target rounded onto a bound: refused with a condition, never rendered
        assert exc.reason == "InvalidAutoscaling", exc
        return
    most = max(spec["replicas"], spec.get("autoscaling", {}).get("maxReplicas", 0))
    policy = spec.get("routing", {}).get("policy")
    expected = (None if policy == "none" else policy) if policy else ("tierAware" if most > 1 else None)
    assert parsed.routing.policy == expected
    body = {"metadata": {"name": "g", "namespace": "ns", "uid": "u"}, "spec": spec}
    if expected is not None:
        container = router_container(body)
        config = cli.config_from_args(cli.build_parser().parse_args([*container["args"], "--dry-run"]))
        assert config.policy == expected
    if parsed.autoscaling is not None:
        hpa = render.hpa(body, parsed)
        kubernetes_validate.validate(hpa, "1.30.0", strict=True)
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        target = hpa["spec"]["metrics"][0].get("pods", hpa["spec"]["metrics"][0].get("external"))["target"]
        value = target.get("averageValue") or target.get("value")
        milli = int(value[:-1]) if value.endswith("m") else int(value) * 1000
        assert milli == max(round(parsed.autoscaling.target * 1000), 1)  # a Quantity, to the milli-unit
        assert parsed.autoscaling.min_replicas <= parsed.engine_replicas <= parsed.autoscaling.max_replicas
        scaled = render.scaled_object(body, parsed)
        assert float(scaled["spec"]["triggers"][0]["metadata"]["threshold"]) == parsed.autoscaling.target


def test_the_operator_refuses_what_the_router_would_refuse_in_process() -> None:
    """operator/contract.py: the same parser and validation before any router pod exists (Ready=False,
    reason RouterWouldRefuse), with the router's own words."""
    from pagoda.operator.contract import ROUTER_REASON, check_router_args

    args = router_container(example("llama-3.1-8b-l40s-routed-autoscaled.yaml"))["args"]
    check_router_args(args)  # what the operator renders passes
    bad = list(args)
    bad[bad.index("--backend-dns") + 1] = "no-port"
    with pytest.raises(SpecError) as info:
        check_router_args(bad)
    assert info.value.reason == ROUTER_REASON and "HOST:PORT" in str(info.value)
    with pytest.raises(SpecError) as info:
        check_router_args([*args, "--no-such-flag"])
    assert info.value.reason == ROUTER_REASON and "--no-such-flag" in str(info.value)


def test_only_a_deployment_that_scales_to_zero_has_its_router_hold_requests() -> None:
    """The router holds requests (scale to zero: router/hold.py) only for autoscaling.minReplicas 0, with the
    router's caps; any other deployment's router answers an outage with 503 + Retry-After at once. The
    rendered flags pass the router's own parser, and its pod is probed on /livez (up during an outage)."""
    from pagoda.router import cli
    from pagoda.router.config import RouterConfig

    seen = {}
    for least in (0, 1):
        body = example("llama-3.1-8b-l40s-routed-autoscaled.yaml")
        body["spec"]["autoscaling"] = {**body["spec"]["autoscaling"], "minReplicas": least, "maxReplicas": 2}
        container = router_container(body)
        config = cli.config_from_args(cli.build_parser().parse_args([*container["args"], "--dry-run"]))
        seen[least] = (config.hold_seconds, config.hold_max_requests, config.hold_max_bytes)
        assert container["readinessProbe"]["httpGet"]["path"] == "/livez"
        assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    caps = (RouterConfig.hold_max_requests, RouterConfig.hold_max_bytes)
    assert seen == {0: (render.ROUTER_HOLD_SECONDS, *caps), 1: (0.0, *caps)}
    assert render.ROUTER_HOLD_SECONDS == 300 and caps == (256, 64 << 20)
