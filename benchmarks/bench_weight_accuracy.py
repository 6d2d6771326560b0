"""What quantized weights cost in accuracy (issue 37, item 4): bench-kv-accuracy's teacher-forced method
applied to weights, on the default model, each format run by Pagoda's own engine.

    make bench-weight-accuracy     # or: python benchmarks/bench_weight_accuracy.py [--ppl-tokens 1024]

The reference is the default model as the engine holds it by default: SmolLM2-135M-Instruct's Q4_1 GGUF
dequantized to float32 (no original bfloat16 checkpoint is installed here, so every format is measured
against the dequantized Q4_1 weights, not against the model as trained). Each variant is a checkpoint of those
same float32 weights in one format, built here (never committed; bench-results/quantized/):

- llm-compressor 0.14 (its own venv, .peers/llmcompressor; benchmarks/quantize_llmcompressor.py): FP8
  dynamic (per-channel weights, per-token activations, no calibration), FP8 block 128x128, W4A16
  round-to-nearest (symmetric, no calibration), W4A16 AWQ (asymmetric) and W4A16 GPTQ (symmetric), all
  group 64 (576 inputs: 128 does not divide them), the last two calibrated on 4 paragraphs of Debian's
  Apache-2.0 licence (128 tokens each);
- GGUF, requantized from the Q4_1 file by llama.cpp's own quantizer (llama-cpp-python's
  llama_model_quantize, in .peers/llamacpp): Q8_0, Q6_K, Q4_K (Q4_K_M's mix) and Q4_0; plus the Q4_1 file
  itself, run from its blocks with `--quantization gguf` (the same weights as the reference: it measures the
  quantized kernels, not a quantization).

GGUF variants run with `--quantization gguf` where the engine has it (else dequantized at load: the same
weights either way, so the quality is the format's). Every checkpoint runs on the engine's model runner
in float32 on the CPU, fed the first --ppl-tokens tokens of a held-out text (/usr/share/common-licenses/GPL-3,
which no calibration set saw) in --chunk-token prefill chunks; at every position the variant's top-1 token is
compared with the reference's (teacher-forced: both see the same text) and the perplexity of the text is
taken. Floors (issue 37): FP8 >= 97%, INT8 (Q8_0) >= 97%, INT4 (W4A16, Q4_*) >= 90% top-1 agreement.

`--model tiny` measures a second model whose reference never was quantized: a 4-layer Llama (hidden 256, the
default model's tokenizer) trained here in float32 on Debian's licence texts, GPL-3 left out
(benchmarks/tiny_trained_model.py, minutes on the CPU), and llm-compressor's checkpoints of it, INT4 at the
issue's group 128. Each model also scores a yardstick: its own weights rounded to bfloat16 (8 significant bits
to FP8's 4), which shows how many top-1 tokens a rounding far finer than any format's already moves. Beside the
agreement each row gives the median of the reference's own log-probability margin between its token and the
variant's where they differ: how near a tie the flipped positions were.

Prints a table, writes bench-results/bench_weight_accuracy[-tiny].json and a plot. --dry-run scores the
reference against itself (the harness alone, no checkpoint built).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, plot_path, print_table, write_json  # noqa: E402
from pagoda.engine.config import EngineConfig  # noqa: E402
from pagoda.engine.frontend.llm_engine import LLMEngine  # noqa: E402
from pagoda.engine.worker.step_input import StepInput  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / ".peers"
TEXT = Path("/usr/share/common-licenses/GPL-3")
BLOCK = 16
QUANTIZED = RESULTS / "quantized" / "smollm2-135m"  # the checkpoints built here (never committed)
TINY = RESULTS / "quantized" / "tiny-llama"  # --model tiny: the model trained here and its checkpoints
KV_BYTES = 256 << 20  # one sequence of --ppl-tokens tokens (SmolLM2 float32: 45 KiB per token)
LLMCOMPRESSOR = "0.14.0.1"
TORCH_CPU = "2.13.0"  # installed first into llm-compressor's venv, so pip keeps the CPU wheel
FLOORS = {"fp8": 97.0, "int8": 97.0, "int4": 90.0}
# label -> (floor class, how it is made); the reference row comes first
LLMC = {
    "fp8-dynamic": ("fp8", "llm-compressor FP8_DYNAMIC (per-channel weights, per-token activations)"),
    "fp8-block": ("fp8", "llm-compressor FP8_BLOCK (128x128 weight blocks)"),
    "w4a16-rtn": ("int4", "llm-compressor W4A16 round-to-nearest, symmetric, group {group}"),
    "w4a16-awq": ("int4", "llm-compressor AWQ + W4A16, asymmetric, group {group}"),
    "w4a16-gptq": ("int4", "llm-compressor GPTQ W4A16, symmetric, group {group}"),
}
# INT4 group of each model: SmolLM2-135M's 576 inputs take 64, not 128; the tiny model's 256 and 768 take 128
GROUPS = {"default": 64, "tiny": 128}
YARDSTICK = "float32, weights rounded to bfloat16"
# GGUF types requantized from the Q4_1 file (llama.cpp's LLAMA_FTYPE_MOSTLY_* numbers)
GGUF_TYPES = {"Q8_0": ("int8", 7), "Q6_K": ("int8", 18), "Q4_K_M": ("int4", 15), "Q4_0": ("int4", 2)}


def say(msg: str) -> None:
    print(f"[bench-weight-accuracy] {msg}", flush=True)


# ---------------------------------------------------------------- building the checkpoints


def _run(cmd: list[str], log: Path, env: dict | None = None) -> None:
    with open(log, "ab") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                              cwd="/", check=False)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited with {proc.returncode}; see {log}")


def ensure_venv(name: str, packages: list[list[str]], probe: str) -> Path:
    """A peer's own venv under .peers/<name>, made on first use (each list of packages one pip install)."""
    venv = PEERS / name
    python = venv / "bin" / "python"
    stamp = venv / f".installed-{name}"
    if stamp.exists():
        return python
    log = RESULTS / f"install-{name}.log"
    say(
        f"installing {', '.join(p for ps in packages for p in ps)} into {venv.relative_to(ROOT)} (log: {log})"
    )
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)], log)
    for pkgs in packages:
        _run([str(python), "-m", "pip", "install", *pkgs], log, {"CMAKE_BUILD_PARALLEL_LEVEL": "2"})
    _run([str(python), "-c", probe], log)
    stamp.write_text("ok\n")
    return python


