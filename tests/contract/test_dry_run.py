"""`pagoda serve ARGS --dry-run`: the full configuration checked, the memory plan printed, no weights loaded."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pagoda.engine.cli.dry_run import DryRunError, check, shape_config
from pagoda.engine.sizing import well_known_shape

PAGODA = str(Path(sys.executable).parent / "pagoda")


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PAGODA, "serve", *args], capture_output=True, text=True, timeout=300, env=env or dict(os.environ)
    )


def test_prints_config_and_memory_plan_as_json() -> None:
    args = ("--dry-run", "--device", "cpu", "--kv-cache-memory-bytes", "512MiB", "--max-num-seqs", "8")
    r = serve(*args, "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["dry_run"] is True and report["weights_loaded"] is False
    assert report["config"]["max_num_seqs"] == 8 and report["config"]["max_model_len"] == 8192
    assert report["model"]["shape_from"] == "gguf metadata"  # the embedded default model
    assert report["plan"]["num_blocks"] == 512 * 2**20 // (46_080 * 16)
    assert report["memory"]["kv_cache_bytes"] == 512 * 2**20 and report["memory"]["measured"] is False
    assert report["fit_checked"] is True
    # `auto` sizes the dtype this CPU runs: bfloat16 where it multiplies bfloat16 natively (half the bytes)
    from pagoda.engine.sizing.engine_plan import cpu_has_native_bf16

    auto = json.loads(serve(*args).stdout)
    bf16 = cpu_has_native_bf16()
    assert auto["device"]["dtype"] == ("bfloat16" if bf16 else "float32")
    assert auto["plan"]["num_blocks"] == 512 * 2**20 // ((23_040 if bf16 else 46_080) * 16)


def test_refuses_with_the_real_starts_error_and_exit_2() -> None:
    args = ("--device", "cpu", "--kv-cache-memory-bytes", "512MiB", "--max-model-len", "100000")
    dry = serve(*args, "--dry-run")
    real = serve(*args, "--skip-tokenizer-init")
    assert dry.returncode == 2 and real.returncode == 1
    line = (
        "pagoda serve: cannot start the engine: max_model_len=100000 is longer than the model's limit of 8192"
    )
    assert dry.stderr.strip().splitlines()[-1].startswith(line)
    assert dry.stderr.strip().splitlines()[-1] == real.stderr.strip().splitlines()[-1]
    assert dry.stdout == ""


def test_configuration_errors_are_the_real_starts() -> None:
    for args in (["--block-size", "7"], ["--gpu-memory-utilization", "1.5"], ["--max-num-seq", "4"]):
        dry, real = serve(*args, "--dry-run"), serve(*args)
        assert dry.returncode == real.returncode == 2, (args, dry.stderr)
        assert dry.stderr.strip().splitlines()[-1] == real.stderr.strip().splitlines()[-1]


def test_weights_are_never_read(tmp_path: Path) -> None:
    """A directory whose safetensors hold a header and no data: a real load would fail, the dry run cannot."""
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "torch_dtype": "bfloat16",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    header = json.dumps({"w": {"dtype": "BF16", "shape": [1000, 64], "data_offsets": [0, 128_000]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)  # no data
    report = check([str(tmp_path), "--device", "cpu", "--kv-cache-memory-bytes", "16MiB"])
    assert report.model.shape.num_params == 64_000 and report.config.max_model_len == 1024
    config["model_type"], config["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DryRunError, match="model_type 'gpt2'.*is not supported"):
        check([str(tmp_path), "--device", "cpu", "--kv-cache-memory-bytes", "16MiB"])


def test_a_gpu_config_without_a_gpu_here() -> None:
    """No CUDA on this machine: --gpu plans with the catalogue's memory; without it the JSON says so."""
    shape = json.dumps(shape_config(well_known_shape("meta-llama/Llama-3.1-8B-Instruct")))
    common = ["meta-llama/Llama-3.1-8B-Instruct", "--model-shape", shape, "--max-model-len", "16384"]
    on_l4 = check([*common, "--gpu", "NVIDIA-L4", "--gpu-memory-utilization", "0.9"])
    assert on_l4.device["type"] == "cuda" and on_l4.device["memory_source"] == "catalogue:L4"
    assert on_l4.plan is not None and on_l4.plan.profile.device_total_bytes == 23034 << 20
    assert on_l4.plan.profile.weights_bytes > 14 << 30  # 8B parameters in bf16
    with pytest.raises(DryRunError, match=r"max_model_len=16384 does not fit in the KV cache.*fits is \d+"):
        check([*common, "--gpu", "NVIDIA-L4", "--gpu-memory-utilization", "0.8"])
    unmeasured = check([*common, "--device", "cuda"]) if not _has_cuda() else None
    if unmeasured is not None:
        assert unmeasured.plan is None and unmeasured.device["memory_source"] == "none"
        assert any("device memory not measured" in w for w in unmeasured.warnings)
        assert unmeasured.to_dict()["fit_checked"] is False


