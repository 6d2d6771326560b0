"""Gemma 2 and Gemma 3 (text) against Hugging Face transformers on the same random tiny weights.

Each HF model (eager attention, so its soft-cap and window apply) is saved with safetensors and loaded back
through Pagoda's loader, then run as one prefill and as prefix + chunks + decodes over a paged cache beside a
second sequence. The window (6) is shorter than the prompt (29), the soft-caps are small enough to bend the
scores, and Gemma 3's two RoPE bases differ, so each feature shows in the logits (the guards below check
that dropping one breaks the match).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from pagoda.engine.attention import get_attention_backend
from pagoda.engine.loader import load_model
from pagoda.engine.models import get_model_class
from pagoda.engine.models.gemma import GemmaForCausalLM
from pagoda.engine.sizing.engine_plan import resolve_dtype_name
from pagoda.engine.sizing.model_config import ModelConfig
from pagoda_testkit import tiny_gemma
from pagoda_testkit.tiny_gemma import SEQ, VOCAB

ATOL, RTOL = 5e-5, 1e-4
_BUILT: dict = {}


def _build(name: str, tmp_path_factory):
    if name not in _BUILT:
        path = tmp_path_factory.mktemp(name)
        hf, ids, ref = tiny_gemma.build(name, path)
        _BUILT[name] = name, path, hf, ids, ref
    return _BUILT[name]


@pytest.fixture(scope="module", params=tiny_gemma.FAMILIES)
def family(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


def _load(path, dtype=torch.float32):
    return load_model(path, dtype, "cpu", get_attention_backend("torch", "cpu"), progress=False)


def _prefill(model, cfg, ids, paged, caches) -> torch.Tensor:
    kv = caches(cfg.num_hidden_layers, 16, 8, cfg.num_key_value_heads, cfg.head_dim, dtype=model.dtype)
    meta = paged(num_blocks=16, block_size=8).step([(0, 0, SEQ)])
    return model.compute_logits(model(ids, torch.arange(SEQ), kv, meta))


def test_config_is_read(family):
    name, path, _, _, _ = family
    model, cfg = _load(path)
    assert isinstance(model, GemmaForCausalLM) and get_model_class(cfg.architecture) is GemmaForCausalLM
    assert cfg.architecture == name and cfg.hidden_act == "gelu_pytorch_tanh" and cfg.tie_word_embeddings
    assert model.lm_head_weight is model.embed_tokens.weight
    assert cfg.attention_scale == 24**-0.5 and model.layers[0].self_attn.scale == 24**-0.5
    windows = [layer.self_attn.sliding_window for layer in model.layers]
    if name == "gemma2":
        assert windows == [6, None, 6, None]
        assert cfg.attn_logit_softcapping == 3.0 and cfg.final_logit_softcapping == 0.8
        assert (
            model.layers[0].self_attn.backend.fixed == {"logit_softcap": 3.0}
            and model.layers[0].self_attn.q_norm is None
        )
        assert len(model.rotaries) == 1
    else:
        assert windows == [6, 6, None, 6, 6, None]
        assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
        assert model.layers[0].self_attn.q_norm is not None
        assert cfg.rope_theta == 10000.0 and cfg.rope_local_base_freq == 100.0
        assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
        assert [cfg.layer_rope_theta(i) for i in range(6)] == [100.0, 100.0, 10000.0, 100.0, 100.0, 10000.0]
        assert model.layer_rotary == [0, 0, 1, 0, 0, 1]
        inv = [r.inv_freq for r in model.rotaries]
        torch.testing.assert_close(inv[0][1], torch.tensor(100.0 ** (-2 / 32)))
        torch.testing.assert_close(inv[1][1], torch.tensor(10000.0 ** (-2 / 32) / 8))


def test_full_prefill_matches_hf(family, paged, caches):
    _, path, _, ids, ref = family
    model, cfg = _load(path)
    batches = paged(num_blocks=16, block_size=8)
    kv = caches(cfg.num_hidden_layers, 16, 8, cfg.num_key_value_heads, cfg.head_dim)
    meta = batches.step([(0, 0, SEQ), (1, 0, SEQ)])
    logits = model.compute_logits(model(ids.reshape(-1), torch.arange(SEQ).repeat(2), kv, meta))
    assert logits.dtype == torch.float32 and logits.shape == (2 * SEQ, VOCAB)
    torch.testing.assert_close(logits, ref.reshape(2 * SEQ, -1), atol=ATOL, rtol=RTOL)
    assert torch.equal(logits.argmax(-1), ref.reshape(2 * SEQ, -1).argmax(-1))
    logprobs = torch.log_softmax(logits, -1)
    torch.testing.assert_close(
        logprobs, torch.log_softmax(ref.reshape(2 * SEQ, -1), -1), atol=ATOL, rtol=RTOL
    )


@pytest.mark.parametrize("block_size", [8, 16])
def test_chunked_prefill_and_decode_match_hf(family, paged, caches, block_size):
    """Seq 0: prefix of 7, chunks of 5 and 9, then decodes; seq 1 starts later and runs beside it."""
    _, path, _, ids, ref = family
    model, cfg = _load(path)
    batches = paged(num_blocks=24, block_size=block_size, seed=block_size)
    kv = caches(cfg.num_hidden_layers, 24, block_size, cfg.num_key_value_heads, cfg.head_dim)
    plan = [
        [(0, 0, 7)],
        [(0, 7, 5), (1, 0, 16)],
        [(0, 12, 9), (1, 16, 1)],
        [(0, 21, 1), (1, 17, 4)],
        *[[(0, 22 + i, 1), (1, 21 + i, 1)] for i in range(7)],
        [(1, 28, 1)],
    ]
    seen = {0: 0, 1: 0}
    for step in plan:
        meta = batches.step(step)
        tokens = torch.cat([ids[s, c : c + q] for s, c, q in step])
        positions = torch.cat([torch.arange(c, c + q) for s, c, q in step])
        logits = model.compute_logits(model(tokens, positions, kv, meta))
        expect = torch.cat([ref[s, c : c + q] for s, c, q in step])
        torch.testing.assert_close(logits, expect, atol=ATOL, rtol=RTOL)
        assert torch.equal(logits.argmax(-1), expect.argmax(-1))
        for s, c, q in step:
            assert seen[s] == c
            seen[s] = c + q
    assert seen == {0: SEQ, 1: SEQ}


@pytest.mark.parametrize(
    ("name", "drop"), [("gemma2", "window"), ("gemma2", "softcap"), ("gemma3", "window"), ("gemma3", "rope")]
)
def test_each_feature_shows_in_the_logits(tmp_path_factory, paged, caches, name, drop):
    """Guards against vacuous parity: without its window, its soft-cap or its local RoPE base our model no
    longer matches transformers (the window only from the 7th token on)."""
    _, path, _, ids, ref = _build(name, tmp_path_factory)
    model, cfg = _load(path)
    first_diff = 0
    for layer in model.layers:
        if drop == "window":
            layer.self_attn.sliding_window = None
            first_diff = 6
        elif drop == "softcap":
            layer.self_attn.backend = layer.self_attn.backend.backend
    if drop == "rope":
        model.layer_rotary = [1] * len(model.layers)  # every layer on the global table
    logits = _prefill(model, cfg, ids[0], paged, caches)
    assert (logits[first_diff:] - ref[0, first_diff:]).abs().max() > 1e-3
    if first_diff:
        torch.testing.assert_close(logits[:first_diff], ref[0, :first_diff], atol=ATOL, rtol=RTOL)


def test_final_softcap_bounds_the_logits(tmp_path_factory, paged, caches):
    _, path, _, ids, ref = _build("gemma2", tmp_path_factory)
    model, cfg = _load(path)
    logits = _prefill(model, cfg, ids[0], paged, caches)
    assert logits.abs().max() < 0.8 and ref[0].abs().max() > 0.5
    cfg.final_logit_softcapping = None
    raw = _prefill(model, cfg, ids[0], paged, caches)
    assert raw.abs().max() > 0.8  # the cap (0.8) bends these logits
    torch.testing.assert_close(0.8 * torch.tanh(raw / 0.8), logits)


def test_bfloat16_runs_close_to_fp32(family, paged, caches):
    _, path, _, ids, ref = family
    model, cfg = _load(path, torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16 and model.embed_scale.item() == 8.0
    logits = _prefill(model, cfg, ids[0], paged, caches)
    assert logits.dtype == torch.float32
    assert (logits - ref[0]).abs().max().item() < 0.1 * ref[0].abs().max().item()
    assert (logits.argmax(-1) == ref[0].argmax(-1)).float().mean() > 0.8


def test_float16_is_refused_and_auto_picks_bfloat16(family):
    name, path, _, _, _ = family
    cfg = ModelConfig.from_dir(path)
    assert not cfg.family.float16
    with pytest.raises(ValueError, match="overflows float16.*bfloat16 or float32"):
        _load(path, torch.float16)
    with pytest.raises(ValueError, match="--dtype float16 is refused.*bfloat16 or float32"):
        resolve_dtype_name("float16", "cuda", "bfloat16", (9, 0), cfg.family.float16)
    assert resolve_dtype_name("auto", "cuda", "float16", (9, 0), cfg.family.float16) == "bfloat16"
    assert resolve_dtype_name("auto", "cuda", "float32", (9, 0), cfg.family.float16) == "bfloat16"
    assert resolve_dtype_name("auto", "cuda", "bfloat16", (7, 5), cfg.family.float16) == "float32"  # T4
    assert resolve_dtype_name("float32", "cuda", "bfloat16", (9, 0), cfg.family.float16) == "float32"
    # Other families keep float16.
    assert resolve_dtype_name("auto", "cuda", "float16", (9, 0)) == "float16"


def test_the_engine_refuses_float16_for_gemma(family):
    from pagoda.engine import LLM

    _, path, _, _, _ = family
    with pytest.raises(ValueError, match="--dtype float16 is refused"):
        LLM(str(path), device="cpu", dtype="float16", skip_tokenizer_init=True)


# ---------------------------------------------------------------- config.json as published


GEMMA3_1B = {  # the layout of google/gemma-3-1b-it's config.json (older transformers), shrunk
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_hidden_layers": 7,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 262144,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "rope_theta": 1000000,
    "rope_local_base_freq": 10000,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "torch_dtype": "bfloat16",
}


def test_published_gemma3_config_without_layer_types():
    cfg = ModelConfig.from_hf_config(GEMMA3_1B)
    assert cfg.architecture == "gemma3" and cfg.qk_norm and cfg.sliding_window == 512
    assert [cfg.layer_sliding_window(i) for i in range(7)] == [512] * 5 + [None, 512]
    assert [cfg.layer_rope_theta(i) for i in range(7)] == [10000.0] * 5 + [1000000.0, 10000.0]
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.attention_scale == 256**-0.5 and cfg.hidden_act == "gelu_pytorch_tanh"


def test_published_gemma2_config_without_layer_types():
    """Gemma 2's first configs list no layer_types: even layers slide."""
    gemma2 = {
        **GEMMA3_1B,
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "num_hidden_layers": 4,
        "hidden_act": "gelu_pytorch_tanh",
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 4096,
        "rope_theta": 10000.0,
        "cache_implementation": "hybrid",
    }
    for key in ("rope_local_base_freq", "rope_scaling", "sliding_window_pattern", "hidden_activation"):
        gemma2.pop(key)
    cfg = ModelConfig.from_hf_config(gemma2)
    assert cfg.architecture == "gemma2" and not cfg.qk_norm
    assert [cfg.layer_sliding_window(i) for i in range(4)] == [4096, None, 4096, None]
    assert cfg.attn_logit_softcapping == 50.0 and cfg.final_logit_softcapping == 30.0
    assert cfg.rope_local_base_freq is None and cfg.layer_rope_theta(0) == 10000.0
    assert cfg.hidden_act == "gelu_pytorch_tanh"


