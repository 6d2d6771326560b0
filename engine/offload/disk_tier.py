"""Disk tier: the base of the pagoda, one verified file per KV block on a local directory (the NVMe PVC).

File ``<hash hex>.kv`` = ``MAGIC`` + u32 header length + JSON header + payload. The header names the
layout version, the engine identity (model fingerprint, compute dtype, KV dtype, block size), the block's hash, shape,
dtype, where its quantization scales are (``scales``), payload length and a BLAKE2b checksum of the
payload; every read checks all of them, and anything that disagrees (or cannot be read) is a miss: the
file is removed and ``verification_failures`` goes up. INT8 blocks carry their float32 per-token, per-head
scales inside the payload (the last 4 bytes of each row, see ModelRunner.block_shape), so a block written
as INT8 is never read as another dtype, nor with another scale layout.

Writes never block the engine step: they run on one background thread, to a temporary name that is
renamed into place, so a crash leaves either a whole block or a ``.tmp`` that the next start removes.
No open ever follows a symlink out of the directory (the volume may be shared, or writable by a process
the engine does not trust): new files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a random
temporary name, block files are read with ``O_NOFOLLOW`` and only if they are regular files (a planted
link or FIFO is a miss, and is removed), and the lock file is never opened through a link.
Blocks queued but not yet written are served from memory. At start the directory is indexed by name,
size and mtime only (no reads) so a restarted engine serves its old prefixes; leftovers beyond the
budget are evicted oldest first. A ``flock`` on ``.lock`` keeps a second engine out of the directory.
A directory that cannot be written (read-only, full) disables the tier with one warning; serving goes on.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import re
import secrets
import stat
import struct
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path

import torch
from pagoda.engine.kv_cache.hashing import BlockHash
from pagoda.engine.offload.host_tier import tensor_bytes

log = logging.getLogger("pagoda.engine.offload")

MAGIC = b"PAGODAKV"
LAYOUT_VERSION = 1
SUFFIX = ".kv"
_NAME = re.compile(r"^[0-9a-f]{64}\.kv$")
_CHECKSUM_HEX = 32  # blake2b digest_size=16


# Never through a symlink; not inherited by child processes; a FIFO or device cannot block the open.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class DirectoryInUseError(RuntimeError):
    """Another engine holds the lock on this disk-tier directory."""


def _checksum(payload: bytes | memoryview) -> str:
    return hashlib.blake2b(payload, digest_size=_CHECKSUM_HEX // 2).hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _scales_layout(dtype: torch.dtype) -> str | None:
    """Where a block of this dtype keeps its scales: INT8 rows end in their float32 scale's 4 bytes."""
    return "float32-per-row-tail" if dtype == torch.int8 else None


def _temporary(path: Path) -> Path:
    """A fresh name next to `path` that nobody can have planted a link at in advance."""
    return path.with_name(f"{path.name}.{secrets.token_hex(8)}.tmp")


def _write_new(path: Path, *chunks: bytes) -> None:
    """Create `path` (it must not exist, not even as a link) and write `chunks` to it."""
    fd = os.open(path, _CREATE_FLAGS, 0o600)
    with open(fd, "wb", closefd=True) as f:
        for chunk in chunks:
            f.write(chunk)


def _read_regular(path: Path) -> bytes:
    """The bytes of `path` if it is a regular file in its own right: a symlink, FIFO or device raises."""
    fd = os.open(path, _READ_FLAGS)
    with open(fd, "rb", closefd=True) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        return f.read()


def block_header(identity: str, block_hash: BlockHash, data: torch.Tensor, checksum: str) -> bytes:
    """``MAGIC`` + u32 length + the JSON header of one block record (see the module docstring)."""
    meta = {
        "layout": LAYOUT_VERSION,
        "identity": identity,
        "key": block_hash.hex(),
        "shape": list(data.shape),
        "dtype": _dtype_name(data.dtype),
        "scales": _scales_layout(data.dtype),
        "payload_bytes": tensor_bytes(data),
        "checksum": checksum,
    }
    raw = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(raw)) + raw


def encode_block(identity: str, block_hash: BlockHash, data: torch.Tensor) -> bytes:
    """One block as a self-checking record (header + payload): the disk tier's file, the KV transfer's unit."""
    payload = data.contiguous().view(torch.uint8).numpy().tobytes()
    return block_header(identity, block_hash, data, _checksum(payload)) + payload


