"""The front end's list of served adapters never diverges from the core's: loads and unloads of one name run
in the order asked, whatever their timing, and a caller that goes away does not cut a change in half."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest

pytestmark = pytest.mark.asyncio


@pytest.fixture
def lora_core(fakes):
    """An AsyncEngine over a fake core that serves adapters by name, taking ``load_s`` to load one."""
    from pagoda.engine.frontend.async_engine import AsyncEngine, CoreThread

    @dataclasses.dataclass
    class LoRACore(fakes.FakeCore):
        load_s: float = 0.05
        adapters: dict = dataclasses.field(default_factory=dict)

        def load_lora_adapter(self, name: str, path: str) -> dict:
            time.sleep(self.load_s * random.random())
            if name in self.adapters:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            self.adapters[name] = path
            return {"name": name, "path": path, "rank": 4, "cache_root": "00"}

        def unload_lora_adapter(self, name: str) -> None:
            if self.adapters.pop(name, None) is None:
                raise KeyError(f"The lora adapter '{name}' cannot be found.")

    engines = []

    def make(**kwargs):
        core = LoRACore(**kwargs)
        engine = AsyncEngine(CoreThread(core), fakes.FakeTokenizer())
        engine.start()
        engines.append(engine)
        return engine, core

    yield make
    for engine in engines:
        engine.shutdown()


async def quietly(coro) -> None:
    try:
        await coro
    except (ValueError, KeyError):
        pass


async def test_an_unload_racing_a_load_of_the_same_name_leaves_both_lists_equal(lora_core) -> None:
    engine, core = lora_core()
    load = asyncio.create_task(engine.load_lora_adapter("a", "/adapters/a"))
    await asyncio.sleep(0)  # the load is on its way to the core
    await engine.unload_lora_adapter("a")  # the unload is asked for after the load: it comes after it
    await load
    assert core.adapters == {} and engine.lora_adapters == {}


async def test_random_races_of_loads_and_unloads_never_diverge(lora_core) -> None:
    engine, core = lora_core(load_s=0.01)
    random.seed(7)
    for _ in range(20):
        ops = [
            engine.load_lora_adapter(n, f"/adapters/{n}")
            if random.random() < 0.6
            else engine.unload_lora_adapter(n)
            for n in random.choices(["a", "b", "c"], k=8)
        ]
        await asyncio.gather(*(quietly(op) for op in ops))
        assert set(engine.lora_adapters) == set(core.adapters)
    assert engine._lora_locks == {}


async def test_a_caller_that_goes_away_mid_load_still_leaves_both_lists_equal(lora_core) -> None:
    engine, core = lora_core(load_s=0.2)
    load = asyncio.create_task(engine.load_lora_adapter("a", "/adapters/a"))
    await asyncio.sleep(0.01)
    load.cancel()  # as when the client closes its connection
    with pytest.raises(asyncio.CancelledError):
        await load
    for _ in range(200):  # the core finishes the load; the front end records its answer all the same
        if core.adapters and engine.lora_adapters:
            break
        await asyncio.sleep(0.01)
    assert core.adapters == {"a": "/adapters/a"} and set(engine.lora_adapters) == {"a"}


# ---------------------------------------------------------------- the runtime routes are off unless enabled


async def test_runtime_lora_routes_are_404_unless_enabled(lora_core, monkeypatch) -> None:
    import httpx
    from pagoda.engine.cli.serve_args import parse_args, server_settings
    from pagoda.engine.server.app import build_app
    from pagoda.engine.server.settings import ServerSettings

    engine, core = lora_core()
    load = {"lora_name": "a", "lora_path": "/adapters/a"}

    async def post(settings: ServerSettings, route: str, body: dict) -> httpx.Response:
        app = build_app(engine, settings)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://pagoda"
        ) as client:
            return await client.post(route, json=body)

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    for route, body in (("/v1/load_lora_adapter", load), ("/v1/unload_lora_adapter", {"lora_name": "a"})):
        r = await post(ServerSettings(), route, body)
        assert r.status_code == 404, r.text
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    assert (await post(ServerSettings(), "/v1/load_lora_adapter", load)).status_code == 404
    assert core.adapters == {}

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # vLLM's variable, read as vLLM reads it
    r = await post(ServerSettings(), "/v1/load_lora_adapter", load)
    assert r.status_code == 200 and "added successfully" in r.text and core.adapters == {"a": "/adapters/a"}

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    settings = server_settings(parse_args(["--allow-runtime-lora-updating"]))  # Pagoda's flag
    assert (
        settings.allow_runtime_lora_updating
        and not server_settings(parse_args([])).allow_runtime_lora_updating
    )
    r = await post(settings, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert r.status_code == 200 and core.adapters == {}
