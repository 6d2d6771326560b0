"""`pagoda router --ext-proc-port`: the router as a Gateway API Inference Extension endpoint picker
(router/ext_proc.py). A Python gRPC client plays Envoy on loopback against the picker served in this
process, over the router tests' fake replicas (fake_replica.py, with routing state from their environment):
the proxy's policies decide (prefix, least load, LoRA affinity, tier-aware), the answer names the endpoint
in the header and the envoy.lb metadata alike, the gateway's subset hint is obeyed, no endpoint is an
immediate 503 (a full hold a 429), and gRPC health answers SERVING."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagoda.engine.kv_cache.hashing import adapter_chain_root
from pagoda.router.app import RouterApp
from pagoda.router.chain import chain_of
from pagoda.router.config import RouterConfig
from pagoda.router.ext_proc import (
    DESTINATION,
    LB_NAMESPACE,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    ExternalProcessor,
    endpoint_of,
    serve,
    struct_of,
)

FAKE = str(Path(__file__).with_name("fake_replica.py"))
BLOCK = 4
MODES = processing_mode_pb2.ProcessingMode
DISK_PROMPT = list(range(1000, 1400))  # 100 blocks on the "disk" replica's disk tier
ROOT = adapter_chain_root("sql-weights")


def _replica(kit, log_dir: Path, name: str, load: int, info: dict, kv: dict | None = None):
    port = kit.free_port()
    env = {"FAKE_LOAD": str(load), "FAKE_ROUTER_INFO": json.dumps(info), "FAKE_KV": json.dumps(kv or {})}
    argv = [sys.executable, FAKE, str(port), "ok", str(log_dir / f"{name}.requests")]
    return kit.start(log_dir, argv, port, f"fake-{name}", env)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, kit):
    """idle (load 0), busy (load 6), lora (load 3, has adapter "sql"), disk (load 0, DISK_PROMPT's blocks
    on its disk tier): every one block size 4, no extra keys."""
    log_dir = tmp_path_factory.mktemp("ext_proc")
    info = {"block_size": BLOCK, "extra_keys": []}
    disk_chain = chain_of(DISK_PROMPT, BLOCK, ())
    procs = {
        "idle": _replica(kit, log_dir, "idle", 0, info),
        "busy": _replica(kit, log_dir, "busy", 6, info),
        "lora": _replica(kit, log_dir, "lora", 3, {**info, "lora_adapters": {"sql": ROOT.hex()}}),
        "disk": _replica(kit, log_dir, "disk", 0, info, {"disk": disk_chain}),
    }
    try:
        yield {name: kit.wait_healthy(p, 30).url for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.stop()


class Picker:
    """A RouterApp (pool following the replicas, no HTTP side) with its ext_proc server, and a stub."""

    def __init__(self, backends: list[str], policy: str, **config: object) -> None:
        self.config = RouterConfig(
            backends=backends, policy=policy, health_interval=0.2, events_interval=0.05, **config
        ).validate()

    async def __aenter__(self) -> Picker:
        self.app = RouterApp(self.config)
        await self.app.pool.start()
        app = self.app
        limit = self.config.max_request_body_bytes
        processor = ExternalProcessor(app.picker, app.hold, app.metrics, self.config.policy, limit)
        self.server, port = await serve(processor, "127.0.0.1", 0)
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.channel.close()
        await self.server.stop(None)
        await self.app.pool.close()

    async def synced(self) -> None:
        """Until every replica's KV snapshot is loaded (the disk tier must be known)."""
        for _ in range(200):
            if all(b.index.synced for b in self.app.pool.backends.values()):
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the picker never loaded the replicas' KV snapshots")

    async def route(
        self,
        body: dict | None,
        mode: int = MODES.BUFFERED,
        subset: list[str] | None = None,
        path: str = "/v1/completions",
    ) -> list[pb.ProcessingResponse]:
        """One request as Envoy sends it in ``mode``; every answer the picker gave."""
        call = self.stub.Process()
        head = pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(
                headers=base_pb2.HeaderMap(
                    headers=[
                        base_pb2.HeaderValue(key=":method", raw_value=b"POST" if body else b"GET"),
                        base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
                        base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
                    ]
                ),
                end_of_stream=body is None,
            ),
            protocol_config=pb.ProtocolConfiguration(request_body_mode=mode),
        )
        if subset is not None:
            head.metadata_context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(struct_of({SUBSET_KEY: subset}))
        got: list[pb.ProcessingResponse] = []
        await call.write(head)
        if body is None:
            got.append(await call.read())
        elif mode == MODES.BUFFERED:  # headers answered first, then the whole body in one message
            got.append(await call.read())
            if not got[-1].HasField("immediate_response"):
                raw = json.dumps(body).encode()
                await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True)))
                got.append(await call.read())
        else:  # full duplex: the body in two chunks without waiting; all answers come at its end
            raw = json.dumps(body).encode()
            half = len(raw) // 2
            await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=raw[:half])))
            await call.write(
                pb.ProcessingRequest(request_body=pb.HttpBody(body=raw[half:], end_of_stream=True))
            )
            got.append(await call.read())
            if not got[-1].HasField("immediate_response"):
                got.append(await call.read())
        await call.done_writing()
        while (rest := await call.read()) is not grpc.aio.EOF:
            got.append(rest)
        return got

    async def pick(self, body: dict | None, **kw: object) -> str:
        """The endpoint the picker chose (the header and the metadata must agree)."""
        return endpoint(await self.route(body, **kw))


