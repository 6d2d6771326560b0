"""The catalogue of well-known shapes: the families of issue 35, their parameter counts against the published
ones, the hub ids that name them, and a plan for each on every catalogue GPU the engine runs on."""

from __future__ import annotations

import math

import pytest
from pagoda.engine.sizing import (
    ENGINE_MIN_COMPUTE,
    GPU_CATALOGUE,
    GPUInfo,
    Hints,
    plan,
    shape_from_config,
    well_known_shape,
)
from pagoda.engine.sizing.architectures import SUPPORTED_ARCHITECTURES
from pagoda.engine.sizing.model_config import ModelConfig
from pagoda.engine.sizing.shapes import _WELL_KNOWN, well_known_config, well_known_family

NEW = ["Qwen3-8B", "Qwen3-32B", "Gemma-3-4B", "Gemma-3-12B", "Gemma-3-27B", "Gemma-2-9B", "Gemma-2-27B",
       "Phi-4", "Phi-3.5-mini", "Granite-3.3-8B"]  # fmt: skip

# Published parameter counts, in billions. Model cards and the Hub's safetensors totals: Qwen3-8B "8.2B"
# (6.95B non-embedding), Qwen3-32B "32.8B", Gemma-2-9B 9.24B, Gemma-2-27B 27.2B, Phi-4 14.7B, Phi-3.5-mini
# 3.8B, Granite-3.3-8B 8.17B. Gemma 3's checkpoints are multimodal (4.3B, 12.2B, 27.4B with the 417M SigLIP
# encoder); the text decoder the catalogue sizes is embedding + non-embedding of the Gemma 3 technical
# report's table 1: 675M + 3,209M, 1,012M + 10,759M, 1,416M + 25,600M.
PUBLISHED = {
    "Qwen3-8B": 8.19, "Qwen3-32B": 32.8, "Gemma-3-4B": 0.675 + 3.209, "Gemma-3-12B": 1.012 + 10.759,
    "Gemma-3-27B": 1.416 + 25.600, "Gemma-2-9B": 9.24, "Gemma-2-27B": 27.2, "Phi-4": 14.7,
    "Phi-3.5-mini": 3.82, "Granite-3.3-8B": 8.17,
}  # fmt: skip

HUB_IDS = {
    "Qwen/Qwen3-8B": "Qwen3-8B", "Qwen/Qwen3-32B": "Qwen3-32B", "Qwen/Qwen3-8B-Base": "Qwen3-8B",
    "google/gemma-3-4b-it": "Gemma-3-4B", "google/gemma-3-12b-it": "Gemma-3-12B",
    "google/gemma-3-27b-it": "Gemma-3-27B", "google/gemma-3-27b-pt": "Gemma-3-27B",
    "google/gemma-2-9b-it": "Gemma-2-9B", "google/gemma-2-27b": "Gemma-2-27B", "microsoft/phi-4": "Phi-4",
    "microsoft/Phi-3.5-mini-instruct": "Phi-3.5-mini", "ibm-granite/granite-3.3-8b-instruct": "Granite-3.3-8B",
    "ibm-granite/granite-3.3-8b-base": "Granite-3.3-8B",
}  # fmt: skip


@pytest.mark.parametrize("name", NEW)
def test_parameter_estimate_is_within_3_percent_of_the_published_count(name: str) -> None:
    shape = well_known_shape(name)
    assert shape is not None
    assert abs(shape.num_params / 1e9 / PUBLISHED[name] - 1) < 0.03, shape.num_params
    assert shape.weight_bytes == 2 * shape.num_params and shape.dtype == "bfloat16"


def test_hub_ids_name_their_shapes() -> None:
    for hub_id, name in HUB_IDS.items():
        shape = well_known_shape(hub_id)
        assert shape is not None and shape.name == name, hub_id
    assert well_known_shape("google/gemma-3-270m-it") is None  # not in the catalogue: no guess
    assert well_known_shape("Qwen/Qwen3-235B-A22B") is None  # not in the catalogue: no guess


def test_every_catalogue_row_names_a_family_the_engine_runs() -> None:
    for row in _WELL_KNOWN.values():
        assert row.family in SUPPORTED_ARCHITECTURES, row
        assert well_known_family(row.name) == row.family
        config = well_known_config(row.name)
        # the engine's strict reader takes the published config.json; Gemma 3 4B-27B are multimodal on the hub,
        # and the engine serves their language model (text only)
        mc = ModelConfig.from_hf_config(config)
        assert (mc.architecture, mc.num_hidden_layers, mc.head_dim) == (row.family, row.layers, row.head_dim)
        assert mc.multimodal_checkpoint == (row.published_as is not None)
    assert sorted(r.name for r in _WELL_KNOWN.values() if r.published_as) == [
        "Gemma-3-12B", "Gemma-3-27B", "Gemma-3-4B",
    ]  # fmt: skip


