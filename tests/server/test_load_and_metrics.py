"""Many concurrent streams with disconnects (no leaks), the metric names, and a real Prometheus scrape."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import httpx
import pytest

VLLM_SERIES = {
    "gauge": ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:cache_config_info"],
    "counter": ["vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:prompt_tokens_cached_by_source"],
    "histogram": ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_max_tokens", "vllm:request_params_n", "vllm:iteration_tokens_total", "vllm:request_num_preemptions"],
}  # fmt: skip
PAGODA_SERIES = ["pagoda:kv_blocks_total", "pagoda:kv_blocks_free", "pagoda:kv_blocks_cached", "pagoda:prefix_cache_hit_ratio", "pagoda:admission_rejections", "pagoda:max_model_len", "pagoda:max_model_len_fitted", "pagoda:offload_bytes_used", "pagoda:offload_hits", "pagoda:offload_load_seconds"]  # fmt: skip
NUM_CLIENTS = 64


async def _one_stream(client: httpx.AsyncClient, i: int, disconnect: bool) -> tuple[str, int]:
    body = {
        "prompt": f"Request {i}: count with me: one, two,",
        "max_tokens": 6,
        "stream": True,
        "temperature": 0,
    }
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                chunks += 1
                if disconnect and chunks == 1:
                    return "disconnected", chunks  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    return "done", chunks
    return "eof", chunks


async def _run_clients(url: str) -> list[tuple[str, int]]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        return await asyncio.gather(*(_one_stream(client, i, i % 3 == 0) for i in range(NUM_CLIENTS)))


def test_64_concurrent_streams_with_disconnects_leave_nothing_behind(server) -> None:
    before_abort = server.metric("vllm:request_success_total", finished_reason="abort")
    results = asyncio.run(_run_clients(server.url))
    assert sum(1 for r, _ in results if r == "done") == NUM_CLIENTS - len(range(0, NUM_CLIENTS, 3))
    assert sum(1 for r, _ in results if r == "disconnected") == len(range(0, NUM_CLIENTS, 3))
    state = server.wait_idle()
    assert state["running"] == 0 and state["waiting"] == 0, state
    assert state["free"] + state["cached"] == state["total"] > 0, state
    # Disconnected clients were aborted, not run to completion (some may have finished first).
    assert server.metric("vllm:request_success_total", finished_reason="abort") > before_abort


def test_every_series_is_exported_with_vllm_names_and_labels(server) -> None:
    text = httpx.get(server.url + "/metrics").text
    for kind, names in VLLM_SERIES.items():
        for name in names:
            suffix = "_total" if kind == "counter" else ""
            assert f"# TYPE {name}{suffix} {kind}" in text, name
    for name in PAGODA_SERIES:
        assert f"# TYPE {name}" in text, name
    for line in text.splitlines():
        if line.startswith(("vllm:", "pagoda:")):
            assert 'engine="0"' in line and "model_name=" in line, line
    for deprecated in (
        "vllm:gpu_cache_usage_perc",
        "vllm:gpu_prefix_cache_queries",
        "vllm:gpu_prefix_cache_hits",
    ):
        help_line = next(
            line
            for line in text.splitlines()
            if line.startswith((f"# HELP {deprecated} ", f"# HELP {deprecated}_total "))
        )
        assert "DEPRECATED" in help_line.upper()
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="2560.0"' in text
    # the CPU kernels: this CPU's best variant, built at install (the server runs on the same CPU as the test)
    from pagoda.kernels.cpu import loader

    best = loader.load()
    assert best.origin == loader.PREBUILT, best.describe()
    assert server.metric("pagoda:cpu_kernels_info", variant=best.variant, origin="prebuilt") == 1
    assert 'le="0.001"' in text and 'vllm:request_success_total{engine="0",finished_reason="abort"' in text


LATENCIES = (
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
)


def test_served_latency_histograms_hold_real_durations(server) -> None:
    """Served latencies are durations on the engine's clock: positive, and within what the client saw."""
    server.wait_idle()
    before = {n: (server.metric(n + "_sum"), server.metric(n + "_count")) for n in LATENCIES}
    start = time.monotonic()
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Latency check:", "max_tokens": 4, "ignore_eos": True},
        timeout=300,
    )
    wall = time.monotonic() - start
    assert r.status_code == 200, r.text
    observed = {}
    for name in LATENCIES:
        total, count = server.metric(name + "_sum"), server.metric(name + "_count")
        assert count - before[name][1] == 1, name
        observed[name] = total - before[name][0]
        assert 0 < observed[name] <= wall, (name, observed[name], wall)
    assert observed["vllm:time_to_first_token_seconds"] <= observed["vllm:e2e_request_latency_seconds"]


@pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="the Debian prometheus package is not installed"
)
def test_real_prometheus_scrapes_the_server(server, tmp_path) -> None:
    port = server.free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: pagoda\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{server.port}']\n"
    )
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def query(expr: str) -> list:
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": expr}, timeout=5)
        except httpx.HTTPError:
            return []
        return r.json()["data"]["result"] if r.status_code == 200 else []

    def wait_value(expr: str, timeout: float = 90) -> float:
        """The first finite value the query returns (rates need two scrapes around the traffic)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = query(expr)
            if result and result[0]["value"][1] not in ("NaN", "+Inf", "-Inf"):
                return float(result[0]["value"][1])
            time.sleep(1)
        raise AssertionError(f"no finite value for {expr}: {query(expr)}")

    rate = "sum(rate({}[1m]))"
    try:
        wait_value('up{job="pagoda"} == 1', timeout=60)  # scraping before the traffic: rates see it
        walls = []
        for i in range(3):
            start = time.monotonic()
            r = httpx.post(
                server.url + "/v1/completions", json={"prompt": f"Hi {i}", "max_tokens": 2}, timeout=300
            )
            walls.append(time.monotonic() - start)
            assert r.status_code == 200
        server.wait_idle()
        # The dashboard's own form of the TTFT median, over the traffic above only.
        p50 = wait_value(
            "histogram_quantile(0.5, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[1m])))"
        )
        mean_e2e = wait_value(
            f"{rate.format('vllm:e2e_request_latency_seconds_sum')} / "
            f"{rate.format('vllm:e2e_request_latency_seconds_count')}"
        )
        # The gauges as scraped after the server went idle: a scrape taken during the traffic can stay the
        # latest sample for a few seconds, so wait (bounded) for one that reads idle.
        gauges = ('vllm:num_requests_running{job="pagoda",engine="0"}',
                  'vllm:num_requests_waiting{job="pagoda",engine="0"}')  # fmt: skip
        idle_by = time.monotonic() + 30
        while True:
            running, waiting = (wait_value(g) for g in gauges)
            if (running, waiting) == (0, 0) or time.monotonic() > idle_by:
                break
            time.sleep(1)
    finally:
        proc.terminate()
        proc.wait(30)
    # A forward pass of the model takes well over a millisecond: a TTFT in the first bucket is garbage.
    assert 0.001 < p50 <= max(walls), (p50, walls)
    assert 0.001 < mean_e2e <= max(walls), (mean_e2e, walls)
    assert running == 0 and waiting == 0  # idle after the traffic, as the gauges must say
