"""--kv-transfer-config's parsed form, under the name the seam gave it (engine/kv_transfer_config.py)."""

from __future__ import annotations

from pagoda.engine.kv_transfer_config import (
    DEFAULT_KV_PORT,
    KV_CONNECTORS,
    KV_ROLES,
    KVTransferConfig,
    parse_kv_transfer_config,
)

__all__ = ["DEFAULT_KV_PORT", "KV_CONNECTORS", "KV_ROLES", "KVTransferConfig", "parse_kv_transfer_config"]
