"""Tiny random-weight Gemma 2 and Gemma 3 (text) checkpoints and transformers' answers on them, shared by
the model parity tests (tests/models) and the Triton-path tests (tests/kernels).

The window (6) is shorter than the prompts (29 tokens), the soft-caps small enough to bend scores and
logits, and Gemma 3's two RoPE bases far apart, so each feature shows in the logits. transformers runs eager
attention, the implementation that applies its soft-cap and window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SEQ = 29
VOCAB = 320
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=112,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=24,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    sliding_window=6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
FAMILIES = ("gemma2", "gemma3")


def hf_model(name: str, layers: int | None = None) -> Any:
    """transformers' model of the family (Gemma 2: 4 layers, Gemma 3: 6, every third global; ``layers``
    fewer; "gemma3_multimodal": Gemma 3's as the language model of a Gemma3ForConditionalGeneration with a
    one-layer SigLIP tower, its head untied), eager attention, every weight random (norms' w around 0: Gemma scales by 1 + w, so a missed
    offset shows; small embeddings: times sqrt(hidden) and tied to the head, larger ones make each token
    predict itself, and greedy runs would repeat one token)."""
    import torch
    import transformers

    if name == "gemma2":
        cfg = transformers.Gemma2Config(
            **COMMON, num_hidden_layers=layers or 4, attn_logit_softcapping=3.0, final_logit_softcapping=0.8
        )
        cls = transformers.Gemma2ForCausalLM
    elif name == "gemma3":
        cfg = _gemma3_text(layers)
        cls = transformers.Gemma3ForCausalLM
    elif name == "gemma3_multimodal":
        cfg = transformers.Gemma3Config(
            text_config=_gemma3_text(layers, tie_word_embeddings=False),  # so the head's names load too
            vision_config=transformers.SiglipVisionConfig(
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),  # fmt: skip
            mm_tokens_per_image=4,
            image_token_index=VOCAB - 1,
            boi_token_index=VOCAB - 3,
            eoi_token_index=VOCAB - 2,
            tie_word_embeddings=False,
        )
        cfg.text_config._attn_implementation = "eager"
        cls = transformers.Gemma3ForConditionalGeneration
    else:
        raise ValueError(name)
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(len(name) + 7)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            scale = 0.3 if "norm" in pname else 0.03 if "embed_tokens" in pname else 0.15
            p.copy_(scale * torch.randn(p.shape, generator=g))
    return model


def _gemma3_text(layers: int | None, **extra: Any) -> Any:
    """Gemma 3's tiny text config: 6 layers, every third global, RoPE bases 100 (local) and 10000 scaled by 8."""
    import transformers

    return transformers.Gemma3TextConfig(
        **COMMON,
        num_hidden_layers=layers or 6,
        sliding_window_pattern=3,  # layers 2 and 5 global
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
        **extra,
    )


def build(name: str, path: Path, layers: int | None = None) -> tuple[Any, Any, Any]:
    """Save the family's tiny model as safetensors in ``path``: (hf model, prompt ids [2, SEQ], its float32
    logits [2, SEQ, VOCAB])."""
    import torch

    hf = hf_model(name, layers)
    hf.save_pretrained(path, safe_serialization=True)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    return hf, ids, ref


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of transformers' full forward each step. Its generate() on these models drifts from that
    after a few tokens (Gemma 3: the 4th), while its full forward, a hand-run decode over its own cache and
    Pagoda's paged cache agree to 1e-6 at every step; so the full forward is the reference."""
    import torch

    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(prompt) :]
