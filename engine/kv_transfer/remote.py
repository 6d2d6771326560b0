"""The API server's side of a prefill/decode split: llm-d's request flow, and vLLM's proxy style.

Consumer (a decode engine): a request that names a prefill engine (header ``x-prefiller-host-port:
HOST:PORT``, its HTTP address) is first prefilled there: the prompt's token ids go to that engine's
/v1/completions with ``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode": true}``; its answer's
``kv_transfer_params`` say where to fetch the blocks (``remote_port``, ``remote_request_id``). A request whose
body already carries ``kv_transfer_params`` with ``do_remote_prefill`` and those fields (a proxy asked the
prefill engine itself) is fetched from directly. The blocks come over TCP (engine/kv_transfer/wire.py), their
checksums are checked on a worker thread, the engine core checks the rest of each record (identity, shape,
dtype) and stages them between two steps, then the request is added as usual: the scheduler finds its prompt
blocks as prefix-cache hits and computes only what is missing.

Whatever fails on the way (the prefill engine down or refusing, the fetch, a record that fails its checks)
is logged, counted in ``pagoda:kv_transfer_failures_total{reason}`` and ends there: the request is then
prefilled here, so a failure costs time, never tokens.

Producer (a prefill engine): a request with ``kv_transfer_params: {"do_remote_decode": true}`` is run with
``kv_export`` (the core holds its prompt blocks when it finishes) and its answer carries the
``kv_transfer_params`` a decode engine needs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagoda.engine.kv_transfer.wire import TransferError, fetch_blocks
from pagoda.engine.offload.disk_tier import check_record_checksum

log = logging.getLogger("pagoda.engine.kv_transfer")

PREFILLER_HEADER = "x-prefiller-host-port"
DEFAULT_PREFILL_TIMEOUT_S = 300.0
DEFAULT_FETCH_TIMEOUT_S = 60.0
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def split_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); ValueError when it is not one."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{PREFILLER_HEADER} must be HOST:PORT, got {text!r}")
    return host, int(port)


@dataclass
class RemotePrefill:
    """Where a request's prompt is to be prefilled: a prefill engine to ask, or blocks already prefilled."""

    prefiller: tuple[str, int] | None = None
    params: dict[str, Any] | None = None  # the body's kv_transfer_params (do_remote_prefill)

    @property
    def fetch_ready(self) -> bool:
        p = self.params or {}
        return isinstance(p.get("remote_port"), int) and isinstance(p.get("remote_request_id"), str)


class TransferMetrics:
    """The consumer's transfer series, in the server's Prometheus registry (GET /metrics)."""

    def __init__(self, registry: Any, labels: dict[str, str]) -> None:
        from prometheus_client import Counter, Histogram

        names = list(labels)
        self.labels = labels
        self.requests = Counter(
            "pagoda:kv_transfer_requests", "Requests this engine served through a KV transfer, by role.",
            [*names, "role"], registry=registry,
        )  # fmt: skip
        self.bytes = Counter(
            "pagoda:kv_transfer_received_bytes", "KV block bytes received from prefill engines.", names,
            registry=registry,
        )  # fmt: skip
        self.blocks = Counter(
            "pagoda:kv_transfer_received_blocks", "KV blocks received, verified and staged.", names,
            registry=registry,
        )  # fmt: skip
        self.fetch_seconds = Histogram(
            "pagoda:kv_transfer_fetch_seconds", "Seconds of one block fetch over TCP (connect to last byte).",
            names, buckets=_SECONDS_BUCKETS, registry=registry,
        )  # fmt: skip
        self.seconds = Histogram(
            "pagoda:kv_transfer_seconds",
            "Seconds from a request's arrival to its blocks staged (remote prefill, fetch, verification).",
            names, buckets=_SECONDS_BUCKETS, registry=registry,
        )  # fmt: skip
        self.failures = Counter(
            "pagoda:kv_transfer_failures",
            "Remote prefills that fell back to a local prefill, by reason (prefiller, fetch, verify, stage).",
            [*names, "reason"], registry=registry,
        )  # fmt: skip


