"""LLMEngine: the synchronous engine core (scheduler + KV cache manager + model runner + detokenizer).

    engine = LLMEngine(EngineConfig(...), stat_loggers=[...])
    engine.add_request(request_id, prompt, params, arrival_time=None, priority=0)
    while engine.has_unfinished_requests():
        for delta in engine.step(): ...        # what each request gained this step (RequestOutput.add)

A step is the scheduler's plan, the runner's execution of it, and the scheduler's update from the result;
the engine only validates input, detokenizes and reports. Not thread-safe: one thread drives step(); other
threads hand requests to that thread (AsyncEngine). `add_request` raises ValueError for bad input, e.g.
"This model's maximum context length is N tokens; the prompt has M tokens". `max_tokens` beyond the
remaining context is clamped; None = up to the limit. Arrival times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

import torch
from pagoda.engine.attention import get_attention_backend
from pagoda.engine.config import EngineConfig
from pagoda.engine.decode_graphs import capture_sizes
from pagoda.engine.detokenizer import Detokenizer, check_stop_strings, visible_text
from pagoda.engine.distributed.parallel_state import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    kv_heads_of_rank,
)
from pagoda.engine.distributed.shard import rank_device, share_cpu_threads
from pagoda.engine.distributed.workers import Allocate, Profile, TPWorkers, free_tcp_port
from pagoda.engine.kv_cache.hashing import cache_identity
from pagoda.engine.kv_cache.ops import SaveBlock
from pagoda.engine.kv_cache.streaming import StreamingDefaults, resolve_streaming
from pagoda.engine.loader import load_model, load_tokenizer, model_fingerprint, resolve_model
from pagoda.engine.model_runner import ModelRunner, kv_bytes_per_token, kv_torch_dtype
from pagoda.engine.models.config import ModelConfig
from pagoda.engine.offload import build_offload
from pagoda.engine.outputs import CompletionOutput, RequestOutput
from pagoda.engine.request import Request, Sequence, now
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.scheduler import CacheConfig, Scheduler, SchedulerConfig, SchedulerOutput, SeqUpdate
from pagoda.engine.sizing.engine_plan import (
    engine_plan,
    max_kv_heads_per_rank,
    profile_tokens,
    resolve_dtype_name,
)
from pagoda.engine.sizing.gpus import check_dtypes
from pagoda.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats, StatLogger
from pagoda.kernels.cpu import loader as cpu_kernels

log = logging.getLogger("pagoda.engine")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but no CUDA GPU is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """The torch dtype of ``--dtype name`` (the sizing module's rule, so dry runs size what runs)."""
    cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return _DTYPES[resolve_dtype_name(name, device.type, checkpoint_dtype, cc)]


def check_device(device: torch.device, dtype: torch.dtype, kv_cache_dtype: str) -> None:
    """Refuse at start-up what this GPU cannot run (UnsupportedOnGPU, exit code 2), before anything else."""
    if device.type == "cuda":
        name, cc = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
        check_dtypes(name, cc, str(dtype).removeprefix("torch."), kv_cache_dtype)


class LLMEngine:
    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger] | None = None) -> None:
        self.config = config
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.device = resolve_device(config.device)
        path = resolve_model(config.model, config.revision)
        self.model_path = path
        self.model_config = ModelConfig.from_dir(path)
        mc = self.model_config
        self.dtype = resolve_dtype(config.dtype, self.device, mc.torch_dtype)
        check_device(self.device, self.dtype, config.kv_cache_dtype)
        self.model_name = config.served_model_name or (config.model or "SmolLM2-135M-Instruct")
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(path)
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        self.workers = self._start_tensor_parallel(path)
        try:
            self._build(config, path, mc)
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown()
                destroy_tensor_parallel()
            raise

    def _build(self, config: EngineConfig, path, mc: ModelConfig) -> None:
        """Everything after the ranks are up: model, KV cache sizing and allocation, scheduler."""
        backend = get_attention_backend(config.attention_backend, self.device)
        self.attention_backend = backend.name
        # The CPU kernels this engine runs, loaded (and logged) at start-up rather than in its first step.
        self.cpu_kernels = cpu_kernels.current() if self.device.type == "cpu" else None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        model, _ = load_model(path, self.dtype, self.device, backend)
        self.fingerprint = model_fingerprint(path)
        eos = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        kv_heads = len(kv_heads_of_rank(mc.num_attention_heads, mc.num_key_value_heads))
        size = config.tensor_parallel_size
        self.runner = ModelRunner(
            model,
            num_layers=mc.num_hidden_layers,
            num_kv_heads=kv_heads,
            head_dim=mc.head_dim,
            device=self.device,
            eos_token_ids=self.eos_token_ids,
        )
        self.runner.peers = self.workers

        kv_dtype = kv_torch_dtype(config.kv_cache_dtype, self.dtype)
        # Per rank: each holds the KV of its own heads (INT8: and their scales); the rank with the most
        # sizes the blocks of all.
        most_heads = max_kv_heads_per_rank(mc.num_attention_heads, mc.num_key_value_heads, size)
        self.kv_bytes_per_token = kv_bytes_per_token(mc.num_hidden_layers, most_heads, mc.head_dim, kv_dtype)
        block_size = config.block_size
        weights_bytes = self.runner.weights_bytes()
        # CUDA graphs: recorded after the cache is allocated, so their memory is measured first and left out
        recordable = self.device.type == "cuda" and backend.name == "triton" and not config.enforce_eager
        graph_sizes = tuple(capture_sizes(config.max_num_seqs)) if recordable else ()
        kv_memory, activation_bytes, device_memory = self._kv_memory_bytes(kv_dtype, graph_sizes)
        # The start-up arithmetic `pagoda serve --dry-run` shares: same lengths, blocks and refusals.
        self.plan = engine_plan(
            config,
            model_max_len=mc.max_position_embeddings,
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_memory_bytes=kv_memory,
            weights_bytes=weights_bytes,
            activation_bytes=activation_bytes,
            device=self.device.type,
            **device_memory,
        )
        self.max_model_len = config.max_model_len = self.plan.max_model_len
        self.num_blocks = self.plan.num_blocks
        self.max_model_len_fitted = self.plan.max_model_len_fitted
        config.max_num_batched_tokens = self.plan.max_num_batched_tokens
        self.runner.allocate_kv_cache(self.num_blocks, block_size, kv_dtype)
        if self.workers is not None:
            self.workers.send(Allocate(self.num_blocks, block_size, kv_dtype))
        if graph_sizes:
            self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
        identity = cache_identity(self.fingerprint, self.dtype, kv_dtype, block_size)
        offload = (
            None
            if self.workers is not None
            else build_offload(
                config,
                self.runner.block_shape,
                kv_dtype,
                self.device,
                identity="|".join(identity),
            )
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                policy=config.scheduling_policy,
                preemption_mode=config.preemption_mode,
            ),
            CacheConfig(
                num_blocks=self.num_blocks,
                block_size=block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                enable_partial_prefix_reuse=config.enable_partial_prefix_reuse,
                extra_keys=identity,
            ),
            offload,
        )
        self.streaming_defaults = StreamingDefaults(
            config.kv_eviction,
            config.kv_sink_tokens,
            config.kv_window_tokens,
            config.kv_eviction_per_request,
            config.kv_eviction_max_tokens,
        )
        # Server-wide sink sizes that no request could use are refused at start, not on every request.
        resolve_streaming(None, self.streaming_defaults, self.max_model_len, block_size, 0)
        self._aborted_outputs: list[RequestOutput] = []
        self._pending_finished: list[FinishedRequestStats] = []
        self.serving_front_end = False  # set by AsyncEngine: this process also runs a server's event loop
        self._cpu_threads: int | None = None
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %s), max_model_len %d, max concurrency %.1fx at full length",
            self.num_blocks, block_size, kv_memory / 2**20, kv_dtype, self.max_model_len,
            self.num_blocks * block_size / self.max_model_len,
        )  # fmt: skip

    def _start_tensor_parallel(self, path) -> TPWorkers | None:
        """With tensor_parallel_size N > 1: check the model splits N ways, start ranks 1..N-1 and join
        them as rank 0 (this process then loads its own shard like any rank)."""
        size = self.config.tensor_parallel_size
        if size == 1:
            return None
        mc = self.model_config
        if mc.num_attention_heads < size:
            raise ValueError(
                f"tensor_parallel_size {size} exceeds the model's {mc.num_attention_heads} attention heads"
            )
        if self.config.kv_offload_disk_dir or self.config.kv_offload_host_bytes:
            log.warning("KV offload tiers are not supported with tensor parallelism yet; tiers are off")
        init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
        workers = TPWorkers(dataclasses.replace(self.config, model=str(path)), size, init_method)
        self.device = rank_device(self.device, 0, size)
        share_cpu_threads(self.device, size)
        try:
            init_tensor_parallel(0, size, init_method, self.device)
        except Exception:
            workers.shutdown()
            raise
        log.info("tensor parallelism: %d ranks (%s)", size, "nccl" if self.device.type == "cuda" else "gloo")
        return workers

    @property
    def dead_reason(self) -> str | None:
        """Why the engine can no longer serve (a tensor-parallel rank died), or None."""
        return self.workers.dead_reason if self.workers is not None else None

    # ---- read-only views (the scheduler owns the state) ---------------------------------------------
    @property
    def kv(self):
        """The KV cache manager, for inspection; only the scheduler writes to it."""
        return self.scheduler.kv

    @property
    def offload(self):
        return self.scheduler.offload

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    # ---- memory -------------------------------------------------------------------------------------
    def _kv_memory_bytes(self, kv_dtype: torch.dtype, graph_sizes: tuple[int, ...]) -> tuple[int, int, dict]:
        """KV bytes to allocate, the activation reserve that was measured (CUDA) or assumed (CPU), and the
        device's memory as measured (for the start-up memory profile): every rank profiles, the least
        budget wins."""
        cfg = self.config
        if cfg.kv_cache_memory_bytes is not None:
            return int(cfg.kv_cache_memory_bytes), 0, {"source": "--kv-cache-memory-bytes"}
        tokens = profile_tokens(cfg.max_num_batched_tokens, self.model_config.max_position_embeddings)
        max_len = self.model_config.max_position_embeddings  # the plan's length is not known yet: at most
        if isinstance(cfg.max_model_len, int):
            max_len = min(max_len, cfg.max_model_len)
        request = Profile(
            tokens,
            cfg.block_size,
            kv_dtype,
            cfg.gpu_memory_utilization,
            cfg.profile_on_cpu,
            graph_sizes,
            max_len,
        )
        budget = self.runner.measure_kv_budget(request)
        ranks = {"rank_kv_cache_bytes": budget.rank_kv_bytes} if self.workers is not None else {}
        return budget.kv_bytes, budget.activation_bytes, {**budget.device_memory, **ranks}

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        params = params or SamplingParams()
        params.validate()
        vocab = self.model_config.vocab_size
        check_ids = getattr(params, "validate_token_ids", None)
        if check_ids is not None:
            check_ids(vocab)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.stop and self.detokenizer is None:
            raise ValueError(
                "stop strings need the tokenizer; the engine was started with skip_tokenizer_init"
            )
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError(
                        "text prompts need the tokenizer; the engine was started with skip_tokenizer_init: "
                        "pass prompt_token_ids"
                    )
                prompt_token_ids = self.tokenizer(prompt).input_ids
            elif prompt is not None:
                prompt_token_ids = list(prompt)
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if any(
            (not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab for t in prompt_token_ids
        ):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has {n} tokens "
                f"(at least one token must be left for the output)"
            )
        room = self.max_model_len - n
        streaming = resolve_streaming(
            params,
            self.streaming_defaults,
            self.max_model_len,
            self.scheduler.kv.block_size,
            n,
            params.max_tokens,
        )
        if streaming is not None and params.max_tokens is not None:
            max_tokens = params.max_tokens  # sinks + window: the context never fills up
        else:
            max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        req = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            max_tokens=max_tokens,
            arrival_time=arrival_time if arrival_time is not None else now(),
            priority=priority,
            eos_token_ids=frozenset(self.eos_token_ids),
            kv_streaming=streaming.as_tuple if streaming is not None else None,
        )
        self.scheduler.add_request(req)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for req in self.scheduler.abort_requests(ids):
            self._record_finished(req)
            self._aborted_outputs.append(self._make_output(req, list(req.seqs), {}, {}))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def demote_cached(self, tier: str = "host") -> int:
        """Move every unreferenced cached device block down to ``tier`` ("host", or "disk", which also drains
        the host tier) and forget it on the device; returns the blocks moved. For benchmarks and draining an
        idle engine; refused (0) while any block is in use."""
        kv, offload = self.scheduler.kv, self.scheduler.offload
        if offload is None:
            raise ValueError(f"no {tier} tier is configured")
        if kv.num_used_blocks > 0:
            return 0
        everything = [SaveBlock(b.block_id, h) for h, b in kv.block_pool.cached.items()]
        saved = self.runner.apply_kv_ops([*kv.take_ops(), *everything])
        offload.store_to(tier, saved)
        kv.reset_prefix_cache()
        return len(everything)

    def close(self) -> None:
        """Write the device's cached blocks and the host tier to the disk tier (when there is one), finish
        queued disk writes and release the tier's directory lock. Idempotent."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self.workers is not None:
            self.workers.shutdown()
            destroy_tensor_parallel()
        offload = self.scheduler.offload
        if offload is None:
            return
        if offload.disk is not None and offload.disk.enabled:
            kv = self.scheduler.kv
            saved = self.runner.apply_kv_ops([*kv.take_ops(), *offload.persist_ops(kv)])
            for block_hash, data in saved:
                offload.disk.put(block_hash, data)
        offload.close()

    # Steps of at most this many new tokens (decodes of one or two streams) leave a core to a server's front
    # end. They are memory-bound, so the core costs little (offline 14.2 -> 16.4 ms per token for one stream on
    # 2 cores), while every token's hand-off to the event loop no longer preempts a thread of the OpenMP team:
    # one served stream went from 22-23 to 17-18 ms per token. Prefills and larger batches are compute-bound
    # and get every core. vLLM's CPU build reserves a core for its front end by default.
    FRONT_END_CORE_MAX_TOKENS = 2

    def _cpu_threads_for(self, sched: SchedulerOutput) -> None:
        """Serving on a CPU without tensor parallelism: one core fewer for a small step (OpenMP's thread count
        is per thread: this runs on the thread that steps the engine)."""
        if not self.serving_front_end or self.device.type != "cpu" or self.workers is not None:
            return
        if self._cpu_threads is None:
            self._cpu_threads = torch.get_num_threads()
        small = sum(s.num_new_tokens for s in sched.scheduled) <= self.FRONT_END_CORE_MAX_TOKENS
        threads = max(1, self._cpu_threads - 1) if small else self._cpu_threads
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def add_stat_logger(self, logger: StatLogger) -> None:
        self.stat_loggers.append(logger)

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan, execute, update; returns one delta per request that progressed or ended."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        sched = self.scheduler.schedule()
        self._cpu_threads_for(sched)
        result = self.runner.execute(sched)
        updates = self.scheduler.update_from_output(sched, result, self._check_stop)
        outputs.extend(self._outputs(updates))  # records this step's finished requests for the stats
        it = self._iteration_stats(sched, updates)
        self._emit_stats(it)
        return outputs

    def _check_stop(self, req: Request, seq: Sequence) -> None:
        if self.detokenizer is None:
            return
        delta = self.detokenizer.append(seq, req.params)
        check_stop_strings(seq, req.params, len(delta))

    # ---- outputs and stats --------------------------------------------------------------------------
    def _outputs(self, updates: list[SeqUpdate]) -> list[RequestOutput]:
        by_request: dict[str, tuple[Request, list[Sequence], dict[int, int], dict[int, dict]]] = {}
        for u in updates:
            req, seqs, tokens, tops = by_request.setdefault(u.request.request_id, (u.request, [], {}, {}))
            seqs.append(u.seq)
            tokens[u.seq.index] = u.token_id
            if u.top_logprobs is not None:
                tops[u.seq.index] = u.top_logprobs
        outputs = []
        for req, seqs, tokens, tops in by_request.values():
            if req.finished:
                self._record_finished(req)
            outputs.append(self._make_output(req, seqs, tokens, tops))
        return outputs

    def _make_output(
        self, req: Request, seqs: list[Sequence], tokens: dict[int, int], tops: dict[int, dict]
    ) -> RequestOutput:
        """The delta of ``seqs``: the token each got this step (if any) and its newly visible text."""
        want_logprobs = req.params.logprobs is not None
        comps = []
        for seq in seqs:
            new_ids = [tokens[seq.index]] if seq.index in tokens else []
            top = tops.get(seq.index)
            if top is not None and self.tokenizer is not None:
                for tid, entry in top.items():
                    if entry.decoded_token is None:
                        entry.decoded_token = self.tokenizer.decode([tid])
            visible = visible_text(seq, req.params)
            text = visible[seq.num_sent_chars :] if len(visible) > seq.num_sent_chars else ""
            seq.num_sent_chars = max(seq.num_sent_chars, len(visible))
            comps.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(new_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=([top] if top is not None else []) if want_logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        finished = req.finished
        if finished and req.metrics.finished_time is None:
            req.metrics.finished_time = now()
        req.metrics.num_preemptions = req.num_preemptions
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=comps,
            finished=finished,
            num_cached_tokens=req.num_cached_tokens,
            metrics=req.metrics,
        )

    def _iteration_stats(self, sched: SchedulerOutput, updates: list[SeqUpdate]) -> IterationStats:
        it = IterationStats(
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=sched.prefix_queries,
            prefix_cache_hits=sched.prefix_hits,
            num_prompt_tokens_per_new_request=list(sched.new_request_prompt_lens),
        )
        if sched.prefix_hits:
            it.cached_tokens_by_source["device"] = sched.prefix_hits
        offload = self.scheduler.offload
        if offload is not None:
            loaded, it.offload = offload.take_step_stats()
            it.cached_tokens_by_source.update(loaded)
        for s in sched.scheduled:
            prompt = s.seq.num_prompt_tokens
            it.num_prompt_tokens += max(0, min(prompt, s.start + s.num_new_tokens) - s.start)
        it.num_generation_tokens = len(updates)
        for u in updates:
            if u.seq.index != 0:
                continue
            if u.gap is None:
                it.time_to_first_tokens.append(u.seq.first_token_time - u.request.arrival_time)
            else:
                it.inter_token_latencies.append(u.gap)
        it.finished_requests, self._pending_finished = self._pending_finished, []
        return it

    def _record_finished(self, req: Request) -> None:
        m = req.metrics
        end = now()
        first_sched = m.first_scheduled_time or end
        first_tok = m.first_token_time or end
        reasons = [s.finish_reason for s in req.seqs]
        reason = "abort" if "abort" in reasons else ("length" if "length" in reasons else "stop")
        self._pending_finished.append(
            FinishedRequestStats(
                finish_reason=reason,
                e2e_latency=end - req.arrival_time,
                queue_time=first_sched - req.arrival_time,
                prefill_time=first_tok - first_sched,
                decode_time=end - first_tok,
                inference_time=end - first_sched,
                num_prompt_tokens=len(req.prompt_token_ids),
                num_generation_tokens=sum(s.num_output_tokens for s in req.seqs),
                max_tokens=req.max_tokens,
                n=req.params.n,
                num_preemptions=req.num_preemptions,
            )
        )

    def get_scheduler_stats(self) -> SchedulerStats:
        kv = self.scheduler.kv
        offload = self.scheduler.offload
        return SchedulerStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage,
            num_blocks_total=kv.num_blocks,
            num_blocks_free=kv.num_free_blocks - kv.num_cached_blocks,
            num_blocks_cached=kv.num_cached_blocks,
            offload=offload.snapshot() if offload is not None else {},
        )

    def _emit_stats(self, it: IterationStats) -> None:
        if not self.stat_loggers:
            return
        stats = self.get_scheduler_stats()
        for logger in self.stat_loggers:
            logger.record(stats, it)

    def kv_waste(self) -> float:
        """Allocated-but-unfilled KV slots over allocated slots, across running sequences."""
        return self.scheduler.kv_waste()
