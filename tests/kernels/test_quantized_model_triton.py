"""Quantized checkpoints on the GPU path: with the Triton attention backend the engine's FP8 and INT4 linears
keep their quantized weights and run the W4A16 / FP8 kernels (here through Triton's interpreter, compiled on
a GPU under PAGODA_KERNEL_TESTS=cuda, see conftest), and a tiny Llama quantized here gives the greedy tokens
of transformers over the dequantized weights. The FP8 path is the weight-only one (the interpreter's choice);
activations quantized per token round differently, so its tokens are compared where FP8 x FP8 is off."""

import pytest
import torch
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.quantization.linear import Fp8Linear, Int4Linear
from pagoda_testkit.quant_checkpoints import save_quantized
from transformers import LlamaConfig, LlamaForCausalLM

NEW = 3
SHAPE = dict(
    vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=128, rms_norm_eps=1e-5,
)  # fmt: skip
# hidden 192, q 192 rows (1.5 blocks of 128), k/v 64, gate/up 192: fused parts cut the 128-row FP8 blocks (SmolLM2's
# q/k/v: 576/192/192), so the block scales are held per row
UNALIGNED = SHAPE | dict(hidden_size=192, intermediate_size=192, num_attention_heads=3, num_key_value_heads=1)


def _greedy(hf, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("fmt", "kind", "shape"),
    [
        ("ct-int4-asym", Int4Linear, SHAPE),
        ("ct-fp8-block", Fp8Linear, SHAPE),
        ("ct-fp8-block", Fp8Linear, UNALIGNED),
    ],
    ids=["int4", "fp8-block", "fp8-block-cut"],
)
def test_quantized_linears_run_the_kernels_on_the_triton_path(tmp_path, fmt, kind, shape, monkeypatch):
    import pagoda.kernels.quant_fp8 as quant_fp8
    import pagoda.kernels.quant_w4a16 as quant_w4a16

    monkeypatch.setattr(quant_fp8, "fp8_act_quant", lambda device: False)  # weight-only: exact weights
    calls = []
    for module, name in ((quant_fp8, "fp8_linear"), (quant_w4a16, "w4a16_linear")):
        kernel = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw)
        )
    torch.manual_seed(0)
    cfg = LlamaConfig(**shape)
    cfg._attn_implementation = "eager"
    hf = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(
                1 + 0.2 * torch.randn(p.shape, generator=g)
                if "norm" in name
                else 0.15 * torch.randn(p.shape, generator=g)
            )
    save_quantized(hf, tmp_path, fmt)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 30]]  # batched: a prefill beside a decode
    expect = [_greedy(hf, p) for p in prompts]
    llm = LLM(
        model=str(tmp_path), attention_backend="triton", device="cpu", dtype="float32", block_size=16,
        kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=16, max_model_len=64, max_num_seqs=2,
        skip_tokenizer_init=True,
    )  # fmt: skip
    try:
        layer = llm.engine.runner.model.layers[0]
        assert type(layer.self_attn.qkv_proj) is kind and type(layer.mlp.down_proj) is kind
        if kind is Fp8Linear:  # per row only where the parts cut the blocks
            held = (1, 128) if shape is UNALIGNED else (128, 128)
            assert layer.self_attn.qkv_proj.block == held and layer.mlp.gate_up_proj.block == held
        params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.close()
    assert got == expect
    # every linear of the layer ran the format's kernel, once per step (q/k/v, o, gate/up, down)
    assert set(calls) == {"w4a16_linear" if kind is Int4Linear else "fp8_linear"} and len(calls) >= 4 * NEW


def test_an_act_order_linear_feeds_the_kernel_its_inputs_in_group_order():
    """GPTQ desc_act: the columns sorted by group at load, the inputs gathered in that order per call."""
    from pagoda.engine.quantization.convert import canonical_tensors
    from pagoda.engine.quantization.detect import detect_quantization
    from pagoda_testkit.quant_checkpoints import quantization_config, quantize_module

    n, k = 32, 256
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.2
    tensors, reference = quantize_module("gptq-act-order", w)
    scheme = detect_quantization({"quantization_config": quantization_config("gptq-act-order")})
    lin = Int4Linear(k, n, False, torch.float32, torch.device("cpu"), 128, False)
    for name, t in canonical_tensors(
        [(f"m.{kind}", t) for kind, t in tensors.items()], scheme, torch.float32
    ):
        lin.load_part(name.split(".")[1], t, 0, n, None)
    lin.finish_loading()
    lin.triton = True
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(lin(x), x @ reference.T, rtol=1e-4, atol=1e-4)