def build_llmcompressor(src: Path, out: Path, group: int = 64, threads: int = 2) -> None:
    python = ensure_venv("llmcompressor", [[f"torch=={TORCH_CPU}"], [f"llmcompressor=={LLMCOMPRESSOR}"]],
                         "import llmcompressor")  # fmt: skip
    missing = [n for n in LLMC if not (out / n / "config.json").exists()]
    if missing:
        say(f"quantizing {', '.join(missing)} with llm-compressor (minutes on CPU)")
        _run([str(python), str(Path(__file__).with_name("quantize_llmcompressor.py")), str(src), str(out),
              "--group-size", str(group), "--threads", str(threads), "--only", *missing],
             RESULTS / "quantize-llmcompressor.log")  # fmt: skip


def build_bf16_rounded(src: Path, target: Path) -> None:
    """The reference with every weight rounded to bfloat16 (8 significant bits) and stored as float32 again: a
    yardstick of how many top-1 tokens a rounding far finer than FP8's (4 significant bits) already moves."""
    if (target / "config.json").exists():
        return
    import shutil

    from safetensors.torch import load_file, save_file

    tmp = target.with_name(f".tmp-{target.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            save_file({k: v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v
                       for k, v in tensors.items()}, tmp / f.name, metadata={"format": "pt"})  # fmt: skip
        elif f.is_file():
            shutil.copy2(f, tmp / f.name)
    tmp.rename(target)


