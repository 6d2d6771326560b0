"""The model fingerprint covers the weights' content, cheaply.

Disk-tier KV blocks are keyed by the fingerprint and the NVMe volume outlives rollouts, so retrained
weights with the same shapes must get a new one. Hashing gigabytes at every start would be slow: Hugging
Face cache blobs are named by their SHA-256, and other files are hashed once, the result kept next to them
(or in the Pagoda cache when the model directory cannot be written), keyed by size and mtime.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from pagoda.engine.loader import model_fingerprint
from pagoda.engine.loader.content_hash import file_sha256, record_paths
from pagoda.engine.loader.gguf_cache import gguf_cache_key
from safetensors.torch import save_file

CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def write_model(path: Path, seed: int) -> Path:
    """A model directory whose weights depend on `seed`; every seed gives the same shapes and sizes."""
    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    save_file(
        {
            "model.norm.weight": torch.randn(16, generator=g),
            "lm_head.weight": torch.randn(32, 16, generator=g),
        },
        str(path / "model.safetensors"),
    )
    return path


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path / "pagoda-cache"))


def test_same_shapes_different_weights_different_fingerprint(tmp_path):
    old = write_model(tmp_path / "v1", seed=1)
    new = write_model(tmp_path / "v2", seed=2)
    assert (old / "model.safetensors").stat().st_size == (new / "model.safetensors").stat().st_size
    assert (old / "config.json").read_bytes() == (new / "config.json").read_bytes()
    assert model_fingerprint(old) != model_fingerprint(new)
    # Same content elsewhere: same fingerprint (content, not location or mtime).
    copy = tmp_path / "copy"
    shutil.copytree(old, copy, ignore=shutil.ignore_patterns(".*"))
    assert model_fingerprint(copy) == model_fingerprint(old)


def test_weights_retrained_in_place_change_the_fingerprint(tmp_path):
    path = write_model(tmp_path / "m", seed=1)
    before = model_fingerprint(path)
    write_model(path, seed=2)  # a rollout that overwrites the weights where they are
    assert model_fingerprint(path) != before


def test_the_second_call_reads_the_cached_hash_not_the_weights(tmp_path):
    path = write_model(tmp_path / "m", seed=1)
    weights = path / "model.safetensors"
    fp = model_fingerprint(path)
    sidecar = record_paths(weights)[0]
    assert sidecar.parent == path and sidecar.is_file()  # kept next to the weights
    assert json.loads(sidecar.read_text())["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    # Prove the cache is what answers: forge the cached hash (same size and mtime)...
    record = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**record, "sha256": "0" * 64}))
    assert model_fingerprint(path) != fp
    # ...and a new mtime (the file was rewritten) makes it hash the file again.
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert model_fingerprint(path) == fp
    assert json.loads(sidecar.read_text())["sha256"] == record["sha256"]


def test_an_unwritable_model_directory_caches_in_the_pagoda_cache(tmp_path):
    path = write_model(tmp_path / "m", seed=1)
    weights = path / "model.safetensors"
    sidecar, elsewhere = record_paths(weights)
    sidecar.mkdir()  # nothing can be written there (as on a read-only volume, even for root)
    digest = file_sha256(weights)
    assert digest == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert elsewhere.is_file() and str(tmp_path / "pagoda-cache") in str(elsewhere)
    record = json.loads(elsewhere.read_text())
    elsewhere.write_text(json.dumps({**record, "sha256": "1" * 64}))
    assert file_sha256(weights) == "1" * 64  # answered from the cache dir, not re-hashed


def test_hugging_face_cache_blobs_are_named_by_their_sha256(tmp_path):
    src = write_model(tmp_path / "src", seed=3)
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / ("a" * 40)
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        data = (src / name).read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    assert model_fingerprint(snap) == model_fingerprint(src)
    # The blob name is taken as the hash: nothing is written into the hub cache.
    assert sorted(p.name for p in snap.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in blobs.iterdir()) == sorted(
        hashlib.sha256((src / n).read_bytes()).hexdigest() for n in ("config.json", "model.safetensors")
    )


def test_gguf_files_that_differ_only_in_the_middle_are_told_apart(tmp_path):
    """The converted-directory key covered the size and both 4 MiB ends: a retrained GGUF of the same size
    whose changes lie in between reused the old conversion (and its fingerprint)."""
    size = 9 << 20
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    data = bytearray(size)
    a.write_bytes(bytes(data))
    data[size // 2] = 1
    b.write_bytes(bytes(data))
    assert gguf_cache_key(a) != gguf_cache_key(b)
    assert gguf_cache_key(a) == gguf_cache_key(a)
