"""The Prometheus exporter and the log line, fed stats objects directly (no model needed)."""

from __future__ import annotations

import logging

from pagoda.engine.core.stats import FinishedRequestStats, IterationStats, SchedulerStats
from pagoda.engine.metrics import LoggingStatLogger, PrometheusStatLogger, buckets
from prometheus_client.parser import text_string_to_metric_families


def samples(exporter: PrometheusStatLogger) -> dict:
    out = {}
    for family in text_string_to_metric_families(exporter.render().decode()):
        for s in family.samples:
            out[
                (
                    s.name,
                    tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))),
                )
            ] = s.value
    return out


def finished(reason: str = "stop", gen: int = 5) -> FinishedRequestStats:
    return FinishedRequestStats(reason, 2.0, 0.1, 0.4, 1.5, 1.9, 10, gen, 16, 1, 0)


def test_buckets_are_vllms() -> None:
    assert (
        buckets.TTFT[0] == 0.001 and buckets.TTFT[-3:] == [160.0, 640.0, 2560.0] and len(buckets.TTFT) == 22
    )
    assert buckets.TOKEN_LATENCY[-1] == 80.0 and len(buckets.TOKEN_LATENCY) == 19
    assert buckets.REQUEST_LATENCY[-1] == 7680.0 and len(buckets.REQUEST_LATENCY) == 21
    assert buckets.one_two_five(1024) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert buckets.ITERATION_TOKENS[0] == 1 and buckets.ITERATION_TOKENS[-1] == 16384


def test_record_updates_gauges_counters_and_histograms() -> None:
    e = PrometheusStatLogger("m", max_model_len=1024, cache_config={"block_size": 16}, block_size=16)
    it = IterationStats(
        num_prompt_tokens=10, num_generation_tokens=3, num_preemptions=1, prefix_cache_queries=32,
        prefix_cache_hits=16, cached_tokens_by_source={"device": 16}, time_to_first_tokens=[0.05],
        inter_token_latencies=[0.02, 0.03], finished_requests=[finished("stop"), finished("abort", 1)],
        num_prompt_tokens_per_new_request=[10],
    )  # fmt: skip
    e.record(SchedulerStats(3, 2, 0.25, 100, 70, 5), it)
    s = samples(e)
    assert s[("vllm:num_requests_running", ())] == 3 and s[("vllm:num_requests_waiting", ())] == 2
    assert s[("vllm:kv_cache_usage_perc", ())] == 0.25 == s[("vllm:gpu_cache_usage_perc", ())]
    assert s[("vllm:prompt_tokens_total", ())] == 10 and s[("vllm:generation_tokens_total", ())] == 3
    assert s[("vllm:prefix_cache_hits_total", ())] == 16 == s[("vllm:gpu_prefix_cache_hits_total", ())]
    assert s[("vllm:num_preemptions_total", ())] == 1
    assert s[("vllm:request_success_total", (("finished_reason", "stop"),))] == 1
    assert s[("vllm:request_success_total", (("finished_reason", "abort"),))] == 1
    assert s[("vllm:request_success_total", (("finished_reason", "length"),))] == 0
    assert s[("vllm:prompt_tokens_cached_by_source_total", (("source", "device"),))] == 16
    assert s[("vllm:time_to_first_token_seconds_bucket", (("le", "0.06"),))] == 1
    assert s[("vllm:time_to_first_token_seconds_bucket", (("le", "0.04"),))] == 0
    assert s[("vllm:inter_token_latency_seconds_count", ())] == 2
    assert s[("vllm:e2e_request_latency_seconds_count", ())] == 2
    assert s[("vllm:iteration_tokens_total_bucket", (("le", "16.0"),))] == 1
    assert s[("vllm:request_time_per_output_token_seconds_sum", ())] == 1.5 / 4
    assert s[("pagoda:kv_blocks_total", ())] == 100 and s[("pagoda:kv_blocks_free", ())] == 70
    assert s[("pagoda:kv_blocks_cached", ())] == 5 and s[("pagoda:prefix_cache_hit_ratio", ())] == 0.5
    assert s[("pagoda:max_model_len", ())] == 1024 and s[("pagoda:max_model_len_fitted", ())] == 1600
    assert s[("vllm:cache_config_info", (("block_size", "16"),))] == 1


def test_hit_ratio_is_over_the_last_n_requests() -> None:
    e = PrometheusStatLogger("m", max_model_len=64, hit_ratio_window=2)
    for hits in (0, 10, 10):  # three requests of 10 tokens: the first (a miss) falls out of the window
        e.record(
            SchedulerStats(),
            IterationStats(
                prefix_cache_queries=10, prefix_cache_hits=hits, num_prompt_tokens_per_new_request=[10]
            ),
        )
    assert samples(e)[("pagoda:prefix_cache_hit_ratio", ())] == 1.0


def test_hit_ratio_window_counts_requests_not_steps() -> None:
    e = PrometheusStatLogger("m", max_model_len=64, hit_ratio_window=4)
    # One step admits 4 requests that all miss, the next 4 that all hit: only the newest 4 count.
    e.record(SchedulerStats(), IterationStats(prefix_cache_queries=40, prefix_cache_hits=0,
                                              num_prompt_tokens_per_new_request=[10] * 4))  # fmt: skip
    assert samples(e)[("pagoda:prefix_cache_hit_ratio", ())] == 0.0
    e.record(SchedulerStats(), IterationStats(prefix_cache_queries=40, prefix_cache_hits=40,
                                              num_prompt_tokens_per_new_request=[10] * 4))  # fmt: skip
    assert samples(e)[("pagoda:prefix_cache_hit_ratio", ())] == 1.0
    # 2 more requests half-hit: the window is the 2 newest of the all-hit step plus these 2.
    e.record(SchedulerStats(), IterationStats(prefix_cache_queries=20, prefix_cache_hits=10,
                                              num_prompt_tokens_per_new_request=[10] * 2))  # fmt: skip
    assert samples(e)[("pagoda:prefix_cache_hit_ratio", ())] == 50 / 60  # the 4-request step stays whole