def decisions(p: Picker, policy: str, reason: str) -> float:
    labels = {"policy": policy, "reason": reason}
    return p.app.metrics.registry.get_sample_value("pagoda:router_decisions_total", labels) or 0.0


def endpoint(answers: list[pb.ProcessingResponse]) -> str:
    found = []
    for a in answers:
        phase = a.WhichOneof("response")
        assert phase != "immediate_response", a
        for h in getattr(a, phase).response.header_mutation.set_headers:
            if h.header.key == DESTINATION:
                meta = json_format.MessageToDict(a.dynamic_metadata)
                assert meta == {LB_NAMESPACE: {DESTINATION: h.header.raw_value.decode()}}
                found.append(h.header.raw_value.decode())
    assert len(found) == 1, answers
    return found[0]


def immediate(answers: list[pb.ProcessingResponse]) -> tuple[int, dict[str, str], dict]:
    imm = answers[-1].immediate_response
    assert answers[-1].HasField("immediate_response"), answers
    headers = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    return imm.status.code, headers, json.loads(imm.body)


def prompt(seed: int, n: int = 64) -> dict:
    return {"model": "m", "prompt": [seed * 1000 + i for i in range(n)], "max_tokens": 4}


def test_a_repeated_prefix_goes_to_the_same_replica(replicas):
    """prefix: two cold prompts are spread over two equal replicas; each one's repeats (and a longer
    continuation of it) follow it, as the proxy's predictions make them (router/index.py)."""

    async def scenario() -> None:
        async with Picker([replicas["idle"], replicas["disk"]], "prefix") as p:
            first_a, first_b = await p.pick(prompt(1)), await p.pick(prompt(2))
            assert first_a != first_b  # equal replicas share cold prompts
            for _ in range(3):
                assert await p.pick(prompt(1)) == first_a
                assert await p.pick(prompt(2), mode=MODES.FULL_DUPLEX_STREAMED) == first_b
            longer = {**prompt(1), "prompt": prompt(1)["prompt"] + [7, 8, 9, 10, 11]}
            assert await p.pick(longer) == first_a
            assert decisions(p, "prefix", "prefix_hit") == 7

    asyncio.run(scenario())


