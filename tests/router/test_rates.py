"""The replica's measured rates that tierAware prices with (engine/server/kv_routes.py: RateTracker)."""

from __future__ import annotations

import pytest
from pagoda.engine.core.stats import IterationStats, SchedulerStats
from pagoda.engine.server.kv_routes import RateTracker


def test_prefill_rate_from_a_first_token_and_tier_load_rates():
    r = RateTracker()
    r.record(SchedulerStats(), IterationStats(num_prompt_tokens=500, time_to_first_tokens=[0.25]))
    assert r.prefill_tokens_per_s == pytest.approx(2000.0)
    r.record(SchedulerStats(), IterationStats(num_prompt_tokens=10, time_to_first_tokens=[0.001]))
    assert r.prefill_tokens_per_s == pytest.approx(2000.0)  # too few tokens to say anything
    it = IterationStats(
        cached_tokens_by_source={"host": 320, "disk": 64},
        offload={"host": {"load_seconds": [0.001, 0.001]}, "disk": {"load_seconds": [0.032]}},
    )
    r.record(SchedulerStats(), it)
    assert r.load_tokens_per_s == pytest.approx({"host": 160_000.0, "disk": 2_000.0})
    r.record(SchedulerStats(), IterationStats(num_prompt_tokens=500, time_to_first_tokens=[0.5]))
    assert r.prefill_tokens_per_s == pytest.approx(0.8 * 2000 + 0.2 * 1000)  # a moving average
    assert r.to_dict()["prefill_tokens_per_s"] == r.prefill_tokens_per_s


def test_the_step_time_the_core_measured_beats_the_first_token_time():
    """The core times its own steps; a step's stats may reach the front end long after it ran."""
    r = RateTracker()
    r.record(
        SchedulerStats(), IterationStats(num_prompt_tokens=100, time_to_first_tokens=[0.5], step_seconds=0.05)
    )
    assert r.prefill_tokens_per_s == pytest.approx(2000.0)
