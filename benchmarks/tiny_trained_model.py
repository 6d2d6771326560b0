"""A tiny Llama trained here, in float32: bench_weight_accuracy.py's second model (issue 37, item 4).

The default model exists here only as its Q4_1 GGUF, so its "unquantized" reference is itself 4-bit weights.
This model's weights never were quantized: it is trained from scratch on the CPU, in minutes, on Debian's
licence texts (/usr/share/common-licenses and the packages' copyright files), leaving out the GPL-3 text the
accuracy bench scores (and any file that quotes it). It uses the default model's tokenizer, and its shapes
divide into 128 (hidden 256, intermediate 768, head dim 64), so llm-compressor's group-128 INT4 and 128 x 128
FP8 blocks apply as the issue states them.

    python benchmarks/tiny_trained_model.py OUT_DIR [--steps 800]

Writes OUT_DIR (config.json, model.safetensors in float32, the tokenizer) and OUT_DIR/training.json (the loss
curve). Deterministic for a given --seed and thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

HELD_OUT = Path("/usr/share/common-licenses/GPL-3")
GPL3_MARKS = ("free, copyleft license for", "29 June 2007")  # GPL-3's preamble and date (LGPL-3 quotes them)
SHAPE = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
)  # fmt: skip


def corpus_files() -> list[Path]:
    """Training texts: every licence and copyright file that is not, and does not quote, the held-out GPL-3."""
    files = sorted(Path("/usr/share/common-licenses").iterdir()) + sorted(
        Path("/usr/share/doc").glob("*/copyright")
    )
    out, seen = [], set()
    for f in files:
        real = f.resolve()
        if real == HELD_OUT.resolve() or real in seen or not real.is_file():
            continue
        text = real.read_text(errors="replace")
        if any(mark in text for mark in GPL3_MARKS):
            continue
        seen.add(real)
        out.append(real)
    return out


def token_stream(tokenizer, files: list[Path], max_tokens: int) -> torch.Tensor:
    ids: list[int] = []
    for f in files:
        ids += tokenizer(f.read_text(errors="replace"), add_special_tokens=False).input_ids
        ids.append(tokenizer.eos_token_id)
        if len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens], dtype=torch.long)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: the default model's)")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-tokens", type=int, default=2_000_000, help="training tokens read from the corpus")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from tqdm import tqdm
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if args.tokenizer is None:
        from pagoda.engine.loader import resolve_model

        args.tokenizer = resolve_model(None)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    files = corpus_files()
    data = token_stream(tok, files, args.max_tokens)
    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      torch_dtype="float32", **SHAPE)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    g = torch.Generator().manual_seed(args.seed)
    losses, t0 = [], time.perf_counter()
    bar = tqdm(range(args.steps), desc="training the tiny Llama", unit="step")
    for step in bar:
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=g)
        batch = torch.stack([data[s : s + args.seq + 1] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = _loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    (args.out / "training.json").write_text(json.dumps({
        "shape": SHAPE, "files": len(files), "tokens": len(data), "steps": args.steps, "batch": args.batch,
        "seq": args.seq, "lr": args.lr, "seconds": time.perf_counter() - t0, "loss_first": losses[0],
        "loss_last_50_mean": sum(losses[-50:]) / len(losses[-50:]), "losses": losses,
    }, indent=1))  # fmt: skip
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"loss {losses[0]:.2f} -> {sum(losses[-50:]) / len(losses[-50:]):.2f} over {args.steps} steps")  # fmt: skip


def _loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a [B, T + 1] batch."""
    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


if __name__ == "__main__":
    main()