def _split_record(raw: memoryview) -> tuple[dict, memoryview]:
    """(header, payload) of a record; ValueError when its frame or header cannot be read."""
    if len(raw) < len(MAGIC) + 4 or bytes(raw[: len(MAGIC)]) != MAGIC:
        raise ValueError("bad magic")
    (hlen,) = struct.unpack_from("<I", raw, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        meta = json.loads(bytes(raw[start : start + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable header: {exc}") from None
    if not isinstance(meta, dict):
        raise ValueError("unreadable header")
    return meta, raw[start + hlen :]


def check_record_checksum(raw: bytes | bytearray | memoryview) -> None:
    """Only the payload's checksum against its header (the costly part of `decode_block`), for a caller that
    checks records on another thread or process than the one that decodes them; ValueError on a mismatch."""
    meta, payload = _split_record(memoryview(raw))
    if meta.get("checksum") != _checksum(payload):
        raise ValueError("payload checksum mismatch")


def decode_block(
    raw: bytes | bytearray | memoryview,
    identity: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    block_hash: BlockHash | None = None,
    *,
    checksum: bool = True,
) -> tuple[BlockHash, torch.Tensor]:
    """(key, tensor) of a record, after checking its layout, identity, key (when ``block_hash`` is given),
    shape, dtype, length and checksum (``checksum=False``: already checked, `check_record_checksum`);
    ValueError names the first that disagrees."""
    meta, payload = _split_record(memoryview(raw))
    expect = {
        "layout": LAYOUT_VERSION,
        "identity": identity,
        "shape": list(shape),
        "dtype": _dtype_name(dtype),
        "scales": _scales_layout(dtype),
    }
    if block_hash is not None:
        expect["key"] = block_hash.hex()
    for field, want in expect.items():
        if meta.get(field) != want:
            raise ValueError(f"{field} is {meta.get(field)!r}, expected {want!r}")
    key = meta.get("key")
    if not isinstance(key, str) or not re.fullmatch(r"[0-9a-f]{64}", key):
        raise ValueError(f"key is {key!r}, expected 64 hex digits")
    nbytes = torch.empty((), dtype=dtype).element_size()
    for dim in shape:
        nbytes *= dim
    if meta.get("payload_bytes") != nbytes or len(payload) != nbytes:
        raise ValueError(f"payload has {len(payload)} bytes, expected {nbytes} (truncated?)")
    if checksum and meta.get("checksum") != _checksum(payload):
        raise ValueError("payload checksum mismatch")
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)
    return BlockHash(bytes.fromhex(key)), data


class DiskTier:
    """A byte-budgeted LRU of block files. ``used_bytes`` never exceeds ``capacity_bytes``."""

    name = "disk"

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, identity: str) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"kv_offload_disk_bytes must not be negative, got {capacity_bytes}")
        self.directory = Path(directory)
        self.capacity_bytes = int(capacity_bytes)
        self.identity = identity
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> file bytes, oldest first
        self._pending: dict[BlockHash, torch.Tensor] = {}  # queued, not yet on disk
        self._jobs: queue.Queue = queue.Queue()
        self._lock_file = None
        self.used_bytes = 0
        self.disabled_reason: str | None = None
        self.evictions = 0
        self.verification_failures = 0
        self.write_errors = 0
        self.store_bytes = 0
        self.load_bytes = 0
        self.store_seconds: list[float] = []  # drained by the manager each step
        self._open()
        self._worker = threading.Thread(target=self._run, name="pagoda-kv-disk", daemon=True)
        self._worker.start()
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- start-up -------------------------------------------------------------------------------------
    def _open(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self.write_errors += 1
            self._disable(f"cannot create {self.directory}: {exc}")
            return
        lock_path = self.directory / ".lock"
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            lock = open(fd, "r+b", buffering=0, closefd=True)  # noqa: SIM115 - held for the tier's lifetime
        except OSError as exc:
            self.write_errors += 1
            why = " (a symlink: not followed)" if lock_path.is_symlink() else ""
            self._disable(f"cannot open the lock file {lock_path}{why}: {exc}")
            return
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise DirectoryInUseError(
                f"kv_offload_disk_dir {str(self.directory)!r} is in use by another engine (its .lock is held); "
                f"give each engine its own directory"
            ) from None
        self._lock_file = lock
        probe = _temporary(self.directory / ".probe")
        try:
            _write_new(probe, b"pagoda")
            probe.unlink()
        except OSError as exc:
            self.write_errors += 1
            self._disable(f"{self.directory} is not writable: {exc}")
            return
        self._index_existing()

    def _index_existing(self) -> None:
        """Index leftovers by name, size and mtime (no reads); evict oldest beyond the budget."""
        found: list[tuple[float, BlockHash, int]] = []
        with os.scandir(self.directory) as it:
            for entry in it:
                if entry.name.endswith(".tmp"):
                    _unlink(entry.path)  # an interrupted write
                    continue
                if not _NAME.match(entry.name) or not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime, BlockHash(bytes.fromhex(entry.name[:64])), st.st_size))
        found.sort(key=lambda f: f[0])
        for _, block_hash, size in found:
            self._index[block_hash] = size
            self.used_bytes += size
        removed = 0
        while self.used_bytes > self.capacity_bytes and self._index:
            self._evict_oldest(now=True)
            removed += 1
        if found:
            log.info(
                "disk KV tier %s: %d blocks from a previous run (%d evicted to fit %d bytes)",
                self.directory, len(self._index), removed, self.capacity_bytes,
            )  # fmt: skip

    def _disable(self, why: str) -> None:
        if self.disabled_reason is None:
            self.disabled_reason = why
            log.warning("disk KV tier disabled, serving goes on without it: %s", why)
        with self._lock:
            self._index.clear()
            self._pending.clear()
            self.used_bytes = 0

    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None

    # -- paths and format ------------------------------------------------------------------------------
    def path_of(self, block_hash: BlockHash) -> Path:
        return self.directory / (block_hash.hex() + SUFFIX)

    def _header(self, block_hash: BlockHash, data: torch.Tensor, checksum: str) -> bytes:
        return block_header(self.identity, block_hash, data, checksum)

    def file_size(self, block_hash: BlockHash, data: torch.Tensor) -> int:
        return len(self._header(block_hash, data, "0" * _CHECKSUM_HEX)) + tensor_bytes(data)

    # -- write path ------------------------------------------------------------------------------------
    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    def hashes(self) -> list[BlockHash]:
        """The blocks on disk, oldest first (a copy taken under the lock the writer thread takes)."""
        with self._lock:
            return list(self._index)

    def put(self, block_hash: BlockHash, data: torch.Tensor) -> bool:
        """Queue ``data`` (a CPU tensor the tier may keep) for writing; False when it cannot be kept."""
        if not self.enabled:
            return False
        size = self.file_size(block_hash, data)
        if size > self.capacity_bytes:
            return False
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True
            while self.used_bytes + size > self.capacity_bytes and self._index:
                self._evict_oldest(now=False)
            self._index[block_hash] = size
            self.used_bytes += size
            self._pending[block_hash] = data
        self._jobs.put(("write", block_hash, data))
        return True

    def _evict_oldest(self, now: bool) -> None:
        block_hash, size = self._index.popitem(last=False)
        self.used_bytes -= size
        self.evictions += 1
        self._pending.pop(block_hash, None)
        if now:
            _unlink(self.path_of(block_hash))
        else:
            self._jobs.put(("delete", block_hash, None))

    def _run(self) -> None:
        while True:
            job, block_hash, data = self._jobs.get()
            try:
                if job == "stop":
                    return
                if job == "delete":
                    _unlink(self.path_of(block_hash))
                elif job == "write":
                    self._write(block_hash, data)
            finally:
                self._jobs.task_done()

    def _write(self, block_hash: BlockHash, data: torch.Tensor) -> None:
        with self._lock:
            if self._pending.get(block_hash) is not data:
                return  # evicted (or the tier disabled) before its turn came
        start = time.perf_counter()
        payload = data.contiguous().view(torch.uint8).numpy().tobytes()
        header = self._header(block_hash, data, _checksum(payload))
        final = self.path_of(block_hash)
        tmp = _temporary(final)
        try:
            _write_new(tmp, header, payload)
            os.replace(tmp, final)  # a link planted at `final` is replaced, never written through
        except OSError as exc:
            _unlink(tmp)
            self.write_errors += 1
            why = (
                "the disk is full"
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
                else "a write failed"
            )
            self._disable(f"{why} in {self.directory}: {exc}")
            return
        with self._lock:
            if self._pending.get(block_hash) is data:
                del self._pending[block_hash]
            self.store_bytes += len(header) + len(payload)
            self.store_seconds.append(time.perf_counter() - start)

    def flush(self) -> None:
        """Wait until every queued write and delete is done (tests, benchmarks, shutdown)."""
        self._jobs.join()

    def close(self) -> None:
        """Write what is queued, stop the writer and release the directory lock."""
        if self._worker.is_alive():
            self._jobs.put(("stop", None, None))
            self._worker.join(timeout=30)
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # -- read path -------------------------------------------------------------------------------------
    def get(self, block_hash: BlockHash, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The verified block, or None (a miss; a bad file is removed and counted)."""
        if not self.enabled:
            return None
        with self._lock:
            if block_hash not in self._index:
                return None
            self._index.move_to_end(block_hash)
            pending = self._pending.get(block_hash)
        if pending is not None:
            return pending
        path = self.path_of(block_hash)
        try:
            raw = _read_regular(path)
            data = self._verify(raw, block_hash, tuple(shape), dtype)
        except (OSError, ValueError) as exc:
            self._reject(block_hash, path, str(exc))
            return None
        self.load_bytes += len(raw)
        return data

    def _verify(
        self, raw: bytes, block_hash: BlockHash, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        _, data = decode_block(raw, self.identity, shape, dtype, block_hash)
        return data

    def _reject(self, block_hash: BlockHash, path: Path, why: str) -> None:
        log.warning("disk KV tier: dropping %s (%s); it will be recomputed", path.name, why)
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.used_bytes -= size
            self.verification_failures += 1
        _unlink(path)

    # -- stats -----------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, float]:
        return {
            "bytes_used": float(self.used_bytes),
            "bytes_capacity": float(self.capacity_bytes if self.enabled else 0),
            "blocks": float(len(self._index)),
            "load_bytes": float(self.load_bytes),
            "store_bytes": float(self.store_bytes),
            "evictions": float(self.evictions),
            "verification_failures": float(self.verification_failures),
            "write_errors": float(self.write_errors),
            "disabled": float(not self.enabled),
        }

    def take_store_seconds(self) -> list[float]:
        with self._lock:
            out, self.store_seconds = self.store_seconds, []
        return out


def _close_at_exit(ref: weakref.ref) -> None:
    tier = ref()
    if tier is not None:
        tier.close()


def _unlink(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
