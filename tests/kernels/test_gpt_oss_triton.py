"""gpt-oss on the GPU path (Triton attention with sinks, fused norms and rotary, the grouped-GEMM experts with
their biases; interpreted here): the experts layer against its CPU path, and the engine's greedy tokens
against transformers' on a two-layer tiny checkpoint (a 4-token sliding layer, then a full one) through
chunked prefills and decodes replayed from recordings (as decode graphs replay on a GPU)."""

import torch
from pagoda.engine.models.gpt_oss import GptOssMoE
from pagoda.engine.sizing.model_config import ModelConfig


def test_the_experts_gpu_path_matches_its_cpu_path():
    cfg = ModelConfig("gpt_oss", 64, 48, 32, 1, 4, 2, 12, num_experts=6, num_experts_per_tok=2,
                      moe_intermediate_size=32, swiglu_limit=0.5)  # fmt: skip
    g = torch.Generator().manual_seed(9)
    layers = [GptOssMoE(cfg, torch.float32, torch.device("cpu"), triton=t) for t in (True, False)]
    for p in layers[0].parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(11, 48, generator=g)
    torch.testing.assert_close(layers[0](x), layers[1](x), atol=1e-4, rtol=1e-4)


def test_triton_path_of_a_tiny_gpt_oss_gives_transformers_greedy_tokens(tmp_path):
    from pagoda.engine import LLM, SamplingParams
    from pagoda.engine.worker.decode_graphs import RerunCapture
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=128, swiglu_limit=0.6,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    hf = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.normal_(0, 1.5)
            else:
                p.normal_(0, 0.15)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (21,), generator=g).tolist(), [5, 9, 77]]
    new = 5
    expect = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            expect.append(ids[len(prompt) :])
    llm = LLM(
        model=str(tmp_path), attention_backend="triton", device="cpu", dtype="float32", block_size=16,
        kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=16, max_model_len=64, max_num_seqs=2,
        skip_tokenizer_init=True,
    )  # fmt: skip
    try:
        engine = llm.engine
        model = engine.runner.model
        assert model.layers[0].mlp.triton and model.layers[0].self_attn.triton
        # decodes replayed from recordings: the routing, tiles and sinks captured too
        capture = RerunCapture()
        assert engine.runner.capture_decode_graphs(2, engine.max_model_len, capture=capture) is None
        capture.replays.clear()
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.close()
    assert got == expect
    assert sum(capture.replays.values()) >= new - 1