def test_least_load_and_the_subset_hint(replicas):
    """leastLoaded: the idle replica over the busy one; with the gateway's subset hint naming only the busy
    one, the busy one; a hint naming no replica of the pool, or an empty one, is an immediate 503."""
    idle, busy = endpoint_of(replicas["idle"]), endpoint_of(replicas["busy"])

    async def scenario() -> None:
        async with Picker([replicas["idle"], replicas["busy"]], "leastLoaded") as p:
            for _ in range(3):
                assert await p.pick(prompt(3)) == idle
            assert await p.pick(prompt(3), subset=[busy]) == busy
            assert await p.pick(prompt(3), subset=[busy, idle]) == idle
            assert await p.pick(None, subset=[busy]) == busy  # no body: picked at the headers
            for hint in (["10.9.9.9:8000"], []):
                status, headers, body = immediate(await p.route(prompt(3), subset=hint))
                assert status == 503 and body["error"]["code"] == "no_backend"

    asyncio.run(scenario())


def test_lora_affinity(replicas):
    """A request for adapter "sql" goes to the replica that has it loaded, busier as it is; the base model's
    to the idle one (the loaded replica is beyond the load bound)."""

    async def scenario() -> None:
        async with Picker([replicas["idle"], replicas["lora"]], "prefix") as p:
            for mode in (MODES.BUFFERED, MODES.FULL_DUPLEX_STREAMED):
                assert await p.pick({**prompt(4), "model": "sql"}, mode=mode) == endpoint_of(replicas["lora"])
                assert await p.pick({**prompt(5), "model": "m"}, mode=mode) == endpoint_of(replicas["idle"])

    asyncio.run(scenario())


def test_tier_aware_prefers_the_replica_with_the_prompt_on_disk(replicas):
    """tierAware: 400 tokens whose blocks sit on one replica's disk tier cost a load, not a prefill there."""

    async def scenario() -> None:
        async with Picker([replicas["idle"], replicas["disk"]], "tierAware") as p:
            await p.synced()
            body = {"model": "m", "prompt": DISK_PROMPT + [1, 2, 3], "max_tokens": 1}
            assert await p.pick(body) == endpoint_of(replicas["disk"])
            assert decisions(p, "tierAware", "tier_hit") == 1
            # sent there: the blocks are predicted on its device now, as after a proxied request
            assert await p.pick(body) == endpoint_of(replicas["disk"])
            assert decisions(p, "tierAware", "device_hit") == 1

    asyncio.run(scenario())


def test_full_duplex_returns_the_whole_body_and_buffered_continues_the_headers(replicas):
    async def scenario() -> None:
        async with Picker([replicas["idle"]], "prefix") as p:
            body = prompt(6)
            buffered = await p.route(body)
            assert buffered[0].request_headers.response.status == pb.CommonResponse.CONTINUE
            assert not buffered[0].request_headers.response.header_mutation.set_headers
            assert buffered[1].WhichOneof("response") == "request_body"
            duplex = await p.route(body, mode=MODES.FULL_DUPLEX_STREAMED)
            assert [a.WhichOneof("response") for a in duplex] == ["request_headers", "request_body"]
            streamed = duplex[1].request_body.response.body_mutation.streamed_response
            assert json.loads(streamed.body) == body and streamed.end_of_stream
            assert endpoint(buffered) == endpoint(duplex) == endpoint_of(replicas["idle"])

    asyncio.run(scenario())


def test_full_duplex_passes_the_answer_through(replicas):
    """The response phases of a full-duplex stream: headers continue, each body chunk comes back as is
    (the picker holds nothing of the answer: tokens stream on)."""

    async def scenario() -> None:
        async with Picker([replicas["idle"]], "leastLoaded") as p:
            call = p.stub.Process()
            mode = pb.ProtocolConfiguration(request_body_mode=MODES.FULL_DUPLEX_STREAMED)
            await call.write(pb.ProcessingRequest(request_headers=pb.HttpHeaders(), protocol_config=mode))
            await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True)))
            assert endpoint([await call.read(), await call.read()]) == endpoint_of(replicas["idle"])
            await call.write(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
            assert (await call.read()).response_headers.response.status == pb.CommonResponse.CONTINUE
            for chunk, last in ((b"data: w0\n\n", False), (b"data: [DONE]\n\n", True)):
                await call.write(
                    pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=last))
                )
                back = (await call.read()).response_body.response.body_mutation.streamed_response
                assert (back.body, back.end_of_stream) == (chunk, last)
            assert p.app.pool.backends[replicas["idle"]].inflight == 1  # open until the stream ends
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            await asyncio.sleep(0.1)
            assert p.app.pool.backends[replicas["idle"]].inflight == 0

    asyncio.run(scenario())


