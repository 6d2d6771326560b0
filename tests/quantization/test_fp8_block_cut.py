"""Block-wise FP8 checkpoints whose fused parts cut the 128-row blocks (llm-compressor's FP8_BLOCK of
SmolLM2-135M: q 576 rows = 4.5 blocks, then k and v): each projection is quantized on its own grid, so the
engine holds those scales per row. A tiny Llama of that kind, quantized here, gives through Pagoda's LLM API
(CPU, float32; one rank, and two gloo ranks whose slices cut the blocks too) the next-token log-probabilities
of transformers running the dequantized weights."""

from __future__ import annotations

import pytest
import torch
from pagoda.engine import LLM, SamplingParams
from pagoda_testkit.quant_checkpoints import save_quantized
from transformers import LlamaConfig, LlamaForCausalLM

# hidden 192 (1.5 blocks of input columns), q 3 x 64 rows, k/v 64 each, gate/up 320 each (2.5 blocks): every
# fused part after the first starts inside a block
SHAPE = dict(
    vocab_size=256, hidden_size=192, intermediate_size=320, num_hidden_layers=2, num_attention_heads=3,
    num_key_value_heads=1, head_dim=64, max_position_embeddings=128, rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)  # fmt: skip
# two tensor-parallel ranks: each holds q 128 rows (a whole block), then k/v 32 rows each that start inside a
# block of the rank's fused linear; o_proj / down_proj split by whole 128-column blocks
TP_SHAPE = SHAPE | dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=32)  # fmt: skip
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 30] * 3]
NEW, TOP = 4, 5


def _reference(path, shape: dict) -> LlamaForCausalLM:
    """The float model, written as an FP8 block checkpoint and then set to its dequantized weights."""
    cfg = LlamaConfig(**shape)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)
    save_quantized(hf, path, "ct-fp8-block")
    return hf


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("shape", "tp"), [(SHAPE, 1), (TP_SHAPE, 2)], ids=["tp1", "tp2"])
def test_fused_parts_that_cut_fp8_blocks_give_the_dequantized_models_logprobs(tmp_path, shape, tp) -> None:
    hf = _reference(tmp_path, shape)
    llm = LLM(
        str(tmp_path), device="cpu", dtype="float32", max_model_len=64, skip_tokenizer_init=True,
        kv_cache_memory_bytes=4 << 20, tensor_parallel_size=tp,
    )  # fmt: skip
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=TOP)
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.engine.close()
    for out, prompt in zip(outs, PROMPTS, strict=True):
        ids = list(prompt)
        for token, step in zip(out.token_ids, out.logprobs, strict=True):
            with torch.no_grad():
                want = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
            assert token == int(want.argmax())
            top = want.topk(TOP).indices.tolist()
            assert set(top) <= set(step)
            got = torch.tensor([step[t].logprob for t in top])
            torch.testing.assert_close(got, want[top], atol=1e-4, rtol=0)
            ids.append(token)
