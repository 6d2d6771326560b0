"""Static checks of the Grafana dashboards: schema, template variables, generator drift, metric names."""

from __future__ import annotations

import importlib.util
import json

import jsonschema
import pytest

DS_REF = {"type": "object", "properties": {"uid": {"const": "${datasource}"}}, "required": ["uid"]}
PANEL = {
    "type": "object",
    "required": ["id", "type", "title", "gridPos"],
    "properties": {
        "id": {"type": "integer"},
        "title": {"type": "string", "minLength": 1},
        "gridPos": {
            "type": "object",
            "required": ["x", "y", "w", "h"],
            "properties": {"x": {"minimum": 0, "maximum": 23}, "w": {"minimum": 1, "maximum": 24}},
        },
    },
    "if": {"properties": {"type": {"not": {"const": "row"}}}},
    "then": {
        "required": ["datasource", "targets"],
        "properties": {
            "datasource": DS_REF,
            "targets": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["refId", "expr", "datasource"],
                    "properties": {"expr": {"type": "string", "minLength": 1}, "datasource": DS_REF},
                },
            },
        },
    },
}
DASHBOARD_SCHEMA = {
    "type": "object",
    "required": ["uid", "title", "schemaVersion", "panels", "templating"],
    "properties": {
        "uid": {"type": "string", "pattern": "^[a-z0-9-]{1,40}$"},
        "title": {"type": "string", "minLength": 1},
        "schemaVersion": {"type": "integer", "minimum": 36},
        "panels": {"type": "array", "minItems": 1, "items": PANEL},
        "templating": {
            "type": "object",
            "properties": {
                "list": {
                    "type": "array",
                    "contains": {
                        "type": "object",
                        "properties": {"name": {"const": "datasource"}, "type": {"const": "datasource"}},
                        "required": ["name", "type"],
                    },
                }
            },
        },
    },
}
REQUIRED_VARS = {
    "engine.json": ["datasource", "namespace", "inferencedeployment", "pod"],
    "operator.json": ["datasource", "namespace", "pod"],
}


@pytest.mark.parametrize("name", REQUIRED_VARS)
def test_dashboard_schema(dash, name):
    dashboard = dash.dashboards()[name]
    jsonschema.validate(dashboard, DASHBOARD_SCHEMA)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = [v["name"] for v in dashboard["templating"]["list"]]
    assert variables == REQUIRED_VARS[name]
    for var in dashboard["templating"]["list"][1:]:
        assert var["datasource"]["uid"] == "${datasource}"
    for panel in dash.panels(dashboard):
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        for target in panel["targets"]:
            for var in variables[1:]:
                if var == "pod" and dash.is_router_expr(target["expr"]):
                    continue  # router pods: $pod lists engine pods
                assert f"${var}" in target["expr"], f"{panel['title']} ignores ${var}: {target['expr']}"


def test_a_panel_without_the_datasource_variable_is_rejected(dash):
    broken = json.loads(json.dumps(dash.dashboards()["engine.json"]))
    broken["panels"][1]["datasource"] = {"type": "prometheus", "uid": "prometheus"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, DASHBOARD_SCHEMA)


def test_dashboard_uids_are_unique(dash):
    uids = [d["uid"] for d in dash.dashboards().values()]
    assert sorted(uids) == ["pagoda-engine", "pagoda-operator"]


def test_engine_dashboard_has_the_issue_panels(dash):
    titles = " | ".join(p["title"] for p in dash.panels(dash.dashboards()["engine.json"])).lower()
    for words in [
        "kv cache usage", "free", "cached", "prefix-cache hit rate", "running / waiting", "preemptions",
        "time to first token", "inter-token latency", "end-to-end", "prompt and generation tokens/s",
        "tier usage", "tier hit rate", "tier load latency", "tier store latency", "verification failures",
        "max-model-len: configured vs fitted",
    ]:  # fmt: skip
        assert words in titles, words
    exprs = " ".join(e for n, _, e in dash.panel_queries() if n == "engine.json")
    for q in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket" in exprs


