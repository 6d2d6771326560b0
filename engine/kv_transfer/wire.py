"""The KV transfer's TCP protocol: a decode engine fetches one request's prefilled blocks from a producer.

    fetch:  b"PGKVGET1" + u32 length + JSON {"request_id": ...}
    answer: b"PGKVPUT1" + u32 length + JSON {"ok": true, "sizes": [record bytes, ...]} + the records
            (or {"ok": false, "error": "..."} and nothing after it)

Each record is one block in the offload tiers' self-checking format (engine/offload/disk_tier.py:
encode_block: magic, JSON header with identity, key, shape, dtype and a BLAKE2b checksum, then the payload),
so the consumer verifies every block as the disk tier verifies a file, and a corrupt one is a miss.

The producer's `BlockServer` runs on threads of the engine core's process and reads only `HeldBlocks`
(host copies taken at the end of the prefill step), never the KV cache itself. Records are encoded on the
server's thread, not on the engine's step.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
import time

from pagoda.engine.kv_transfer.blocks import HeldBlocks
from pagoda.engine.offload.disk_tier import encode_block

log = logging.getLogger("pagoda.engine.kv_transfer")

FETCH_MAGIC = b"PGKVGET1"
ANSWER_MAGIC = b"PGKVPUT1"
MAX_HEADER_BYTES = 1 << 24
MAX_ANSWER_BYTES = 1 << 34  # 16 GiB: a record list that claims more is refused before reading it
REAP_INTERVAL_S = 1.0  # how often held blocks past their time are released


class TransferError(RuntimeError):
    """A fetch that did not bring blocks back (the caller falls back to computing them)."""


def _frame(magic: bytes, obj: dict) -> bytes:
    raw = json.dumps(obj, separators=(",", ":")).encode()
    return magic + struct.pack("<I", len(raw)) + raw


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransferError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _read_frame(sock: socket.socket, magic: bytes) -> dict:
    head = _read_exact(sock, len(magic) + 4)
    if head[: len(magic)] != magic:
        raise TransferError("not a Pagoda KV transfer peer (bad magic)")
    (length,) = struct.unpack_from("<I", head, len(magic))
    if length > MAX_HEADER_BYTES:
        raise TransferError(f"header of {length} bytes")
    try:
        obj = json.loads(_read_exact(sock, length))
    except ValueError as exc:
        raise TransferError(f"unreadable header: {exc}") from None
    if not isinstance(obj, dict):
        raise TransferError("unreadable header")
    return obj


def encode_answer(records: list[bytes]) -> bytes:
    """A whole answer carrying ``records`` (what a producer sends back for a fetch)."""
    return _frame(ANSWER_MAGIC, {"ok": True, "sizes": [len(r) for r in records]}) + b"".join(records)


class BlockServer:
    """Serves `HeldBlocks` on ``host:port`` (port 0: any free port; `port` says which) until `close()`."""

    def __init__(self, held: HeldBlocks, identity: str, host: str, port: int) -> None:
        self.held = held
        self.identity = identity
        self.sent_bytes = 0
        self.sent_blocks = 0
        self.fetches = 0
        self.misses = 0  # fetches of a request that is not held (expired, already fetched, unknown)
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="pagoda-kv-transfer", daemon=True
        )
        self._thread.start()
        # Released on time even when no fetch or prefill comes along to notice.
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="pagoda-kv-transfer-reaper", daemon=True)
        self._reaper.start()
        log.info("KV transfer: serving prefilled blocks on %s:%d", host, self.port)

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(60)
        try:
            ask = _read_frame(sock, FETCH_MAGIC)
            request_id = ask.get("request_id")
            blocks = self.held.take(request_id) if isinstance(request_id, str) else None
            self.fetches += 1
            if blocks is None:
                self.misses += 1
                sock.sendall(
                    _frame(ANSWER_MAGIC, {"ok": False, "error": f"no blocks held for {request_id!r}"})
                )
                return
            records = [encode_block(self.identity, h, t) for h, t in blocks]
            sock.sendall(encode_answer(records))
            self.sent_bytes += sum(len(r) for r in records)
            self.sent_blocks += len(records)
        except (OSError, TransferError) as exc:
            log.warning("KV transfer: a fetch failed: %s", exc)

    def _reap(self) -> None:
        while not self._stop.wait(REAP_INTERVAL_S):
            self.held.expire()

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()


def fetch_blocks(
    host: str,
    port: int,
    request_id: str,
    timeout: float = 30.0,
) -> list[bytes]:
    """The records a producer holds for ``request_id`` (unverified: the engine core checks each); raises
    TransferError (or OSError) when they cannot be had."""
    start = time.monotonic()
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(_frame(FETCH_MAGIC, {"request_id": request_id}))
        answer = _read_frame(sock, ANSWER_MAGIC)
        if not answer.get("ok"):
            raise TransferError(str(answer.get("error") or "the producer refused the fetch"))
        sizes = answer.get("sizes")
        if not isinstance(sizes, list) or not all(isinstance(n, int) and n > 0 for n in sizes):
            raise TransferError("unreadable record sizes")
        if sum(sizes) > MAX_ANSWER_BYTES:
            raise TransferError(f"the producer announced {sum(sizes)} bytes")
        records = [_read_exact(sock, n) for n in sizes]
    log.debug(
        "KV transfer: %d records from %s:%d in %.3f s", len(records), host, port, time.monotonic() - start
    )
    return records
