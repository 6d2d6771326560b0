"""Prefill/decode disaggregation in the router (router/prefill.py): with --prefill-backend the request goes to a
decode replica with x-prefiller-host-port naming a routable prefill replica; a client's own header never
reaches a replica; with no routable prefill replica the header is left out (the decode replica prefills)."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web
from pagoda.router.app import RouterApp
from pagoda.router.cli import build_parser, config_from_args
from pagoda_testkit.processes import free_port


class FakeReplica:
    """Answers /health (``healthy`` decides 200 or 500) and completions, recording their headers."""

    def __init__(self) -> None:
        self.healthy = True
        self.seen: list[dict[str, str]] = []
        self.port = free_port()
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()

        async def health(_: web.Request) -> web.Response:
            return web.Response(status=200 if self.healthy else 500)

        async def completion(request: web.Request) -> web.Response:
            self.seen.append({k.lower(): v for k, v in request.headers.items()})
            return web.json_response({"id": "x", "object": "text_completion", "choices": [{"text": "ok"}]})

        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", completion)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def _router(argv: list[str]) -> tuple[RouterApp, web.AppRunner, int]:
    config = config_from_args(build_parser().parse_args(argv))
    router = RouterApp(config)
    runner = web.AppRunner(router.build())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return router, runner, port


async def _complete(port: int, headers: dict[str, str]) -> int:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps({"prompt": "hi", "max_tokens": 1}),
            headers={"Content-Type": "application/json", **headers},
        ) as r,
    ):
        await r.read()
        return r.status


@pytest.mark.asyncio
async def test_the_decode_replica_is_told_which_prefill_replica_to_use() -> None:
    decode, prefill = FakeReplica(), FakeReplica()
    await decode.start()
    await prefill.start()
    argv = ["--policy", "leastLoaded", "--backend", decode.url, "--prefill-backend", prefill.url]
    router, runner, port = await _router([*argv, "--health-interval", "0.2"])
    try:
        assert await _complete(port, {"x-prefiller-host-port": "evil.example:1"}) == 200
        assert decode.seen[-1]["x-prefiller-host-port"] == f"127.0.0.1:{prefill.port}"
        assert not prefill.seen  # the decode engine asks it, not the router
        state = router.prefill.to_dicts()
        assert [b["url"] for b in state] == [prefill.url]

        prefill.healthy = False  # no routable prefill replica: the decode replica prefills itself
        await router.prefill.pool.check_all()
        await router.prefill.pool.check_all()
        assert not router.prefill.pool.routable()
        assert await _complete(port, {"x-prefiller-host-port": "evil.example:1"}) == 200
        assert "x-prefiller-host-port" not in decode.seen[-1]
        text = router.metrics.render().decode()
        assert f'pagoda:router_prefill_routed_total{{backend="{prefill.url}"}} 1.0' in text
    finally:
        await runner.cleanup()
        await decode.stop()
        await prefill.stop()


@pytest.mark.asyncio
async def test_without_prefill_backends_a_clients_prefiller_header_is_dropped() -> None:
    decode = FakeReplica()
    await decode.start()
    router, runner, port = await _router(["--policy", "roundRobin", "--backend", decode.url])
    try:
        assert router.prefill is None
        assert await _complete(port, {"x-prefiller-host-port": "10.9.9.9:8000"}) == 200
        assert "x-prefiller-host-port" not in decode.seen[-1]
    finally:
        await runner.cleanup()
        await decode.stop()


def test_prefill_flags_are_checked_like_the_backend_flags() -> None:
    parse = build_parser().parse_args
    config = config_from_args(
        parse(
            ["--backend-dns", "d:8000", "--prefill-backend-dns", "p:8000", "--prefill-backend", "http://x:1/"]
        )
    )
    assert config.prefill_backend_dns == ["p:8000"] and config.prefill_backends == ["http://x:1"]
    from pagoda.router.config import ConfigError

    with pytest.raises(ConfigError, match="--prefill-backend-dns must be HOST:PORT"):
        config_from_args(parse(["--backend-dns", "d:8000", "--prefill-backend-dns", "p"]))
    with pytest.raises(ConfigError, match="--prefill-backend must be an http"):
        config_from_args(parse(["--backend-dns", "d:8000", "--prefill-backend", "p:8000"]))
