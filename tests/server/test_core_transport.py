"""Between the front end and the engine core's process (engine/frontend/core_process.py): no command is ever
dropped, a core that cannot keep up makes requests wait (or get a 503 with Retry-After before they are
admitted, never after), a core that dies ends every waiting request with an error, and a core never
outlives its front end. A fake core runs in the real core process behind the real ZMQ transport: what is
tested is the transport, not a model."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from pagoda_testkit.fake_core import FakeCoreFactory

BODY = {"model": "fake", "prompt": "a b", "max_tokens": 2}


def _app(engine, **settings):
    from pagoda.engine.server.app import build_app
    from pagoda.engine.server.settings import ServerSettings

    return build_app(engine, ServerSettings(**settings))


def _start(fakes, factory: FakeCoreFactory):
    from pagoda.engine.frontend.async_engine import AsyncEngine
    from pagoda.engine.frontend.core_process import CoreProcess

    core = CoreProcess(None, core_factory=factory)
    engine = AsyncEngine(core, fakes.FakeTokenizer())
    engine.start()
    return engine, core


async def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_3000_concurrent_requests_to_a_core_in_a_long_step_are_all_answered(fakes, tmp_path):
    """The core holds its first step (a first compile, a long prefill) while 3,000 requests arrive, far
    more than the sockets queue (1,000 a side): every one is admitted (the queue limit allows them), waits,
    and is answered in full once the core reads again. Before, a third of them were dropped and never
    answered."""
    release = tmp_path / "release"
    engine, core = _start(fakes, FakeCoreFactory(hold_until=str(release)))
    n = 3000
    try:
        app = _app(engine, max_num_queued_reqs=100_000)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://pagoda", timeout=90) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json=BODY)) for _ in range(n)]
            await _until(lambda: len(engine._streams) == n, 60, "not every request was admitted")
            backlog = getattr(core, "backlog", 0)
            release.touch()
            done, pending = await asyncio.wait(tasks, timeout=60)
            assert not pending, f"{len(pending)} of {n} requests never answered"
            answers = [t.result() for t in done]
        assert backlog > 0  # the sockets were full: the rest waited in order in the outbox
        assert sorted({r.status_code for r in answers}) == [200]
        assert {r.json()["usage"]["completion_tokens"] for r in answers} == {2}
        assert {r.json()["choices"][0]["text"] for r in answers} == {" w1 w2"}
        assert core.backlog == 0 and not engine._streams and engine.is_alive
    finally:
        release.touch()
        engine.shutdown()


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_past_the_queue_limit_a_busy_core_gets_503s_before_admission_never_after(fakes, tmp_path):
    """With the core held and a queue limit of 300, 500 concurrent requests: 300 are admitted and each is
    answered in full; the other 200 get a 503 with Retry-After at once; nothing fails after admission."""
    release = tmp_path / "release"
    engine, core = _start(fakes, FakeCoreFactory(hold_until=str(release)))
    try:
        app = _app(engine, max_num_queued_reqs=300, retry_after_seconds=2)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://pagoda", timeout=90) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json=BODY)) for _ in range(500)]
            await _until(lambda: sum(t.done() for t in tasks) == 200, 60, "the overflow was not refused")
            refused = [t.result() for t in tasks if t.done()]
            assert len(engine._streams) == 300
            release.touch()
            answers = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert {r.status_code for r in refused} == {503}
        assert {r.headers["retry-after"] for r in refused} == {"2"}
        assert {r.json()["error"]["code"] for r in refused} == {"queue_full"}
        ok = [r for r in answers if r.status_code == 200]
        assert len(ok) == 300 and {r.json()["usage"]["completion_tokens"] for r in ok} == {2}
    finally:
        release.touch()
        engine.shutdown()


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_core_that_dies_with_commands_waiting_ends_every_request_with_an_error(fakes, tmp_path):
    """The core dies in its long step with 2,000 requests waiting for it (most still in the front end's
    outbox): every client gets a 500 naming the core's death, at once, none hangs; new ones get 503."""
    release, started = tmp_path / "release", tmp_path / "started"
    engine, core = _start(fakes, FakeCoreFactory(hold_until=str(release), started_file=str(started)))
    n = 2000
    try:
        app = _app(engine, max_num_queued_reqs=100_000)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://pagoda", timeout=90) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json=BODY)) for _ in range(n)]
            await _until(lambda: len(engine._streams) == n and started.exists(), 60, "not all admitted")
            os.kill(core.pid, signal.SIGKILL)
            done, pending = await asyncio.wait(tasks, timeout=30)
            assert not pending, f"{len(pending)} of {n} requests hang after the core died"
            answers = [t.result() for t in done]
            late = await client.post("/v1/completions", json=BODY)
        assert {r.status_code for r in answers} == {500}
        assert {r.json()["error"]["code"] for r in answers} == {"engine_error"}
        assert all("killed by signal 9" in r.json()["error"]["message"] for r in answers)
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
        assert core.backlog == 0
    finally:
        release.touch()
        engine.shutdown()


# ---------------------------------------------------------------- a core never outlives its front end

FRONT_END = """
import sys, time
import msgspec
from pagoda_testkit.fake_core import FakeCoreFactory
from pagoda.engine.frontend.core_process import CoreProcess
from pagoda.engine.core.messages import AddRequests, EngineCoreRequest
from pagoda.engine.sampling_params import SamplingParams

if __name__ == "__main__":
    core = CoreProcess(None, core_factory=FakeCoreFactory(gil_bound=True, started_file=sys.argv[1]))
    print("CORE", core.pid, flush=True)
    add = AddRequests([EngineCoreRequest("r", [1], SamplingParams(max_tokens=2), 2, 0.0)])
    core._in.send(msgspec.msgpack.encode(add))  # blocks until the core is connected
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(120)
def test_a_core_stuck_holding_the_gil_dies_with_its_front_end(tmp_path):
    """The front end is SIGKILLed while its core is in a step that holds the GIL (a runaway regex) and
    ignores SIGTERM: the core is gone within seconds. Before, it spun on as an orphan until its step
    ended (here: for days)."""
    started = tmp_path / "started"
    script = tmp_path / "front_end.py"
    script.write_text(FRONT_END)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(started)], stdout=subprocess.PIPE, text=True, env=env
    )
    core_pid = None
    try:
        line = proc.stdout.readline()
        assert line.startswith("CORE"), line
        core_pid = int(line.split()[1])
        deadline = time.monotonic() + 60
        while not started.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the core never started its step"
            time.sleep(0.05)
        time.sleep(0.5)  # inside the regex now
        assert _alive(core_pid)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 5
        while _alive(core_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(core_pid), "the engine core outlived its front end"
    finally:
        proc.kill()
        if core_pid is not None and _alive(core_pid):
            os.kill(core_pid, signal.SIGKILL)
