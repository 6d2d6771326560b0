"""A model the engine does not run (a quantized checkpoint, an architecture outside its table) is refused by
the operator before anything is downloaded, with reason UnsupportedModel and the engine's own words, while a
refusal of the plan or the flags keeps reason EngineWouldRefuse (issue 36, item 3)."""

from __future__ import annotations

import argparse

import pytest
import yaml
from pagoda.engine.cli.dry_run import DryRunError
from pagoda.engine.cli.dry_run import check as dry_run_check
from pagoda.engine.sizing.errors import SizingError, UnsupportedModelError
from pagoda.engine.sizing.model_config import ModelConfig
from pagoda.engine.sizing.shapes import well_known_config
from pagoda.operator import render
from pagoda.operator.contract import REASON, check_engine_args
from pagoda.operator.planning import decide
from pagoda.operator.render_cli import _pools_for
from pagoda.operator.render_cli import main as render_main
from pagoda.operator.spec import SpecError, parse_spec
from pagoda_testkit import INFD, STS, Cluster, example, running_operator

JOBS, PVCS = "batch/v1/jobs", "v1/persistentvolumeclaims"
BNB = "unsloth/Llama-3.1-8B-Instruct-bnb-4bit"  # bitsandbytes stays refused (AWQ, GPTQ, FP8 run: issue 37)


def deployment(name: str, model: dict) -> dict:
    cr = example("qwen2.5-7b-l4-fp8.yaml")
    cr["metadata"]["name"] = name
    cr["spec"]["model"] = model
    cr["spec"]["gpu"] = {"product": "NVIDIA-H100-80GB-HBM3", "count": 1}
    return cr


@pytest.mark.parametrize(
    ("hub_id", "method", "label"),
    [("Qwen/Qwen3-8B-AWQ", "awq", "int4 (awq, group 128, asymmetric)"),
     ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "gptq", "int4 (gptq, group 128, symmetric)"),
     ("RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8", "fp8", "fp8 (fp8, per-tensor, dynamic activations)"),
     ("google/gemma-3-12b-it-awq", "awq", "int4 (awq, group 128, asymmetric)")],
)  # fmt: skip
def test_a_quantized_checkpoint_of_a_catalogue_model_is_read_with_its_scheme(hub_id, method, label) -> None:
    """AWQ, GPTQ and FP8 checkpoints run (issue 37): their config reads with the scheme the engine loads."""
    config = well_known_config(hub_id)
    assert config["quantization_config"] == {"quant_method": method}
    assert ModelConfig.from_hf_config(config).quantization.label == label


def test_a_bitsandbytes_checkpoint_of_a_catalogue_model_is_refused_as_an_unsupported_model() -> None:
    config = well_known_config("unsloth/Llama-3.1-8B-Instruct-bnb-4bit")
    assert config["quantization_config"] == {"quant_method": "bitsandbytes"}
    with pytest.raises(
        UnsupportedModelError, match="'bitsandbytes'-quantized .* Pagoda runs compressed-tensors"
    ):
        ModelConfig.from_hf_config(config)


def test_model_refusals_and_shape_errors_are_told_apart() -> None:
    assert well_known_config("Qwen/Qwen3-8B").get("quantization_config") is None
    assert well_known_config("someone/unknown-model-AWQ") is None  # not a catalogue model: nothing to say
    with pytest.raises(UnsupportedModelError, match="'mamba'"):
        ModelConfig.from_hf_config({"model_type": "mamba", "architectures": ["MambaForCausalLM"]})
    with pytest.raises(UnsupportedModelError, match="rope_scaling type 'dynamic'"):
        ModelConfig.from_hf_config(
            {**well_known_config("Qwen3-8B"), "rope_scaling": {"rope_type": "dynamic"}}
        )
    with pytest.raises(SizingError) as missing:  # a broken config.json is not a model the engine refuses
        ModelConfig.from_hf_config({"model_type": "llama", "num_attention_heads": 8})
    assert not isinstance(missing.value, UnsupportedModelError)


