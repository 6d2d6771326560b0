"""The engine's memory facts for its supervisor: exit code 3 and the termination message when start-up runs out
of memory, GET /pagoda/memory when it starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pagoda.engine.cli import serve
from pagoda.engine.exit_codes import (
    EXIT_OUT_OF_MEMORY,
    FORMAT,
    MESSAGE_LIMIT,
    REASON_CUDA_OOM,
    REASON_KV_TOO_SMALL,
    parse_termination_message,
    termination_message,
)


@pytest.fixture
def termination_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "termination-log"
    monkeypatch.setenv("PAGODA_TERMINATION_LOG", str(path))
    return path


CPU_TOO_SMALL = [
    "--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", "64MiB", "--max-model-len", "4096",
    "--skip-tokenizer-init",
]  # fmt: skip


def test_a_context_that_does_not_fit_exits_3(termination_log: Path, capsys) -> None:
    import torch

    torch.set_num_threads(2)
    assert serve.main(CPU_TOO_SMALL) == EXIT_OUT_OF_MEMORY
    assert "out of memory at start-up" in capsys.readouterr().err
    failure = parse_termination_message(termination_log.read_text())
    assert failure is not None and failure["reason"] == REASON_KV_TOO_SMALL and failure["exitCode"] == 3
    assert "the largest max_model_len that fits is 1456" in failure["message"]


def test_the_refusal_carries_the_measured_profile(termination_log: Path) -> None:
    import torch

    torch.set_num_threads(2)
    assert serve.main(CPU_TOO_SMALL) == EXIT_OUT_OF_MEMORY
    profile = parse_termination_message(termination_log.read_text())["profile"]
    assert profile["kv_cache_bytes"] == 64 << 20 and profile["weights_bytes"] > 500 << 20
    assert profile["measured"] is True and profile["kv_allocated_bytes"] == 0


def test_cuda_out_of_memory_exits_3(termination_log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a CUDA OOM while loading looks like to the supervisor (simulated: there is no GPU here; the core
    is built in this process, where the simulation can reach it)."""
    import torch
    from pagoda.engine.core import engine_core

    def oom(*_: object, **__: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(engine_core, "EngineCore", oom)
    assert serve.main(["--device", "cpu", "--no-engine-process"]) == EXIT_OUT_OF_MEMORY
    failure = parse_termination_message(termination_log.read_text())
    assert failure["reason"] == REASON_CUDA_OOM and "Tried to allocate 2.00 GiB" in failure["message"]


def test_other_start_failures_keep_exit_1(termination_log: Path) -> None:
    assert serve.main(["/no/such/model", "--device", "cpu"]) == 1
    assert not termination_log.exists()


def test_the_message_fits_the_kubelets_limit() -> None:
    text = termination_message(REASON_CUDA_OOM, "x" * 10_000, {"weights_bytes": 1})
    assert len(text.encode()) <= MESSAGE_LIMIT
    body = json.loads(text)
    assert body["format"] == FORMAT and body["profile"] == {"weights_bytes": 1}
    assert body["message"].endswith("...")
    assert parse_termination_message("Error: something else") is None
    assert parse_termination_message(json.dumps({"format": "other"})) is None


def test_the_memory_profile_is_served() -> None:
    import torch
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.frontend.llm_engine import LLMEngine
    from pagoda.engine.server.memory_status import ROUTE, install_memory_status

    torch.set_num_threads(2)
    engine = LLMEngine(
        EngineConfig(
            device="cpu", kv_cache_memory_bytes=64 << 20, max_model_len="auto", skip_tokenizer_init=True
        )
    )
    try:
        profile = engine.info.memory_profile
    finally:
        engine.close()
    assert profile["weights_bytes"] == engine.runner.weights_bytes()
    assert profile["kv_allocated_bytes"] == engine.num_blocks * 16 * engine.kv_bytes_per_token
    assert profile["num_blocks"] == engine.num_blocks and profile["max_model_len"] == engine.max_model_len
    app = FastAPI()
    install_memory_status(app, profile)
    assert TestClient(app).get(ROUTE).json() == json.loads(json.dumps(profile))


def test_the_operators_plan_is_what_the_default_image_measures() -> None:
    """The operator re-plans when an upgraded image measures a KV cache or weights more than 10% off the plan
    (operator/profile.py); for the engine of this checkout, started with the args the operator renders for a
    CPU pod of the default model, the measured profile matches the plan: no re-plan for nothing."""
    import torch
    from pagoda.engine.cli.serve_args import engine_config_kwargs, parse_args
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.frontend.llm_engine import LLMEngine
    from pagoda.operator import profile, render
    from pagoda.operator.planning import decide
    from pagoda.operator.spec import parse_spec

    torch.set_num_threads(2)
    spec = parse_spec({"gpu": {"count": 0}, "resources": {"limits": {"memory": "3Gi"}}})
    decision = decide(spec, {})
    engine = LLMEngine(EngineConfig(**engine_config_kwargs(parse_args(render.engine_args(spec, decision)))))
    try:
        measured = engine.info.memory_profile
    finally:
        engine.close()
    assert profile.differences(decision.plan, measured) == []
    assert measured["weights_bytes"] == decision.plan.weights_bytes_per_gpu
    assert (
        abs(measured["kv_allocated_bytes"] - decision.plan.kv_cache_bytes)
        <= decision.plan.kv_cache_bytes // 100
    )
    # and the check has teeth: the same profile from an image with 20% heavier weights is a different one
    heavier = {**measured, "weights_bytes": int(measured["weights_bytes"] * 1.2)}
    assert [d.split(" ")[0] for d in profile.differences(decision.plan, heavier)] == ["weights"]


def test_a_failed_start_up_gets_the_same_verdict_in_either_process() -> None:
    """The engine core's process sends this verdict to the server, which exits by it as an in-process start
    would: usage (2) for a GPU that cannot run the dtype, out of memory (3, with a termination message),
    1 for a model that cannot be loaded, and a bug stays a bug (None: re-raised)."""
    from pagoda.engine.core.startup import startup_failure
    from pagoda.engine.sizing.errors import UnsupportedOnGPU

    message, code, termination = startup_failure(UnsupportedOnGPU("Tesla T4 cannot run bfloat16"))
    assert (code, termination) == (2, None) and "Tesla T4" in message
    message, code, termination = startup_failure(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert code == EXIT_OUT_OF_MEMORY and parse_termination_message(termination)["reason"] == REASON_CUDA_OOM
    assert startup_failure(FileNotFoundError("/no/such/model"))[1:] == (1, None)
    assert startup_failure(KeyError("a bug")) is None
