"""Every dashboard and alert query, evaluated by the real Prometheus server scraping the real engine and operator.

`pagoda serve` (the default embedded model, with host and disk offload tiers) gets a short load through the
official `openai` client; the operator reconciles InferenceDeployments in kmock's emulated cluster and
serves its metrics endpoint. Prometheus scrapes both every second with the labels the ServiceMonitors give
engine pods in Kubernetes (namespace, pod, app_kubernetes_io_name, app_kubernetes_io_instance).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
ENGINE_LABELS = {
    "namespace": "llm",
    "pod": "chat-0",
    "app_kubernetes_io_name": "pagoda-engine",
    "app_kubernetes_io_instance": "chat",
}
OPERATOR_LABELS = {"namespace": "pagoda-system", "pod": "pagoda-operator-0"}
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


class OperatorThread:
    """kmock's emulated cluster and the operator, in an event loop on a thread; metrics on a free port."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.ready = threading.Event()
        self.stop = None
        self.error: BaseException | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            self.loop.run_until_complete(self._run())
        except BaseException as exc:  # reported to the test
            self.error = exc
            self.ready.set()

    async def _run(self) -> None:
        from pagoda.operator import metrics, testkit

        self.stop = asyncio.Event()
        async with testkit.emulated_cluster() as cluster:
            await cluster.add_node("gpu-h100-0", "h100")
            await cluster.add_node("gpu-l4-0", "l4")
            async with testkit.running_operator(cluster):
                metrics.serve(self.port, addr="127.0.0.1")
                await cluster.create(testkit.example("llama-3.1-8b-h100-nvme.yaml"))
                await cluster.create(testkit.example("qwen2.5-7b-l4-fp8.yaml"))
                unservable = testkit.example("llama-3.1-70b-h100x2-tp.yaml")
                unservable["metadata"]["name"] = "needs-b200"
                unservable["spec"]["gpu"] = {"product": "B200", "count": 1}
                await cluster.create(unservable)
                await cluster.settle()
                self.ready.set()
                await self.stop.wait()

    def __enter__(self) -> OperatorThread:
        self.thread.start()
        assert self.ready.wait(120), "the operator never settled"
        if self.error:
            raise self.error
        return self

    def __exit__(self, *exc) -> None:
        if self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


@pytest.fixture(scope="module")
def operator(dash):
    port = dash.free_port()
    with OperatorThread(port):
        yield dash.Target("operator", f"127.0.0.1:{port}", OPERATOR_LABELS)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, dash, engine, operator):
    prom = dash.Prometheus(
        tmp_path_factory.mktemp("prometheus"), [engine, operator], rule_files=[dash.ALERTS]
    )
    try:
        prom.wait_for('up{job="engine"} == 1', what="the engine scraped")
        prom.wait_for('up{job="operator"} == 1', what="the operator scraped")
        # enough samples after the load for every rate() window to hold two of them
        time.sleep(5)
        yield prom
    finally:
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


def test_every_dashboard_and_alert_metric_is_exported_by_the_real_endpoints(engine, operator, dash):
    exported = _exported(engine, dash) | _exported(operator, dash)
    used = {n for _, _, expr in dash.panel_queries() for n in dash.metric_names(expr)}
    used |= {n for rule in dash.alert_rules() for n in dash.metric_names(rule["expr"])}
    missing = sorted(n for n in used if n != "up" and n not in exported)
    assert not missing, f"dashboards/alerts query metrics that /metrics does not export: {missing}"


def test_every_panel_query_returns_series(prometheus, dash):
    failures = []
    for name, dashboard in dash.dashboards().items():
        values = _variables(dashboard)
        for panel in dash.panels(dashboard):
            for target in panel["targets"]:
                expr = dash.fill(target["expr"], values)
                res = prometheus.query(expr)
                if res["status"] != "success":
                    failures.append(f"{name} / {panel['title']}: does not parse: {res.get('error')} ({expr})")
                elif not res["data"]["result"]:
                    failures.append(f"{name} / {panel['title']}: no series ({expr})")
    assert not failures, "\n".join(failures)


def test_template_variable_queries_find_the_scraped_objects(prometheus, dash):
    """label_values(metric{...}, label) as Grafana runs it: the label values API with a series matcher."""
    import re

    for name, dashboard in dash.dashboards().items():
        values = _variables(dashboard)
        labels = ENGINE_LABELS if "inferencedeployment" in values else OPERATOR_LABELS
        expected = {"namespace": labels["namespace"], "pod": labels["pod"]}
        expected["inferencedeployment"] = labels.get("app_kubernetes_io_instance")
        for var in dashboard["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]["query"])
            assert m, f"{name}: variable {var['name']} is not a label_values() query"
            selector, label = dash.fill(m.group(1), values), m.group(2)
            res = prometheus.api(f"label/{label}/values", **{"match[]": selector})
            assert res["status"] == "success", res
            assert expected[var["name"]] in res["data"], f"{name}: ${var['name']} offers {res['data']}"


def test_alert_rules_parse_and_evaluate_in_the_real_server(prometheus, dash):
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
    # the engine is up and Ready is true for none of the unservable ones: the not-Ready rule sees data
    up = prometheus.query('up{app_kubernetes_io_name="pagoda-engine"}')["data"]["result"]
    assert up and up[0]["value"][1] == "1"


def test_operator_reports_conditions_and_gpus(prometheus):
    res = prometheus.query('pagoda_operator_gpus_requested{product=~".+"}')["data"]["result"]
    assert {r["metric"]["product"] for r in res} >= {"NVIDIA-H100-80GB-HBM3"}
    res = prometheus.query('sum(pagoda_operator_inference_deployments{condition="Ready"})')["data"]["result"]
    assert float(res[0]["value"][1]) == 3