def test_the_windows_and_soft_caps_of_the_new_families() -> None:
    g3, g2 = well_known_shape("Gemma-3-27B"), well_known_shape("Gemma-2-9B")
    # 62 layers, every sixth global: 10 global, 52 sliding; Gemma 2: the even layers of 42 slide
    assert (g3.sliding_window, g3.sliding_window_layers, g3.attn_logit_softcapping) == (1024, 52, None)
    assert (g2.sliding_window, g2.sliding_window_layers, g2.attn_logit_softcapping) == (4096, 21, 50.0)
    assert (g3.vocab_size, g3.head_dim, g3.tie_word_embeddings) == (262208, 128, True)
    for name in ("Qwen3-8B", "Qwen3-32B", "Phi-4", "Granite-3.3-8B"):
        s = well_known_shape(name)
        assert (
            s.sliding_window is None and s.sliding_window_layers is None and s.attn_logit_softcapping is None
        )
    assert well_known_shape("Phi-3.5-mini").head_dim == 96


# The published config.json (the fields sizing reads) of three checkpoints; the engine's reader must give the
# catalogue's shape from each, so a plan from the hub id and one from the downloaded config agree.
GEMMA_3_27B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
        "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024,
        "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "vocab_size": 262208, "max_position_embeddings": 131072,
    },
    "torch_dtype": "bfloat16",
}  # fmt: skip
GEMMA_2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584,
    "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    "query_pre_attn_scalar": 256, "vocab_size": 256000, "max_position_embeddings": 8192,
    "torch_dtype": "float32", "hidden_activation": "gelu_pytorch_tanh",
}  # fmt: skip
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "sliding_window": None, "use_sliding_window": False, "max_window_layers": 36,
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}  # fmt: skip


@pytest.mark.parametrize(
    "name, config", [("Gemma-3-27B", GEMMA_3_27B_IT), ("Gemma-2-9B", GEMMA_2_9B), ("Qwen3-8B", QWEN3_8B)]
)
def test_the_engines_reader_gives_the_catalogue_shape_from_the_published_config(name: str, config) -> None:
    known = well_known_shape(name).to_dict()
    read = shape_from_config(config, name=name).to_dict()
    for key in ("name", "dtype", "weight_bytes", "num_params", "tie_word_embeddings"):
        known.pop(key), read.pop(key)  # Gemma ties by its family's default, not in config.json
    assert read == known


@pytest.mark.parametrize("name", NEW)
def test_a_plan_for_every_gpu_the_engine_runs_on(name: str) -> None:
    shape = well_known_shape(name)
    for spec in GPU_CATALOGUE:
        if spec.compute_capability < ENGINE_MIN_COMPUTE:
            continue  # refused for every model (tests/operator/test_unsupported_gpu.py)
        p = plan(shape, GPUInfo.from_spec(spec, 64), Hints())
        # at least the planner's default context (4,096 tokens) for one sequence, or the model's whole limit
        assert p.num_gpu_blocks > 0 and p.max_model_len >= min(4096, shape.max_position_embeddings), spec.name
        assert shape.num_attention_heads % p.tensor_parallel_size == 0


def test_kernels_warm_plans_every_new_model_on_every_gpu_the_engine_runs_on() -> None:
    """`pagoda kernels warm --gpu all --model NAME --common` for each new model: a kernel plan for every GPU the
    engine image's torch build runs (none skipped for not fitting), with the model's head_dim (Phi-3.5-mini's 96
    padded by the kernels) and window, and
    Gemma in float32 where the GPU has no bfloat16 (T4). Compiling them is tests/kernels/test_warm.py's job."""
    from pagoda.engine.cli.kernels import Result, _gpus, _parser, units_of
    from pagoda.engine.sizing.gpus import TORCH_WHEEL_ARCHS

    models = [arg for name in NEW for arg in ("--model", name)]
    args = _parser().parse_args(["warm", "--gpu", "all", *models, "--common"])
    result = Result()
    specs = _gpus(args.gpu, TORCH_WHEEL_ARCHS, result)
    units = units_of(args, specs, result.skipped)
    assert sorted(s.split(":")[0] for s in result.skipped) == ["V100-16GB", "V100-32GB"]  # compute 7.0
    for name in NEW:
        shape = well_known_shape(name)
        mine = [u for u in units if u.model == name]
        assert {u.gpus[0] for u in mine} == {s.name for s in specs}, name
        for unit in mine:
            assert unit.plan.head_dim == shape.head_dim and unit.plan.sliding_window == shape.sliding_window
            cc = unit.compute_capability
            want = "float16" if cc < (8, 0) else "bfloat16"
            if not shape.float16 and cc < (8, 0):
                want = "float32"
            assert unit.dtype == want, (name, unit.gpus)


