"""The engine core's side of a prefill/decode split: what a producer holds and a consumer stages.

Producer (kv_producer / kv_both): a request admitted with ``kv_export`` is remembered; when a step finishes
it, its full prompt blocks (those a consumer can use: all but the block holding the last prompt token when
the prompt fills it) are read from the device cache to the host, still in that step and before anything can
reuse them, and held for the `BlockServer` (engine/kv_transfer/wire.py) to hand to the decode engine.

Consumer (kv_consumer / kv_both): `stage` verifies received records (identity, shape, dtype, checksum: the
disk tier's checks; the server checks the checksums first, off the step loop) and keeps the good ones in
`StagedBlocks`, which the scheduler's prefix lookup reads
after the device cache and the offload tiers. A block that fails a check is dropped and counted; its tokens
are computed as if it never came.

Not with tensor or pipeline parallelism (a rank holds only its heads' or its stage's KV) nor a sliding-window
group (its blocks have another shape): those engines log a warning and compute every prompt themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from pagoda.engine.kv_cache.hashing import BlockHash, hash_full_blocks
from pagoda.engine.kv_cache.ops import SaveBlock
from pagoda.engine.kv_transfer.blocks import (
    DEFAULT_HELD_BYTES,
    DEFAULT_HOLD_SECONDS,
    DEFAULT_STAGED_BYTES,
    HeldBlocks,
    StagedBlocks,
)
from pagoda.engine.kv_transfer.config import KVTransferConfig
from pagoda.engine.kv_transfer.wire import BlockServer
from pagoda.engine.offload.disk_tier import decode_block

log = logging.getLogger("pagoda.engine.kv_transfer")


def _number(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"kv_connector_extra_config.{key} must be a positive number, got {value!r}")
    return value


class KVTransferCore:
    """Owned by EngineCore; every method runs on the thread that steps the core, between device steps."""

    def __init__(
        self,
        config: KVTransferConfig,
        *,
        identity: str,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        block_size: int,
    ) -> None:
        self.config = config
        self.identity = identity
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.block_size = block_size
        extra = config.extra
        self.held: HeldBlocks | None = None
        self.server: BlockServer | None = None
        self.staged: StagedBlocks | None = None
        if config.produces:
            self.held = HeldBlocks(
                _number(extra, "hold_seconds", DEFAULT_HOLD_SECONDS),
                int(_number(extra, "max_held_bytes", DEFAULT_HELD_BYTES)),
            )
            self.server = BlockServer(self.held, identity, config.kv_ip, config.kv_port)
        if config.consumes:
            self.staged = StagedBlocks(int(_number(extra, "max_staged_bytes", DEFAULT_STAGED_BYTES)))
        self._expected: dict[str, tuple[list[int], BlockHash | None]] = {}
        self.exported_blocks = 0
        self.staged_blocks = 0
        self.rejected_blocks = 0

    def info(self) -> dict[str, Any]:
        """What the server needs: the role, and where this engine serves its blocks."""
        return {
            "kv_role": self.config.kv_role,
            "kv_port": self.server.port if self.server is not None else None,
        }

    # -- producer ------------------------------------------------------------------------------------------
    def expect(self, request_id: str, token_ids: Sequence[int], root: BlockHash | None) -> None:
        """Hold ``request_id``'s prompt blocks when it finishes (a remote-decode prefill)."""
        if self.held is not None:
            self._expected[request_id] = (list(token_ids), root)

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._expected.pop(request_id, None)

    def export_finished(self, requests: Iterable[Any], kv: Any, runner: Any) -> None:
        """Read the usable prompt blocks of the expected requests among ``requests`` that finished (they are
        cached-and-free now, nothing has reused them yet) and hold them for the decode engine."""
        if not self._expected or self.held is None:
            return
        done = {r.request_id: r for r in requests if r.finished and r.request_id in self._expected}
        for request_id in done:
            token_ids, root = self._expected.pop(request_id)
            usable = max(0, (len(token_ids) - 1) // self.block_size)
            hashes = hash_full_blocks(token_ids, self.block_size, kv.extra_key_bytes, root, max_blocks=usable)
            ops: list[SaveBlock] = []
            for block_hash in hashes:
                block = kv.block_pool.get_cached_block(block_hash)
                if block is None:
                    break  # evicted already (a full cache): the decode engine computes the rest
                ops.append(SaveBlock(block.block_id, block_hash))
            saved = runner.apply_kv_ops(ops) if ops else []
            self.held.put(request_id, [(h, t) for h, t in saved])
            self.exported_blocks += len(saved)

    # -- consumer ------------------------------------------------------------------------------------------
    def stage(self, records: Sequence[bytes], checksummed: bool = False) -> dict[str, Any]:
        """Verify and stage received records: {"staged": n, "rejected": m, "error": the first reason}.
        ``checksummed``: the server already checked their payloads (`check_record_checksum`, on its worker
        thread), so the step loop pays only for the header checks and one copy per block."""
        if self.staged is None:
            raise ValueError("this engine is not a KV consumer (--kv-transfer-config kv_role)")
        staged = rejected = 0
        first_error = None
        for raw in records:
            try:
                block_hash, data = decode_block(
                    raw, self.identity, self.block_shape, self.dtype, checksum=not checksummed
                )
            except ValueError as exc:
                rejected += 1
                first_error = first_error or str(exc)
                continue
            self.staged.put(block_hash, data)
            staged += 1
        self.staged_blocks += staged
        self.rejected_blocks += rejected
        if rejected:
            log.warning("KV transfer: %d of %d received blocks failed verification (%s); they will be computed",
                        rejected, len(records), first_error)  # fmt: skip
        return {"staged": staged, "rejected": rejected, "error": first_error}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def build_kv_transfer(
    config: KVTransferConfig | None,
    *,
    identity: str,
    block_shape: tuple[int, ...],
    dtype: torch.dtype,
    block_size: int,
    prefix_caching: bool,
    refused: str = "",
) -> KVTransferCore | None:
    """The core's KV transfer, or None (not configured, or refused: ``refused`` says why, logged)."""
    if config is None:
        return None
    if not prefix_caching:
        refused = refused or "prefix caching is off (received blocks are prefix-cache blocks)"
    if refused:
        log.warning(
            "--kv-transfer-config %s is ignored: %s; every prompt is computed here", config.kv_role, refused
        )
        return None
    return KVTransferCore(
        config, identity=identity, block_shape=block_shape, dtype=dtype, block_size=block_size
    )
