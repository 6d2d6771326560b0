"""The alert rules through the real promtool: syntax and unit tests of each alert firing and not firing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RULES = HERE.parents[1] / "charts" / "pagoda" / "alerts" / "pagoda-alerts.yaml"
UNIT_TESTS = HERE / "alerts_test.yaml"
EXPECTED = {
    "PagodaKVCacheNearlyFull",
    "PagodaPreemptionRateRising",
    "PagodaWaitingQueueGrowing",
    "PagodaOffloadVerificationFailures",
    "PagodaEngineDown",
    "PagodaInferenceDeploymentNotReady",
    "PagodaRouterBackendUnhealthy",  # issue 14: the router's view of its engines
}


def _alerts() -> dict[str, dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"]}


def test_promtool_check_rules(promtool):
    proc = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(EXPECTED)} rules found" in proc.stdout


def test_the_issue_alerts_exist_with_their_durations():
    alerts = _alerts()
    assert set(alerts) == EXPECTED
    assert (
        alerts["PagodaKVCacheNearlyFull"]["for"] == "10m"
        and "> 0.9" in alerts["PagodaKVCacheNearlyFull"]["expr"]
    )
    assert alerts["PagodaInferenceDeploymentNotReady"]["for"] == "15m"
    for rule in alerts.values():
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_promtool_unit_tests_cover_firing_and_not_firing_for_each_alert(promtool):
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    fired, quiet = set(), set()
    for case in tests:
        for check in case["alert_rule_test"]:
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fired == EXPECTED and quiet == EXPECTED
    proc = subprocess.run(
        [promtool, "test", "rules", str(UNIT_TESTS)], capture_output=True, text=True, timeout=120, cwd=HERE
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_unit_tests_can_fail(promtool, tmp_path):
    """Guard against a vacuous harness: expecting an alert that cannot fire must fail promtool."""
    case = yaml.safe_load(UNIT_TESTS.read_text())
    case["rule_files"] = [str(RULES)]
    first = case["tests"][0]
    first["alert_rule_test"][0]["exp_alerts"] = [{"exp_labels": {"severity": "warning"}}]
    path = tmp_path / "broken_test.yaml"
    path.write_text(yaml.safe_dump(case))
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "PagodaKVCacheNearlyFull" in proc.stdout + proc.stderr
