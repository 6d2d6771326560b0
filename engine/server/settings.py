"""Server-side settings (the engine's own live in EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Two batches of the default --max-num-seqs (256): more waiting requests only add latency a client cannot
# see, where a 503 + Retry-After lets it try another replica. Each waiting request holds its prompt (about
# 64 bytes per token at worst: text, ids, block hashes) and its state; at an 8k context that is ~270 MB at
# most, at 32k ~1.1 GB (docs/serving.md). The operator renders a per-pod value from its plan.
DEFAULT_MAX_NUM_QUEUED_REQS = 512
# Larger bodies get a 413; `pagoda router` takes the same default, so it never refuses what a replica takes.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024


@dataclass
class ServerSettings:
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=list)  # empty = the engine's model name
    api_key: str | None = None
    # None (the flag absent) means the default: the queue is never unbounded.
    max_num_queued_reqs: int | None = DEFAULT_MAX_NUM_QUEUED_REQS
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    shutdown_grace_seconds: float = 30.0
    retry_after_seconds: int = 1
    uvicorn_log_level: str = "info"
    log_stats_interval_s: float = 10.0
    # The engine core in a process of its own (False: on a thread of the server's process).
    engine_process: bool = True
    # The chat template's text (--chat-template); None: the model's own.
    chat_template: str | None = None
    # How tool calls are read from outputs (engine/tool_parsers); "auto": from the chat template.
    tool_call_parser: str = "auto"
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter exist (--allow-runtime-lora-updating, or vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING); off, they are 404s as in vLLM.
    allow_runtime_lora_updating: bool = False
    # --strict-api: a request field that no model here knows is a 400 (default: logged once and ignored, as
    # vLLM does).
    strict_api: bool = False

    def __post_init__(self) -> None:
        if self.max_num_queued_reqs is None:
            self.max_num_queued_reqs = DEFAULT_MAX_NUM_QUEUED_REQS