def test_multimodal_gemma3_is_read_as_its_language_model():
    """Gemma3ForConditionalGeneration (model_type gemma3, the 4B/12B/27B on the Hub): the engine reads its
    text_config, with the wrapper's dtype and stop ids, and notes it is served text only."""
    text = {k: v for k, v in GEMMA3_1B.items() if k not in ("architectures", "model_type", "torch_dtype")}
    multimodal = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {**text, "model_type": "gemma3_text", "eos_token_id": 1},
        "vision_config": {"model_type": "siglip_vision_model"},
        "eos_token_id": [1, 106],
        "torch_dtype": "bfloat16",
    }
    for strict in (True, False):
        cfg = ModelConfig.from_hf_config(multimodal, strict=strict)
        assert cfg.architecture == "gemma3" and cfg.model_type == "gemma3" and cfg.multimodal_checkpoint
        assert cfg.num_hidden_layers == 7 and cfg.num_key_value_heads == 1 and cfg.head_dim == 32
        assert cfg.eos_token_ids == [1, 106] and cfg.torch_dtype == "bfloat16" and cfg.qk_norm
        assert [cfg.layer_sliding_window(i) for i in range(7)] == [512] * 5 + [None, 512]
    assert not ModelConfig.from_hf_config(GEMMA3_1B).multimodal_checkpoint


