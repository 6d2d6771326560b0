"""`pagoda plan` as a user runs it: the installed console script in a subprocess."""

import json
import subprocess

import pytest


@pytest.fixture
def run(pagoda_cli):
    def run(*args):
        return subprocess.run([str(pagoda_cli), "plan", *args], capture_output=True, text=True, timeout=60)

    return run


def test_table_mode_shows_every_setting_with_its_reason(run):
    out = run("--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "NVIDIA-L4", "--memory-limit", "64Gi")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "Llama-3.1-8B on 1 x L4" in text
    for key in ("gpu_memory_utilization", "max_model_len", "block_size", "kv_cache_dtype", "max_num_seqs",
                "max_num_batched_tokens", "tensor_parallel_size", "num_gpu_blocks", "kv_offload_host_bytes",
                "kv_offload_disk_bytes", "pvc_size"):  # fmt: skip
        line = next(ln for ln in text.splitlines() if ln.startswith(key))
        assert len(line.split(None, 2)) == 3, line  # name, value, reason
    assert "engine flags: --gpu-memory-utilization" in text and "--kv-cache-dtype fp8" in text


def test_json_mode(run):
    out = run("--model", "Llama-3.1-70B", "--gpu", "H100", "--gpus", "2", "--target-context", "16384",
              "--min-concurrency", "2", "--p99-prompt", "3000", "--p99-output", "1000", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["tensor_parallel_size"] == 2 and data["max_model_len"] == 16384
    assert data["max_num_batched_tokens"] >= 3000 and data["kv_cache_dtype"] == "fp8"
    assert set(data["reasons"]) >= {"max_model_len", "tensor_parallel_size", "gpu_memory_utilization"}
    assert "--tensor-parallel-size" in data["engine_args"]


def test_gguf_file_on_cpu_and_quality_first(run, default_gguf):
    out = run("--model", str(default_gguf), "--memory-limit", "4Gi", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert (
        data["device"] == "cpu" and data["kv_bytes_per_token"] == 46_080 and data["kv_cache_memory_bytes"] > 0
    )
    out = run("--model", "Llama-3.1-8B", "--gpu", "H100", "--quality-first", "--json")
    assert json.loads(out.stdout)["kv_cache_dtype"] == "auto"


def test_errors_go_to_stderr_with_exit_2(run):
    out = run("--model", "Llama-3.1-70B", "--gpu", "H100")
    assert out.returncode == 2 and out.stdout == ""
    assert "tensor_parallel_size=2" in out.stderr
    out = run("--model", "no/such-model", "--gpu", "H100")
    assert out.returncode == 2 and "neither a local path nor a well-known model" in out.stderr
    out = run(
        "--model", "unsloth/Llama-3.1-8B-Instruct-bnb-4bit", "--gpu", "H100"
    )  # the engine's refusal, as serve and the operator say it
    assert out.returncode == 2 and "'bitsandbytes'-quantized checkpoint" in out.stderr, out.stderr
    out = run("--model", "Llama-3.1-8B", "--gpu", "Z9000")
    assert out.returncode == 2 and "unknown GPU" in out.stderr
    out = run("--model", "Llama-3.1-8B", "--gpu", "H100", "--memory-limit", "lots")
    assert out.returncode == 2 and "--memory-limit" in out.stderr
