"""`--quantization gguf`: GGUFLinear over row segments of mixed ggml types, the tensor source of a GGUF file
(q/k rows unpermuted as block rows, the LM head from the file's blocks), the engine's greedy tokens against
the dequantized model's on a tiny Llama written here in quantized blocks, and the flag's refusals."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from pagoda.engine.config import EngineConfig
from pagoda.engine.frontend.llm import LLM
from pagoda.engine.loader import resolve_model
from pagoda.engine.loader.gguf_quant import check_quantization, gguf_source, iter_gguf_blocks
from pagoda.engine.quantization.gguf_linear import GGUFLinear, gguf_matmul
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.sizing.model_config import ModelConfig
from pagoda.kernels import gguf_reference as ref
from pagoda_testkit.native import require_native

EPS32 = 2.0**-24
Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def _native() -> None:
    from pagoda.kernels.cpu import loader

    require_native(loader.library() is not None)


def _quantized(w: torch.Tensor, ggml_type: int) -> torch.Tensor:
    blocks = torch.from_numpy(gguf.quants.quantize(w.numpy(), Q(ggml_type)))
    blocks.ggml_type = ggml_type
    return blocks


def _k_quant(rows: int, k: int, ggml_type: int, seed: int) -> torch.Tensor:
    """Valid Q4_K / Q6_K blocks (the gguf package only decodes them): random bytes, finite small scales."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(rows * k // 256, ref.BLOCKS[ggml_type][1]), dtype=np.uint8)
    at = 0 if ggml_type == ref.Q4_K else 208
    b[:, at : at + 2] = rng.uniform(0, 0.002, len(b)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if ggml_type == ref.Q4_K:
        b[:, 2:4] = rng.uniform(0, 0.002, len(b)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    t = torch.from_numpy(b.reshape(rows, -1))
    t.ggml_type = ggml_type
    return t


@pytest.mark.parametrize("m", [1, 9])
def test_fused_linear_of_mixed_types(m):
    """q in Q4_K, k in Q6_K, v in Q8_0 (a Q4_K_M file's mix) and a bias: each segment's columns are x W^T
    of its own blocks, within float32's summation bound over K."""
    torch.manual_seed(m)
    k = 256
    parts = [
        _k_quant(64, k, ref.Q4_K, 1),
        _k_quant(32, k, ref.Q6_K, 2),
        _quantized(torch.randn(32, k), ref.Q8_0),
    ]
    layer = GGUFLinear(k, 128, True, torch.float32, "cpu")
    offset = 0
    for blocks in parts:
        assert layer.load_part("weight", blocks, offset, blocks.shape[0]) == blocks.shape[0]
        offset += blocks.shape[0]
    bias = torch.randn(128)
    assert layer.load_part("bias", bias, 0, 128) == 128
    assert [s[2] for s in layer.segments] == [ref.Q4_K, ref.Q6_K, ref.Q8_0]
    assert layer.weight.shape == (128, ref.row_bytes(ref.Q8_0, k))  # the widest type's rows
    w = torch.cat([ref.dequantize_gguf(b, b.ggml_type, k) for b in parts])
    x = torch.randn(m, k)
    got = layer(x)
    want = x.double() @ w.T + bias.double()
    bound = (k + 3) * EPS32 * (x.double().abs() @ w.abs().T + bias.double().abs())
    assert torch.all((got.double() - want).abs() <= bound)
    assert torch.equal(layer.dequantize(), w.float())
    y16 = layer(x.bfloat16())  # bfloat16 activations: computed in float32, returned in bfloat16
    assert y16.dtype == torch.bfloat16


def test_neighbouring_parts_of_one_type_run_as_one_segment():
    torch.manual_seed(0)
    layer = GGUFLinear(64, 96, False, torch.float32, "cpu")
    w = torch.randn(96, 64)
    for lo, hi in ((0, 32), (32, 64), (64, 96)):
        layer.load_part("weight", _quantized(w[lo:hi], ref.Q4_1), lo, hi - lo)
    assert layer.segments == [(0, 96, ref.Q4_1)]
    x = torch.randn(3, 64)
    blocks = _quantized(w, ref.Q4_1)
    assert torch.equal(layer(x), gguf_matmul(x, blocks, ref.Q4_1))


def test_load_part_refusals():
    layer = GGUFLinear(64, 32, False, torch.float32, "cpu")
    blocks = _quantized(torch.randn(32, 64), ref.Q4_1)
    with pytest.raises(ValueError, match="tensor-parallel"):
        layer.load_part("weight", blocks, 0, 32, (0, list(range(16))))
    half = blocks[:16]
    half.ggml_type = ref.Q4_1
    with pytest.raises(ValueError, match="do not fit"):
        layer.load_part("weight", half, 0, 32)
    plain = torch.zeros(32, 40, dtype=torch.uint8)
    with pytest.raises(ValueError, match="GGUFLinear takes blocks"):
        layer.load_part("weight", plain, 0, 32)
    with pytest.raises(ValueError, match="CPU only"):
        GGUFLinear(64, 32, False, torch.float32, "meta")


# ---- a tiny Llama written in quantized blocks --------------------------------------------------------------

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 96, 2, 4, 2, 261
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleaving of the rotary halves of q/k rows (what the loaders undo)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_llama(path, linear_type: int = ref.Q4_1, down_type: int = ref.Q8_0) -> None:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    # a byte-level vocabulary (GPT-2's byte alphabet), two merges and three control tokens
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    alphabet = dict(zip(printable + others, printable + [256 + i for i in range(len(others))], strict=True))
    tokens = [chr(alphabet[b]) for b in range(256)] + [
        "he",
        "ll",
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (VOCAB - 3) + [3] * 3)
    writer.add_token_merges(["h e", "l l"])
    writer.add_bos_token_id(VOCAB - 2)
    writer.add_eos_token_id(VOCAB - 3)
    writer.add_chat_template(TEMPLATE)

    def quant(name: str, w: np.ndarray, ggml_type: int) -> None:
        writer.add_tensor(name, gguf.quants.quantize(w, Q(ggml_type)), raw_dtype=Q(ggml_type))

    hd = HIDDEN // HEADS
    quant("token_embd.weight", rng.normal(0, 0.5, (VOCAB, HIDDEN)).astype(np.float32), ref.Q8_0)
    writer.add_tensor("output_norm.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
        for name, rows, heads in (("attn_q", HIDDEN, HEADS), ("attn_k", KV_HEADS * hd, KV_HEADS)):
            quant(
                f"blk.{i}.{name}.weight",
                _permute(rng.normal(0, 0.3, (rows, HIDDEN)).astype(np.float32), heads),
                linear_type,
            )
        quant(
            f"blk.{i}.attn_v.weight", rng.normal(0, 0.3, (KV_HEADS * hd, HIDDEN)).astype(np.float32), ref.Q8_0
        )
        quant(
            f"blk.{i}.attn_output.weight",
            rng.normal(0, 0.3, (HIDDEN, HIDDEN)).astype(np.float32),
            linear_type,
        )
        quant(f"blk.{i}.ffn_gate.weight", rng.normal(0, 0.3, (INTER, HIDDEN)).astype(np.float32), linear_type)
        quant(f"blk.{i}.ffn_up.weight", rng.normal(0, 0.3, (INTER, HIDDEN)).astype(np.float32), ref.Q4_0)
        quant(f"blk.{i}.ffn_down.weight", rng.normal(0, 0.3, (HIDDEN, INTER)).astype(np.float32), down_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-llama.gguf"
    _tiny_llama(path)
    return path


def _llm(model, **kw) -> LLM:
    return LLM(
        model=str(model),
        device="cpu",
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=4 << 20,
        **kw,
    )


def test_tensor_source_unpermutes_q_and_k_as_block_rows(tiny_gguf):
    """The blocks of q_proj decode to the converter's (dequantized, unpermuted) q_proj weight."""
    from safetensors.torch import load_file

    converted = resolve_model(str(tiny_gguf))
    assert gguf_source(converted) == tiny_gguf.resolve()
    dense = load_file(str(converted / "model.safetensors"))
    blocks = dict(iter_gguf_blocks(tiny_gguf, ModelConfig.from_dir(converted)))
    assert "lm_head.weight" in blocks and blocks["lm_head.weight"].ggml_type == ref.Q8_0  # the tied embedding
    for name in ("q_proj", "k_proj", "v_proj", "down_proj"):
        full = f"model.layers.1.{'mlp' if name == 'down_proj' else 'self_attn'}.{name}.weight"
        b = blocks[full]
        assert torch.equal(ref.dequantize_gguf(b, b.ggml_type, dense[full].shape[1]).float(), dense[full]), (
            name
        )


def test_greedy_tokens_equal_the_dequantized_models(tiny_gguf):
    """The kernels compute with gguf's float32 weights: the same greedy tokens as the dequantized model,
    through GGUFLinear for every linear and the Q8_0 LM head."""
    prompts = [[259, 5, 17, 99], [259, 200, 3], [259, 42] * 7]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for method in (None, "gguf"):
        llm = _llm(tiny_gguf, quantization=method)
        model = llm.engine.core.runner.model
        if method == "gguf":
            assert isinstance(model.layers[0].self_attn.qkv_proj, GGUFLinear)
            assert [s[2] for s in model.layers[0].self_attn.qkv_proj.segments] == [ref.Q4_1, ref.Q8_0]
            assert isinstance(model.lm_head_quantized, GGUFLinear)
        else:
            assert model.lm_head_quantized is None
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[method] = [list(o.outputs[0].token_ids) for o in out]
    assert tokens["gguf"] == tokens[None]


def test_a_type_the_kernels_do_not_run_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-q5_1.gguf"
    _tiny_llama(path, down_type=int(Q.Q5_1))
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_down\.weight' is Q5_1.*leave the flag out"):
        _llm(path, quantization="gguf")


def test_the_flag_is_checked_against_the_model(tiny_gguf, tmp_path):
    converted = resolve_model(str(tiny_gguf))
    mc = ModelConfig.from_dir(converted)
    cpu = torch.device("cpu")
    check_quantization(None, converted, mc, cpu)
    check_quantization("gguf", converted, mc, cpu)
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization("gguf", converted, mc, torch.device("cuda"))
    with pytest.raises(ValueError, match="pass --quantization gguf"):
        check_quantization("awq", converted, mc, cpu)
    plain = tmp_path / "plain"  # the same weights as a safetensors checkpoint
    shutil.copytree(converted, plain)
    (plain / "pagoda_source.json").unlink()
    with pytest.raises(ValueError, match="safetensors checkpoint .not quantized.: leave the flag out"):
        check_quantization("gguf", plain, mc, cpu)
    with pytest.raises(ValueError, match="does not match .* not quantized"):
        check_quantization("fp8", plain, mc, cpu)
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineConfig(quantization="gguf", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="bitsandbytes")
