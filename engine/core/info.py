"""What a started engine is, as the core reports it once: `EngineInfo` and the adapters it serves.

Built by the core, sent across the process boundary as one message, read by the front end and the server
(engine/frontend/engine_client.py is their typed boundary). Nothing here changes while the engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.kv_cache.streaming import StreamingDefaults


@dataclass(frozen=True)
class LoRAAdapterInfo:
    """A LoRA adapter an engine serves (docs/lora.md)."""

    name: str  # what a request puts in `model` to run through it
    path: str  # the directory it was loaded from
    rank: int
    cache_root: str  # hex: where its requests' block-hash chains start (routers hash prompts from it)


@dataclass(frozen=True)
class EngineInfo:
    """What a front end knows of a started engine; nothing here changes while it runs."""

    model_name: str
    max_model_len: int
    vocab_size: int  # rows of the logits: a token id at or past it cannot be sampled or fed
    block_size: int
    num_blocks: int
    kv_bytes_per_token: int = 0
    max_model_len_fitted: int | None = None  # the longest context the KV cache could hold
    tiers: tuple[str, ...] = ("device",)  # device, then the offload tiers that are on (host, disk)
    enable_prefix_caching: bool = True
    kv_extra_keys: tuple[str, ...] = ()  # what a router mixes into a block-hash chain for this replica
    kv_events_epoch: str | None = None  # the block-event log's lifetime id; None: no events published
    streaming: StreamingDefaults = field(default_factory=StreamingDefaults)  # --kv-eviction & co.
    eos_token_ids: tuple[int, ...] = ()
    # generation_config.json's sampling values (--generation-config): defaults of requests that leave them out
    generation_defaults: dict[str, float] = field(default_factory=dict)
    max_logprobs: int = 20  # --max-logprobs
    tensor_parallel_size: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    cache_config: dict[str, Any] = field(default_factory=dict)  # vllm:cache_config_info labels
    cpu_kernels: dict[str, str] | None = None  # the CPU kernels' info labels (variant, origin); None on a GPU
    memory_profile: dict[str, Any] = field(default_factory=dict)  # GET /pagoda/memory
    lora_adapters: tuple[LoRAAdapterInfo, ...] = ()  # loaded at start (--lora-modules)
    num_speculative_tokens: int = 0  # --speculative-config's most proposed tokens per step; 0: off
    # --kv-transfer-config as running: {"kv_role", "kv_port" (where a producer serves blocks)}; None: off
    kv_transfer: dict[str, Any] | None = None
