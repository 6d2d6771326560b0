"""Greedy output matches Hugging Face transformers on the same weights (vLLM's comparison rule).

Where the two diverge, each side's token must be in the other's top-5 with log-probabilities within 1e-3,
and at least 95% of sequences must match exactly.
"""

from __future__ import annotations

import pytest
import torch
from pagoda.engine import LLM, SamplingParams
from pagoda_testkit.parity import parity_prompts

NEW_TOKENS = 64
TOPK = 5
TOL = 1e-3


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Greedy decoding with the HF model's own forward and KV cache, no logits processors (EOS included,
    as our side runs with ignore_eos); returns each prompt's tokens and each step's raw log-probabilities.

    All prompts decode in one left-padded batch with an attention mask and each row's own positions, so a
    row computes what it would alone: a CPU decode step is bound by reading the weights, and one read per
    step for every prompt instead of one per prompt cuts the reference from minutes to seconds."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    past, tokens, logprobs = None, [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            lp = out.logits[:, -1].float().log_softmax(-1)
            ids = lp.argmax(-1, keepdim=True)
            tokens.append(ids[:, 0].tolist())
            logprobs.append(lp)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            positions = positions[:, -1:] + 1
    return [([step[row] for step in tokens], [step[row] for step in logprobs]) for row in range(len(prompts))]


def compare(ours_tokens, ours_logprobs, hf_tokens, hf_logprobs) -> bool:
    """True if identical; asserts the divergence rule where they differ."""
    for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens, strict=True)):
        if a == b:
            continue
        ours_top = ours_logprobs[i]
        hf_top = torch.topk(hf_logprobs[i], TOPK).indices.tolist()
        assert a in hf_top, f"step {i}: our token {a} not in HF's top-{TOPK} {hf_top}"
        assert b in ours_top, f"step {i}: HF's token {b} not in our top-{TOPK} {list(ours_top)}"
        assert abs(ours_top[b].logprob - float(hf_logprobs[i][b])) < TOL
        assert abs(ours_top[a].logprob - float(hf_logprobs[i][a])) < TOL
        return False
    return True


def run_parity(model_dir, prompts_ids: list[list[int]], hf_model) -> float:
    llm = LLM(
        str(model_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=64 << 20, max_model_len=512
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOPK)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts_ids], params, use_tqdm=False)
    exact = 0
    for out, (hf_tokens, hf_lp) in zip(outs, hf_greedy(hf_model, prompts_ids, NEW_TOKENS), strict=True):
        comp = out.outputs[0]
        assert len(comp.token_ids) == NEW_TOKENS
        exact += compare(comp.token_ids, comp.logprobs, hf_tokens, hf_lp)
    return exact / len(prompts_ids)


def test_default_model_matches_transformers(default_model_dir):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompts = parity_prompts(tok)
    assert len(prompts) >= 20
    assert run_parity(default_model_dir, prompts, hf) >= 0.95


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_tiny_random_models_match_transformers(family, tiny_model):
    import transformers

    model_dir = tiny_model(family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    # Lengths past Mistral's 24-token window and across several 16-token blocks.
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 16, 30, 47, 70)]
    assert run_parity(model_dir, prompts, hf) >= 0.95
