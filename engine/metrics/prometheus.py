"""Prometheus exporter for the engine: vLLM's metric names, labels and buckets, plus Pagoda's own.

It is a StatLogger: the engine calls `record(scheduler_stats, iteration_stats)` after every step (on the
engine thread; prometheus-client is thread-safe). Series live in their own registry so several engines
(tests, benchmarks) can coexist in one process.

Offload tiers are read generically, so the offload work can feed them without touching this file:

- `SchedulerStats.offload[tier]` (a snapshot): gauges `bytes_used`, `bytes_capacity`, `blocks`, and the
  running totals `queries`, `hits`, `load_bytes`, `store_bytes`, `verification_failures`, `evictions`
  (cumulative; the counters advance by the difference from the previous snapshot).
- `IterationStats.offload[tier]` (optional attribute, one step's worth): `load_seconds` / `store_seconds`
  lists of latencies to observe, and the same counter names as deltas if the tier prefers to report deltas
  (report each counter one way only).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import prometheus_client
from pagoda.engine.core.stats import (
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
    SpecDecodingStats,
)
from pagoda.engine.metrics import buckets
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

FINISH_REASONS = ("stop", "length", "abort", "error")
CACHE_SOURCES = ("device", "host", "disk")
OFFLOAD_TIERS = ("host", "disk")
OFFLOAD_GAUGES = {
    "bytes_used": "offload_bytes_used",
    "bytes_capacity": "offload_bytes_capacity",
    "blocks": "offload_blocks",
}
OFFLOAD_COUNTERS = {
    "queries": "offload_queries",
    "hits": "offload_hits",
    "load_bytes": "offload_load_bytes",
    "store_bytes": "offload_store_bytes",
    "verification_failures": "offload_verification_failures",
    "evictions": "offload_evictions",
}
OFFLOAD_HISTOGRAMS = {"load_seconds": "offload_load_seconds", "store_seconds": "offload_store_seconds"}
DEPRECATED = " DEPRECATED: kept for old dashboards, use {} instead."


class PrometheusStatLogger:
    """Holds every engine series; `render()` gives the text exposition for GET /metrics."""

    def __init__(
        self,
        model_name: str,
        *,
        max_model_len: int,
        cache_config: dict[str, Any] | None = None,
        max_model_len_fitted: int | None = None,
        block_size: int | None = None,
        cpu_kernels: dict[str, str] | None = None,
        engine_index: int = 0,
        hit_ratio_window: int = 100,
        registry: CollectorRegistry | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        prometheus_client.disable_created_metrics()  # no *_created series, like vLLM
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name, "engine": str(engine_index)}
        names = list(self.labels)
        reg = self.registry

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, names + list(extra), registry=reg)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, names + list(extra), registry=reg)

        def histogram(name: str, doc: str, bucket_list: list, extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, names + list(extra), buckets=bucket_list, registry=reg)

        lb = self.labels
        # -- vLLM gauges
        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        ).labels(**lb)
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        ).labels(**lb)
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        ).labels(**lb)
        self.gpu_kv_usage = gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage." + DEPRECATED.format("vllm:kv_cache_usage_perc"),
        ).labels(**lb)
        # Pagoda's per-pool usage with a window group (sliding layers): vllm:kv_cache_usage_perc is the fuller
        # pool's, this says which pool it is (pool="full" | "window"); no series with one pool.
        self._pool_usage = gauge(
            "pagoda:kv_cache_usage_perc",
            "KV-cache usage of each pool of a cache with a sliding-window group (pool=full|window). "
            "1 means 100 percent usage.",
            ("pool",),
        )
        info = {k: str(v) for k, v in (cache_config or {}).items()}
        info_gauge = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            names + sorted(info),
            registry=reg,
        )
        info_gauge.labels(**lb, **info).set(1)
        # vLLM's LoRA info, as the Gateway API Inference Extension's model-server protocol reads it: one
        # series whose labels list the adapters (comma-separated names) and whose value is when it was last
        # updated (Unix seconds); only while LoRA is on (max_lora > 0), like vLLM.
        self.lora_info = gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
        )
        self._lora_labels: tuple[str, str, str] | None = None
        if cpu_kernels is not None:
            Gauge(
                "pagoda:cpu_kernels_info",
                "The native CPU kernels this engine runs: variant (torch = none loaded) and origin (prebuilt at "
                "install, or compiled at run time).",
                names + sorted(cpu_kernels),
                registry=reg,
            ).labels(**lb, **cpu_kernels).set(1)
        # -- vLLM counters
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        ).labels(**lb)
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(**lb)
        self.gpu_prefix_queries = counter(
            "vllm:gpu_prefix_cache_queries",
            "GPU prefix cache queries, in terms of number of queried tokens."
            + DEPRECATED.format("vllm:prefix_cache_queries"),
        ).labels(**lb)
        self.gpu_prefix_hits = counter(
            "vllm:gpu_prefix_cache_hits",
            "GPU prefix cache hits, in terms of number of cached tokens."
            + DEPRECATED.format("vllm:prefix_cache_hits"),
        ).labels(**lb)
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        ).labels(**lb)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(**lb)
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(**lb)
        # speculative decoding (vLLM's names; zero without --speculative-config)
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.").labels(
            **lb
        )
        self.spec_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."
        ).labels(**lb)
        self.spec_accepted = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        ).labels(**lb)
        self._spec_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft (speculative token) position.",
            ("position",),
        )
        for pos in range(num_speculative_tokens):  # every position's series from the start, at zero
            self._spec_per_pos.labels(**lb, position=str(pos))
        success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        self.success = {r: success.labels(**lb, finished_reason=r) for r in FINISH_REASONS}
        self._success_family = success
        cached = counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prompt tokens served from a cache instead of computed, by where they were found.",
            ("source",),
        )
        self.cached_by_source = {s: cached.labels(**lb, source=s) for s in CACHE_SOURCES}
        self._cached_family = cached
        # -- vLLM histograms
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", buckets.TTFT
        ).labels(**lb)
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            buckets.TOKEN_LATENCY,
        ).labels(**lb)
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            buckets.TOKEN_LATENCY,
        ).labels(**lb)
        req = buckets.REQUEST_LATENCY
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", req
        ).labels(**lb)
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", req
        ).labels(**lb)
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            req,
        ).labels(**lb)
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", req
        ).labels(**lb)
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", req
        ).labels(**lb)
        lens = buckets.one_two_five(max(1, max_model_len))
        self.req_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", lens
        ).labels(**lb)
        self.req_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", lens
        ).labels(**lb)
        self.req_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", lens
        ).labels(**lb)
        self.req_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", buckets.PARAMS_N
        ).labels(**lb)
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            buckets.ITERATION_TOKENS,
        ).labels(**lb)
        self.req_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Number of preemptions a request went through.",
            buckets.NUM_PREEMPTIONS,
        ).labels(**lb)
        # -- Pagoda's own
        self.blocks_total = gauge("pagoda:kv_blocks_total", "Usable KV-cache blocks on the device.").labels(
            **lb
        )
        self.blocks_free = gauge("pagoda:kv_blocks_free", "KV-cache blocks holding nothing.").labels(**lb)
        self.blocks_cached = gauge(
            "pagoda:kv_blocks_cached", "Unreferenced KV-cache blocks holding a reusable prefix."
        ).labels(**lb)
        self.hit_ratio = gauge(
            "pagoda:prefix_cache_hit_ratio",
            f"Prefix-cache hit ratio (tokens) over the last {hit_ratio_window} requests.",
        ).labels(**lb)
        self._rejections = counter(
            "pagoda:admission_rejections", "Requests refused before queueing, by reason.", ("reason",)
        )
        self._rejections.labels(**lb, reason="queue_full")
        gauge("pagoda:max_model_len", "The context length the engine serves.").labels(**lb).set(max_model_len)
        self.max_len_fitted = gauge(
            "pagoda:max_model_len_fitted", "The longest single sequence the KV memory could hold."
        ).labels(**lb)
        if max_model_len_fitted is not None:
            self.max_len_fitted.set(max_model_len_fitted)
        self._fitted_known = max_model_len_fitted is not None
        self.block_size = block_size
        self._offload_gauges = {
            key: gauge(f"pagoda:{name}", _OFFLOAD_DOCS[name], ("tier",))
            for key, name in OFFLOAD_GAUGES.items()
        }
        self._offload_counters = {
            key: counter(f"pagoda:{name}", _OFFLOAD_DOCS[name], ("tier",))
            for key, name in OFFLOAD_COUNTERS.items()
        }
        self._offload_histograms = {
            key: histogram(f"pagoda:{name}", _OFFLOAD_DOCS[name], buckets.OFFLOAD_SECONDS, ("tier",))
            for key, name in OFFLOAD_HISTOGRAMS.items()
        }
        for tier in OFFLOAD_TIERS:  # series exist (at 0) before a tier reports, so dashboards show them
            for family in (
                *self._offload_gauges.values(),
                *self._offload_counters.values(),
                *self._offload_histograms.values(),
            ):
                family.labels(**lb, tier=tier)
        self._offload_last: dict[tuple[str, str], float] = {}
        self._step_failures = counter(
            "pagoda:engine_step_failures",
            "Engine steps that raised; every request in the batch failed with them. Should stay 0.",
        ).labels(**lb)
        # Sliding window for the hit ratio: (queries, hits, new requests) per step with lookups.
        self._window: deque[tuple[int, int, int]] = deque()
        self._window_queries = 0
        self._window_hits = 0
        self._window_requests = 0
        self._window_size = hit_ratio_window

    # ------------------------------------------------------------ StatLogger

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        s, it = scheduler_stats, iteration_stats
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_cache_usage)
        self.gpu_kv_usage.set(s.kv_cache_usage)
        for pool, usage in s.kv_pool_usage.items():
            self._pool_usage.labels(**self.labels, pool=pool).set(usage)
        self.blocks_total.set(s.num_blocks_total)
        self.blocks_free.set(s.num_blocks_free)
        self.blocks_cached.set(s.num_blocks_cached)
        if not self._fitted_known and s.num_blocks_total:
            if self.block_size:
                self.max_len_fitted.set(s.num_blocks_total * self.block_size)

        _inc(self.prefix_queries, it.prefix_cache_queries)
        _inc(self.gpu_prefix_queries, it.prefix_cache_queries)
        _inc(self.prefix_hits, it.prefix_cache_hits)
        _inc(self.gpu_prefix_hits, it.prefix_cache_hits)
        _inc(self.preemptions, it.num_preemptions)
        _inc(self.prompt_tokens, it.num_prompt_tokens)
        _inc(self.generation_tokens, it.num_generation_tokens)
        if it.spec_decoding is not None:
            self._record_spec(it.spec_decoding)
        for source, n in it.cached_tokens_by_source.items():
            child = self.cached_by_source.get(source) or self._cached_family.labels(
                **self.labels, source=source
            )
            _inc(child, n)
        step_tokens = it.num_prompt_tokens + it.num_generation_tokens
        if step_tokens > 0:
            self.iteration_tokens.observe(step_tokens)
        for v in it.time_to_first_tokens:
            self.ttft.observe(v)
        for v in it.inter_token_latencies:
            self.itl.observe(v)
        for fin in it.finished_requests:
            self._record_finished(fin)
        self._update_hit_ratio(it)
        self._record_offload(s, it)
        self._record_lora(s)

    def _record_spec(self, spec: SpecDecodingStats) -> None:
        _inc(self.spec_drafts, spec.num_drafts)
        _inc(self.spec_draft_tokens, spec.num_draft_tokens)
        _inc(self.spec_accepted, spec.num_accepted_tokens)
        for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
            _inc(self._spec_per_pos.labels(**self.labels, position=str(pos)), n)

    def _record_lora(self, s: SchedulerStats) -> None:
        """One vllm:lora_requests_info series: the current adapters, stamped now (old sets are dropped)."""
        if s.max_lora <= 0:
            return
        labels = (str(s.max_lora), ",".join(s.waiting_lora_adapters), ",".join(s.running_lora_adapters))
        if labels != self._lora_labels:
            self.lora_info.clear()
            self._lora_labels = labels
        max_lora, waiting, running = labels
        self.lora_info.labels(
            **self.labels, max_lora=max_lora, waiting_lora_adapters=waiting, running_lora_adapters=running
        ).set(time.time())

    def _record_finished(self, fin: FinishedRequestStats) -> None:
        reason = fin.finish_reason if fin.finish_reason in self.success else "error"
        self.success[reason].inc()
        self.e2e.observe(fin.e2e_latency)
        self.queue_time.observe(fin.queue_time)
        self.inference_time.observe(fin.inference_time)
        self.prefill_time.observe(fin.prefill_time)
        self.decode_time.observe(fin.decode_time)
        self.req_prompt_tokens.observe(fin.num_prompt_tokens)
        self.req_generation_tokens.observe(fin.num_generation_tokens)
        if fin.max_tokens:
            self.req_max_tokens.observe(fin.max_tokens)
        self.req_n.observe(fin.n)
        self.req_preemptions.observe(fin.num_preemptions)
        if fin.num_generation_tokens > 1:
            self.tpot.observe(fin.decode_time / (fin.num_generation_tokens - 1))

    def _update_hit_ratio(self, it: IterationStats) -> None:
        """Hit ratio over the newest `hit_ratio_window` requests admitted (whole steps at the edge).

        Steps that looked up tokens without admitting a new request (a preempted request coming back)
        still count as entries, and the window never holds more than `hit_ratio_window` entries either,
        so memory stays bounded and the gauge stays windowed whatever the producer reports.
        """
        new_requests = len(it.num_prompt_tokens_per_new_request)
        if it.prefix_cache_queries == 0 and new_requests == 0:
            return
        entry = (it.prefix_cache_queries, it.prefix_cache_hits, new_requests)
        self._window.append(entry)
        self._window_queries += entry[0]
        self._window_hits += entry[1]
        self._window_requests += entry[2]
        while len(self._window) > 1 and (
            self._window_requests - self._window[0][2] >= self._window_size
            or len(self._window) > self._window_size
        ):
            q, h, r = self._window.popleft()
            self._window_queries -= q
            self._window_hits -= h
            self._window_requests -= r
        queries = self._window_queries
        self.hit_ratio.set(self._window_hits / queries if queries else 0.0)

    @property
    def hit_ratio_window_steps(self) -> int:
        """How many step entries the hit-ratio window holds now (bounded by `hit_ratio_window`)."""
        return len(self._window)

    def _record_offload(self, s: SchedulerStats, it: IterationStats) -> None:
        for tier, values in (s.offload or {}).items():
            for key, value in values.items():
                if key in self._offload_gauges:
                    self._offload_gauges[key].labels(**self.labels, tier=tier).set(value)
                elif key in self._offload_counters:
                    last = self._offload_last.get((tier, key), 0.0)
                    delta = value - last if value >= last else value  # a reset starts over
                    self._offload_last[(tier, key)] = value
                    _inc(self._offload_counters[key].labels(**self.labels, tier=tier), delta)
        for tier, values in (getattr(it, "offload", None) or {}).items():
            for key, value in values.items():
                if key in self._offload_histograms:
                    hist = self._offload_histograms[key].labels(**self.labels, tier=tier)
                    for v in value if isinstance(value, (list, tuple)) else [value]:
                        hist.observe(v)
                elif key in self._offload_counters:
                    _inc(self._offload_counters[key].labels(**self.labels, tier=tier), value)

    # ------------------------------------------------------------ server side

    def step_failed(self, error: BaseException | None = None) -> None:
        """Count an engine step that raised (AsyncEngine calls this from its loop thread)."""
        self._step_failures.inc()

    def admission_rejected(self, reason: str) -> None:
        self._rejections.labels(**self.labels, reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _inc(counter: Any, value: float) -> None:
    if value and value > 0:
        counter.inc(value)


_OFFLOAD_DOCS = {
    "offload_bytes_used": "Bytes held by an offload tier.",
    "offload_bytes_capacity": "The offload tier's byte budget.",
    "offload_blocks": "KV blocks held by an offload tier.",
    "offload_queries": "Prompt tokens looked up in an offload tier.",
    "offload_hits": "Prompt tokens found in an offload tier.",
    "offload_load_bytes": "Bytes loaded from an offload tier.",
    "offload_store_bytes": "Bytes stored to an offload tier.",
    "offload_load_seconds": "Latency of loading blocks from an offload tier.",
    "offload_store_seconds": "Latency of storing blocks to an offload tier.",
    "offload_verification_failures": "Blocks that failed verification when read from a tier (served as a miss).",
    "offload_evictions": "Blocks evicted from an offload tier.",
}