# google/gemma-3-4b-it's config.json as published (transformers 4.50): its text_config names only what differs
# from Gemma3TextConfig's defaults; the vision config shortened.
GEMMA3_4B_PUBLISHED = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {"model_type": "siglip_vision_model", "image_size": 896, "patch_size": 14},
}


def test_a_published_text_config_takes_transformers_defaults_for_what_it_omits():
    """The 4B's text_config gives no heads, head_dim, vocabulary, scalar or RoPE bases: ours are the ones
    transformers' own Gemma3Config reads from the same file."""
    import transformers

    cfg = ModelConfig.from_hf_config(GEMMA3_4B_PUBLISHED)
    hf = transformers.Gemma3Config.from_dict(GEMMA3_4B_PUBLISHED).text_config
    assert cfg.architecture == "gemma3" and cfg.multimodal_checkpoint and cfg.torch_dtype == "bfloat16"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (34, 2560, 10240)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (
        8,
        4,
        256,
        262208,
    )
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.vocab_size,
    )  # fmt: skip
    assert cfg.query_pre_attn_scalar == hf.query_pre_attn_scalar == 256
    assert cfg.attention_scale == 256**-0.5 and cfg.hidden_act == hf.hidden_activation
    assert cfg.max_position_embeddings == hf.max_position_embeddings == 131072
    assert cfg.tie_word_embeddings and hf.tie_word_embeddings and cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.sliding_window == hf.sliding_window == 1024
    assert cfg.layer_types == hf.layer_types
    assert sum(cfg.layer_sliding_window(i) is None for i in range(34)) == 5  # layers 5, 11, ..., 29
    assert cfg.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert cfg.rope_local_base_freq == hf.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert hf.rope_parameters["full_attention"]["factor"] == 8.0
    assert cfg.eos_token_ids == [1, 106] and cfg.bos_token_id == 2