class KVTransferServing:
    """What OpenAIServing asks about KV transfers; a no-op for an engine without --kv-transfer-config."""

    def __init__(self, engine: Any, exporter: Any = None) -> None:
        self.engine = engine
        info = getattr(engine.info, "kv_transfer", None) or {}
        role = info.get("kv_role")
        self.produces = role in ("kv_producer", "kv_both") and info.get("kv_port") is not None
        self.consumes = role in ("kv_consumer", "kv_both")
        self.kv_port = info.get("kv_port")
        self.prefill_timeout = DEFAULT_PREFILL_TIMEOUT_S
        self.fetch_timeout = DEFAULT_FETCH_TIMEOUT_S
        registry = getattr(exporter, "registry", None)
        self.metrics = (
            TransferMetrics(registry, dict(exporter.labels))
            if registry is not None and role is not None
            else None
        )

    # -- consumer --------------------------------------------------------------------------------------------
    def remote_of(
        self, headers: Mapping[str, str], body_params: dict[str, Any] | None
    ) -> RemotePrefill | None:
        """The request's remote prefill, or None (prefill here). A malformed header is a local prefill."""
        if not self.consumes:
            return None
        params = (
            body_params if isinstance(body_params, dict) and body_params.get("do_remote_prefill") else None
        )
        target = headers.get(PREFILLER_HEADER)
        prefiller = None
        if target:
            try:
                prefiller = split_host_port(target)
            except ValueError as exc:
                log.warning("KV transfer: %s; prefilling here", exc)
        if prefiller is None and params is None:
            return None
        return RemotePrefill(prefiller, params)

    async def prefill_remotely(
        self, remote: RemotePrefill, token_ids: list[int], model: str | None, authorization: str | None
    ) -> int:
        """Have the prompt prefilled elsewhere and its blocks staged in this engine; the number of blocks
        staged (0 when anything failed: the request is then prefilled here)."""
        start = time.perf_counter()
        stage = "prefiller"
        try:
            params = remote.params or {}
            host = params.get("remote_host") if isinstance(params.get("remote_host"), str) else None
            if not remote.fetch_ready:
                if remote.prefiller is None:
                    raise TransferError(
                        "kv_transfer_params lack remote_port/remote_request_id and no prefiller"
                    )
                params = await asyncio.to_thread(
                    ask_prefiller, remote.prefiller, token_ids, model, authorization, self.prefill_timeout
                )
                host = remote.prefiller[0]
            if not host and remote.prefiller is not None:
                host = remote.prefiller[0]
            if not host:
                raise TransferError("kv_transfer_params lack remote_host")
            stage = "fetch"
            t_fetch = time.perf_counter()
            records = await asyncio.to_thread(
                fetch_blocks,
                host,
                int(params["remote_port"]),
                str(params["remote_request_id"]),
                self.fetch_timeout,
            )
            fetch_s = time.perf_counter() - t_fetch
            received = sum(len(r) for r in records)
            stage = "stage"
            good, bad, why = await asyncio.to_thread(checked_prefix, records)
            if bad:
                log.warning("KV transfer: block %d of %d failed its checksum (%s); it and the ones after it "
                            "will be computed", len(good), len(records), why)  # fmt: skip
            result = await self.engine.kv_transfer_stage(good, True)
            staged = int(result.get("staged", 0))
            if self.metrics is not None:
                m, lbl = self.metrics, self.metrics.labels
                m.requests.labels(**lbl, role="consumer").inc()
                m.bytes.labels(**lbl).inc(received)
                m.blocks.labels(**lbl).inc(staged)
                m.fetch_seconds.labels(**lbl).observe(fetch_s)
                m.seconds.labels(**lbl).observe(time.perf_counter() - start)
                if bad or result.get("rejected"):
                    m.failures.labels(**lbl, reason="verify").inc()
            return staged
        except Exception as exc:  # noqa: BLE001 - any failure is a local prefill, never an error
            log.warning("KV transfer (%s) failed: %s; prefilling here", stage, exc)
            if self.metrics is not None:
                self.metrics.failures.labels(**self.metrics.labels, reason=stage).inc()
            return 0

    # -- producer --------------------------------------------------------------------------------------------
    def exports(self, body_params: dict[str, Any] | None) -> bool:
        """A remote-decode prefill: its prompt blocks are to be held for a decode engine."""
        return self.produces and isinstance(body_params, dict) and bool(body_params.get("do_remote_decode"))

    def answer_params(self, request_id: str, host: str | None) -> dict[str, Any]:
        """The ``kv_transfer_params`` a prefill answer carries (vLLM's names): where to fetch its blocks."""
        if self.metrics is not None:
            self.metrics.requests.labels(**self.metrics.labels, role="producer").inc()
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_request_id": request_id,
            "remote_host": host,
            "remote_port": self.kv_port,
        }


def checked_prefix(records: list[bytes]) -> tuple[list[bytes], int, str | None]:
    """The records up to the first whose payload fails its checksum (the blocks after it in the chain could
    not be used anyway), how many were dropped, and why. Runs on a worker thread: hashing never holds the
    engine's step loop."""
    for i, raw in enumerate(records):
        try:
            check_record_checksum(raw)
        except ValueError as exc:
            return records[:i], len(records) - i, str(exc)
    return records, 0, None


def ask_prefiller(
    prefiller: tuple[str, int],
    token_ids: list[int],
    model: str | None,
    authorization: str | None,
    timeout: float,
) -> dict[str, Any]:
    """POST the prompt's token ids to the prefill engine's /v1/completions (max_tokens 1, do_remote_decode);
    its answer's kv_transfer_params. Blocking: run it on a worker thread."""
    host, port = prefiller
    body: dict[str, Any] = {
        "prompt": token_ids,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    if model:
        body["model"] = model
    headers = {"Content-Type": "application/json"}
    if authorization:
        headers["Authorization"] = authorization
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    req = urllib.request.Request(
        f"http://{netloc}/v1/completions", data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - http to a named engine
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise TransferError(f"the prefill engine {netloc} answered {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise TransferError(f"the prefill engine {netloc}: {exc}") from None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict) or not isinstance(params.get("remote_port"), int):
        raise TransferError(f"the prefill engine {netloc} sent no kv_transfer_params (is it a kv_producer?)")
    if not isinstance(params.get("remote_request_id"), str):
        raise TransferError(f"the prefill engine {netloc} sent no remote_request_id")
    return params