def build_tiny(target: Path, threads: int = 2) -> None:
    """The tiny Llama trained here (benchmarks/tiny_trained_model.py; minutes on the CPU, with a progress bar)."""
    if (target / "config.json").exists():
        return
    say(f"training the tiny Llama into {target}")
    subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("tiny_trained_model.py")),
            str(target),
            "--threads",
            str(threads),
        ],
        check=True,
        env={
            k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"
        },  # its progress bar, not the loader's
    )


def build_gguf(q4_1: Path, out: Path) -> None:
    from peers_llamacpp import ensure_llamacpp

    python, note = ensure_llamacpp(install=True)  # the venv bench-peers' llama.cpp comparison uses
    if python is None:
        raise RuntimeError(note)
    out.mkdir(parents=True, exist_ok=True)
    for name, (_, ftype) in GGUF_TYPES.items():
        target = out / f"SmolLM2-135M-Instruct.{name}.gguf"
        if target.exists():
            continue
        code = (
            "import llama_cpp, sys\n"
            "p = llama_cpp.llama_model_quantize_default_params()\n"
            f"p.ftype = {ftype}\np.allow_requantize = True\np.nthread = 2\n"
            f"rc = llama_cpp.llama_model_quantize({str(q4_1).encode()!r}, {str(target).encode()!r}, p)\n"
            "sys.exit(rc)\n"
        )
        say(f"requantizing the Q4_1 file to {name} with llama.cpp")
        _run([str(python), "-c", code], RESULTS / "quantize-gguf.log")


# ---------------------------------------------------------------- scoring


class Scorer:
    """One engine's model runner on one checkpoint, one sequence fed in prefill chunks (no scheduler)."""

    def __init__(self, model: Path, quantization: str | None, tokens: int) -> None:
        kwargs = {"quantization": quantization} if quantization else {}
        self.engine = LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_model_len=BLOCK,
                                             kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=False, **kwargs))  # fmt: skip
        self.blocks = -(-tokens // BLOCK) + 1
        if self.engine.num_blocks < self.blocks:
            raise RuntimeError(
                f"{KV_BYTES >> 20} MiB of KV hold {self.engine.num_blocks} blocks, not {self.blocks}"
            )

    def score(self, ids: list[int], chunk: int) -> tuple[torch.Tensor, float]:
        """(log-probabilities of the next token at each position 0.., perplexity of ids[1:])."""
        table = np.arange(self.blocks, dtype=np.int32).reshape(1, self.blocks)
        lps, nll = [], 0.0
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start : start + chunk]
            step = StepInput(
                input_ids=np.asarray(piece, dtype=np.int64),
                positions=np.arange(start, start + len(piece), dtype=np.int64),
                query_lens=np.asarray([len(piece)]),
                context_lens=np.asarray([start]),
                block_tables=table,
                sample_idx=np.arange(len(piece), dtype=np.int64),
            )
            logits = self.engine.runner.run(step).float()
            targets = torch.tensor(ids[start + 1 : start + 1 + len(piece)])
            lp = logits[: len(targets)].log_softmax(-1)
            lps.append(lp)
            nll -= float(lp.gather(1, targets[:, None]).sum())
        return torch.cat(lps), math.exp(nll / (len(ids) - 1))

    def close(self) -> None:
        self.engine.close()


def has_quantization_flag() -> bool:
    return "quantization" in EngineConfig.__dataclass_fields__