def test_other_multimodal_wrappers_are_refused():
    """A wrapper the table does not serve (LLaVA around a Llama) is refused naming what is served; sizing
    still reads its decoder."""
    llava = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "vocab_size": 320},
    }  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"model_type 'llava' \(LlavaForConditionalGeneration\) is a multimodal checkpoint \(its decoder "
        r"under text_config\), which Pagoda does not run; .*language model \(text only\) of model_type gemma3",
    ):
        ModelConfig.from_hf_config(llava)
    lenient = ModelConfig.from_hf_config(llava, strict=False)
    assert lenient.architecture == "llama" and not lenient.multimodal_checkpoint


def test_embedding_gemma_is_refused():
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_config({**GEMMA3_1B, "use_bidirectional_attention": True})


# ---------------------------------------------------------------- tensor parallelism


def _with_tokenizer(path: Path) -> Path:
    from pagoda.engine.loader import resolve_model

    src = Path(resolve_model(None))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, path / name)
    return path


@pytest.mark.timeout(180)
def test_gemma3_tp2_matches_tp1_and_hf(tmp_path_factory):
    """Two gloo ranks (each with 2 of the 4 query heads, 1 KV head, half the MLP and of the vocabulary)
    give the greedy tokens of one rank and of transformers."""
    from pagoda.engine import LLM, SamplingParams

    _, path, hf, ids, _ = _build("gemma3", tmp_path_factory)
    path = _with_tokenizer(path)
    assert json.loads((path / "config.json").read_text())["model_type"] == "gemma3_text"
    prompts = [ids[0, :20].tolist(), ids[1, :9].tolist()]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expect = [tiny_gemma.hf_greedy(hf, p, 12) for p in prompts]
    results = {}
    for tp in (1, 2):
        llm = LLM(
            str(path), device="cpu", dtype="float32", max_model_len=128, tensor_parallel_size=tp,
            kv_cache_memory_bytes=4 << 20,
        )  # fmt: skip
        try:
            results[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        finally:
            llm.engine.close()
    assert results[1] == expect
    assert results[2] == expect


def test_streaming_eviction_rotates_each_layer_with_its_base(tmp_path_factory, monkeypatch):
    """Attention sinks past max_model_len: each layer's kept keys are re-rotated with that layer's RoPE base
    (Gemma 3's sliding layers 100, its global ones 10000 scaled by 8)."""
    from pagoda.engine import LLM, SamplingParams
    from pagoda.engine.worker import model_runner

    _, path, _, ids, _ = _build("gemma3", tmp_path_factory)
    used = []
    rotate = model_runner.rotate_keys_

    def spy(kv, scales, src, dst, deltas, inv_freq):
        used.append(float(inv_freq[1]))
        return rotate(kv, scales, src, dst, deltas, inv_freq)

    monkeypatch.setattr(model_runner, "rotate_keys_", spy)
    llm = LLM(
        str(path), device="cpu", dtype="float32", max_model_len=64, kv_cache_memory_bytes=4 << 20,
        skip_tokenizer_init=True, kv_eviction="streaming", kv_sink_tokens=16, kv_window_tokens=32,
    )  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, kv_eviction="streaming")
        out = llm.generate([ids[0, :20].tolist()], params, use_tqdm=False)
    finally:
        llm.engine.close()
    assert len(out[0].outputs[0].token_ids) == 100
    local, full = 100.0 ** (-2 / 32), 10000.0 ** (-2 / 32) / 8
    assert used and used[:6] == pytest.approx([local, local, full, local, local, full])


