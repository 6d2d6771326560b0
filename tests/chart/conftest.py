"""Shared helpers for the chart tests: the real helm binary and rendered objects."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pagoda"

# every optional feature of the chart switched on, in cluster-wide mode
ALL_ON = [
    "--set", "operator.replicas=2",
    "--set", "operator.peering.enabled=true",
    "--set", "serviceMonitor.enabled=true",
    "--set", "serviceMonitor.labels.release=kube-prometheus-stack",
    "--set", "prometheusRule.enabled=true",
    "--set", "dashboards.enabled=true",
    "--set", "dashboards.annotations.grafana_folder=Pagoda",
    "--set", "operator.verbose=true",
    "--set", "operator.extraArgs={--priority=1}",
]  # fmt: skip
# the same in namespaced-only mode, watching two namespaces
NAMESPACED = ALL_ON + ["--set", "watch.namespaced=true", "--set", "watch.namespaces={team-a,team-b}"]


def find_tool(name: str) -> str:
    for candidate in (ROOT / ".tools" / "bin" / name, ROOT / ".venv" / "bin" / name):
        if candidate.is_file():
            return str(candidate)
    found = shutil.which(name)
    if not found:
        pytest.fail(
            f"`{name}` not found in .tools/bin, .venv/bin or PATH; run `make install` "
            f"(scripts/install_tools.sh puts helm/kubectl in .tools/bin, apt installs prometheus)",
            pytrace=False,
        )
    return found


class Helm:
    """The real helm binary, pointed at charts/pagoda."""

    root = ROOT
    chart = CHART
    all_on = ALL_ON
    namespaced = NAMESPACED

    def __init__(self, path: str) -> None:
        self.path = path

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.path, *args], capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def template(self, *values: str, namespace: str = "pagoda-system", check: bool = True):
        return self.run(
            "template", "pagoda", str(CHART), "--namespace", namespace, "--include-crds", *values, check=check
        )

    def render(self, *values: str, namespace: str = "pagoda-system") -> list[dict]:
        """`helm template` the chart and return its objects, CRDs included."""
        out = self.template(*values, namespace=namespace).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="session")
def helm() -> Helm:
    return Helm(find_tool("helm"))


@pytest.fixture(scope="session")
def promtool() -> str:
    return find_tool("promtool")