def variants(args: argparse.Namespace, reference: Path, q4_1: Path, out: Path = QUANTIZED) -> list[dict]:
    """Every checkpoint to score (label, floor class, path, --quantization, how it was made); the ones built
    here go to `out`."""
    gguf_flag = "gguf" if has_quantization_flag() else None
    rows = [{"label": "float32 (dequantized Q4_1)", "floor": None, "path": reference, "quantization": None,
             "made": "the engine's own GGUF conversion: the reference"}]  # fmt: skip
    if args.dry_run:
        return rows + [{**rows[0], "label": "float32 again (dry run)"}]
    rows.append({"label": "gguf Q4_1 (its own blocks)", "floor": "int4", "path": q4_1, "quantization": gguf_flag,
                 "made": "the default model's file" + ("" if gguf_flag else " (dequantized: no --quantization)")})  # fmt: skip
    rows.append(yardstick_row(args, reference, out))
    if not args.skip_gguf and not args.no_build:
        build_gguf(q4_1, out)
    if not args.skip_gguf:
        for name, (floor, _) in GGUF_TYPES.items():
            rows.append({"label": f"gguf {name}", "floor": floor, "quantization": gguf_flag,
                         "path": out / f"SmolLM2-135M-Instruct.{name}.gguf",
                         "made": "llama.cpp requantized from the Q4_1 file"})  # fmt: skip
    rows += llmcompressor_rows(args, reference, out, GROUPS["default"])
    rows = rows[:2] + _built(args, rows[2:])
    if getattr(args, "int8_activations", False) and gguf_flag:
        rows += [int8_row(r) for r in rows[1:] if r["quantization"] == gguf_flag and _int8_types(r["label"])]
    return rows


def tiny_variants(args: argparse.Namespace, reference: Path, out: Path = TINY) -> list[dict]:
    """--model tiny: the Llama trained here in float32 (the reference), its bfloat16 yardstick and
    llm-compressor's checkpoints of it at the issue's own group 128."""
    rows = [{"label": "float32 (trained here)", "floor": None, "path": reference, "quantization": None,
             "made": "benchmarks/tiny_trained_model.py: the reference"}]  # fmt: skip
    if args.dry_run:
        return rows + [{**rows[0], "label": "float32 again (dry run)"}]
    rows += [yardstick_row(args, reference, out), *llmcompressor_rows(args, reference, out, GROUPS["tiny"])]
    return rows[:1] + _built(args, rows[1:])


def yardstick_row(args: argparse.Namespace, reference: Path, out: Path) -> dict:
    if not args.no_build:
        build_bf16_rounded(reference, out / "bf16-rounded")
    return {"label": YARDSTICK, "floor": None, "path": out / "bf16-rounded", "quantization": None,
            "made": "the reference's weights rounded to bfloat16 (a yardstick, no format)"}  # fmt: skip


def llmcompressor_rows(args: argparse.Namespace, reference: Path, out: Path, group: int) -> list[dict]:
    if args.skip_llmcompressor:
        return []
    if not args.no_build:
        build_llmcompressor(reference, out, group, getattr(args, "threads", 2))
    return [{"label": name, "floor": floor, "path": out / name, "quantization": None, "made": made.format(group=group)}
            for name, (floor, made) in LLMC.items()]  # fmt: skip


def _built(args: argparse.Namespace, rows: list[dict]) -> list[dict]:
    """With --no-build, only the checkpoints an earlier run (or a build still going) left."""
    if not args.no_build:
        return rows
    return [r for r in rows if Path(r["path"]).is_file() or (Path(r["path"]) / "config.json").exists()]


def _int8_types(label: str) -> bool:
    """Whether a GGUF row's linears are (mostly) of the types the int8-activation product runs."""
    return any(t in label for t in ("Q4_1", "Q4_0", "Q8_0"))


def int8_row(row: dict) -> dict:
    """The same GGUF checkpoint with PAGODA_GGUF_ACTIVATIONS=int8, fed in chunks of the rows that mode takes
    (decode's: each row's result does not depend on how many rows a call has, so these are the logits its
    decode computes)."""
    from pagoda.engine.quantization.gguf_linear import INT8_ROWS_MAX

    return {**row, "label": f"{row['label']}, int8 activations", "env": {"PAGODA_GGUF_ACTIVATIONS": "int8"},
            "chunk": INT8_ROWS_MAX, "made": row["made"] + "; activations int8 per 32 values (integer dot products)"}  # fmt: skip