# ---------------------------------------------------------------- a multimodal Gemma 3, served text only

# transformers 5's in-memory names of Gemma3ForConditionalGeneration (save_pretrained still writes the
# published checkpoints' language_model.model.* layout, which the tiny checkpoint has)
_TRANSFORMERS5_NAMES = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    return _build("gemma3_multimodal", tmp_path_factory)


def _rewritten(src: Path, dst: Path, renames=(), extra=None) -> Path:
    """A copy of the checkpoint in ``src`` with its tensors renamed (first matching prefix) and ``extra``
    tensors added."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        tensors[name] = tensor
    save_file({**tensors, **(extra or {})}, dst / "model.safetensors")
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def _names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())


@pytest.mark.parametrize("layout", ["published", "transformers5"])
def test_multimodal_gemma3_serves_its_language_model(multimodal, layout, tmp_path, paged, caches):
    """Both weight layouts of a Gemma3ForConditionalGeneration load (vision tower and projector skipped) and
    give transformers' text-only logits (input_ids alone) on both sequences."""
    _, path, hf, ids, ref = multimodal
    if layout == "transformers5":
        path = _rewritten(path, tmp_path, _TRANSFORMERS5_NAMES)
    names = _names(path)
    lm, head, vision = {
        "published": ("language_model.model.layers.", "language_model.lm_head.weight", "vision_tower."),
        "transformers5": ("model.language_model.layers.", "lm_head.weight", "model.vision_tower."),
    }[layout]
    assert any(n.startswith(lm) for n in names) and head in names
    assert any(n.startswith(vision) for n in names) and any("multi_modal_projector." in n for n in names)
    model, cfg = _load(path)
    assert cfg.architecture == "gemma3" and cfg.model_type == "gemma3" and cfg.multimodal_checkpoint
    assert isinstance(model, GemmaForCausalLM) and not cfg.tie_word_embeddings
    torch.testing.assert_close(model.lm_head_weight, hf.lm_head.weight)
    assert [layer.self_attn.sliding_window for layer in model.layers] == [6, 6, None, 6, 6, None]
    batches = paged(num_blocks=16, block_size=8)
    kv = caches(cfg.num_hidden_layers, 16, 8, cfg.num_key_value_heads, cfg.head_dim)
    meta = batches.step([(0, 0, SEQ), (1, 0, SEQ)])
    logits = model.compute_logits(model(ids.reshape(-1), torch.arange(SEQ).repeat(2), kv, meta))
    torch.testing.assert_close(logits, ref.reshape(2 * SEQ, -1), atol=ATOL, rtol=RTOL)
    assert torch.equal(logits.argmax(-1), ref.reshape(2 * SEQ, -1).argmax(-1))


