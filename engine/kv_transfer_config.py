"""--kv-transfer-config, vLLM's JSON spelling: which side of a prefill/decode split this engine is.

Pure (no torch, nothing of the engine): engine/config.py validates the flag with it and the operator's checks
reach it through there. It lives beside engine/config.py, not inside engine/kv_transfer/, because the
transfer itself needs the KV cache and offload modules, which import engine/config.py: a package both
below and above the config would be an import cycle. engine/kv_transfer/config.py re-exports it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# Pagoda's own transfer (TCP, the offload tiers' block format); NixlConnector is what llm-d's manifests name,
# accepted so their flags run unchanged, and served by the same transfer.
KV_CONNECTORS = ("PagodaConnector", "NixlConnector")
DEFAULT_KV_PORT = 14579


@dataclass(frozen=True)
class KVTransferConfig:
    kv_role: str
    kv_connector: str = "PagodaConnector"
    kv_port: int = DEFAULT_KV_PORT  # where a producer serves its blocks
    kv_ip: str = "0.0.0.0"  # what a producer binds
    extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def parse_kv_transfer_config(text: str | dict | None) -> KVTransferConfig | None:
    """The flag's JSON (or an already parsed dict); None when unset. A ValueError says what is wrong."""
    if text is None or text == "":
        return None
    if isinstance(text, str):
        try:
            obj = json.loads(text)
        except ValueError:
            raise ValueError(f"{text!r} is not valid JSON") from None
    else:
        obj = text
    if not isinstance(obj, dict):
        raise ValueError("must be a JSON object")
    known = {"kv_role", "kv_connector", "kv_port", "kv_ip", "kv_connector_extra_config", "engine_id"}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ValueError(f"has unknown keys {unknown}; Pagoda reads {sorted(known)}")
    role = obj.get("kv_role")
    if role not in KV_ROLES:
        raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}")
    connector = obj.get("kv_connector", "PagodaConnector")
    if connector not in KV_CONNECTORS:
        raise ValueError(f"kv_connector must be one of {', '.join(KV_CONNECTORS)} (Pagoda's TCP transfer)")
    port = obj.get("kv_port", DEFAULT_KV_PORT)
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError("kv_port must be a TCP port (1-65535)")
    ip = obj.get("kv_ip", "0.0.0.0")
    if not isinstance(ip, str) or not ip:
        raise ValueError("kv_ip must be an address")
    extra = obj.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_connector_extra_config must be an object")
    return KVTransferConfig(kv_role=role, kv_connector=connector, kv_port=port, kv_ip=ip, extra=extra)