def fp8_act_rows(rows: list[dict]) -> list[dict]:
    """Each FP8 row again, its activations quantized per token (per token and 128 columns for blocks) as the
    GPU's FP8 x FP8 kernel does at compute capability 8.9 and up. The CPU engine runs FP8 checkpoints
    dequantized (weights only), so this runs the kernel's torch twin (kernels/quant_reference.fp8_reference,
    which the kernel is tested against) in each FP8 linear instead."""
    return [{**r, "label": f"{r['label']}, FP8 activations (GPU path, torch twin)", "fp8_activations": True,
             "made": r["made"] + "; activations FP8 per token, as the GPU kernel quantizes them"}
            for r in rows if r["floor"] == "fp8" and "fp8_activations" not in r]  # fmt: skip


@contextlib.contextmanager
def fp8_activations(on: bool):
    """While `on`, FP8 linears stay quantized on the CPU and multiply through the GPU kernel's torch twin with
    activations quantized (see fp8_act_rows)."""
    if not on:
        yield
        return
    from pagoda.engine.quantization.linear import Fp8Linear
    from pagoda.kernels.quant_reference import fp8_reference

    saved = Fp8Linear.dense_on_cpu, Fp8Linear._matmul
    Fp8Linear.dense_on_cpu = False
    Fp8Linear._matmul = lambda self, x: fp8_reference(
        x, self.weight, self.weight_scale, self.block, self.bias, act_quant=True
    )
    try:
        yield
    finally:
        Fp8Linear.dense_on_cpu, Fp8Linear._matmul = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ppl-tokens", type=int, default=1024, help="tokens of the held-out text scored")
    ap.add_argument("--chunk", type=int, default=128, help="prefill chunk")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="score only these labels (and the reference)")
    ap.add_argument("--skip-gguf", action="store_true", help="no llama.cpp requantized GGUF variants")
    ap.add_argument("--skip-llmcompressor", action="store_true", help="no llm-compressor variants")
    ap.add_argument("--no-build", action="store_true", help="score only the checkpoints already built")
    ap.add_argument("--int8-activations", action="store_true",
                    help="also each GGUF row of Q4_0 / Q4_1 / Q8_0 with PAGODA_GGUF_ACTIVATIONS=int8")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="the reference against itself: the harness only")
    ap.add_argument("--model", choices=("default", "tiny"), default="default",
                    help="default: SmolLM2-135M-Instruct against its dequantized Q4_1 weights; tiny: the Llama "
                    "trained here in float32 (benchmarks/tiny_trained_model.py)")  # fmt: skip
    args = ap.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")  # the loader's per-tensor progress bars, once per checkpoint
    torch.set_num_threads(args.threads)
    RESULTS.mkdir(exist_ok=True)
    from pagoda.engine.loader import load_tokenizer, resolve_model
    from pagoda.engine.loader.resolve import default_model_gguf

    if args.model == "tiny":
        reference = TINY / "float32"
        if not args.no_build:
            build_tiny(reference, args.threads)
        todo = tiny_variants(args, reference)
        title = "the float32 tiny Llama trained here (4 layers, hidden 256)"
    else:
        reference, q4_1 = resolve_model(None), default_model_gguf()
        todo = variants(args, reference, q4_1)
        title = "the float32 dequantized Q4_1 reference (SmolLM2-135M-Instruct)"
    todo += fp8_act_rows(todo)
    ids = load_tokenizer(reference)(TEXT.read_text(), add_special_tokens=False).input_ids[: args.ppl_tokens]

    results: dict[str, dict] = {}
    ref_lp: torch.Tensor | None = None
    for row in todo:
        if args.only and ref_lp is not None and row["label"] not in args.only:
            continue
        t0 = time.perf_counter()
        say(
            f"{row['label']}: {row['path']}"
            + (f" --quantization {row['quantization']}" if row["quantization"] else "")
        )
        saved = {k: os.environ.get(k) for k in row.get("env", {})}
        os.environ.update(row.get("env", {}))
        try:
            with fp8_activations(row.get("fp8_activations", False)):
                scorer = Scorer(row["path"], row["quantization"], len(ids))
                try:
                    lp, ppl = scorer.score(ids, row.get("chunk", args.chunk))
                finally:
                    scorer.close()
        except Exception as exc:  # a format the engine does not load yet is reported, not fatal
            results[row["label"]] = {**_meta(row), "error": f"{type(exc).__name__}: {exc}"[:400]}
            say(f"{row['label']}: FAILED {results[row['label']]['error']}")
            continue
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        if ref_lp is None:
            ref_lp, ref_ppl = lp, ppl
        agree, gap = agreement(ref_lp, lp)
        results[row["label"]] = {**_meta(row), "top1_agreement_pct": agree, "perplexity": ppl,
                                 "perplexity_ratio": ppl / ref_ppl, "median_flip_gap_nats": gap,
                                 "seconds": time.perf_counter() - t0}  # fmt: skip
        floor = FLOORS.get(row["floor"] or "")
        results[row["label"]]["meets_floor"] = None if floor is None else agree >= floor
        say(f"{row['label']}: top-1 agreement {agree:.2f}%, perplexity {ppl:.4f} ({ppl / ref_ppl:.4f}x)")

    rows = []
    for label, r in results.items():
        if "error" in r:
            rows.append([label, r["floor"] or "-", "failed", "", "", "", r["error"][:80]])
            continue
        floor = FLOORS.get(r["floor"] or "")
        verdict = "" if floor is None else ("yes" if r["meets_floor"] else "NO")
        rows.append([label, f"{r['floor']} >= {floor:g}%" if floor else "reference",
                     f"{r['top1_agreement_pct']:.2f}", f"{r['perplexity']:.4f}", f"{r['perplexity_ratio']:.4f}",
                     "" if r["median_flip_gap_nats"] is None else f"{r['median_flip_gap_nats']:.3f}", verdict])  # fmt: skip
    print_table(
        f"Weight formats vs {title}, teacher-forced on {len(ids)} tokens of GPL-3 in {args.chunk}-token chunks, "
        "Pagoda's engine, CPU float32",
        ["checkpoint", "floor", "top-1 agreement %", "perplexity", "perplexity ratio",
         "median gap at a flip (nats)", "meets floor"],
        rows,
    )  # fmt: skip
    name = "bench_weight_accuracy" + ("-tiny" if args.model == "tiny" else "")
    path = write_json(name, {"args": vars(args), "reference": str(reference), "text": str(TEXT), "tokens": len(ids),
                             "results": results})  # fmt: skip
    say(f"wrote {path}")
    _plot(results, name)