def test_multimodal_gemma3_greedy_tokens_match_hf(multimodal):
    """The engine on the multimodal checkpoint gives transformers' greedy tokens (its full forward each step)."""
    from pagoda.engine import LLM, SamplingParams

    _, path, hf, ids, _ = multimodal
    prompts = [ids[0, :20].tolist(), ids[1, :9].tolist()]
    llm = LLM(
        str(path), device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20,
        skip_tokenizer_init=True,
    )  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.close()
    assert got == [tiny_gemma.hf_greedy(hf, p, 10) for p in prompts]


@pytest.mark.parametrize(
    "extra", ["language_model.model.layers.0.extra_norm.weight", "image_newline", "model.audio_tower.w"]
)
def test_multimodal_gemma3_refuses_an_unknown_tensor(multimodal, tmp_path, extra):
    """Only the vision tower and projector are skipped: any other tensor the model has no place for fails
    the load by name, as in a text checkpoint."""
    _, path, _, _, _ = multimodal
    path = _rewritten(path, tmp_path, extra={extra: torch.zeros(64)})
    with pytest.raises(ValueError, match="has no place in a gemma3 model"):
        _load(path)


def test_the_dry_run_of_a_multimodal_gemma3_sizes_its_language_model(multimodal):
    """`pagoda serve --dry-run` on the multimodal directory passes, and weighs only the tensors the engine
    loads (the vision tower and projector are skipped at load, so not sized)."""
    from pagoda.engine.cli.dry_run import check

    _, path, hf, _, _ = multimodal
    report = check(
        [str(path), "--device", "cpu", "--kv-cache-memory-bytes", "16MiB", "--max-model-len", "256"]
    )
    decoder = sum(p.numel() for p in hf.model.language_model.parameters()) + hf.lm_head.weight.numel()
    vision = sum(p.numel() for p in hf.model.vision_tower.parameters())
    assert vision > 0 and sum(p.numel() for p in hf.parameters()) > decoder
    assert report.model.shape.num_params == decoder and report.model.shape.architecture == "gemma3"
    assert report.model.shape.sliding_window_layers == 4 and report.plan is not None
