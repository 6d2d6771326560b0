"""Helpers for the dashboard and alert checks: PromQL extraction and a real Prometheus server harness."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pagoda"
DASHBOARD_DIR = CHART / "dashboards"
ALERTS = CHART / "alerts" / "pagoda-alerts.yaml"
METRICS_DOC = ROOT / "docs" / "metrics.md"

# PromQL words that look like metric names but are not
KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "offset",
    "bool",
}
KEYWORDS |= {"inf", "nan", "le"}
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def panels(dashboard: dict) -> list[dict]:
    """Every non-row panel, rows' nested panels included."""
    out = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) for every target of every panel."""
    return [
        (name, panel["title"], target["expr"])
        for name, dash in dashboards().items()
        for panel in panels(dash)
        for target in panel["targets"]
    ]


def is_router_expr(expr: str) -> bool:
    """Whether a query selects the router's pods (the engine dashboard's router row)."""
    return 'app_kubernetes_io_name="pagoda-router"' in expr


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (label names, functions and keywords removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?", text):
        word, call = match.group(1), match.group(2)
        if call or word.lower() in KEYWORDS:
            continue
        names.add(word)
    return names


def documented_metrics() -> set[str]:
    """Names docs/metrics.md fixes for the engine and the operator (as written there)."""
    names = set(re.findall(r"`((?:vllm:|pagoda:|pagoda_operator_)[a-zA-Z0-9_:]+)", METRICS_DOC.read_text()))
    assert len(names) > 40, "docs/metrics.md lists fewer metrics than expected; did its format change?"
    return names


def base_name(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def unknown_metrics(used: set[str], exported: set[str]) -> set[str]:
    """Names used but not exported; a name matches when it or its family (without _total/_bucket/...) does."""
    return {n for n in used if n != "up" and n not in exported and base_name(n) not in exported}


def fill(expr: str, values: dict[str, str]) -> str:
    """Substitute Grafana template variables the way Grafana does for a regex matcher."""
    for name, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    assert "$" not in expr, f"unfilled template variable in {expr}"
    return expr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@dataclass
class Target:
    """A scrape target and the labels Kubernetes service discovery would have given it."""

    job: str
    address: str  # host:port
    labels: dict[str, str] = field(default_factory=dict)


class Prometheus:
    """The real Prometheus server on a free port, scraping given targets every second."""

    def __init__(self, workdir: Path, targets: list[Target], rule_files: list[Path] = ()) -> None:
        binary = shutil.which("prometheus")
        if not binary:
            pytest.fail(
                "the `prometheus` server binary is not installed: these checks need the real server "
                "(Debian package `prometheus`; `make install` installs it when run as root)",
                pytrace=False,
            )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [
                {
                    "job_name": t.job,
                    "metrics_path": "/metrics",
                    "static_configs": [{"targets": [t.address], "labels": t.labels}],
                }
                for t in targets
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.workdir = workdir
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()}")
            try:
                if http_get(f"{self.url}/-/ready", timeout=1)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("prometheus never became ready")

    def api(self, path: str, **params: str | list[str]) -> dict:
        query = urllib.parse.urlencode(params, doseq=True)
        status, body = http_get(f"{self.url}/api/v1/{path}?{query}", timeout=10)
        data = json.loads(body)
        data["http_status"] = status
        return data

    def query(self, expr: str) -> dict:
        return self.api("query", query=expr)

    def wait_for(self, expr: str, timeout: float = 60.0, what: str = "") -> list[dict]:
        """Wait until an instant query returns at least one series."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            res = self.query(expr)
            if res["status"] == "success" and res["data"]["result"]:
                return res["data"]["result"]
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what or expr}; last answer {res}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="session")
def dash() -> SimpleNamespace:
    """The helpers above as one object (test modules cannot import conftest under importlib mode)."""
    return SimpleNamespace(
        ROOT=ROOT,
        CHART=CHART,
        ALERTS=ALERTS,
        dashboards=dashboards,
        panels=panels,
        panel_queries=panel_queries,
        alert_rules=alert_rules,
        is_router_expr=is_router_expr,
        base_name=base_name,
        metric_names=metric_names,
        documented_metrics=documented_metrics,
        unknown_metrics=unknown_metrics,
        fill=fill,
        free_port=free_port,
        http_get=http_get,
        Target=Target,
        Prometheus=Prometheus,
    )
