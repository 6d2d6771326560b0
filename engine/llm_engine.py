"""LLMEngine: the synchronous engine core (scheduler + KV cache manager + model runner + detokenizer).

    engine = LLMEngine(EngineConfig(...), stat_loggers=[...])
    engine.add_request(request_id, prompt, params, arrival_time=None, priority=0)
    while engine.has_unfinished_requests():
        for out in engine.step(): ...          # cumulative RequestOutputs of requests that progressed

Not thread-safe: one thread drives step(); other threads hand requests to that thread (AsyncEngine).
`add_request` raises ValueError for bad input, e.g. "This model's maximum context length is N tokens;
the prompt has M tokens". `max_tokens` beyond the remaining context is clamped; None = up to the limit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from pagoda.engine.attention import get_attention_backend
from pagoda.engine.config import EngineConfig
from pagoda.engine.detokenizer import Detokenizer, check_stop_strings, visible_text
from pagoda.engine.kv_cache.manager import KVCacheManager
from pagoda.engine.loader import load_model, load_tokenizer, model_fingerprint, resolve_model
from pagoda.engine.memory import cpu_kv_cache_bytes
from pagoda.engine.model_runner import ModelRunner, kv_torch_dtype
from pagoda.engine.models.config import ModelConfig
from pagoda.engine.offload import build_offload
from pagoda.engine.outputs import CompletionOutput, RequestOutput
from pagoda.engine.request import Request, Sequence, now
from pagoda.engine.sampler import SamplingRow, sample
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.scheduler import Scheduler, SchedulerOutput
from pagoda.engine.sizing.fit import fit_max_model_len
from pagoda.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats, StatLogger

log = logging.getLogger("pagoda.engine")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}  # fmt: skip


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but no CUDA GPU is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # the fastest and most exact choice on CPUs without bf16 matrix units
    return (
        _DTYPES.get(checkpoint_dtype or "", torch.bfloat16)
        if checkpoint_dtype != "float32"
        else torch.bfloat16
    )


class LLMEngine:
    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger] | None = None) -> None:
        self.config = config
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.device = resolve_device(config.device)
        path = resolve_model(config.model)
        self.model_path = path
        self.model_config = ModelConfig.from_dir(path)
        mc = self.model_config
        self.dtype = resolve_dtype(config.dtype, self.device, mc.torch_dtype)
        self.model_name = config.served_model_name or (config.model or "SmolLM2-135M-Instruct")
        self.tokenizer = load_tokenizer(path)
        self.detokenizer = Detokenizer(self.tokenizer)
        backend = get_attention_backend(config.attention_backend, self.device)
        self.attention_backend = backend.name
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.model, _ = load_model(path, self.dtype, self.device, backend)
        self.fingerprint = model_fingerprint(path)

        kv_dtype = kv_torch_dtype(config.kv_cache_dtype, self.dtype)
        elem = torch.empty((), dtype=kv_dtype).element_size()
        self.kv_bytes_per_token = mc.kv_bytes_per_token(elem)
        block_size = config.block_size
        weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        kv_memory, activation_bytes = self._kv_memory_bytes(weights_bytes)
        self.max_model_len = fit_max_model_len(
            config.max_model_len,
            mc.max_position_embeddings,
            self.kv_bytes_per_token,
            kv_memory,
            block_size,
            weights_bytes=weights_bytes,
            activation_bytes=activation_bytes,
            device=self.device.type,
        )
        config.max_model_len = self.max_model_len
        num_blocks = max(kv_memory // (self.kv_bytes_per_token * block_size), 1)
        self.num_blocks = int(num_blocks)
        self.max_model_len_fitted = self.num_blocks * block_size
        if config.max_num_batched_tokens is None:
            base = 2048
            config.max_num_batched_tokens = (
                base if config.enable_chunked_prefill else max(base, self.max_model_len)
            )
        elif not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be at least max_model_len "
                f"({self.max_model_len}) when chunked prefill is off"
            )

        self.kv = KVCacheManager(
            self.num_blocks,
            block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            extra_keys=(self.fingerprint, str(kv_dtype), str(block_size)),
        )
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
        )
        self.runner = ModelRunner(
            self.model,
            num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            num_blocks=self.num_blocks,
            block_size=block_size,
            kv_dtype=kv_dtype,
            device=self.device,
        )
        self.offload = build_offload(
            config, self.kv, self.runner.kv_caches, identity=f"{self.fingerprint}|{kv_dtype}|{block_size}"
        )
        self.scheduler.offload = self.offload
        self.scheduler.preemption_mode = config.preemption_mode
        eos = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.requests: dict[str, Request] = {}
        self._aborted_outputs: list[RequestOutput] = []
        self._pending_finished: list[FinishedRequestStats] = []
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %s), max_model_len %d, max concurrency %.1fx at full length",
            self.num_blocks, block_size, kv_memory / 2**20, kv_dtype, self.max_model_len,
            self.num_blocks * block_size / self.max_model_len,
        )  # fmt: skip

    # ---- memory -------------------------------------------------------------------------------------
    def _kv_memory_bytes(self, weights_bytes: int) -> tuple[int, int]:
        """KV bytes to allocate, and the activation reserve that was measured (CUDA) or assumed (CPU)."""
        cfg = self.config
        if cfg.kv_cache_memory_bytes is not None:
            return int(cfg.kv_cache_memory_bytes), 0
        if self.device.type != "cuda":
            return cpu_kv_cache_bytes(), 0
        activation = self._profile_activation_peak()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * cfg.gpu_memory_utilization - used_by_others - weights_bytes - activation
        return max(int(budget), 0), activation

    def _profile_activation_peak(self) -> int:
        """Run one dummy step of max_num_batched_tokens tokens against a one-block cache; return its peak."""
        mc = self.model_config
        tokens = min(self.config.max_num_batched_tokens or 2048, mc.max_position_embeddings)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        probe = ModelRunner(
            self.model, num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim, num_blocks=-(-tokens // self.config.block_size), block_size=self.config.block_size,
            kv_dtype=self.dtype, device=self.device,
        )  # fmt: skip
        params = SamplingParams(max_tokens=1)
        req = Request("profile", None, [0] * tokens, params, 1, now())
        from pagoda.engine.scheduler import ScheduledSeq

        table = list(range(probe.kv_caches[0].kv.shape[1]))
        probe.execute([ScheduledSeq(req, req.seqs[0], tokens)], [table])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del probe
        torch.cuda.empty_cache()
        return int(peak)

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
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.tokenizer(prompt).input_ids
            elif prompt is not None:
                prompt_token_ids = list(prompt)
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has {n} tokens "
                f"(at least one token must be left for the output)"
            )
        room = self.max_model_len - n
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        req = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            max_tokens=max_tokens,
            arrival_time=arrival_time if arrival_time is not None else now(),
            priority=priority,
        )
        self.requests[request_id] = req
        self.scheduler.add_request(req)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            for seq in req.seqs:
                if not seq.finished:
                    seq.finish_reason = "abort"
            self.scheduler.finish_request(req)
            self._record_finished(req)
            self._aborted_outputs.append(self._make_output(req))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def close(self) -> None:
        """Finish queued disk-tier writes and release the tier's directory lock (idempotent)."""
        if self.offload is not None:
            self.offload.close()

    def add_stat_logger(self, logger: StatLogger) -> None:
        self.stat_loggers.append(logger)

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted_outputs = self._aborted_outputs, []
        sched = self.scheduler.schedule()
        it = IterationStats(
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=sched.prefix_queries,
            prefix_cache_hits=sched.prefix_hits,
        )
        if sched.prefix_hits:
            it.cached_tokens_by_source["device"] = sched.prefix_hits
        if self.offload is not None:
            self.offload.save_evicted()  # before anything writes KV into the reused blocks
            loaded, it.offload = self.offload.take_step_stats()
            it.cached_tokens_by_source.update(loaded)
        if not sched.empty:
            outputs.extend(self._run(sched, it))
        it.finished_requests, self._pending_finished = self._pending_finished, []
        self._emit_stats(it)
        return outputs

    def _run(self, sched: SchedulerOutput, it: IterationStats) -> list[RequestOutput]:
        step_start = now()
        self.runner.copy_blocks(self.kv.take_pending_copies())
        tables = [self.kv.get_block_table(s.seq.seq_id) for s in sched.scheduled]
        logits = self.runner.execute(sched.scheduled, tables)
        for s in sched.scheduled:
            seq = s.seq
            start = seq.num_computed_tokens
            it.num_prompt_tokens += max(0, min(seq.num_prompt_tokens, start + s.num_new_tokens) - start)
            if s.request.metrics.first_scheduled_time is None:
                s.request.metrics.first_scheduled_time = step_start
                if s.request.num_cached_tokens == 0:
                    s.request.num_cached_tokens = start
        self.scheduler.advance(sched)

        # One sampling row per sequence; a request with n > 1 forks when its prompt is done.
        targets: list[tuple[Request, Sequence, int]] = []
        row = 0
        for s in sched.scheduled:
            if not s.samples:
                continue
            req = s.request
            targets.append((req, s.seq, row))
            if req.params.n > 1 and not req.forked:
                for child in req.fork_children():
                    self.kv.fork(s.seq.seq_id, child.seq_id)
                    targets.append((req, child, row))
            row += 1
        if not targets:
            return []
        rows = [
            SamplingRow(
                params=req.params,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=seq.output_token_ids,
                generator=seq.generator,
                stop_ids=([] if req.params.ignore_eos else self.eos_token_ids) + req.params.stop_token_ids,
            )
            for req, seq, _ in targets
        ]
        result = sample(logits[[t[2] for t in targets]], rows)
        t_now = now()
        touched: dict[str, Request] = {}
        for (req, seq, _), tok, lp, top in zip(
            targets, result.token_ids, result.logprobs, result.top_logprobs, strict=True
        ):
            self._append_token(req, seq, tok, lp, top, t_now, it)
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            if req.finished:
                self.scheduler.finish_request(req)
                self.requests.pop(req.request_id, None)
                self._record_finished(req)
            outputs.append(self._make_output(req))
        return outputs

    def _append_token(self, req: Request, seq: Sequence, tok: int, lp: float, top, t_now: float, it) -> None:
        params = req.params
        seq.token_ids.append(tok)
        seq.cumulative_logprob += lp
        if params.logprobs is not None:
            for tid, entry in top.items():
                entry.decoded_token = self.tokenizer.decode([tid])
            seq.logprobs.append(top)
        it.num_generation_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = t_now
            if seq.index == 0 and req.metrics.first_token_time is None:
                req.metrics.first_token_time = t_now
                it.time_to_first_tokens.append(t_now - req.arrival_time)
        elif seq.index == 0:
            it.inter_token_latencies.append(t_now - seq.last_token_time)
        seq.last_token_time = t_now
        req.metrics.last_token_time = t_now

        n_out = seq.num_output_tokens
        if n_out >= params.min_tokens:
            if tok in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", tok
            elif not params.ignore_eos and tok in self.eos_token_ids:
                seq.finish_reason = "stop"
        if not seq.finished:
            delta = self.detokenizer.append(seq, params)
            check_stop_strings(seq, params, len(delta))
        if not seq.finished and (n_out >= req.max_tokens or seq.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"
        if seq.finished:
            self.scheduler.free_finished_seq(seq)

    # ---- outputs and stats --------------------------------------------------------------------------
    def _make_output(self, req: Request) -> RequestOutput:
        comps = [
            CompletionOutput(
                index=seq.index,
                text=visible_text(seq, req.params),
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=seq.logprobs if req.params.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in req.seqs
        ]
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
        kv = self.kv
        return SchedulerStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage,
            num_blocks_total=kv.num_blocks,
            num_blocks_free=kv.num_free_blocks - kv.num_cached_blocks,
            num_blocks_cached=kv.num_cached_blocks,
            offload=self.offload.snapshot() if self.offload is not None else {},
        )

    def _emit_stats(self, it: IterationStats) -> None:
        if not self.stat_loggers:
            return
        stats = self.get_scheduler_stats()
        for logger in self.stat_loggers:
            logger.record(stats, it)

    def kv_waste(self) -> float:
        """Allocated-but-unfilled KV slots over allocated slots, across running sequences."""
        allocated = filled = 0
        for req in self.scheduler.running:
            for seq in req.active_seqs:
                if seq.has_blocks:
                    allocated += len(self.kv.get_block_table(seq.seq_id)) * self.kv.block_size
                    filled += seq.num_computed_tokens
        return 0.0 if allocated == 0 else 1.0 - filled / allocated
