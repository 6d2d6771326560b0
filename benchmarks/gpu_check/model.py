"""A random-weight Llama checkpoint written by the check itself: no model hub, no tokenizer package.

`LLAMA_8B_8L` is Llama-3.1-8B's shape (hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocabulary
128,256, llama3 RoPE scaling) cut to 8 layers: about 2.8 B parameters, 5.6 GB in bfloat16. `TINY` is the
same code path small enough for the CPU (the dry mode builds it). The tokenizer is a word-level one over
the whole vocabulary ("w17" is token 17), written with the `tokenizers` library, so a prompt of N words is
N tokens and every id the model samples decodes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    max_position_embeddings: int
    llama3_rope: bool

    @property
    def parameters(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
        layer = attn + 3 * h * i + 2 * h
        return self.num_hidden_layers * layer + 2 * self.vocab_size * h + h


LLAMA_8B_8L = Shape(
    "llama-3.1-8b-shape-8-layers", hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256, bos_token_id=128000,
    eos_token_id=128001, max_position_embeddings=131072, llama3_rope=True,
)  # fmt: skip
# the kernels' tile shapes want head_dim >= 16 and whole tiles of query heads per KV head (as tests/kernels)
TINY = Shape(
    "tiny-llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, head_dim=16, vocab_size=512, bos_token_id=1, eos_token_id=2,
    max_position_embeddings=2048, llama3_rope=False,
)  # fmt: skip
SHAPES = {s.name: s for s in (LLAMA_8B_8L, TINY)}
UNK = "<unk>"


def config(shape: Shape) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0 if shape.llama3_rope else 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": shape.bos_token_id,
        "eos_token_id": shape.eos_token_id,
    }
    if shape.llama3_rope:
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    return cfg


def vocabulary(shape: Shape) -> dict[str, int]:
    vocab = {f"w{i}": i for i in range(shape.vocab_size)}
    for token_id, token in ((0, UNK), (shape.bos_token_id, "<s>"), (shape.eos_token_id, "</s>")):
        del vocab[next(k for k, v in vocab.items() if v == token_id)]
        vocab[token] = token_id
    return vocab


def write_tokenizer(out: Path, shape: Shape) -> None:
    """tokenizer.json (word level over the whole vocabulary) and tokenizer_config.json with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocabulary(shape), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    tok.save(str(out / "tokenizer.json"))
    template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": UNK,
        "model_max_length": shape.max_position_embeddings,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def tensor_names(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face Llama tensor names and shapes, embeddings first, then layer by layer."""
    h, i, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d
    names = [("model.embed_tokens.weight", (shape.vocab_size, h))]
    for n in range(shape.num_hidden_layers):
        p = f"model.layers.{n}."
        names += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    names += [("model.norm.weight", (h,)), ("lm_head.weight", (shape.vocab_size, h))]
    return names


def write_model(out: Path, shape: Shape, device: str = "cpu", seed: int = 0) -> dict:
    """config.json, the tokenizer and bfloat16 safetensors (one file per layer, so memory stays at one
    layer's worth); weights drawn on ``device`` (a GPU draws 2.8 B values in well under a second).
    Returns what was written (for the JSON report)."""
    import time

    import torch
    from safetensors.torch import save_file

    start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config(shape), indent=2))
    write_tokenizer(out, shape)
    gen = torch.Generator(device=device).manual_seed(seed)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, dims in tensor_names(shape):
        part = name.split(".")[2] if name.startswith("model.layers.") else "outer"
        if len(dims) == 1:
            t = torch.ones(dims, dtype=torch.bfloat16)
        else:
            # std 0.02 (Llama's init) keeps activations finite through the layers; sharper logits than
            # that make no difference to a throughput check
            t = torch.randn(dims, generator=gen, device=device, dtype=torch.float32).mul_(0.02)
            t = t.to(torch.bfloat16).cpu()
        groups.setdefault(part, {})[name] = t
        if part != "outer" and name.endswith("down_proj.weight"):  # a layer is complete: write it out
            save_file(
                groups.pop(part), str(out / f"model-layer-{int(part):03d}.safetensors"), {"format": "pt"}
            )
    save_file(groups.pop("outer"), str(out / "model-outer.safetensors"), {"format": "pt"})
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return {
        "shape": asdict(shape),
        "parameters": shape.parameters,
        "safetensors_bytes": size,
        "seconds": round(time.monotonic() - start, 2),
        "path": str(out),
    }


def prompt(shape: Shape, length: int, seed: int) -> str:
    """A prompt of exactly ``length`` tokens (words the tokenizer knows, no special token)."""
    import random

    rng = random.Random(seed)
    specials = {0, shape.bos_token_id, shape.eos_token_id}
    words = []
    while len(words) < length:
        i = rng.randrange(shape.vocab_size)
        if i not in specials:
            words.append(f"w{i}")
    return " ".join(words)
