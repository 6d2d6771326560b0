"""LLMEngine: the synchronous engine of the offline API, its three parts called in turn on one thread.

    engine = LLMEngine(EngineConfig(...), stat_loggers=[...])
    engine.add_request(request_id, prompt, params, arrival_time=None, priority=0)
    while engine.has_unfinished_requests():
        for delta in engine.step(): ...        # what each request gained this step (RequestOutput.add)

Input processing (engine/frontend/input_processor.py: validation, tokenization) -> the engine core
(engine/core/engine_core.py: schedule -> execute -> update) -> output processing (engine/frontend/output_processor.py:
detokenization, stop strings, deltas). A server runs the same three parts split across its event loop and
the core's own thread or process (engine/frontend/async_engine.py). `add_request` raises ValueError for bad input,
e.g. "This model's maximum context length is N tokens; the prompt has M tokens"; `max_tokens` beyond the
remaining context is clamped; None = up to the limit. Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagoda.engine.config import EngineConfig
from pagoda.engine.core.engine_core import EngineCore
from pagoda.engine.core.info import EngineInfo
from pagoda.engine.core.stats import StatLogger
from pagoda.engine.frontend.input_processor import InputProcessor
from pagoda.engine.frontend.output_processor import OutputProcessor
from pagoda.engine.loader import load_tokenizer, resolve_model
from pagoda.engine.loader.tokenizer import tokenizer_path
from pagoda.engine.outputs import RequestOutput
from pagoda.engine.sampling_params import SamplingParams

__all__ = ["LLMEngine"]


class LLMEngine:
    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger] | None = None) -> None:
        self.config = config
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        path = resolve_model(config.model, config.revision)
        self.tokenizer = (
            None if config.skip_tokenizer_init else load_tokenizer(tokenizer_path(config.tokenizer, path))
        )
        self.core = EngineCore(config, tokenizer=self.tokenizer)
        self.input_processor = InputProcessor(self.core.info, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)

    # ---- the parts' facts, for callers that inspect the engine (tests, benchmarks) ------------------
    @property
    def info(self) -> EngineInfo:
        return self.core.info

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def scheduler(self):
        """The scheduler, for inspection; only the core's step writes to it."""
        return self.core.scheduler

    @property
    def kv(self):
        return self.core.scheduler.kv

    @property
    def runner(self):
        return self.core.runner

    @property
    def num_blocks(self) -> int:
        return self.core.num_blocks

    @property
    def kv_bytes_per_token(self) -> int:
        return self.core.kv_bytes_per_token

    @property
    def offload(self):
        return self.core.scheduler.offload

    @property
    def workers(self):
        """The tensor-parallel ranks 1..N-1 (None with one rank)."""
        return self.core.workers

    @property
    def model_config(self):
        return self.core.model_config

    @property
    def model_path(self):
        return self.core.model_path

    @property
    def dtype(self):
        return self.core.dtype

    def kv_waste(self) -> float:
        return self.core.kv_waste()

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
        lora: str | None = None,
    ) -> None:
        """``lora``: the name of a loaded LoRA adapter to run the request through (None: the base model)."""
        req = self.input_processor.process(
            request_id,
            prompt,
            params,
            prompt_token_ids=prompt_token_ids,
            arrival_time=arrival_time,
            priority=priority,
            lora=lora,
        )
        self.core.add_request(req)  # ValueError for a request id in use or an adapter not loaded
        self.output_processor.add_request(req, prompt if isinstance(prompt, str) else None)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """End them; each one's final delta (finish_reason "abort") comes with the next step."""
        self.core.abort_requests([request_ids] if isinstance(request_ids, str) else list(request_ids))

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter directory at ``path`` as ``name`` (ValueError when it cannot be served)."""
        self.core.load_lora_adapter(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        self.core.unload_lora_adapter(name)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.core.request_ids())

    def get_scheduler_stats(self):
        return self.core.get_scheduler_stats()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def demote_cached(self, tier: str = "host") -> int:
        return self.core.demote_cached(tier)

    def add_stat_logger(self, logger: StatLogger) -> None:
        self.stat_loggers.append(logger)

    def close(self) -> None:
        self.core.close()

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One core step, its outputs processed; returns one delta per request that progressed or ended."""
        out = self.core.step(stats=bool(self.stat_loggers))
        deltas, stops = self.output_processor.process(out.outputs)
        if stops:  # ended by a stop string: the core frees them before its next step
            self.core.finish_seqs(stops)
        if self.stat_loggers and out.iteration_stats is not None:
            it = out.iteration_stats
            stats = out.scheduler_stats
            if stops:
                it.finished_requests.extend(self.core.take_finished_stats())
                stats = self.core.get_scheduler_stats()
            for logger in self.stat_loggers:
                logger.record(stats, it)
        return deltas
