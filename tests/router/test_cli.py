"""`pagoda router` command line: the dry run the operator's contract test relies on, and no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pagoda.router.main import main


def test_dry_run_prints_the_validated_config(capsys):
    argv = [
        "--backend",
        "http://10.0.0.1:8000/",
        "--backend-dns",
        "llm-headless.default.svc:8000",
        "--policy",
        "prefix",
        "--api-key",
        "s3cret",
        "--dry-run",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "prefix" and out["port"] == 8000 and out["host"] == "0.0.0.0"
    assert out["backends"] == ["http://10.0.0.1:8000"] and out["backend_dns"] == [
        "llm-headless.default.svc:8000"
    ]
    assert out["dns_interval"] == 5.0 and out["health_interval"] == 2.0
    assert out["api_key"] == "***"  # never printed


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([], "at least one --backend"),
        (["--backend", "10.0.0.1:8000"], "http(s) URL"),
        (["--backend-dns", "svc"], "HOST:PORT"),
        (["--backend-dns", "svc:99999"], "HOST:PORT"),
        (["--backend", "http://a:1", "--health-interval", "0"], "health-interval"),
    ],
)
def test_bad_settings_exit_2_naming_the_flag(argv, words, capsys):
    assert main([*argv, "--dry-run"]) == 2
    assert words in capsys.readouterr().err


def test_unknown_policy_is_a_usage_error(capsys):
    assert main(["--backend", "http://a:1", "--policy", "random", "--dry-run"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_router_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pagoda.router.app, pagoda.router.cli, pagoda.router.main, pagoda.router.chain, pagoda.router.policies\n"
        "from pagoda.cli.main import main\n"
        "assert main(['router', '--backend', 'http://a:1', '--dry-run']) == 0\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["policy"] == "tierAware"
