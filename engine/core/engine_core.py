"""EngineCore: the scheduler, the KV cache and the model runner; a step is schedule -> execute -> update.

    core = EngineCore(EngineConfig(...))
    core.add_request(EngineCoreRequest(...))     # from input processing: token ids, lengths resolved
    while core.has_unfinished_requests():
        out = core.step()                        # EngineCoreOutputs: each sequence's new token, stats

The core knows no text: input processing (engine/frontend/input_processor.py) hands it token ids and checked
parameters, output processing (engine/frontend/output_processor.py) detokenizes and applies stop strings, and tells
the core which sequences a stop string ended (`finish_seqs`). It runs on one thread (LLMEngine's caller, a
thread of the server, or the busy loop of its own process, engine/frontend/core_process.py); nothing else calls it.
Arrival times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch
from pagoda.engine.config import EngineConfig
from pagoda.engine.core.async_steps import InFlight, StepThread
from pagoda.engine.core.info import EngineInfo, LoRAAdapterInfo
from pagoda.engine.core.messages import CoreOutput, EngineCoreOutputs, EngineCoreRequest, SeqDelta
from pagoda.engine.core.scheduler import CacheConfig, Scheduler, SchedulerConfig, SeqUpdate
from pagoda.engine.core.stats import (
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
    SpecDecodingStats,
)
from pagoda.engine.distributed.parallel_state import (
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from pagoda.engine.kv_cache.block_pool import BlockPool
from pagoda.engine.kv_cache.hashing import cache_identity
from pagoda.engine.kv_cache.ops import SaveBlock
from pagoda.engine.kv_cache.publisher import KVEventPublisher
from pagoda.engine.kv_cache.streaming import StreamingDefaults, resolve_streaming
from pagoda.engine.kv_transfer.core import KVTransferCore, build_kv_transfer
from pagoda.engine.loader import load_tokenizer, model_fingerprint, resolve_model
from pagoda.engine.loader.generation_config import eos_token_ids as generation_eos_ids
from pagoda.engine.loader.generation_config import read_generation_config, sampling_defaults
from pagoda.engine.loader.gguf_quant import check_quantization
from pagoda.engine.loader.tokenizer import tokenizer_path
from pagoda.engine.lora.model import LoRAModel
from pagoda.engine.lora.registry import LoRAAdapter, LoRARegistry
from pagoda.engine.offload import build_offload
from pagoda.engine.request import Request, Sequence, now
from pagoda.engine.sizing.engine_plan import (
    engine_plan,
    kv_bytes_per_token,
    profile_tokens,
)
from pagoda.engine.sizing.kv_dtypes import kv_cache_dtype
from pagoda.engine.sizing.kv_split import engine_sliding_layout
from pagoda.engine.sizing.model_config import ModelConfig
from pagoda.engine.sizing.stages import max_stage_layers
from pagoda.engine.step import SchedulerOutput
from pagoda.engine.worker.decode_graphs import capture_sizes
from pagoda.engine.worker.draft_runner import DraftProposer
from pagoda.engine.worker.model_runner import kv_torch_dtype
from pagoda.engine.worker.pp_workers import check_pipeline, start_pipeline, uses_pipeline
from pagoda.engine.worker.rank import (
    build_rank,
    check_device,
    rank_device,
    resolve_device,
    resolve_dtype,
    share_cpu_threads,
)
from pagoda.engine.worker.rank_messages import Allocate, Profile
from pagoda.engine.worker.tp_workers import TPWorkers, free_tcp_port
from pagoda.kernels.cpu import loader as cpu_kernels

log = logging.getLogger("pagoda.engine")


def adapter_info(adapter: LoRAAdapter) -> LoRAAdapterInfo:
    return LoRAAdapterInfo(adapter.name, adapter.path, adapter.rank, adapter.cache_root.hex())


class EngineCore:
    """One model replica's compute and state. ``tokenizer`` adds its EOS id to the model's and gives the
    grammar engine its vocabulary (a core built without one loads it, unless ``skip_tokenizer_init``: then
    no structured outputs); ``publish_kv_events`` keeps the block-event
    log routers follow (engine/kv_cache/events.py)."""

    def __init__(
        self, config: EngineConfig, *, tokenizer: Any = None, publish_kv_events: bool = False
    ) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        path = resolve_model(config.model, config.revision)
        self.model_path = path
        self.model_config = ModelConfig.from_dir(path)
        mc = self.model_config
        check_quantization(config.quantization, path, mc, self.device)  # --quantization against the model
        self.dtype = resolve_dtype(config.dtype, self.device, mc.torch_dtype, mc.family.float16)
        check_device(self.device, self.dtype, config.kv_cache_dtype)
        self.model_name = config.served_model_name or (config.model or "SmolLM2-135M-Instruct")
        if tokenizer is None and not config.skip_tokenizer_init:
            tokenizer = load_tokenizer(tokenizer_path(config.tokenizer, path))
        self._closed = False
        self.workers = self._start_tensor_parallel(path)
        try:
            self._build(config, path, mc, tokenizer)
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown()
                destroy_tensor_parallel()
            raise
        self.kv_publisher = KVEventPublisher(self.scheduler) if publish_kv_events else None
        self.kv_transfer = self._start_kv_transfer()
        self.info = self._engine_info()

    def _build(self, config: EngineConfig, path, mc: ModelConfig, tokenizer: Any) -> None:
        """Everything after the ranks are up: model, KV cache sizing and allocation, scheduler."""
        # The CPU kernels this engine runs, loaded (and logged) at start-up rather than in its first step.
        self.cpu_kernels = cpu_kernels.current() if self.device.type == "cpu" else None
        generation = read_generation_config(config.generation_config, path)  # --generation-config
        self.generation_defaults = sampling_defaults(generation)
        eos = set(mc.eos_token_ids) | set(generation_eos_ids(generation))
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
        if tokenizer_eos is not None:
            eos.add(tokenizer_eos)
        self.eos_token_ids = sorted(eos)
        self._eos = frozenset(eos)
        self.runner = build_rank(config, path, mc, self.device, self.dtype, eos_token_ids=self.eos_token_ids)
        self.attention_backend = self.runner.attention_backend
        model = self.runner.model
        self.fingerprint = model_fingerprint(path)
        self.lora = LoRAModel(model, config.max_loras, config.max_lora_rank) if config.enable_lora else None
        size = config.tensor_parallel_size
        self.runner.peers = self.workers
        self.runner.lora = self.lora

        kv_dtype = kv_torch_dtype(config.kv_cache_dtype, self.dtype)
        # Per rank: each holds the KV of its own heads (INT8: and their scales); the rank with the most
        # sizes the blocks of all.
        kv = kv_cache_dtype(config.kv_cache_dtype, str(self.dtype).removeprefix("torch."))
        self.kv_bytes_per_token = kv_bytes_per_token(
            max_stage_layers(mc.num_hidden_layers, config.pipeline_parallel_size),  # a stage's layers
            mc.num_attention_heads,
            mc.num_key_value_heads,
            mc.head_dim,
            kv.element_bytes,
            size,
            kv.scale_bytes,
        )
        block_size = config.block_size
        weights_bytes = self.runner.weights_bytes()
        # CUDA graphs: recorded after the cache is allocated, so their memory is measured first and left out
        recordable = (
            self.device.type == "cuda"
            and self.attention_backend == "triton"
            and not config.enforce_eager
            and self.lora is None  # a step's LoRA segments are not part of a recording
            and config.pipeline_parallel_size == 1  # the pipeline's stages hand on activations eagerly
        )
        # The sliding layers' window group (engine/sizing/kv_split.py), decided as the dry run decides it.
        sliding, self.window_cache_reason = engine_sliding_layout(
            config, [mc.layer_sliding_window(i) for i in range(mc.num_hidden_layers)]
        )
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
            sliding=sliding,
            **device_memory,
        )
        self.max_model_len = config.max_model_len = self.plan.max_model_len
        self.num_blocks = self.plan.num_blocks
        self.max_model_len_fitted = self.plan.max_model_len_fitted
        config.max_num_batched_tokens = self.plan.max_num_batched_tokens
        window_blocks, window_layers = self.plan.num_window_blocks, self.plan.window_layers
        self.runner.allocate_kv_cache(self.num_blocks, block_size, kv_dtype, window_blocks, window_layers)
        if self.workers is not None:
            self.workers.send(Allocate(self.num_blocks, block_size, kv_dtype, window_blocks, window_layers))
        if graph_sizes:
            self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
        identity = cache_identity(self.fingerprint, self.dtype, kv_dtype, block_size)
        offload = (
            None
            if self.workers is not None or window_blocks  # a window group: no tier (engine_sliding_layout)
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
                max_loras=config.max_loras if self.lora is not None else 0,
            ),
            CacheConfig(
                num_blocks=self.num_blocks,
                block_size=block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                # sub-block reuse copies one pool's block; a window group runs without it
                enable_partial_prefix_reuse=config.enable_partial_prefix_reuse and not window_blocks,
                extra_keys=identity,
                window=self.plan.window,
                num_window_blocks=window_blocks,
            ),
            offload,
            self._structured_outputs(tokenizer),
            speculative=config.speculative,
            proposer=self._draft_proposer(config, mc),
        )
        self.streaming_defaults = StreamingDefaults(
            config.kv_eviction,
            config.kv_sink_tokens,
            config.kv_window_tokens,
            config.kv_eviction_per_request,
            config.kv_eviction_max_tokens,
            refused="the sliding layers' KV cache keeps only their window (--sliding-window-cache off allows it)"
            if window_blocks
            else "",
        )
        # Server-wide sink sizes that no request could use are refused at start, not on every request.
        resolve_streaming(None, self.streaming_defaults, self.max_model_len, block_size, 0)
        self.lora_registry = None
        if self.lora is not None:
            self.lora_registry = LoRARegistry(
                mc.num_hidden_layers,
                self.lora.shapes,
                config.max_lora_rank,
                (self.model_name,),
                max_adapters=config.lora_adapter_limit,
            )
            for name, adapter_path in config.lora_module_paths.items():
                self.lora_registry.load(name, adapter_path)
        self.kv_dtype = kv_dtype
        self._steps = self._step_thread(config)
        self._in_flight: InFlight | None = None
        self._aborted_outputs: list[CoreOutput] = []
        self._pending_finished: list[FinishedRequestStats] = []
        self.serving_front_end = False  # set when a server's front end shares this process's cores
        self._cpu_threads: int | None = None
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %s), max_model_len %d, max concurrency %.1fx at full length",
            self.num_blocks, block_size, kv_memory / 2**20, kv_dtype, self.max_model_len,
            self.plan.sequences_at_max_len if self._all_sliding else self.num_blocks * block_size / self.max_model_len,
        )  # fmt: skip
        if window_blocks:
            log.info(
                "KV window group: %d blocks for %d sliding layers (window %d), %d sequences of %d tokens fit",
                window_blocks, len(window_layers), self.plan.window, self.plan.sequences_at_max_len,
                self.max_model_len,
            )  # fmt: skip

    def _draft_proposer(self, config: EngineConfig, mc: ModelConfig) -> DraftProposer | None:
        """--speculative-config's draft model, loaded beside the target (None: n-gram or no speculation)."""
        spec = config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        target_tokens = self.num_blocks * config.block_size
        return DraftProposer.build(
            config, spec, mc, self.device, self.dtype, self.max_model_len, target_tokens
        )

    def _start_kv_transfer(self) -> KVTransferCore | None:
        """--kv-transfer-config: a producer serves its prefilled blocks, a consumer stages received ones for
        its scheduler's prefix lookup (engine/kv_transfer/core.py)."""
        config = self.config.kv_transfer
        if config is None:
            return None
        refused = (
            "tensor parallelism is on"
            if self.workers is not None
            else "pipeline parallelism is on"
            if self.config.pipeline_parallel_size > 1
            else "the sliding layers keep a window cache"
            if self.plan.num_window_blocks
            else ""
        )
        transfer = build_kv_transfer(
            config,
            identity="|".join(
                cache_identity(self.fingerprint, self.dtype, self.kv_dtype, self.config.block_size)
            ),
            block_shape=tuple(self.runner.block_shape),
            dtype=self.kv_dtype,
            block_size=self.config.block_size,
            prefix_caching=self.scheduler.kv.enable_prefix_caching,
            refused=refused,
        )
        if transfer is not None and transfer.staged is not None:
            self.scheduler.remote_blocks = transfer.staged
        return transfer

    def kv_transfer_stage(self, records: list[bytes], checksummed: bool = False) -> dict[str, Any]:
        """Verify and stage blocks a consumer received from a prefill engine (a utility call, before the
        request that uses them is added; ``checksummed``: the server checked their payloads already)."""
        if self.kv_transfer is None:
            raise ValueError("this engine has no --kv-transfer-config")
        return self.kv_transfer.stage(records, checksummed)

    def _export_kv(self, updates: list[SeqUpdate]) -> None:
        """Hold the prompt blocks of remote-decode prefills this step finished (nothing is in flight now)."""
        if self.kv_transfer is not None:
            self.kv_transfer.export_finished((u.request for u in updates), self.scheduler.kv, self.runner)

    def _step_thread(self, config: EngineConfig) -> StepThread | None:
        """With --async-scheduling: the thread steps' device sides run on (engine/core/async_steps.py).
        Not with tensor parallelism or LoRA (the ranks' step messages and the adapter slots are not yet
        safe to drive from a second thread): those engines step synchronously, with a warning."""
        if not config.async_scheduling:
            return None
        why = "tensor parallelism" if self.workers is not None else "LoRA" if self.lora is not None else ""
        if why:
            log.warning("--async-scheduling is not supported with %s yet; steps run synchronously", why)
            return None
        log.info("async scheduling: the next step is planned while this one runs")
        return StepThread(self.runner, self.device)

    def _structured_outputs(self, tokenizer: Any):
        """The grammar engine over this model's vocabulary (None without a tokenizer); it compiles on a
        thread of its own, never on the loop that steps this core."""
        if tokenizer is None:
            return None
        from pagoda.engine.structured_output.manager import StructuredOutputManager

        return StructuredOutputManager(tokenizer, self.model_config.vocab_size, self.eos_token_ids)

    def _start_tensor_parallel(self, path) -> TPWorkers | None:
        """With tensor_parallel_size N > 1: check the model splits N ways, start ranks 1..N-1 and join
        them as rank 0 (this process then loads its own shard like any rank)."""
        size = self.config.tensor_parallel_size
        if uses_pipeline(self.config):
            from pagoda.engine.models import get_model_class

            mc = self.model_config
            check_pipeline(self.config, mc, get_model_class(mc.architecture))
            if self.config.kv_offload_disk_dir or self.config.kv_offload_host_bytes:
                log.warning("KV offload tiers are not supported with pipeline parallelism yet; tiers are off")
            workers, self.device = start_pipeline(self.config, path, self.device, mc.num_hidden_layers)
            return workers
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

    def _engine_info(self) -> EngineInfo:
        cfg, kv = self.config, self.scheduler.kv
        offload = self.scheduler.offload
        cache_config = {
            "block_size": cfg.block_size,
            "cache_dtype": cfg.kv_cache_dtype,
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "num_gpu_blocks": self.num_blocks,
            "kv_cache_memory_bytes": cfg.kv_cache_memory_bytes,
        }
        return EngineInfo(
            model_name=str(self.model_name),
            max_model_len=int(self.max_model_len),
            vocab_size=int(self.model_config.vocab_size),
            block_size=int(cfg.block_size),
            num_blocks=int(self.num_blocks),
            kv_bytes_per_token=int(self.kv_bytes_per_token),
            max_model_len_fitted=self.max_model_len_fitted,
            tiers=("device", *(t.name for t in offload.tiers)) if offload is not None else ("device",),
            enable_prefix_caching=kv.enable_prefix_caching,
            kv_extra_keys=tuple(kv.extra_keys),
            kv_events_epoch=self.kv_publisher.log.epoch if self.kv_publisher is not None else None,
            streaming=self.streaming_defaults,
            eos_token_ids=tuple(self.eos_token_ids),
            generation_defaults={k: float(v) for k, v in self.generation_defaults.items()},
            max_logprobs=int(cfg.max_logprobs),
            tensor_parallel_size=int(cfg.tensor_parallel_size),
            device=self.device.type,
            dtype=str(self.dtype).removeprefix("torch."),
            cache_config=cache_config,
            cpu_kernels=(
                {"variant": self.cpu_kernels.variant, "origin": self.cpu_kernels.origin or "none"}
                if self.cpu_kernels is not None
                else None
            ),
            memory_profile=self.memory_profile(),
            lora_adapters=tuple(adapter_info(a) for a in self.lora_adapters()),
            num_speculative_tokens=spec.max_tokens if (spec := cfg.speculative) is not None else 0,
            kv_transfer=self.kv_transfer.info() if self.kv_transfer is not None else None,
        )

    def memory_profile(self) -> dict[str, Any]:
        """The start-up memory profile as JSON (weights, activation peak, KV allocated), for a supervisor
        to compare with its plan (GET /pagoda/memory)."""
        cfg = self.config
        out = self.plan.profile.to_dict()
        out.update(
            num_blocks=int(self.num_blocks),
            block_size=int(cfg.block_size),
            kv_bytes_per_token=int(self.kv_bytes_per_token),
            max_model_len=int(self.max_model_len),
            tensor_parallel_size=int(cfg.tensor_parallel_size),
            pipeline_parallel_size=int(cfg.pipeline_parallel_size),
        )
        return out

    # ---- memory -------------------------------------------------------------------------------------
    def _kv_memory_bytes(self, kv_dtype: torch.dtype, graph_sizes: tuple[int, ...]) -> tuple[int, int, dict]:
        """KV bytes to allocate, the activation reserve that was measured (CUDA) or assumed (CPU), and the
        device's memory as measured (for the start-up memory profile): every rank profiles, the least
        budget wins."""
        cfg = self.config
        if cfg.kv_cache_memory_bytes is not None:
            return int(cfg.kv_cache_memory_bytes), 0, {"source": "--kv-cache-memory-bytes"}
        max_len = self.model_config.max_position_embeddings  # the plan's length is not known yet: at most
        if isinstance(cfg.max_model_len, int):
            max_len = min(max_len, cfg.max_model_len)
        tokens = profile_tokens(
            cfg.max_num_batched_tokens,
            self.model_config.max_position_embeddings,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            max_model_len=cfg.max_model_len,
        )
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
    def add_request(self, req: EngineCoreRequest) -> None:
        """Admit a request input processing has checked; ValueError only for a request id in use."""
        adapter = self._lora_of(req.lora)
        self.scheduler.add_request(
            Request(
                request_id=req.request_id,
                prompt_token_ids=req.prompt_token_ids,
                params=req.params,
                max_tokens=req.max_tokens,
                arrival_time=req.arrival_time,
                priority=req.priority,
                eos_token_ids=self._eos,
                kv_streaming=tuple(req.kv_streaming) if req.kv_streaming is not None else None,
                lora=adapter,
            )
        )
        if req.kv_export and self.kv_transfer is not None:
            self.kv_transfer.expect(
                req.request_id, req.prompt_token_ids, adapter.cache_root if adapter is not None else None
            )

    # ---- LoRA adapters ------------------------------------------------------------------------------
    def _lora_of(self, name: str | None) -> LoRAAdapter | None:
        """The loaded adapter called ``name`` (None for None); ValueError when there is none."""
        if name is None:
            return None
        adapter = self.lora_registry.get(name) if self.lora_registry is not None else None
        if adapter is None:
            why = "" if self.lora_registry is not None else " (the engine was started without --enable-lora)"
            raise ValueError(f"LoRA adapter {name!r} is not loaded{why}")
        return adapter

    def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Read a PEFT adapter directory and serve it as ``name``: its `LoRAAdapterInfo` as a dict (it
        crosses the process boundary); ValueError when it cannot be served."""
        if self.lora_registry is None:
            raise ValueError("LoRA adapters need an engine started with --enable-lora")
        return dataclasses.asdict(adapter_info(self.lora_registry.load(name, path)))

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving ``name`` (KeyError when no adapter has it); requests already admitted finish with it."""
        if self.lora_registry is None:
            raise KeyError(f"The lora adapter '{name}' cannot be found.")
        adapter = self.lora_registry.unload(name)
        if not any(r.lora is adapter for r in self.scheduler.requests.values()):
            self.lora.release(adapter)

    def lora_adapters(self) -> list[LoRAAdapter]:
        return self.lora_registry.adapters() if self.lora_registry is not None else []

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End them (unknown ids are ignored); their final outputs come with the next step."""
        request_ids = list(request_ids)
        if self.kv_transfer is not None:
            self.kv_transfer.forget(request_ids)
        for req in self.scheduler.abort_requests(request_ids):
            self._record_finished(req)
            self._aborted_outputs.append(self._make_output(req, list(req.seqs), {}, {}))

    def finish_seqs(self, seqs: Iterable[tuple[str, int, str]]) -> None:
        """Finish sequences a stop string ended in output processing (the front end already sent their
        final text; no output comes back for them)."""
        for request_id, index, stop in seqs:
            req = self.scheduler.finish_seq(request_id, index, "stop", stop)
            if req is not None:
                self._record_finished(req)

    def take_finished_stats(self) -> list[FinishedRequestStats]:
        """Requests ended since the last step (by `finish_seqs`), for a caller that reports right away."""
        out, self._pending_finished = self._pending_finished, []
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    def num_requests(self) -> int:
        return len(self.scheduler.requests)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def check_invariants(self) -> str:
        """ "ok", or the first invariant that request state and the KV cache manager violate."""
        try:
            self.scheduler.check_invariants()
        except AssertionError as exc:
            return f"violated: {exc}"
        return "ok"

    def kv_events(self, since: int, epoch: str | None) -> dict[str, Any]:
        assert self.kv_publisher is not None, "this core publishes no block events"
        return self.kv_publisher.events_since(since, epoch)

    def kv_snapshot(self) -> dict[str, Any]:
        assert self.kv_publisher is not None, "this core publishes no block events"
        return self.kv_publisher.snapshot()

    def demote_cached(self, tier: str = "host") -> int:
        """Move every unreferenced cached device block down to ``tier`` ("host", or "disk", which also drains
        the host tier) and forget it on the device; returns the blocks moved. For benchmarks and draining an
        idle engine; refused (0) while any block is in use."""
        kv, offload = self.scheduler.kv, self.scheduler.offload
        if offload is None:
            raise ValueError(f"no {tier} tier is configured")
        if kv.num_used_blocks > 0:
            return 0
        self._settle_in_flight()  # a step of aborted requests only: its saves land first
        everything = [SaveBlock(b.block_id, h) for h, b in kv.block_pool.cached.items()]
        saved = self.runner.apply_kv_ops([*kv.take_ops(), *everything])
        offload.store_to(tier, saved)
        kv.reset_prefix_cache()
        return len(everything)

    def close(self) -> None:
        """Write the device's cached blocks and the host tier to the disk tier (when there is one), finish
        queued disk writes and release the tier's directory lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.kv_transfer is not None:
            self.kv_transfer.close()
        if self._steps is not None:
            self._settle_in_flight()
            self._steps.close()
        if self.workers is not None:
            self.workers.shutdown()
            destroy_tensor_parallel()
        if self.scheduler.structured is not None:
            self.scheduler.structured.close()
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
    # end. They are memory-bound, so the core costs little, while every token's hand-off to the front end no
    # longer preempts a thread of the OpenMP team (measurements: docs/benchmarks.md). Prefills and larger
    # batches are compute-bound and get every core. vLLM's CPU build reserves a core for its front end.
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

    # ---- the step -----------------------------------------------------------------------------------
    def step(self, stats: bool = True) -> EngineCoreOutputs:
        """Plan, execute, update: one output per request that progressed or ended, and the step's stats
        (``stats=False``: none, for a caller that reports none)."""
        if self._steps is not None:
            return self._step_async(stats)
        started = time.perf_counter()
        outputs, self._aborted_outputs = self._aborted_outputs, []
        sched = self.scheduler.schedule()
        self._cpu_threads_for(sched)
        result = self.runner.execute(sched)
        updates = self.scheduler.update_from_output(sched, result)
        self._export_kv(updates)
        self._grammar_failed(sched, outputs)
        return self._step_outputs(outputs, sched, updates, stats, started)

    def _step_async(self, stats: bool) -> EngineCoreOutputs:
        """Async scheduling: the outputs of the step in flight (one is submitted first if none is), with the
        next step already running when this returns. While the step in flight computes, the next one is
        planned, unless its tokens decide what comes next (`Scheduler.can_advance`): then it is planned
        after them. Sequences that the step ended (stop, EOS, max_tokens) leave the next step before it runs;
        ones ended while it ran (aborts, stop strings) get no token."""
        started = time.perf_counter()
        outputs, self._aborted_outputs = self._aborted_outputs, []
        scheduler = self.scheduler
        if self._in_flight is None:
            sched = scheduler.schedule()
            self._grammar_failed(sched, outputs)
            if sched.empty:  # nothing to compute: the ops (if any) and the stats, as a synchronous step
                updates = scheduler.update_from_output(sched, self.runner.execute(sched))
                return self._step_outputs(outputs, sched, updates, stats, started)
            self._submit(sched)
        current, nxt = self._in_flight, None
        if scheduler.can_advance(current.sched):
            scheduler.advance_in_flight(current.sched)
            current.advanced = True
            nxt = scheduler.schedule()
        self._in_flight = None
        try:
            result = current.future.result()
        except Exception:
            if nxt is not None:
                self._run_ops_of(nxt)
            raise
        updates = scheduler.update_from_output(current.sched, result, advanced=current.advanced)
        self._export_kv(updates)
        if nxt is None:
            nxt = scheduler.schedule()
        else:
            scheduler.drop_finished(nxt)
        self._grammar_failed(nxt, outputs)
        if nxt.empty:  # its ops (if any) run now; its counts join this step's stats
            scheduler.update_from_output(nxt, self.runner.execute(nxt))
            _add_counts(current.sched, nxt)
        else:
            self._submit(nxt)
        return self._step_outputs(outputs, current.sched, updates, stats, started)

    def _submit(self, sched: SchedulerOutput) -> None:
        self._cpu_threads_for(sched)
        self._in_flight = self._steps.submit(sched)

    def _run_ops_of(self, planned: SchedulerOutput) -> None:
        """A step that failed leaves the step planned after it unrun: its cache writes (loads and copies the
        prefix index already counts on, saves) still run, so the index never names blocks never written."""
        try:
            ops_only = SchedulerOutput(kv_ops=planned.kv_ops)
            self.scheduler.update_from_output(ops_only, self.runner.execute(ops_only))
        except Exception:  # noqa: BLE001 - the step's own failure is the one to report
            log.exception("the cache writes planned after a failed step failed too")

    def _settle_in_flight(self) -> None:
        """Finish the step in flight and take in its results (blocks saved for the tiers included); its
        outputs are dropped: only for a core that stops, or whose requests have all ended."""
        current, self._in_flight = self._in_flight, None
        if current is not None and current.future.exception() is None:
            self.scheduler.update_from_output(current.sched, current.future.result(), current.advanced)

    def _grammar_failed(self, sched: SchedulerOutput, outputs: list[CoreOutput]) -> None:
        for req in sched.grammar_failed:
            self._record_finished(req)
            outputs.append(self._make_output(req, list(req.seqs), {}, {}))
        sched.grammar_failed = []

    def _step_outputs(
        self,
        outputs: list[CoreOutput],
        sched: SchedulerOutput,
        updates: list[SeqUpdate],
        stats: bool,
        started: float,
    ) -> EngineCoreOutputs:
        outputs.extend(self._outputs(updates))  # records this step's finished requests for the stats
        if not stats:
            self._pending_finished.clear()
            return EngineCoreOutputs(outputs)
        it = self._iteration_stats(sched, updates)
        it.step_seconds = time.perf_counter() - started
        return EngineCoreOutputs(outputs, self.get_scheduler_stats(), it)

    # ---- outputs and stats --------------------------------------------------------------------------
    def _outputs(self, updates: list[SeqUpdate]) -> list[CoreOutput]:
        by_request: dict[str, tuple[Request, list[Sequence], dict[int, list[int]], dict[int, dict]]] = {}
        for u in updates:
            req, seqs, tokens, tops = by_request.setdefault(u.request.request_id, (u.request, [], {}, {}))
            seqs.append(u.seq)
            tokens[u.seq.index] = [u.token_id, *u.more_token_ids]
            if u.top_logprobs is not None:
                tops[u.seq.index] = u.top_logprobs
        outputs = []
        for req, seqs, tokens, tops in by_request.values():
            if req.finished:
                self._record_finished(req)
            outputs.append(self._make_output(req, seqs, tokens, tops))
        return outputs

    def _make_output(
        self, req: Request, seqs: list[Sequence], tokens: dict[int, list[int]], tops: dict[int, dict]
    ) -> CoreOutput:
        """What ``seqs`` got this step: the tokens each got (if any; several with speculative decoding),
        how each stands."""
        want_logprobs = req.params.logprobs is not None
        deltas = [
            SeqDelta(
                seq.index,
                tokens.get(seq.index, []),
                seq.cumulative_logprob,
                tops.get(seq.index) if want_logprobs else None,
                seq.finish_reason,
                seq.stop_reason,
            )
            for seq in seqs
        ]
        metrics = None
        if req.finished:
            metrics = req.metrics
            if metrics.finished_time is None:
                metrics.finished_time = now()
            metrics.num_preemptions = req.num_preemptions
        prompt_logprobs = None
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent and deltas:
            prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        return CoreOutput(
            req.request_id, deltas, req.finished, req.num_cached_tokens, metrics, prompt_logprobs
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
        it.num_generation_tokens = sum(1 + len(u.more_token_ids) for u in updates)
        if sched.spec_num_drafts:
            it.spec_decoding = SpecDecodingStats(
                sched.spec_num_drafts, sched.spec_num_draft_tokens, list(sched.spec_accepted_per_pos)
            )
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
        sched = self.scheduler
        running = sorted({r.lora.name for r in sched.running if r.lora is not None})
        queued = [*sched.waiting, *sched.compiling]
        waiting = sorted({r.lora.name for r in queued if r.lora is not None})
        return SchedulerStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            kv_pool_usage=self._pool_usage(kv.pool_usage),
            # an all-sliding model's blocks are the window pool's (its full group's are bookkeeping)
            **(
                self._block_counts(kv.window_pool, 1)
                if self._all_sliding
                else self._block_counts(kv.block_pool)
            ),
            offload=offload.snapshot() if offload is not None else {},
            running_lora_adapters=running,
            waiting_lora_adapters=waiting,
            max_lora=self.config.max_loras if self.lora is not None else 0,
        )

    @property
    def _all_sliding(self) -> bool:
        """Every layer's cache is the window pool's (engine/sizing/kv_split.py: the full group holds no KV)."""
        return len(self.plan.window_layers) == self.model_config.num_hidden_layers

    def _pool_usage(self, usage: dict[str, float]) -> dict[str, float]:
        """Per-pool usage for the metrics: none with one pool, no "full" when every layer slides (that pool is
        bookkeeping, sized never to bind)."""
        if "window" not in usage:
            return {}
        return {"window": usage["window"]} if self._all_sliding else usage

    @staticmethod
    def _block_counts(pool: BlockPool, reserved: int = 0) -> dict[str, int]:
        """The block gauges of one pool (``reserved``: a window pool's null block, neither usable nor free)."""
        return dict(
            num_blocks_total=pool.num_blocks - reserved,
            num_blocks_free=pool.num_free_blocks - pool.num_cached_blocks,
            num_blocks_cached=pool.num_cached_blocks,
        )

    def kv_waste(self) -> float:
        """Allocated-but-unfilled KV slots over allocated slots, across running sequences."""
        return self.scheduler.kv_waste()


def _add_counts(into: SchedulerOutput, other: SchedulerOutput) -> None:
    """Fold the planning counts of a step that computed nothing into another step's (for its stats)."""
    into.num_preemptions += other.num_preemptions
    into.prefix_queries += other.prefix_queries
    into.prefix_hits += other.prefix_hits
    into.new_request_prompt_lens.extend(other.new_request_prompt_lens)