def test_the_real_gemma_3_270m_gguf_is_sized_as_the_engine_reads_it(gemma3_gguf, pagoda_cli) -> None:
    """Gemma 3 270M (GGUF Q4_K_M): its metadata goes through the engine's config reader, so the family's rules
    apply (five of six layers slide, bfloat16); `pagoda plan --model gemma-3-270m` finds the embedded file."""
    import json
    import subprocess

    from pagoda.engine.sizing import shape_from_path

    shape = shape_from_path(gemma3_gguf)
    assert (shape.architecture, shape.num_layers, shape.num_attention_heads, shape.num_kv_heads) == (
        "gemma3",
        18,
        4,
        1,
    )
    assert (shape.head_dim, shape.hidden_size, shape.vocab_size, shape.tie_word_embeddings) == (
        256,
        640,
        262144,
        True,
    )
    assert (shape.sliding_window, shape.sliding_window_layers, shape.dtype) == (512, 15, "bfloat16")
    assert abs(shape.num_params / 268e6 - 1) < 0.01  # "270M": 268M parameters (the model card)
    r = subprocess.run([str(pagoda_cli), "plan", "--model", "gemma-3-270m", "--gpu", "L4", "--json"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["max_model_len"] == 32768 and p["kv_bytes_per_token"] == 18 * 1 * 256 * 2  # FP8 on an L4
    assert any("512-token sliding window on 15 of 18 layers" in w for w in p["warnings"])


# Mixture-of-experts decoders sized from config.json alone (spec.model.shape, --model-shape, a config without
# safetensors): every expert's weights count. Published totals: Qwen3-30B-A3B "30.5B" (model card), Mixtral-8x7B
# 46.7B; the engine's own model built from these configs on the meta device has 30.53B and 46.70B
# (tests/models/test_moe_vs_hf.py).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "bfloat16",
}  # fmt: skip
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}  # fmt: skip


def test_a_multimodal_checkpoint_is_sized_without_its_vision_tower(tmp_path) -> None:
    """Gemma 3 4B-27B as published: the engine loads the language model only, so the safetensors headers'
    vision tower and projector are not counted."""
    import json
    import struct

    from pagoda.engine.sizing import shape_from_path

    (tmp_path / "config.json").write_text(json.dumps(well_known_config("google/gemma-3-4b-it")))
    tensors = {"language_model.model.embed_tokens.weight": [1000, 64],
               "vision_tower.vision_model.embeddings.patch_embedding.weight": [1152, 3, 14, 14],
               "multi_modal_projector.mm_input_projection_weight": [1152, 2560]}  # fmt: skip
    header, offset = {}, 0
    for name, dims in tensors.items():
        size = 2 * math.prod(dims)
        header[name] = {"dtype": "BF16", "shape": dims, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)
    shape = shape_from_path(tmp_path)
    assert shape.num_params == 64_000 and shape.weight_bytes == 128_000
    assert (shape.architecture, shape.num_layers, shape.sliding_window_layers) == ("gemma3", 34, 29)


def test_a_mixture_of_experts_is_sized_with_every_expert() -> None:
    qwen, mixtral = shape_from_config(QWEN3_30B_A3B), shape_from_config(MIXTRAL_8X7B)
    assert round(qwen.num_params / 1e9, 2) == 30.53 and round(mixtral.num_params / 1e9, 2) == 46.70
    # dense layers stay dense: with every other layer sparse, half the experts' weights
    half = shape_from_config({**QWEN3_30B_A3B, "decoder_sparse_step": 2})
    dense_mlp, experts = 3 * 2048 * 6144, 128 * 3 * 2048 * 768 + 2048 * 128
    assert qwen.num_params - half.num_params == 24 * (experts - dense_mlp)