def test_pagoda_render_refuses_the_same_model(tmp_path, capsys) -> None:
    path = tmp_path / "bnb.yaml"
    path.write_text(yaml.safe_dump(deployment("bnb", {"source": f"hf://{BNB}"})))
    assert render_main([str(path)]) == 1
    err = capsys.readouterr().err
    assert "'bitsandbytes'-quantized checkpoint" in err and BNB in err
    path.write_text(yaml.safe_dump(deployment("qwen3", {"source": "hf://Qwen/Qwen3-8B"})))
    assert render_main([str(path)]) == 0
    assert "kind: Job" in capsys.readouterr().out


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_operator_refuses_an_unsupported_model_before_any_download(cluster: Cluster) -> None:
    await cluster.add_node("gpu-h100-1", "h100")
    mamba_shape = {"numLayers": 64, "numAttentionHeads": 32, "hiddenSize": 4096, "vocabSize": 50280,
                   "modelType": "mamba"}  # fmt: skip
    async with running_operator(cluster):
        await cluster.create(deployment("qwen3", {"source": "hf://Qwen/Qwen3-8B"}))
        await cluster.create(deployment("bnb", {"source": f"hf://{BNB}"}))
        await cluster.create(deployment("mamba", {"source": "pvc://models/mamba", "shape": mamba_shape}))
        for name, words in (("bnb", "'bitsandbytes'-quantized checkpoint"), ("mamba", "'mamba'")):
            ready = await cluster.wait_for(
                lambda n=name: (c := cluster.condition(n, "Ready")).get("reason") == "UnsupportedModel" and c,
                what=f"{name}: Ready=False, UnsupportedModel",
            )
            assert ready["status"] == "False" and words in ready["message"], ready
            event = await cluster.wait_for(
                lambda n=name: [e for e in cluster.events(n) if e["reason"] == "UnsupportedModel"],
                what=f"{name}: an UnsupportedModel Event",
            )
            assert event[0]["type"] == "Warning" and words in event[0]["message"]
        # the supported model gets its download Job; the refused ones get nothing at all
        await cluster.wait_for(
            lambda: any(j["metadata"]["name"].startswith("qwen3-download-") for j in cluster.objects(JOBS)),
            what="the Qwen3 download Job",
        )
        await cluster.settle()
        for name in ("bnb", "mamba"):
            assert not [j for j in cluster.objects(JOBS) if j["metadata"]["name"].startswith(f"{name}-")]
            assert not [p for p in cluster.objects(PVCS) if p["metadata"]["name"].startswith(f"{name}-")]
            assert cluster.get(STS, "default", name) is None
            assert (
                cluster.condition(name, "Ready")["reason"] == "UnsupportedModel"
            )  # no crash loop, no flapping
        assert cluster.get(INFD, "default", "qwen3")["status"]["conditions"]


def test_a_flag_the_engine_refuses_keeps_reason_engine_would_refuse() -> None:
    spec = parse_spec(deployment("qwen3", {"source": "hf://Qwen/Qwen3-8B"})["spec"])
    args = argparse.Namespace(nodes=None, gpu=None, gpus_per_node=8)
    decision = decide(spec, _pools_for(args, 1, spec.gpu.product))
    with pytest.raises(SpecError) as refused:
        check_engine_args(decision, [*render.engine_args(spec, decision), "--gpu-memory-utilization", "0.05"])
    assert refused.value.reason == REASON == "EngineWouldRefuse"


def test_the_engines_dry_run_refuses_the_quantized_hub_id_without_its_weights(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache: the weights are not here
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(DryRunError, match=f"{BNB}'s config.json as published: a 'bitsandbytes'-quantized"):
        dry_run_check([BNB, "--gpu", "H100"])
    report = dry_run_check(["meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100"])  # unquantized: sized
    assert report.plan is not None and report.model.shape_from == "catalogue of known models"
