"""Replica bookkeeping (router/backends.py): load from /metrics text, ejection after failed checks."""

from __future__ import annotations

from pagoda.router.backends import Backend, parse_load

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting_by_priority{engine="0"} 7.0
vllm:num_preemptions_total{engine="0"} 9.0
"""


def test_load_is_running_plus_waiting():
    assert parse_load(METRICS) == 5
    b = Backend("http://a", healthy=True, scraped_load=5, inflight=2)
    assert b.load == 7 and b.routable


def test_one_slow_check_keeps_a_replica_two_eject_it_a_refusal_ejects_at_once():
    b = Backend("http://a", healthy=True)
    b.check_failed("timeout")
    assert b.routable
    b.check_failed("timeout")
    assert not b.routable and b.last_error == "timeout"
    c = Backend("http://c", healthy=True)
    c.check_failed("connection refused", refused=True)
    assert not c.routable
    d = Backend("http://d", healthy=True, draining=True)
    assert not d.routable
