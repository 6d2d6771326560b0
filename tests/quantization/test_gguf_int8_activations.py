"""`--quantization gguf` with PAGODA_GGUF_ACTIVATIONS=int8 on the default model's own Q4_1 file: the layers
take the int8-activation product for decode's rows only, an unknown mode is refused by name, and the greedy
tokens stay close to the exact (float32-activation) mode's."""

from __future__ import annotations

import pytest
import torch
from pagoda.engine.frontend.llm import LLM
from pagoda.engine.loader.resolve import default_model_gguf
from pagoda.engine.quantization import gguf_linear
from pagoda.engine.quantization.gguf_linear import GGUFLinear
from pagoda.engine.sampling_params import SamplingParams
from pagoda.kernels import gguf_reference as ref
from pagoda_testkit.native import require_native

PROMPTS = [
    [1, 9690, 314, 253, 1345, 2914, 282, 28],  # short prompts: prefill's rows take the int8 product too
    [1, 504, 3575, 282, 4649, 314],
    [1, 1780, 253, 2378, 563, 253, 18225, 29, 3479, 30, 216, 5248, 3365, 314, 1048, 28, 1217, 6226],
]
TOKENS = 32
NEAR_TIE = 0.5  # nats: the most the exact mode may prefer its token where the int8 mode first differs


@pytest.fixture(autouse=True)
def _native() -> None:
    from pagoda.kernels.cpu import loader

    require_native(loader.library() is not None)


def _greedy(llm: LLM, monkeypatch, mode: str) -> list[list[int]]:
    """The greedy tokens with the layers' kernel calls made again under ``mode`` (read at a layer's first use)."""
    monkeypatch.setenv("PAGODA_GGUF_ACTIVATIONS", mode)
    for layer in llm.engine.core.runner.model.modules():
        if isinstance(layer, GGUFLinear):
            layer._calls = None
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in out]


def test_int8_greedy_tokens_against_the_exact_mode(monkeypatch):
    """Greedy tokens agree with the exact mode's until a near tie: where a prompt's tokens first differ, the
    exact mode itself ranks the int8 mode's token within NEAR_TIE nats of its own top one (after it, the texts
    differ and are not compared). The Q4_1 linears and the Q8_0 head took the int8 product, and a 9-row call the
    exact one."""
    llm = LLM(
        model=str(default_model_gguf()),
        device="cpu",
        dtype="float32",
        quantization="gguf",
        max_model_len=256,
        kv_cache_memory_bytes=16 << 20,
        enable_prefix_caching=False,  # each mode computes its prompts itself
    )
    exact = _greedy(llm, monkeypatch, "float32")
    int8 = _greedy(llm, monkeypatch, "int8")
    model = llm.engine.core.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GGUFLinear) and {s[2] for s in qkv.segments} <= gguf_linear.INT8_TYPES
    assert model.lm_head_quantized._calls[0][1] is not None  # Q8_0 head: the int8 function
    firsts = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), TOKENS)
        for x, y in zip(exact, int8, strict=True)
    ]
    print(f"int8 activations: greedy tokens agree with the exact mode's for the first {firsts} of {TOKENS}")
    assert min(firsts) >= 4
    monkeypatch.setenv("PAGODA_GGUF_ACTIVATIONS", "float32")
    for layer in model.modules():
        if isinstance(layer, GGUFLinear):
            layer._calls = None
    for prompt, tokens, first in zip(PROMPTS, int8, firsts, strict=True):
        if first == TOKENS:
            continue
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
        out = llm.generate([{"prompt_token_ids": prompt + tokens[:first]}], params, use_tqdm=False)
        ranked = out[0].outputs[0].logprobs[0]
        best = max(v.logprob for v in ranked.values())
        assert tokens[first] in ranked, (first, ranked)
        gap = best - ranked[tokens[first]].logprob
        print(f"  at token {first}: the exact mode's log-probability gap to the int8 choice {gap:.3f} nats")
        assert gap < NEAR_TIE

    monkeypatch.setenv("PAGODA_GGUF_ACTIVATIONS", "int8")
    qkv._calls = None
    torch.manual_seed(0)
    x = torch.randn(9, qkv.in_features)
    want = x.double() @ qkv.dequantize().double().T
    got = qkv(x)  # 9 rows: the exact product, float32's summation error only
    assert float((got.double() - want).norm() / want.norm()) < 1e-6
    got = qkv(x[:3])  # decode's rows: the int8 product, within int8's rounding but not exact
    assert 1e-4 < float((got.double() - want[:3]).norm() / want[:3].norm()) < 0.02


def test_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv("PAGODA_GGUF_ACTIVATIONS", "int4")
    layer = GGUFLinear(32, 2, False, torch.float32, "cpu")
    blocks = torch.zeros(2, 34, dtype=torch.uint8)
    blocks.ggml_type = ref.Q8_0
    layer.load_part("weight", blocks, 0, 2)
    with pytest.raises(ValueError, match="PAGODA_GGUF_ACTIVATIONS='int4'"):
        layer(torch.zeros(1, 32))
