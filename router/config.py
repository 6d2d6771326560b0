"""The router's settings, checked once at start (and by ``pagoda router --dry-run``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pagoda.engine.server.settings import DEFAULT_MAX_REQUEST_BODY_BYTES

POLICIES = ("roundRobin", "leastLoaded", "prefix", "tierAware")
# The scale-to-zero hold's caps (router/hold.py): each held request keeps its connection and its body.
DEFAULT_HOLD_MAX_REQUESTS = 256
DEFAULT_HOLD_MAX_BYTES = 64 << 20


class ConfigError(ValueError):
    """A setting the router cannot start with; the message names it."""


@dataclass
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    policy: str = "tierAware"
    backends: list[str] = field(default_factory=list)  # static base URLs, e.g. http://10.0.0.5:8000
    backend_dns: list[str] = field(default_factory=list)  # HOST:PORT of a headless Service
    # Prefill/decode disaggregation (docs/disaggregation.md): the prefill replicas. With any set, the
    # backends above are the decode replicas and each request they get names a prefill replica
    # (x-prefiller-host-port).
    prefill_backends: list[str] = field(default_factory=list)
    prefill_backend_dns: list[str] = field(default_factory=list)
    dns_interval: float = 5.0
    health_interval: float = 2.0
    events_interval: float = 0.25  # how often each replica's KV events are pulled
    model: str | None = None
    api_key: str | None = None
    tokenizer: str | None = None  # model source for local chain hashing; None = the engines' default model
    load_slack: int = (
        2  # "bounded by load": a replica may carry this many more requests than the least loaded
    )
    # Seconds a replica may stay silent: before its answer starts and between two reads of it. No limit on
    # the whole answer (a long generation streams for as long as it needs).
    read_timeout: float = 600.0
    # Other replicas tried when one refuses the connection, drops it or answers 503 before the client got
    # any byte.
    max_retries: int = 2
    # The engine's own limit (`pagoda serve --max-request-body-bytes`): the router never refuses a body a
    # replica would take.
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_index_blocks: int = 262_144  # per replica, all tiers together (docs/router.md)
    # How long a request waits for a routable replica (scale to zero: router/hold.py); 0 (the default, for
    # a deployment that cannot scale to zero): 503 + Retry-After at once.
    hold_seconds: float = 0.0
    hold_max_requests: int = DEFAULT_HOLD_MAX_REQUESTS  # requests held at once; more: 503 + Retry-After
    hold_max_bytes: int = DEFAULT_HOLD_MAX_BYTES  # bytes of their bodies held at once; more: the same
    # Envoy ext_proc endpoint picker (Gateway API Inference Extension) beside the HTTP proxy; None: off.
    ext_proc_port: int | None = None

    def validate(self) -> RouterConfig:
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.backends and not self.backend_dns:
            raise ConfigError("give at least one --backend URL or --backend-dns HOST:PORT")
        for flag, urls in (("--backend", self.backends), ("--prefill-backend", self.prefill_backends)):
            for url in urls:
                if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
                    raise ConfigError(f"{flag} must be an http(s) URL, got {url!r}")
        for flag, targets in (
            ("--backend-dns", self.backend_dns),
            ("--prefill-backend-dns", self.prefill_backend_dns),
        ):
            for target in targets:
                host, sep, port = target.rpartition(":")
                if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                    raise ConfigError(f"{flag} must be HOST:PORT, got {target!r}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be 1..65535, got {self.port}")
        if self.ext_proc_port is not None and not (
            0 < self.ext_proc_port < 65536 and self.ext_proc_port != self.port
        ):
            raise ConfigError(f"--ext-proc-port must be 1..65535 and not --port, got {self.ext_proc_port}")
        for name in ("dns_interval", "health_interval", "events_interval", "read_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if not 0 <= self.hold_seconds <= 3600:
            raise ConfigError(f"--hold-seconds must be in [0, 3600], got {self.hold_seconds}")
        if self.load_slack < 0 or self.max_retries < 0:
            raise ConfigError("--load-slack and --max-retries must not be negative")
        for name in ("max_request_body_bytes", "max_index_blocks", "hold_max_requests", "hold_max_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        self.backends = [u.rstrip("/") for u in self.backends]
        self.prefill_backends = [u.rstrip("/") for u in self.prefill_backends]
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["api_key"]:
            d["api_key"] = "***"
        return d
