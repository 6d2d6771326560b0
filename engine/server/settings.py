"""Server-side settings (the engine's own live in EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerSettings:
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=list)  # empty = the engine's model name
    api_key: str | None = None
    max_num_queued_reqs: int | None = None  # None = unbounded
    max_request_body_bytes: int = 16 * 1024 * 1024
    shutdown_grace_seconds: float = 30.0
    retry_after_seconds: int = 1
    uvicorn_log_level: str = "info"
    log_stats_interval_s: float = 10.0
