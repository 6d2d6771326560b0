"""Every dashboard and alert query, evaluated by the real Prometheus server scraping the real engine and operator.

`pagoda serve` (the default embedded model, with host and disk offload tiers and n-gram speculation) gets a short load through the
official `openai` client, directly and through a real `pagoda router` in front of it (the Router row); the
real `pagoda-operator` process reconciles InferenceDeployments in kmock's emulated cluster and serves its
metrics endpoint. Prometheus scrapes them every second with the labels the ServiceMonitors give the pods in
Kubernetes (namespace, pod, app_kubernetes_io_name, app_kubernetes_io_instance).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
ENGINE_LABELS = {
    "namespace": "llm",
    "pod": "chat-0",
    "app_kubernetes_io_name": "pagoda-engine",
    "app_kubernetes_io_instance": "chat",
}
OPERATOR_LABELS = {"namespace": "pagoda-system", "pod": "pagoda-operator-0"}
# the InferenceDeployment's router pod (spec.routing), scraped through its client Service
ROUTER_LABELS = {
    "namespace": "llm",
    "pod": "chat-router-0",
    "app_kubernetes_io_name": "pagoda-router",
    "app_kubernetes_io_instance": "chat",
}
RATE_WINDOW = "30s"  # stands in for $__rate_interval: at a 1s scrape, 30 samples


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float, dash) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(OSError):
            if dash.http_get(url, timeout=2)[0] == 200:
                return
        time.sleep(1)
    raise AssertionError(f"{url} did not answer within {timeout}s:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, dash):
    """`pagoda serve` with the default model and both offload tiers, after a short load."""
    work = tmp_path_factory.mktemp("engine")
    port = dash.free_port()
    log = work / "serve.log"
    cmd = [
        str(ROOT / ".venv" / "bin" / "pagoda"),
        "serve",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", "512",
        "--kv-offload-host-bytes", "64MiB",
        "--kv-offload-disk-dir", str(work / "kv-disk"),
        "--kv-offload-disk-bytes", "128MiB",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
        "--disable-log-stats",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, log, timeout=420, dash=dash)
        _load(f"http://127.0.0.1:{port}/v1")
        yield dash.Target("engine", f"127.0.0.1:{port}", ENGINE_LABELS)
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def router(tmp_path_factory, dash, engine):
    """`pagoda router` in front of the engine (a static backend where the pod resolves the headless
    Service), after the same short load sent through it."""
    work = tmp_path_factory.mktemp("router")
    port = dash.free_port()
    log = work / "router.log"
    cmd = [
        str(ROOT / ".venv" / "bin" / "pagoda"),
        "router",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--policy", "tierAware",
        "--backend", f"http://{engine.address}",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, log, timeout=120, dash=dash)
        _load(f"http://127.0.0.1:{port}/v1")
        yield dash.Target("router", f"127.0.0.1:{port}", ROUTER_LABELS)
    finally:
        _stop(proc)


def _load(base_url: str) -> None:
    """A short, varied load: shared prefixes (prefix-cache hits), a stream, several finish reasons."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    system = "You are a terse assistant for a Kubernetes platform team. " * 6
    for question in ("What is a pod?", "What is a node?", "What is a pod?"):
        client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=6,
            temperature=0,
        )
    stream = client.completions.create(
        model=model, prompt=system + "Name a colour:", max_tokens=6, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) is not None


async def _populate(cluster) -> None:
    """GPU nodes and three InferenceDeployments, one unservable."""
    import pagoda_testkit as testkit

    await cluster.add_node("gpu-h100-0", "h100")
    await cluster.add_node("gpu-l4-0", "l4")
    await cluster.create(testkit.example("llama-3.1-8b-h100-nvme.yaml"))
    await cluster.create(testkit.example("qwen2.5-7b-l4-fp8.yaml"))
    unservable = testkit.example("llama-3.1-70b-h100x2-tp.yaml")
    unservable["metadata"]["name"] = "needs-b200"
    unservable["spec"]["gpu"] = {"product": "B200", "count": 1}
    await cluster.create(unservable)


@pytest.fixture(scope="module")
def operator(tmp_path_factory, dash):
    """The real `pagoda-operator` process, with the args the Helm chart gives it, on the emulated cluster."""
    work = tmp_path_factory.mktemp("operator")
    port, health = dash.free_port(), dash.free_port()
    cmd = [
        str(ROOT / ".venv" / "bin" / "pagoda-operator"),
        "--standalone",
        "--all-namespaces",
        f"--metrics-port={port}",
        f"--liveness=http://127.0.0.1:{health}/healthz",
    ]
    log = work / "operator.log"
    import pagoda_testkit as testkit

    with testkit.ClusterThread(_populate) as cluster:
        kubeconfig = work / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(testkit.kubeconfig(cluster.url)))
        env = dict(os.environ, KUBECONFIG=str(kubeconfig), POD_ID="op-0")
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_http(f"http://127.0.0.1:{port}/metrics", proc, log, timeout=60, dash=dash)
            deadline = time.monotonic() + 60
            while 'pagoda_operator_gpus_requested{product="NVIDIA-H100-80GB-HBM3"}' not in (
                body := dash.http_get(f"http://127.0.0.1:{port}/metrics")[1]
            ):
                assert time.monotonic() < deadline, (
                    f"the operator never reconciled:\n{body}\n{log.read_text()}"
                )
                time.sleep(0.5)
            yield dash.Target("operator", f"127.0.0.1:{port}", OPERATOR_LABELS)
        finally:
            _stop(proc)


