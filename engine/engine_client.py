"""The typed boundary between a server and an engine: the `EngineClient` protocol and the frozen `EngineInfo`.

The server (engine/server/*) sees an engine only through these two. `EngineInfo` holds every fact about the
engine that a front end needs and that does not change once it has started (lengths, vocabulary, KV layout,
tiers, defaults, the start-up memory profile); it is built once by the core and crosses the process
boundary as a message. `EngineClient` is the moving part: add requests and stream their outputs, abort,
health, stats, and the few maintenance calls the routes expose. `AsyncEngine` implements it (the core on a
thread of this process, or in its own process); test fakes implement it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagoda.engine.kv_cache.streaming import StreamingDefaults
from pagoda.engine.request_stream import RequestStream
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.stats import StatLogger


class EngineDeadError(RuntimeError):
    """The engine core stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request."""


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
    tensor_parallel_size: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    cache_config: dict[str, Any] = field(default_factory=dict)  # vllm:cache_config_info labels
    cpu_kernels: dict[str, str] | None = None  # the CPU kernels' info labels (variant, origin); None on a GPU
    memory_profile: dict[str, Any] = field(default_factory=dict)  # GET /pagoda/memory
    lora_adapters: tuple[LoRAAdapterInfo, ...] = ()  # loaded at start (--lora-modules)


@dataclass
class NewRequest:
    """One request as a server hands it over: a prompt (token ids, or text when the engine tokenizes) and
    its sampling parameters. Input processing checks and resolves it before the core sees it."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    lora: str | None = None  # the name of a served LoRA adapter to run it through; None: the base model


class EngineClient(Protocol):
    """An engine as a server uses it. Call everything from the event loop the client was started on."""

    info: EngineInfo
    tokenizer: Any  # the front end's tokenizer (None when the engine serves token ids only)

    def start(self) -> None:
        """Start serving (from the running event loop)."""

    def shutdown(self) -> None:
        """Stop the core after its work is done (disk-tier writes, tensor-parallel ranks)."""

    async def add_requests(self, requests: Sequence[NewRequest]) -> list[RequestStream]:
        """Admit all of them or none: ValueError names the problem (a 400), EngineDeadError when stopped."""

    def abort(self, request_ids: str | Iterable[str]) -> None: ...

    @property
    def is_alive(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    @property
    def num_waiting(self) -> int:
        """Requests admitted but not yet running (for admission control)."""

    @property
    def num_running(self) -> int: ...

    def add_stat_logger(self, logger: StatLogger) -> None:
        """Call `logger.record(scheduler_stats, iteration_stats)` for every step, on the event loop."""

    def add_step_failure_listener(self, fn: Callable[[BaseException], None]) -> None: ...

    def add_dead_listener(self, fn: Callable[[str], None]) -> None:
        """Call `fn(reason)` once, on the event loop, when the core stops for good."""

    async def reset_prefix_cache(self) -> bool: ...

    @property
    def lora_adapters(self) -> dict[str, LoRAAdapterInfo]:
        """The LoRA adapters served now, by name."""

    async def load_lora_adapter(self, name: str, path: str) -> LoRAAdapterInfo:
        """Read a PEFT directory in the core and serve it as ``name`` from the next request on; ValueError
        names why it cannot be served."""

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving ``name`` (KeyError when nothing has it); admitted requests finish with it."""

    async def kv_events(self, since: int, epoch: str | None) -> dict[str, Any]:
        """Block-event batches after `since` (engine/kv_cache/events.py)."""

    async def kv_snapshot(self) -> dict[str, Any]: ...