def test_engine_dashboard_has_a_router_row(dash):
    """Issue 14: the router's decisions, predicted vs observed cached tokens, its overhead and its view of
    the engines, every panel on the router's series only."""
    dashboard = dash.dashboards()["engine.json"]
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert "Router" in rows
    router = [(t, e) for n, t, e in dash.panel_queries() if n == "engine.json" and "pagoda:router_" in e]
    assert all(dash.is_router_expr(e) for _, e in router)
    used = {m for _, e in router for m in dash.metric_names(e)}
    for metric in (
        "pagoda:router_decisions_total",
        "pagoda:router_predicted_cached_tokens_total",
        "pagoda:router_observed_cached_tokens_total",
        "pagoda:router_backend_healthy",
        "pagoda:router_routing_overhead_seconds_bucket",
    ):
        assert metric in used, metric
    assert "by (policy, reason)" in " ".join(e for _, e in router)


def test_every_router_metric_queried_is_one_the_router_registers(dash):
    """The router row against the router's own registry (pagoda.router.metrics.RouterMetrics)."""
    from pagoda.router import metrics

    registry = metrics.RouterMetrics().registry
    exported = set()
    for collector in list(registry._collector_to_names):
        exported |= set(registry._collector_to_names[collector])
    used = {
        m
        for n, _, e in dash.panel_queries()
        if n == "engine.json" and dash.is_router_expr(e)
        for m in dash.metric_names(e)
    }
    assert len(used) >= 8
    missing = sorted(m for m in used if m not in exported and dash.base_name(m) not in exported)
    assert not missing, f"not registered by the router: {missing}"


def test_operator_dashboard_has_the_issue_panels(dash):
    exprs = " ".join(e for n, _, e in dash.panel_queries() if n == "operator.json")
    for metric in (
        "pagoda_operator_inference_deployments",
        "pagoda_operator_reconciles_total",
        "pagoda_operator_reconcile_errors_total",
        "pagoda_operator_reconcile_duration_seconds_bucket",
        "pagoda_operator_gpus_requested",
    ):
        assert metric in exprs, metric


def test_committed_dashboards_match_the_generator(dash):
    path = dash.CHART / "hack" / "dashboards.py"
    spec = importlib.util.spec_from_file_location("pagoda_dashboard_generator", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in module.DASHBOARDS:
        committed = (dash.CHART / "dashboards" / name).read_text()
        assert committed == module.render(name), f"{name} drifted; run python {path.relative_to(dash.ROOT)}"


def test_metric_names_parse_promql(dash):
    expr = (
        'histogram_quantile(0.99, sum by (le, tier) (rate(pagoda:offload_load_seconds_bucket{pod=~"$pod"}[5m])))'
        " / on (pod) group_left() max without (engine) (vllm:kv_cache_usage_perc offset 5m) > bool 0.9"
    )
    assert dash.metric_names(expr) == {"pagoda:offload_load_seconds_bucket", "vllm:kv_cache_usage_perc"}


def test_no_dashboard_or_alert_uses_an_undocumented_metric(dash):
    """The static check: every name in a dashboard or alert is one docs/metrics.md says is exported."""
    documented = dash.documented_metrics()
    used = {}
    for name, title, expr in dash.panel_queries():
        for metric in dash.metric_names(expr):
            used.setdefault(metric, f"{name} / {title}")
    for rule in dash.alert_rules():
        for metric in dash.metric_names(rule["expr"]):
            used.setdefault(metric, f"alert {rule['alert']}")
    unknown = dash.unknown_metrics(set(used), documented)
    assert not unknown, "not exported: " + ", ".join(f"{m} ({used[m]})" for m in sorted(unknown))
    assert len(used) >= 30
    # and the check itself catches a typo
    assert dash.unknown_metrics({"vllm:kv_cache_usage_percent"}, documented) == {
        "vllm:kv_cache_usage_percent"
    }