def agreement(ref_lp: torch.Tensor, lp: torch.Tensor) -> tuple[float, float | None]:
    """(top-1 agreement %, the median of the reference's own log-probability margin between its top token and
    the variant's, over the positions where they differ: how near a tie each flip was; None without flips)."""
    ref_top, top = ref_lp.argmax(-1), lp.argmax(-1)
    flips = (top != ref_top).nonzero().flatten()
    agree = 100.0 * (1.0 - len(flips) / len(top))
    if not len(flips):
        return agree, None
    gaps = ref_lp[flips, ref_top[flips]] - ref_lp[flips, top[flips]]
    return agree, float(gaps.median())


def _meta(row: dict) -> dict:
    return {
        "floor": row["floor"],
        "path": str(row["path"]),
        "quantization": row["quantization"],
        "made": row["made"],
    }


def _plot(results: dict[str, dict], name: str) -> None:
    ok = {k: r for k, r in results.items() if "top1_agreement_pct" in r}
    if not ok:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 0.45 * len(ok) + 1.6))
    names = list(ok)[::-1]
    a.barh(names, [ok[n]["top1_agreement_pct"] for n in names], color="#48c")
    for floor in sorted(set(FLOORS.values())):
        a.axvline(floor, color="#c84", linestyle="--", linewidth=1)
    a.set_xlim(min(80.0, min(ok[n]["top1_agreement_pct"] for n in names) - 2), 100.5)
    a.set_title("top-1 agreement with the reference, %")
    b.barh(names, [ok[n]["perplexity_ratio"] for n in names], color="#4a4")
    b.set_title("perplexity / reference")
    fig.tight_layout()
    fig.savefig(plot_path(name))
    say(f"wrote {plot_path(name)}")


if __name__ == "__main__":
    main()
