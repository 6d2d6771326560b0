"""The chart through the real helm binary: lint, render, Kubernetes schemas, security, RBAC, values schema."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

K8S_VERSION = kubernetes_validate.latest_version()
# Kinds from CRDs that kubernetes-validate carries no schema for; checked by hand below instead.
NO_UPSTREAM_SCHEMA = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("kopf.dev/v1", "ClusterKopfPeering"),
    ("kopf.dev/v1", "KopfPeering"),
}
MODES = {"default": [], "all-on": "all_on", "namespaced": "namespaced"}


def _values(helm, mode: str) -> list[str]:
    attr = MODES[mode]
    return getattr(helm, attr) if isinstance(attr, str) else attr


def _by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def _app_version(helm) -> str:
    return yaml.safe_load((helm.chart / "Chart.yaml").read_text())["appVersion"]


def _pod_specs(objs: list[dict]) -> list[tuple[str, dict]]:
    specs = []
    for o in objs:
        if o["kind"] == "Deployment":
            specs.append((o["metadata"]["name"], o["spec"]["template"]["spec"]))
        elif o["kind"] == "Pod":
            specs.append((o["metadata"]["name"], o["spec"]))
    return specs


@pytest.mark.parametrize("mode", MODES)
def test_helm_lint_strict(helm, mode):
    proc = helm.run("lint", "--strict", str(helm.chart), *_values(helm, mode), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("mode", MODES)
def test_rendered_objects_validate_against_kubernetes_schemas(helm, mode):
    objs = helm.render(*_values(helm, mode))
    validated, skipped = 0, set()
    for obj in objs:
        key = (obj["apiVersion"], obj["kind"])
        if key in NO_UPSTREAM_SCHEMA:
            skipped.add(key)
            assert obj["metadata"]["name"] and "spec" in obj or obj["kind"].endswith("KopfPeering")
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{obj['kind']}/{obj['metadata']['name']} does not validate: {exc.message} at {exc.path}"
            )
        validated += 1
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "ServiceAccount", "Service", "CustomResourceDefinition", "Pod"} <= kinds
    assert validated >= 8
    if mode == "default":
        assert not skipped
    else:
        assert {k for _, k in skipped} == {"ServiceMonitor", "PrometheusRule", "ClusterKopfPeering"} or {
            k for _, k in skipped
        } == {"ServiceMonitor", "PrometheusRule", "KopfPeering"}


def test_default_render_has_no_optional_objects(helm):
    kinds = {o["kind"] for o in helm.render()}
    assert not kinds & {
        "ServiceMonitor",
        "PrometheusRule",
        "ConfigMap",
        "PodDisruptionBudget",
        "ClusterKopfPeering",
    }


@pytest.mark.parametrize("mode", MODES)
def test_every_pod_is_restricted_with_resources_and_pinned_images(helm, mode):
    objs = helm.render(*_values(helm, mode))
    version = _app_version(helm)
    specs = _pod_specs(objs)
    assert len(specs) == 2  # the operator Deployment and the helm test Pod
    for name, spec in specs:
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0, name
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", name
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), name
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc["runAsNonRoot"] is True, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), (
                name,
                c["name"],
            )
            assert sc["seccompProfile"]["type"] == "RuntimeDefault", (name, c["name"])
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], (
                name,
                c["name"],
            )
            assert c["resources"]["limits"]["memory"], (name, c["name"])
            assert c["image"].endswith(f":{version}"), (name, c["image"])
        for vol in spec.get("volumes", []):
            assert set(vol) <= {"name", "emptyDir", "configMap", "secret", "projected"}, (name, vol)


def test_engine_image_defaults_to_app_version_and_tags_can_be_pinned(helm):
    version = _app_version(helm)
    dep = _by_kind(helm.render(), "Deployment")[0]
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PAGODA_ENGINE_IMAGE"] == f"localhost/pagoda-engine:{version}"
    dep = _by_kind(
        helm.render("--set", "engine.image.tag=9.9.9", "--set", "operator.image.tag=1.2.3"), "Deployment"
    )[0]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["image"].endswith(":1.2.3")
    assert {"name": "PAGODA_ENGINE_IMAGE", "value": "localhost/pagoda-engine:9.9.9"} in container["env"]


def test_default_values_images_are_the_ones_make_builds(helm):
    """No registry publishes Pagoda's images: the defaults are the names images/check.py tags them with
    (`make image-gpu`: engine VERSION; `make image-check`: engine VERSION-cpu and the operator), and the
    README says how to push them and point the chart elsewhere."""
    root = Path(__file__).resolve().parents[2]
    version = _app_version(helm)
    assert version == tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    check = (root / "images" / "check.py").read_text()
    for built in (
        'f"localhost/pagoda-engine:{version()}"',
        'f"localhost/pagoda-engine:{version()}-cpu"',
        'f"localhost/pagoda-operator:{version()}"',
    ):
        assert built in check, built
    dep = _by_kind(helm.render(), "Deployment")[0]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["image"] == f"localhost/pagoda-operator:{version}"
    assert env["PAGODA_DOWNLOAD_IMAGE"] == container["image"]
    engine = env["PAGODA_ENGINE_IMAGE"]
    assert engine == f"localhost/pagoda-engine:{version}"
    # the operator's own defaults (no chart) are the same names, and the CPU flavour is the -cpu tag
    from pagoda.operator.model_cache import DEFAULT_IMAGE_REPO as OPERATOR_REPO
    from pagoda.operator.objects import DEFAULT_IMAGE_REPO as ENGINE_REPO
    from pagoda.operator.objects import cpu_flavour

    assert (ENGINE_REPO, OPERATOR_REPO) == ("localhost/pagoda-engine", "localhost/pagoda-operator")
    assert cpu_flavour(engine) == f"localhost/pagoda-engine:{version}-cpu"
    readme = (helm.chart / "README.md").read_text()
    assert "buildah push localhost/$image docker://$REGISTRY/$image" in readme
    assert "--set engine.image.repository=$REGISTRY/pagoda-engine" in readme
    assert "--set operator.image.repository=$REGISTRY/pagoda-operator" in readme


def _args(objs: list[dict]) -> list[str]:
    return _by_kind(objs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_engine_image_allow_list_reaches_the_operator(helm, tmp_path):
    assert not [a for a in _args(helm.render()) if a.startswith("--allowed-image")]  # default: any image
    values = tmp_path / "values.yaml"
    patterns = ["registry.corp/ml/*", "ghcr.io/pagoda-llm/pagoda-engine"]
    values.write_text(yaml.safe_dump({"engine": {"allowedImages": patterns}}))
    for mode in ([], helm.namespaced):
        args = _args(helm.render(*mode, "-f", str(values)))
        assert [a for a in args if a.startswith("--allowed-image")] == [
            f"--allowed-image={p}" for p in patterns
        ]
    # and exactly those strings reach the operator's own parser
    from pagoda.operator.cli import parse_args

    parsed = parse_args([a for a in _args(helm.render("-f", str(values))) if a.startswith("--allowed-image")])
    assert parsed.allowed_image == patterns


def test_standalone_by_default_peering_when_enabled(helm):
    objs = helm.render()
    assert "--standalone" in _args(objs) and "--all-namespaces" in _args(objs)
    assert _by_kind(objs, "Deployment")[0]["spec"]["strategy"]["type"] == "Recreate"
    objs = helm.render(*helm.all_on)
    args = _args(objs)
    assert "--peering=pagoda" in args and "--standalone" not in args
    assert "--verbose" in args and args[-1] == "--priority=1"
    # priority null: no flag from the chart, the operator picks one per replica
    assert not [a for a in args[:-1] if a.startswith("--priority")]
    assert "--priority=7" in _args(helm.render(*helm.all_on, "--set", "operator.peering.priority=7"))
    assert _by_kind(objs, "Deployment")[0]["spec"]["replicas"] == 2
    assert _by_kind(objs, "ClusterKopfPeering")[0]["metadata"]["name"] == "pagoda"
    assert _by_kind(objs, "PodDisruptionBudget")[0]["spec"]["minAvailable"] == 1
    peering_crds = {o["metadata"]["name"] for o in _by_kind(objs, "CustomResourceDefinition")}
    assert {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"} <= peering_crds


def test_several_standalone_replicas_are_refused(helm):
    proc = helm.template("--set", "operator.replicas=3", check=False)
    assert proc.returncode != 0
    assert "operator.peering.enabled" in proc.stderr


def _rules(role: dict) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.setdefault((group, res), set()).update(rule["verbs"])
    return out


WRITE = {"create", "update", "patch", "delete"}
OWNED = [("apps", "statefulsets"), ("", "services"), ("policy", "poddisruptionbudgets")]
OWNED += [("monitoring.coreos.com", "servicemonitors")]
# issue 14: the router Deployment, the HPA or KEDA ScaledObject of spec.autoscaling
OWNED += [("apps", "deployments"), ("autoscaling", "horizontalpodautoscalers"), ("keda.sh", "scaledobjects")]
# issue 42: spec.gateway's InferencePool (the picker is a Deployment and a Service, above)
OWNED += [("inference.networking.k8s.io", "inferencepools")]
# issue 43: a replica spanning nodes is a LeaderWorkerSet
OWNED += [("leaderworkerset.x-k8s.io", "leaderworkersets")]


def _assert_namespaced_rules(rules: dict) -> None:
    for key in OWNED:
        assert rules[key] == {"get", "list", "watch"} | WRITE, key
    assert rules[("pagoda.dev", "inferencedeployments")] == {"get", "list", "watch", "patch", "update"}
    for sub in ("status", "scale"):
        assert rules[("pagoda.dev", f"inferencedeployments/{sub}")] == {"get", "patch", "update"}
    assert rules[("", "events")] == {"create", "patch"}
    assert rules[("events.k8s.io", "events")] == {"create", "patch"}
    assert rules[("", "pods")] == {"get", "list", "watch", "delete"}  # re-fit: read terminations, roll
    assert rules[("", "pods/proxy")] == {"get"}  # an upgraded image's measured memory (GET /pagoda/memory)
    # issue 26: model downloads (the cache claim, the Job, its progress in the pod's log); never Secrets
    assert rules[("", "persistentvolumeclaims")] == {"get", "list", "watch", "create"}
    assert rules[("batch", "jobs")] == {"get", "list", "watch", "create", "delete"}
    assert rules[("", "pods/log")] == {"get"}
    assert ("", "secrets") not in rules


def test_cluster_rbac_grants_only_what_the_operator_uses(helm):
    roles = _by_kind(helm.render(*helm.all_on), "ClusterRole")
    assert len(roles) == 1
    rules = _rules(roles[0])
    _assert_namespaced_rules(rules)
    assert rules[("", "nodes")] == {"get", "list", "watch"}
    assert rules[("apiextensions.k8s.io", "customresourcedefinitions")] == {"get", "list", "watch"}
    assert rules[("", "namespaces")] == {"list", "watch"}
    assert rules[("kopf.dev", "clusterkopfpeerings")] == {"get", "list", "watch", "patch"}
    assert set(rules) == {
        *OWNED,
        ("pagoda.dev", "inferencedeployments"),
        ("pagoda.dev", "inferencedeployments/status"),
        ("pagoda.dev", "inferencedeployments/scale"),
        ("", "events"),
        ("events.k8s.io", "events"),
        ("", "pods"),
        ("", "pods/proxy"),
        ("", "persistentvolumeclaims"),
        ("batch", "jobs"),
        ("", "pods/log"),
        ("", "nodes"),
        ("apiextensions.k8s.io", "customresourcedefinitions"),
        ("", "namespaces"),
        ("kopf.dev", "clusterkopfpeerings"),
    }
    for verbs in rules.values():
        assert "*" not in verbs and "escalate" not in verbs and "bind" not in verbs
    binding = _by_kind(helm.render(), "ClusterRoleBinding")[0]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "pagoda-operator", "namespace": "pagoda-system"}
    ]
    # no peering, no peering rights
    assert ("kopf.dev", "clusterkopfpeerings") not in _rules(_by_kind(helm.render(), "ClusterRole")[0])


def test_namespaced_mode_uses_roles_and_namespace_flags(helm):
    objs = helm.render(*helm.namespaced)
    roles = _by_kind(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        rules = _rules(role)
        _assert_namespaced_rules(rules)
        assert rules[("kopf.dev", "kopfpeerings")] == {"get", "list", "watch", "patch"}
    bindings = _by_kind(objs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    # cluster-wide: read-only nodes and CRDs, nothing that writes
    (cluster_role,) = _by_kind(objs, "ClusterRole")
    assert _rules(cluster_role) == {
        ("", "nodes"): {"get", "list", "watch"},
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    }
    args = _args(objs)
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args
    assert sorted(p["metadata"]["namespace"] for p in _by_kind(objs, "KopfPeering")) == ["team-a", "team-b"]
    # without clusterReadAccess nothing cluster-scoped is granted at all
    objs = helm.render("--set", "watch.namespaced=true", "--set", "rbac.clusterReadAccess=false")
    assert not _by_kind(objs, "ClusterRole") and not _by_kind(objs, "ClusterRoleBinding")
    assert [r["metadata"]["namespace"] for r in _by_kind(objs, "Role")] == ["pagoda-system"]


def test_metrics_service_and_service_monitor(helm):
    objs = helm.render(*helm.all_on)
    (svc,) = _by_kind(objs, "Service")
    dep = _by_kind(objs, "Deployment")[0]
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["ports"] == [
        {"name": "metrics", "containerPort": 8080, "protocol": "TCP"},
        {"name": "health", "containerPort": 8081, "protocol": "TCP"},
    ]
    assert "--liveness=http://0.0.0.0:8081/healthz" in container["args"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())
    (sm,) = _by_kind(objs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert (
        sm["spec"]["endpoints"][0]["port"] == "metrics" and sm["spec"]["endpoints"][0]["path"] == "/metrics"
    )
    assert all(svc["metadata"]["labels"][k] == v for k, v in sm["spec"]["selector"]["matchLabels"].items())


def test_prometheus_rule_embeds_the_alerts_file(helm):
    (rule,) = _by_kind(helm.render(*helm.all_on), "PrometheusRule")
    source = yaml.safe_load((helm.chart / "alerts" / "pagoda-alerts.yaml").read_text())
    assert rule["spec"] == source
    names = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert len(names) == 7  # six engine and operator alerts, one router alert (issue 14)


def test_dashboard_config_maps_carry_the_sidecar_label(helm):
    maps = _by_kind(helm.render(*helm.all_on, "--set", "dashboards.namespace=monitoring"), "ConfigMap")
    assert len(maps) == 2
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == "monitoring"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "Pagoda"}
        ((key, body),) = cm["data"].items()
        source = helm.chart / "dashboards" / key.removeprefix("pagoda-")
        assert json.loads(body) == json.loads(source.read_text())


def test_helm_test_hook_fetches_operator_metrics(helm):
    (pod,) = _by_kind(helm.render(), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["command"][-1]
    assert "http://pagoda-operator.pagoda-system.svc:8080/metrics" in script
    assert "pagoda_operator_reconciles_total" in script
    compile(script, "helm-test", "exec")


def test_notes_tell_the_user_what_to_apply_next(helm):
    out = helm.run("install", "pagoda", str(helm.chart), "--dry-run=client", "-n", "pagoda-system").stdout
    notes = out.split("NOTES:", 1)[1]
    assert "kind: InferenceDeployment" in notes and "kubectl get infd" in notes
    assert "helm test pagoda" in notes


BAD_VALUES = [
    ({"operator": {"replicas": "two"}}, "replicas"),
    ({"operator": {"replicaCount": 2}}, "replicaCount"),
    ({"serviceMonitor": {"enabled": "yes"}}, "enabled"),
    ({"dashboards": {"enable": True}}, "enable"),
    ({"unknownTopLevel": 1}, "unknownTopLevel"),
    ({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "pullPolicy"),
    ({"operator": {"resources": {"requests": {"cpu": "lots"}, "limits": {}}}}, "cpu"),
    ({"serviceMonitor": {"interval": 30}}, "interval"),
    ({"operator": {"peering": {"priority": "high"}}}, "priority"),
    ({"watch": {"namespaces": ["Not_A_Namespace"]}}, "namespaces"),
    ({"engine": {"allowedImages": "registry.corp/*"}}, "allowedImages"),
    ({"engine": {"allowedImages": [""]}}, "allowedImages"),
]


@pytest.mark.parametrize(("values", "field"), BAD_VALUES, ids=[f for _, f in BAD_VALUES])
def test_values_schema_rejects_wrong_types_and_unknown_keys(helm, tmp_path, values, field):
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    proc = helm.template("-f", str(path), check=False)
    assert proc.returncode != 0, f"{values} was accepted"
    assert "schema" in proc.stderr and field in proc.stderr, proc.stderr


def test_values_file_documents_every_key(helm):
    """Every key in values.yaml has a comment right above it (line by line documentation)."""
    lines = (helm.chart / "values.yaml").read_text().splitlines()

    def indent(line: str) -> int:
        return len(line) - len(line.lstrip())

    def commented(i: int) -> bool:
        return i > 0 and lines[i - 1].strip().startswith("#")

    undocumented = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "-")) or ":" not in stripped:
            continue
        key, _, rest = stripped.partition(":")
        if not rest.strip():
            continue  # a section header: its keys carry the comments
        # documented here, or inside a block whose key is documented (e.g. resources.requests.cpu)
        documented, level, j = commented(i), indent(line), i
        while not documented and level > 0 and j > 0:
            j -= 1
            if lines[j].strip() and not lines[j].strip().startswith("#") and indent(lines[j]) < level:
                level = indent(lines[j])
                documented = commented(j)
        if not documented:
            undocumented.append(key)
    assert not undocumented, f"values.yaml keys without a comment: {undocumented}"
    schema = json.loads((helm.chart / "values.schema.json").read_text())
    values = yaml.safe_load((helm.chart / "values.yaml").read_text())
    assert set(values) <= set(schema["properties"])
    assert schema["additionalProperties"] is False


def test_packaged_chart_carries_crds_dashboards_and_alerts_but_no_maintainer_tools(helm, tmp_path):
    import tarfile

    helm.run("package", str(helm.chart), "--destination", str(tmp_path))
    (archive,) = tmp_path.glob("pagoda-*.tgz")
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    for path in (
        "pagoda/crds/pagoda.dev_inferencedeployments.yaml",
        "pagoda/crds/kopf-peerings.yaml",
        "pagoda/dashboards/engine.json",
        "pagoda/dashboards/operator.json",
        "pagoda/alerts/pagoda-alerts.yaml",
        "pagoda/values.schema.json",
        "pagoda/templates/NOTES.txt",
    ):
        assert path in names, path
    assert not [n for n in names if "/hack/" in n or n.endswith("sync-crds.sh")], names