def test_no_replica_is_an_immediate_503_and_a_full_hold_429(kit):
    dead = f"http://127.0.0.1:{kit.free_port()}"  # nothing listens there

    async def scenario() -> None:
        async with Picker([dead], "prefix") as p:
            status, headers, body = immediate(await p.route(prompt(7)))
            assert status == 503 and headers["retry-after"] == "1" and body["error"]["code"] == "no_backend"
        async with Picker([dead], "prefix", hold_seconds=1.5, hold_max_requests=1) as p:
            held = asyncio.create_task(p.route(prompt(8)))
            while p.app.hold.waiting < 1:
                await asyncio.sleep(0.01)
            status, headers, body = immediate(await p.route(prompt(9)))
            assert status == 429 and body["error"]["code"] == "hold_full" and int(headers["retry-after"]) > 0
            status, _, body = immediate(await held)  # none came up within the hold
            assert status == 503 and body["error"]["code"] == "no_backend"

    asyncio.run(scenario())


def test_a_body_past_the_limit_is_an_immediate_413(replicas):
    """--max-request-body-bytes, as the proxy (and the engine) apply it: in either body mode."""

    async def scenario() -> None:
        async with Picker([replicas["idle"]], "prefix", max_request_body_bytes=1000) as p:
            for mode in (MODES.BUFFERED, MODES.FULL_DUPLEX_STREAMED):
                status, _, body = immediate(await p.route(prompt(10, n=400), mode=mode))
                assert status == 413 and body["error"]["code"] == "request_too_large"
                assert await p.pick(prompt(10, n=20), mode=mode) == endpoint_of(replicas["idle"])

    asyncio.run(scenario())


def test_grpc_health_is_serving(replicas):
    async def scenario() -> None:
        async with Picker([replicas["idle"]], "prefix") as p:
            health = health_pb2_grpc.HealthStub(p.channel)
            for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                got = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert got.status == health_pb2.HealthCheckResponse.SERVING, service
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await health.Check(health_pb2.HealthCheckRequest(service="nope"))
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(scenario())


def test_pagoda_router_serves_the_picker_beside_the_proxy(replicas, tmp_path, kit):
    """The command itself: `pagoda router --ext-proc-port N` answers health and picks on N, while its HTTP
    side (/health, /metrics, the proxy) runs as ever."""
    port = kit.free_port()
    router = kit.start_router(tmp_path, [replicas["idle"]], "--ext-proc-port", str(port), *kit.FAST)

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            got = await health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=30)
            assert got.status == health_pb2.HealthCheckResponse.SERVING
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(pb.ProcessingRequest(request_headers=pb.HttpHeaders(end_of_stream=True)))
            assert endpoint([await call.read()]) == endpoint_of(replicas["idle"])
            await call.done_writing()

    try:
        asyncio.run(scenario())
        assert router.metric("pagoda:router_routed_total", backend=replicas["idle"]) == 1
    finally:
        router.stop()


def test_the_cli_takes_the_port():
    from pagoda.router.cli import build_parser, config_from_args

    args = build_parser().parse_args(["--backend", "http://a:8000", "--ext-proc-port", "9002"])
    assert config_from_args(args).ext_proc_port == 9002
    bad = build_parser().parse_args(["--backend", "http://a:8000", "--ext-proc-port", "8000"])
    with pytest.raises(ValueError, match="--ext-proc-port"):
        config_from_args(bad)
