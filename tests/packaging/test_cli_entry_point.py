"""One `pagoda` command over both halves: the engine never imports the operator's code to reach `render`."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_pagoda_script_is_the_top_level_dispatcher() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pagoda"] == "pagoda.cli.main:main"
    import pagoda.cli.main

    assert Path(pagoda.cli.main.__file__).parent == REPO / "cli"
    modules = {module for module, _ in pagoda.cli.main.SUBCOMMANDS.values()}
    assert "pagoda.operator.render_cli" in modules and "pagoda.engine.cli.serve" in modules


def test_no_engine_module_names_the_operator() -> None:
    offenders = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "engine").rglob("*.py"))
        if "pagoda.operator" in path.read_text()
    ]
    assert offenders == [], f"engine modules that reach into pagoda.operator: {offenders}"


def test_render_dispatches_through_the_top_level_command(capsys) -> None:
    from pagoda.cli.main import main

    assert main(["render", str(REPO / "examples" / "qwen2.5-7b-l4-fp8.yaml")]) == 0
    assert "kind: StatefulSet" in capsys.readouterr().out