def _prometheus(workdir: Path, dash, targets: list) -> object:
    prom = dash.Prometheus(workdir, targets, rule_files=[dash.ALERTS])
    try:
        for target in targets:
            prom.wait_for(f'up{{job="{target.job}"}} == 1', what=f"{target.job} scraped")
        # enough samples for every rate() window to hold several of them
        time.sleep(5)
    except BaseException:
        prom.stop()
        raise
    return prom


@pytest.fixture(scope="module")
def operator_prometheus(tmp_path_factory, dash, operator):
    """Prometheus scraping the operator alone: its checks do not wait for (or depend on) the engine."""
    prom = _prometheus(tmp_path_factory.mktemp("prometheus-operator"), dash, [operator])
    yield prom
    prom.stop()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, dash, engine, operator, router):
    """Prometheus scraping the engine (after its load), the router in front of it and the operator."""
    prom = _prometheus(tmp_path_factory.mktemp("prometheus"), dash, [engine, operator, router])
    yield prom
    prom.stop()


def _exported(target, dash) -> set[str]:
    status, body = dash.http_get(f"http://{target.address}/metrics")
    assert status == 200
    return {s.name for fam in text_string_to_metric_families(body) for s in fam.samples}


def _variables(dashboard: dict) -> dict[str, str]:
    names = {v["name"] for v in dashboard["templating"]["list"]}
    labels = ENGINE_LABELS if "inferencedeployment" in names else OPERATOR_LABELS
    values = {"__rate_interval": RATE_WINDOW, "namespace": labels["namespace"], "pod": labels["pod"]}
    if "inferencedeployment" in names:
        values["inferencedeployment"] = labels["app_kubernetes_io_instance"]
    return values


# each side is checked against the Prometheus that scrapes it; the operator side first (it is quick)
SIDES = {"operator.json": ("operator", "operator_prometheus"), "engine.json": ("engine", "prometheus")}


def _used_metrics(dash, dashboard: str, with_alerts: bool) -> dict[str, str]:
    used = {}
    for name, title, expr in dash.panel_queries():
        if name == dashboard:
            for metric in dash.metric_names(expr):
                used.setdefault(metric, f"{name} / {title}")
    if with_alerts:
        for rule in dash.alert_rules():
            prefix = "pagoda_operator_" if dashboard == "operator.json" else ("vllm:", "pagoda:")
            for metric in dash.metric_names(rule["expr"]):
                if metric.startswith(prefix):
                    used.setdefault(metric, f"alert {rule['alert']}")
    return used


@pytest.mark.parametrize("dashboard", SIDES)
def test_every_metric_queried_is_exported_by_the_real_endpoint(request, dash, dashboard):
    """The static check against the real /metrics output, dashboards and alerts alike."""
    target = request.getfixturevalue(SIDES[dashboard][0])
    exported = _exported(target, dash)
    if dashboard == "engine.json":  # its Router row: the router's own endpoint
        exported |= _exported(request.getfixturevalue("router"), dash)
    used = _used_metrics(dash, dashboard, with_alerts=True)
    missing = sorted(f"{m} ({where})" for m, where in used.items() if m != "up" and m not in exported)
    assert not missing, f"queried but not exported by {target.job} /metrics: {missing}"


@pytest.mark.parametrize("dashboard", SIDES)
def test_every_panel_query_returns_series(request, dash, dashboard):
    prometheus = request.getfixturevalue(SIDES[dashboard][1])
    values = _variables(dash.dashboards()[dashboard])
    failures, checked = [], 0
    for panel in dash.panels(dash.dashboards()[dashboard]):
        for target in panel["targets"]:
            expr = dash.fill(target["expr"], values)
            res = prometheus.query(expr)
            checked += 1
            if res["status"] != "success":
                failures.append(f"{panel['title']}: does not parse: {res.get('error')} ({expr})")
            elif not res["data"]["result"]:
                failures.append(f"{panel['title']}: no series ({expr})")
    assert checked >= 5
    assert not failures, f"{dashboard}:\n" + "\n".join(failures)


