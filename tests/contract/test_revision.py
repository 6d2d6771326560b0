"""`model.revision` end to end: `--revision` selects a snapshot of a hub id in the local Hugging Face cache."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest
from pagoda.engine.cli.dry_run import DryRunError, check
from pagoda.engine.config import EngineConfig
from pagoda.engine.loader.resolve import ModelNotFoundError, resolve_model

REPO_ID = "pagoda-test/tiny-llama"
COMMITS = {"main": "a" * 40, "v2": "b" * 40}
MAX_POSITIONS = {"main": 256, "v2": 512}  # tells the two snapshots apart


def _snapshot(path: Path, max_positions: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=max_positions, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face cache as `hf download --revision` leaves it: refs/<name> -> snapshots/<sha>."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    for name, sha in COMMITS.items():
        _snapshot(repo / "snapshots" / sha, MAX_POSITIONS[name])
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / name).write_text(sha)
    return cache


@pytest.fixture
def in_cache(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    return hub_cache


def test_revision_selects_the_snapshot(in_cache: Path) -> None:
    assert resolve_model(REPO_ID).name == COMMITS["main"]
    assert resolve_model(REPO_ID, "main").name == COMMITS["main"]
    assert resolve_model(REPO_ID, "v2").name == COMMITS["v2"]
    assert resolve_model(REPO_ID, COMMITS["v2"]).name == COMMITS["v2"]  # a commit, not a ref
    with pytest.raises(
        ModelNotFoundError, match=r"revision 'v3'.*revisions cached: main, v2, a{40}, b{40}"
    ) as err:
        resolve_model(REPO_ID, "v3")
    # the command the message recommends is one the installed huggingface_hub ships (`huggingface-cli` is gone)
    assert f"`hf download {REPO_ID} --revision v3`" in str(err.value)
    assert [e.value for e in entry_points(group="console_scripts", name="hf")]


def test_a_revision_that_is_not_a_name_is_refused() -> None:
    for bad in ("../../etc", "-rf", "v1/", ""):
        with pytest.raises(ValueError, match="revision"):
            EngineConfig(revision=bad)
    assert EngineConfig(revision="refs/pr/1").revision == "refs/pr/1"


def test_the_dry_run_reads_the_revision_asked_for(in_cache: Path) -> None:
    common = [REPO_ID, "--device", "cpu", "--kv-cache-memory-bytes", "64MiB", "--skip-tokenizer-init"]
    main = check(common)
    v2 = check([*common, "--revision", "v2"])
    assert main.model.max_position_embeddings == 256 and main.model.path.endswith(COMMITS["main"])
    assert v2.model.max_position_embeddings == 512 and v2.model.path.endswith(COMMITS["v2"])
    assert v2.to_dict()["model"]["revision"] == "v2" and v2.config.max_model_len == 512
    with pytest.raises(DryRunError, match="revision 'nope'"):
        check([*common, "--revision", "nope"])


def test_the_engine_serves_the_revision_asked_for(in_cache: Path) -> None:
    from pagoda.engine.frontend.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model=REPO_ID,
            revision="v2",
            device="cpu",
            kv_cache_memory_bytes=64 << 20,
            skip_tokenizer_init=True,
        )
    )
    try:
        assert engine.model_config.max_position_embeddings == 512
    finally:
        engine.close()
