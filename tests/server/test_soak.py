"""The short soak (the full one is `make soak`): a few hundred mixed requests with random disconnects and
invalid requests through the real server and model, then nothing may be left behind."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_soak():
    spec = importlib.util.spec_from_file_location("pagoda_soak", ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_short_soak_leaves_nothing_behind() -> None:
    soak = load_soak()
    cfg = soak.SoakConfig(
        requests=160, warmup=40, concurrency=16, max_tokens=4, invalid_rate=0.05, progress=False
    )
    report = soak.run_soak(cfg)
    assert report.problems() == [], report
    outcomes = report.outcomes
    assert outcomes["error"] == 0 and sum(outcomes.values()) == 160
    assert outcomes["completed"] > 80 and outcomes["cancelled"] > 0 and outcomes["rejected"] > 0, outcomes
    assert report.failed_steps == 0
    assert (report.running, report.waiting, report.unfinished, report.open_streams) == (0, 0, False, 0)
    assert report.blocks_free + report.blocks_cached == report.blocks_total > 0
    assert report.invariants == "ok"
    assert report.rss_growth <= 0.10, (report.rss_after_warmup_mib, report.rss_end_mib)