@pytest.mark.parametrize("dashboard", SIDES)
def test_template_variable_queries_find_the_scraped_objects(request, dash, dashboard):
    """label_values(metric{...}, label) as Grafana runs it: the label values API with a series matcher."""
    prometheus = request.getfixturevalue(SIDES[dashboard][1])
    board = dash.dashboards()[dashboard]
    values = _variables(board)
    labels = ENGINE_LABELS if "inferencedeployment" in values else OPERATOR_LABELS
    expected = {"namespace": labels["namespace"], "pod": labels["pod"]}
    expected["inferencedeployment"] = labels.get("app_kubernetes_io_instance")
    for var in board["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]["query"])
        assert m, f"variable {var['name']} is not a label_values() query"
        selector, label = dash.fill(m.group(1), values), m.group(2)
        res = prometheus.api(f"label/{label}/values", **{"match[]": selector})
        assert res["status"] == "success", res
        assert expected[var["name"]] in res["data"], f"${var['name']} offers {res['data']}"


def test_alert_rules_parse_and_evaluate_in_the_real_server(operator_prometheus, dash):
    prometheus = operator_prometheus
    for rule in dash.alert_rules():
        res = prometheus.query(rule["expr"])
        assert res["status"] == "success", f"{rule['alert']}: {res.get('error')}"
    # the server loaded the very file and evaluates every rule without error
    deadline = time.monotonic() + 30
    while True:
        groups = prometheus.api("rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules):
            break
        assert time.monotonic() < deadline, "rules were never evaluated"
        time.sleep(1)
    assert {r["name"] for r in rules} == {r["alert"] for r in dash.alert_rules()}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    # one InferenceDeployment cannot be served: the not-Ready alert's condition holds (pending, 15m to fire)
    pending = prometheus.wait_for(
        'ALERTS{alertname="PagodaInferenceDeploymentNotReady", alertstate="pending"}'
    )
    assert pending[0]["metric"]["namespace"] == OPERATOR_LABELS["namespace"]


def test_operator_reports_conditions_and_gpus(operator_prometheus):
    res = operator_prometheus.query('pagoda_operator_gpus_requested{product=~".+"}')["data"]["result"]
    assert {r["metric"]["product"] for r in res} >= {"NVIDIA-H100-80GB-HBM3", "NVIDIA-L4"}
    res = operator_prometheus.query('sum(pagoda_operator_inference_deployments{condition="Ready"})')
    assert float(res["data"]["result"][0]["value"][1]) == 3


def test_engine_alerts_see_the_engine(prometheus):
    up = prometheus.query('up{app_kubernetes_io_name="pagoda-engine"}')["data"]["result"]
    assert up and up[0]["value"][1] == "1"
    usage = prometheus.query('vllm:kv_cache_usage_perc{app_kubernetes_io_instance="chat"}')["data"]["result"]
    assert usage and 0 <= float(usage[0]["value"][1]) <= 1


LATENCY_PANELS = {"Time to first token": 0.001, "End-to-end request latency": 0.001, "Queue time": 0.0}


def _bucket_ceiling(prometheus, family: str, seconds: float) -> float:
    """The upper bound of the exported bucket that holds `seconds`: histogram_quantile interpolates inside a
    bucket, so a quantile may exceed the longest real duration, never that bound."""
    series = prometheus.query(f"{family}_bucket")["data"]["result"]
    bounds = sorted({float(s["metric"]["le"]) for s in series})
    return min(b for b in bounds if b >= seconds)


def test_latency_panels_show_real_durations(prometheus, engine, dash):
    """What the latency panels plot, checked as values: positive durations no longer than the client saw, up to
    the bucket that holds it (a wall-clock arrival stamp once made every one of them about -1.8e9 s, drawn as
    the first bucket)."""
    start = time.monotonic()
    _load(f"http://{engine.address}/v1")  # while Prometheus scrapes, so the panels' rate() windows see it
    wall = time.monotonic() - start
    time.sleep(3)  # two more scrapes after the last request
    values = _variables(dash.dashboards()["engine.json"])
    checked = 0
    for panel in dash.panels(dash.dashboards()["engine.json"]):
        floor = LATENCY_PANELS.get(panel["title"])
        if floor is None:
            continue
        family = panel["targets"][0]["expr"].split("rate(")[1].split("_bucket")[0]
        ceiling = _bucket_ceiling(prometheus, family, wall)
        for target in panel["targets"]:
            expr = dash.fill(target["expr"], values)
            result = prometheus.query(expr)["data"]["result"]
            assert result, f"{panel['title']}: no series ({expr})"
            value = float(result[0]["value"][1])
            assert floor < value <= ceiling, (
                f"{panel['title']}: {value} s, the load took {wall:.1f} s, its bucket ends at {ceiling} s ({expr})"
            )
            checked += 1
        mean = prometheus.query(
            f"sum(rate({family}_sum[{RATE_WINDOW}])) / sum(rate({family}_count[{RATE_WINDOW}]))"
        )["data"]["result"]
        assert mean and 0 < float(mean[0]["value"][1]) <= wall, (family, mean)
    assert checked == 9  # p50, p95 and p99 of each of the three panels