def test_hit_ratio_window_stays_bounded_when_steps_report_no_new_requests() -> None:
    """Lookups with no request count (re-admitted preempted requests, or a producer that never fills the
    list) must not grow the window forever into a lifetime average."""
    e = PrometheusStatLogger("m", max_model_len=64, hit_ratio_window=100)
    for _ in range(5000):  # a long history of misses...
        e.record(SchedulerStats(), IterationStats(prefix_cache_queries=16, prefix_cache_hits=0))
    for _ in range(500):  # ...then a run of hits longer than the window
        e.record(SchedulerStats(), IterationStats(prefix_cache_queries=16, prefix_cache_hits=16))
    assert samples(e)[("pagoda:prefix_cache_hit_ratio", ())] == 1.0
    assert e.hit_ratio_window_steps <= 100


def test_step_failures_are_counted() -> None:
    e = PrometheusStatLogger("m", max_model_len=64)
    assert samples(e)[("pagoda:engine_step_failures_total", ())] == 0
    e.step_failed()
    e.step_failed()
    assert samples(e)[("pagoda:engine_step_failures_total", ())] == 2


def test_offload_series_are_read_generically() -> None:
    e = PrometheusStatLogger("m", max_model_len=64)
    snap = {
        "host": {"bytes_used": 100.0, "bytes_capacity": 1000.0, "blocks": 3, "hits": 32, "load_bytes": 10}
    }
    e.record(SchedulerStats(offload=snap), IterationStats())
    snap["host"]["hits"] = 48  # cumulative: the counter advances by 16
    it = IterationStats()
    it.offload = {"disk": {"load_seconds": [0.002, 0.004], "evictions": 2}}  # type: ignore[attr-defined]
    e.record(SchedulerStats(offload=snap), it)
    s = samples(e)
    assert s[("pagoda:offload_bytes_used", (("tier", "host"),))] == 100
    assert s[("pagoda:offload_hits_total", (("tier", "host"),))] == 48
    assert s[("pagoda:offload_load_bytes_total", (("tier", "host"),))] == 10
    assert s[("pagoda:offload_load_seconds_count", (("tier", "disk"),))] == 2
    assert s[("pagoda:offload_evictions_total", (("tier", "disk"),))] == 2
    assert s[("pagoda:offload_hits_total", (("tier", "disk"),))] == 0  # pre-created series


def test_deprecated_aliases_say_so_and_rejections_count() -> None:
    e = PrometheusStatLogger("m", max_model_len=64)
    e.admission_rejected("queue_full")
    text = e.render().decode()
    for name in ("vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits"):
        assert "DEPRECATED" in next(
            line
            for line in text.splitlines()
            if line.startswith((f"# HELP {name} ", f"# HELP {name}_total "))
        )
    assert samples(e)[("pagoda:admission_rejections_total", (("reason", "queue_full"),))] == 1
    assert "_created" not in text


def test_log_line_every_interval_while_busy(caplog) -> None:
    now = [0.0]
    logger = LoggingStatLogger(interval_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="pagoda.engine.metrics"):
        for _ in range(5):
            now[0] += 3
            logger.record(
                SchedulerStats(2, 1, 0.5),
                IterationStats(num_generation_tokens=30, prefix_cache_queries=10, prefix_cache_hits=5),
            )
        now[0] += 100
        logger.record(SchedulerStats(), IterationStats())  # flushes the tokens of the last 3 s
        now[0] += 100
        logger.record(SchedulerStats(), IterationStats())  # idle: nothing logged
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "Running: 2 reqs, Waiting: 1 reqs" in lines[0] and "KV cache usage: 50.0%" in lines[0]
    assert (
        "Prefix cache hit rate: 50.0%" in lines[0] and "Avg generation throughput: 10.0 tokens/s" in lines[0]
    )


def test_lora_requests_info_is_one_series_of_the_current_adapters_stamped_now() -> None:
    """vllm:lora_requests_info as the Gateway API Inference Extension reads it: labels list the adapters
    (comma-separated), the value is the update time; a changed set replaces the old series; LoRA off: none."""
    import time

    def lora_series(e: PrometheusStatLogger) -> list[tuple[tuple, float]]:
        return [(k[1], v) for k, v in samples(e).items() if k[0] == "vllm:lora_requests_info"]

    e = PrometheusStatLogger("m", max_model_len=1024)
    e.record(SchedulerStats(1, 0), IterationStats())
    assert lora_series(e) == []  # max_lora 0: LoRA is off
    before = time.time()
    e.record(
        SchedulerStats(2, 1, running_lora_adapters=["a", "b"], waiting_lora_adapters=["c"], max_lora=4),
        IterationStats(),
    )
    [(labels, stamp)] = lora_series(e)
    assert dict(labels) == {"max_lora": "4", "running_lora_adapters": "a,b", "waiting_lora_adapters": "c"}
    assert before <= stamp <= time.time()
    e.record(SchedulerStats(1, 0, running_lora_adapters=["c"], max_lora=4), IterationStats())
    [(labels, later)] = lora_series(e)
    assert dict(labels) == {"max_lora": "4", "running_lora_adapters": "c", "waiting_lora_adapters": ""}
    assert later >= stamp
