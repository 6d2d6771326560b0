"""Quantize the default model's float checkpoint with llm-compressor: the checkpoints bench_weight_accuracy.py
loads into Pagoda. Runs in llm-compressor's own venv (.peers/llmcompressor; `bench_weight_accuracy.py
--install` makes it), never in the project's: it pins its own transformers.

    .peers/llmcompressor/bin/python benchmarks/quantize_llmcompressor.py SRC_DIR OUT_DIR [--only fp8-dynamic ...]

SRC_DIR is the float32 directory the engine converts the default GGUF into (its GGUF cache); each scheme is
written to OUT_DIR/<name> as a compressed-tensors checkpoint (safetensors + config.json with its
quantization_config + tokenizer):

- fp8-dynamic: FP8 e4m3 weights with one scale per output channel, activations quantized per token at run
  time (llm-compressor's FP8_DYNAMIC: no calibration data);
- fp8-block: FP8 weights in 128 x 128 blocks, one scale each (FP8_BLOCK; no calibration data);
- w4a16-rtn: INT4 weights, symmetric, group 64, round-to-nearest (no calibration data);
- w4a16-awq: INT4 weights, asymmetric, group 64, AWQ's scale search then round-to-nearest, calibrated on a
  few paragraphs;
- w4a16-gptq: INT4 weights, symmetric, group 64, by GPTQ on the same paragraphs (the slowest: minutes per
  layer on two busy cores).

The INT4 groups are 64, not 128: SmolLM2-135M's projections read 576 inputs (hidden size), which 128 does not
divide, and llm-compressor refuses a group that does not divide the columns. The LM head (tied to the
embeddings) stays float in every scheme. Calibration text is Debian's Apache-2.0 licence, never the GPL-3
text the accuracy bench scores.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

CALIBRATION = Path("/usr/share/common-licenses/Apache-2.0")


def calibration_sentences(n: int) -> list[str]:
    """`n` paragraphs of the Apache-2.0 licence, each a few sentences (the calibration set)."""
    paragraphs = [" ".join(p.split()) for p in CALIBRATION.read_text().split("\n\n")]
    return [p for p in paragraphs if len(p) > 200][:n]


def int4_group(symmetric: bool, group: int) -> dict:
    return {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
                        "group_size": group, "dynamic": False},
        }
    }  # fmt: skip


def recipe(name: str, group: int) -> list:
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    if name == "fp8-dynamic":
        return [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])]
    if name == "fp8-block":
        return [QuantizationModifier(targets="Linear", scheme="FP8_BLOCK", ignore=["lm_head"])]
    if name == "w4a16-rtn":
        return [QuantizationModifier(config_groups=int4_group(True, group), ignore=["lm_head"])]
    if name == "w4a16-gptq":
        return [GPTQModifier(targets="Linear", config_groups=int4_group(True, group), ignore=["lm_head"])]
    if name == "w4a16-awq":
        return [
            AWQModifier(),
            QuantizationModifier(config_groups=int4_group(False, group), ignore=["lm_head"]),
        ]
    raise SystemExit(f"unknown scheme {name!r}")


SCHEMES = ("fp8-dynamic", "fp8-block", "w4a16-rtn", "w4a16-awq", "w4a16-gptq")
CALIBRATED = ("w4a16-gptq", "w4a16-awq")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", nargs="*", choices=SCHEMES, default=list(SCHEMES))
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--calibration-samples", type=int, default=4)
    ap.add_argument("--max-seq-length", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    if not torch.cuda.is_available():
        # llm-compressor 0.14's AWQ pins its cached activations for host-to-device copies, which a CPU-only
        # torch refuses ("Cannot access accelerator device"); with no device there is nothing to pin for.
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *a, **k: None
    texts = calibration_sentences(args.calibration_samples)
    for name in args.only:
        target = args.out / name
        if (target / "config.json").exists():
            print(f"{name}: {target} exists, kept")
            continue
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(args.src, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(args.src)
        kwargs: dict = {}
        if name in CALIBRATED:
            data = Dataset.from_dict({"text": texts})
            kwargs = {
                "dataset": data,
                "num_calibration_samples": len(texts),
                "max_seq_length": args.max_seq_length,
            }
        oneshot(model=model, recipe=recipe(name, args.group_size), tokenizer=tok, **kwargs)
        tmp = args.out / f".tmp-{name}"
        model.save_pretrained(tmp, save_compressed=True)
        tok.save_pretrained(tmp)
        tmp.rename(target)
        quant = json.loads((target / "config.json").read_text()).get("quantization_config", {})
        print(f"{name}: wrote {target} in {time.perf_counter() - t0:.0f} s ({quant.get('format')})")


if __name__ == "__main__":
    main()
