"""Tiny Llama and Qwen3 checkpoints quantized here in each format generate, through Pagoda's LLM API, the
greedy tokens of transformers running the dequantized weights in float32, with the same logprobs; two gloo
ranks do the same for one INT4 and one FP8 format. (On the CPU the engine runs FP8 and INT4 checkpoints over
weights dequantized once at load, so the match is to float32 summation order.)"""

from __future__ import annotations

import pytest
import torch
from pagoda.engine.models.layers import Linear
from pagoda_testkit.quant_checkpoints import FORMATS, save_quantized
from transformers import LlamaConfig, Qwen3Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import Qwen3ForCausalLM as HFQwen3

# hidden 256 = two groups of 128 (down_proj: four), q 4 x 64 and k/v 2 x 64 rows: whole 128-row FP8 blocks
SHAPE = dict(
    vocab_size=320,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
FAMILIES = {
    "llama": (HFLlama, lambda: LlamaConfig(**SHAPE, tie_word_embeddings=False)),
    "qwen3": (HFQwen3, lambda: Qwen3Config(**SHAPE, tie_word_embeddings=True)),
}
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300] * 5]
N = 5


def build(family: str, fmt: str, path) -> torch.nn.Module:
    """The float reference (transformers over the dequantized weights) after writing the quantized checkpoint."""
    hf_cls, make_config = FAMILIES[family]
    torch.manual_seed(0)
    cfg = make_config()
    cfg._attn_implementation = "eager"
    hf = hf_cls(cfg).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(
                1 + 0.2 * torch.randn(p.shape, generator=g)
                if "norm" in name
                else 0.15 * torch.randn(p.shape, generator=g)
            )
    save_quantized(hf, path, fmt)
    return hf


def hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(N):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            ids.append(int(logits.argmax()))
            logprobs.append(float(torch.log_softmax(logits, -1)[ids[-1]]))
    return ids[len(prompt) :], logprobs


def pagoda_greedy(path, tp: int = 1):
    from pagoda.engine import LLM, SamplingParams

    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        max_model_len=64,
        tensor_parallel_size=tp,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=4 << 20,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=0)
        return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.engine.close()


def check(hf, outs) -> None:
    for out, prompt in zip(outs, PROMPTS, strict=True):
        tokens, logprobs = hf_greedy(hf, prompt)
        assert list(out.token_ids) == tokens
        got = [step[t].logprob for step, t in zip(out.logprobs, tokens, strict=True)]
        assert got == pytest.approx(logprobs, abs=1e-4)


CASES = [("llama", fmt) for fmt in FORMATS] + [
    ("qwen3", fmt) for fmt in ("gptq", "ct-int4-asym", "ct-fp8-block")
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "fmt"), CASES)
def test_quantized_checkpoint_generates_the_dequantized_models_tokens(tmp_path, family, fmt) -> None:
    hf = build(family, fmt, tmp_path)
    outs = pagoda_greedy(tmp_path)
    check(hf, outs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "fmt"), [("gemma3", "ct-int4-channel"), ("gemma2", "ct-fp8-channel")])
def test_a_quantized_gemma_generates_the_dequantized_models_tokens(tmp_path, family, fmt) -> None:
    """Gemma's GeGLU MLP takes quantized linears too (per channel: the tiny Gemma's 64-wide layers)."""
    from pagoda_testkit import tiny_gemma

    hf = tiny_gemma.hf_model(family, layers=2)
    save_quantized(hf, tmp_path, fmt)
    outs = pagoda_greedy(tmp_path)
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert list(out.token_ids) == tiny_gemma.hf_greedy(hf, prompt, N)


def test_bfloat16_runs_the_dequantized_weights_rounded_once(tmp_path) -> None:
    """In bfloat16 the engine holds the dequantized float32 weights rounded to bfloat16: the same model as the
    float checkpoint of those weights run in bfloat16, token for token and logprob for logprob."""
    from pagoda.engine import LLM, SamplingParams

    hf = build("llama", "gptq-asym-v2", tmp_path / "q")
    hf.save_pretrained(tmp_path / "dense", safe_serialization=True)  # the dequantized weights, float32
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=0)
    runs = []
    for path in (tmp_path / "q", tmp_path / "dense"):
        llm = LLM(str(path), device="cpu", dtype="bfloat16", max_model_len=64, skip_tokenizer_init=True,
                  kv_cache_memory_bytes=4 << 20)  # fmt: skip
        try:
            runs.append([o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        finally:
            llm.engine.close()
    for quantized, dense in zip(*runs, strict=True):
        assert list(quantized.token_ids) == list(dense.token_ids)
        assert [s[t].logprob for s, t in zip(quantized.logprobs, quantized.token_ids, strict=True)] == [
            s[t].logprob for s, t in zip(dense.logprobs, dense.token_ids, strict=True)
        ]


def test_the_cpu_engine_holds_dense_linears_over_the_dequantized_weights(tmp_path) -> None:
    from pagoda.engine.attention import get_attention_backend
    from pagoda.engine.loader import load_model

    hf = build("llama", "ct-int4-asym", tmp_path)
    model, config = load_model(tmp_path, torch.float32, "cpu", get_attention_backend("torch", "cpu"), False)
    assert config.quantization.label == "int4 (compressed-tensors, group 128, asymmetric)"
    attn = model.layers[1].self_attn
    assert type(attn.qkv_proj) is Linear and type(model.layers[1].mlp.down_proj) is Linear
    ref = hf.state_dict()
    qkv = torch.cat([ref[f"model.layers.1.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(attn.qkv_proj.weight, qkv)


def test_a_quantized_mixture_of_experts_checkpoint_is_refused() -> None:
    from pagoda.engine.attention import get_attention_backend
    from pagoda.engine.models import LlamaForCausalLM, ModelConfig
    from pagoda.engine.sizing.errors import UnsupportedModelError
    from pagoda_testkit.quant_checkpoints import quantization_config

    moe = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **SHAPE, "num_experts": 4}
    config = ModelConfig.from_hf_config(moe | {"quantization_config": quantization_config("awq")})
    with pytest.raises(UnsupportedModelError, match="quantized .int4 .awq.* mixture-of-experts checkpoint"):
        LlamaForCausalLM(config, get_attention_backend("torch", "cpu"), torch.float32)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["gptq", "ct-fp8-channel"])
def test_tp2_quantized_checkpoint_matches_the_dequantized_model(tmp_path, fmt) -> None:
    """Two gloo ranks: q/k/v and gate/up rows split, o_proj and down_proj columns split by whole groups of
    128 (one group of o_proj per rank, two of down_proj)."""
    hf = build("llama", fmt, tmp_path)
    outs = pagoda_greedy(tmp_path, tp=2)
    check(hf, outs)