def test_tensor_parallel_splits_the_weights_and_kv() -> None:
    shape = json.dumps(shape_config(well_known_shape("meta-llama/Llama-3.1-70B-Instruct")))
    common = [
        "m",
        "--model-shape",
        shape,
        "--gpu",
        "H100",
        "--max-model-len",
        "16384",
        "--kv-cache-dtype",
        "fp8",
    ]
    with pytest.raises(DryRunError, match="does not fit"):
        check(common)  # 70B of bf16 weights on one H100
    two = check([*common, "--tensor-parallel-size", "2"])
    assert two.plan is not None and two.plan.kv_bytes_per_token == 327_680 // 2 // 2  # half the heads, fp8
    with pytest.raises(DryRunError, match="tensor_parallel_size 128 exceeds the model's 64 attention heads"):
        check([*common, "--tensor-parallel-size", "128"])


def test_gemma_runs_in_bfloat16_or_float32_and_refuses_float16_as_the_real_start_does() -> None:
    """The operator's --model-shape carries the family: Gemma overflows float16, so `auto` is bfloat16 (float32
    on a GPU without bfloat16) and an explicit float16 is the real start's refusal (engine_plan's rule)."""
    config = shape_config(well_known_shape("google/gemma-3-12b-it"))
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] == 1024
    common = ["/models/gemma-3-12b-text", "--model-shape", json.dumps(config), "--max-model-len", "4096"]
    on_l40s = check([*common, "--gpu", "L40S"])
    assert on_l40s.device["dtype"] == "bfloat16" and on_l40s.model.shape.sliding_window_layers == 40
    on_t4 = check([*common, "--gpu", "T4", "--tensor-parallel-size", "8"])
    assert on_t4.device["dtype"] == "float32"
    assert on_t4.device["weights_bytes_estimated"] == -(-well_known_shape("Gemma-3-12B").num_params * 4 // 8)
    with pytest.raises(DryRunError, match="cannot start the engine: --dtype float16 is refused"):
        check([*common, "--gpu", "L40S", "--dtype", "float16"])
    soft = shape_config(well_known_shape("google/gemma-2-9b-it"))
    assert soft["attn_logit_softcapping"] == 50.0 and soft["model_type"] == "gemma2"
    assert "model_type" not in shape_config(
        dataclasses.replace(well_known_shape("Qwen3-8B"), architecture="")
    )


def test_a_hub_id_published_as_a_multimodal_checkpoint_is_served_by_its_language_model(
    tmp_path: Path,
) -> None:
    """google/gemma-3-27b-it's config.json is Gemma3ForConditionalGeneration: the engine serves its language
    model (text only), and the dry run sizes that decoder where the weights are not (the operator, a laptop)."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub")}
    r = serve("google/gemma-3-27b-it", "--dry-run", "--gpu", "H100", "--max-model-len", "32768", env=env)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert (
        report["model"]["shape"]["num_layers"] == 62 and report["model"]["shape"]["architecture"] == "gemma3"
    )
    assert report["device"]["dtype"] == "bfloat16"
    shape = json.dumps(shape_config(well_known_shape("Gemma-3-27B")))
    assert check(
        ["google/gemma-3-27b-it", "--model-shape", shape, "--gpu", "H100", "--max-model-len", "32768"]
    ).plan


def test_a_catalogue_hub_id_whose_published_config_the_engine_refuses_is_refused_without_its_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the operator cannot read a hub model's config.json, the catalogue's copy goes through the engine's
    strict reader: a wrapper the engine does not serve is refused with the engine's own message, no pod."""
    from pagoda.engine.sizing import shapes

    llava = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
             "text_config": shapes.well_known_config("Qwen/Qwen3-8B")}  # fmt: skip
    monkeypatch.setattr(shapes, "well_known_config", lambda model: llava)
    shape = json.dumps(shape_config(well_known_shape("Qwen3-8B")))
    with pytest.raises(DryRunError, match="Qwen/Qwen3-8B's config.json as published: model_type 'llava'"):
        check(["Qwen/Qwen3-8B", "--model-shape", shape, "--gpu", "H100"])
    assert check(
        ["/models/qwen3-8b", "--model-shape", shape, "--gpu", "H100"]
    ).plan  # a local path reads itself


def test_a_head_dim_of_96_runs_on_a_gpu() -> None:
    """Phi-3.5-mini's head_dim 96: the Triton kernels pad a head to the next power of two, so a GPU plan stands."""
    shape = json.dumps(shape_config(well_known_shape("Phi-3.5-mini")))
    report = check(
        [
            "microsoft/Phi-3.5-mini-instruct",
            "--model-shape",
            shape,
            "--gpu",
            "L40S",
            "--max-model-len",
            "8192",
        ]
    )
    assert report.plan is not None and report.model.head_dim == 96


def test_dry_run_flags_are_refused_without_dry_run() -> None:
    r = serve("--gpu", "H100")
    assert r.returncode == 2 and "apply to --dry-run only" in r.stderr


def test_the_dry_run_does_not_need_torch_with_a_given_shape() -> None:
    shape = json.dumps(shape_config(well_known_shape("Qwen/Qwen2.5-7B-Instruct")))
    code = (
        "import sys, json\n"
        "from pagoda.engine.cli.dry_run import check\n"
        f"r = check(['Qwen/Qwen2.5-7B-Instruct', '--model-shape', {shape!r}, '--gpu', 'L4', '--device', 'cuda'])\n"
        "assert 'torch' not in sys.modules, 'the dry run imported torch'\n"
        "print(r.config.max_model_len)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == 32768


def _has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None
