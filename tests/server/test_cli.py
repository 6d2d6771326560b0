"""`pagoda serve` flag parsing: vLLM names and defaults, close matches for typos, exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pagoda.engine.cli import engine_args, serve, serve_args

PAGODA = str(Path(sys.executable).parent / "pagoda")


def test_unknown_flag_lists_close_matches_and_exits_2() -> None:
    r = subprocess.run([PAGODA, "serve", "--max-num-seq", "4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--max-num-seq" in r.stderr and "--max-num-seqs" in r.stderr


def test_unknown_flag_in_process() -> None:
    assert serve.main(["--gpu-memory-utilisation", "0.5"]) == 2
    with pytest.raises(serve_args.UnknownFlagError, match="--gpu-memory-utilization"):
        serve_args.parse_args(["--gpu-memory-utilisation", "0.5"])
    with pytest.raises(serve_args.UnknownFlagError, match="--enable-prefix-caching"):
        serve_args.parse_args(["--enable-prefix-cache"])
    with pytest.raises(serve_args.UnknownFlagError, match="--port"):
        serve_args.parse_args(["--prot=80"])


def test_vllm_defaults() -> None:
    a = serve_args.parse_args([])
    assert a.model is None and a.host == "0.0.0.0" and a.port == 8000
    assert a.block_size == 16 and a.gpu_memory_utilization == 0.92 and a.max_num_seqs == 256
    assert a.enable_prefix_caching is True and a.enable_chunked_prefill is True
    assert a.kv_cache_dtype == "auto" and a.scheduling_policy == "fcfs" and a.max_num_queued_reqs == 512


def test_flags_reach_the_engine_config() -> None:
    a = serve_args.parse_args(
        ["some/model", "--served-model-name", "a", "b", "--max-model-len", "4K", "--no-enable-prefix-caching",
         "--no-enable-chunked-prefill", "--kv-cache-memory-bytes", "512MiB", "--kv-cache-dtype", "fp8",
         "--scheduling-policy", "priority", "--max-num-batched-tokens", "4096", "--kv-offload-host-bytes", "2G"]
    )  # fmt: skip
    kw = serve_args.engine_config_kwargs(a)
    assert kw["model"] == "some/model" and kw["served_model_name"] == "a"
    assert kw["max_model_len"] == 4096 and kw["enable_prefix_caching"] is False
    assert kw["enable_chunked_prefill"] is False and kw["kv_cache_memory_bytes"] == 512 * 2**20
    assert kw["kv_cache_dtype"] == "fp8" and kw["scheduling_policy"] == "priority"
    assert kw["max_num_batched_tokens"] == 4096 and kw["kv_offload_host_bytes"] == 2 * 10**9
    assert serve_args.server_settings(a).served_model_names == ["a", "b"]


def test_api_key_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_API_KEY", "from-env")
    assert serve_args.server_settings(serve_args.parse_args([])).api_key == "from-env"
    assert serve_args.server_settings(serve_args.parse_args(["--api-key", "flag"])).api_key == "flag"


@pytest.mark.parametrize(
    ("text", "value"),
    [("1024", 1024), ("64MiB", 64 * 2**20), ("2G", 2 * 10**9), ("1.5GiB", 3 * 2**29), ("8kb", 8000)],
)
def test_parse_bytes(text, value) -> None:
    assert engine_args.parse_bytes(text) == value


def test_bad_values_exit_2() -> None:
    assert serve.main(["--max-model-len", "big"]) == 2
    assert serve.main(["--kv-cache-memory-bytes", "lots"]) == 2
    assert serve.main(["--block-size", "7"]) == 2
    assert engine_args.parse_max_model_len("auto") == "auto" and engine_args.parse_max_model_len("4k") == 4000


def test_help_exits_0(capsys) -> None:
    assert serve.main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--gpu-memory-utilization", "--max-num-queued-reqs", "--api-key", "--uvicorn-log-level"):
        assert flag in out
    # The queue limit's help shows the number the server applies, not "None".
    queued = out[out.index("  --max-num-queued-reqs") :].split("--max-request-body-bytes")[0]
    assert "512" in queued and "None" not in queued


def test_engine_flags_are_generated_from_the_engine_config() -> None:
    """Every EngineConfig field (but the positional model) is a flag with the field's default and help,
    and every engine flag lands in the config: nothing is accepted and dropped."""
    import dataclasses

    from pagoda.engine.config import EngineConfig

    parser = serve_args.build_parser()
    by_dest = {a.dest: a for a in parser._actions}
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for name, f in fields.items():
        if name in ("model", "served_model_name"):
            continue
        action = by_dest[name]
        assert action.default == f.default, name
        assert action.help == f.metadata["help"], name
        if "choices" in f.metadata:
            assert list(action.choices) == list(f.metadata["choices"]), name
    engine_group = next(g for g in parser._action_groups if g.title == "engine")
    dests = {a.dest for a in engine_group._group_actions}
    assert dests <= set(fields), f"engine flags without a config field: {dests - set(fields)}"
    kw = serve_args.engine_config_kwargs(serve_args.parse_args(["--swap-space", "2", "-tp", "1"]))
    assert set(kw) == set(fields)
    config = EngineConfig(**kw)
    assert config.swap_space == 2.0 and config.host_tier_bytes == 2 * 2**30


def test_gpu_memory_utilization_default_is_stated_once() -> None:
    import inspect

    from pagoda.engine.config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
    from pagoda.engine.frontend.llm import LLM

    assert EngineConfig().gpu_memory_utilization == DEFAULT_GPU_MEMORY_UTILIZATION
    assert serve_args.parse_args([]).gpu_memory_utilization == DEFAULT_GPU_MEMORY_UTILIZATION
    default = inspect.signature(LLM).parameters["gpu_memory_utilization"].default
    assert default == DEFAULT_GPU_MEMORY_UTILIZATION


@pytest.mark.parametrize(
    ("gpu", "cc", "flags", "says"),
    [
        ("NVIDIA A100-SXM4-80GB", (8, 0), ["--kv-cache-dtype", "fp8"], "--kv-cache-dtype int8"),
        ("Tesla T4", (7, 5), ["--dtype", "bfloat16"], "--dtype float16"),
    ],
)
def test_a_dtype_the_gpu_cannot_run_is_refused_at_start_up_with_exit_2(
    monkeypatch, capsys, gpu, cc, flags, says
):
    """Before the ranks or the weights: the GPU's name, its compute capability and what to use instead (no GPU
    here: torch is told this one is there, and the refusal comes before anything uses it; the engine core
    is built in this process, where that can be told)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    assert serve.main(["--device", "cuda", "--no-engine-process", *flags]) == 2
    err = capsys.readouterr().err
    assert f"{gpu} (compute capability {cc[0]}.{cc[1]})" in err and says in err
