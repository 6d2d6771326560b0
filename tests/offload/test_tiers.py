"""The host and disk tiers on their own, with small fake blocks: LRU, budgets, restarts, integrity, failures."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pagoda.engine.kv_cache.hashing import hash_block_tokens
from pagoda.engine.offload.disk_tier import MAGIC, DirectoryInUseError, DiskTier
from pagoda.engine.offload.host_tier import HostTier

SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block_size, kv heads, head dim
ID = "model-abc|torch.float32|4"


def key(i: int):
    return hash_block_tokens(None, [i, i + 1, i + 2, i + 3], ("test",))


def block(i: int) -> torch.Tensor:
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE) + 1000 * i


@pytest.fixture
def disk(tmp_path):
    tiers = []

    def make(capacity: int = 10**6, directory: Path | None = None, identity: str = ID) -> DiskTier:
        tier = DiskTier(directory or tmp_path / "kv", capacity, identity)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


def test_host_tier_lru_spills_oldest_to_the_next_tier():
    spilled = []
    host = HostTier(3 * block(0).nbytes, on_evict=lambda h, d: spilled.append(h))
    for i in range(3):
        assert host.put(key(i), block(i))
    assert host.get(key(0)) is not None  # 0 becomes the most recent: 1 is the oldest now
    host.put(key(3), block(3))
    assert spilled == [key(1)]
    assert key(1) not in host and key(0) in host
    assert host.used_bytes == 3 * block(0).nbytes and host.evictions == 1
    assert not HostTier(10).put(key(9), block(9))  # larger than the whole tier: refused


def test_disk_roundtrip_and_warm_restart_index_without_reads(disk, tmp_path):
    tier = disk()
    for i in range(4):
        assert tier.put(key(i), block(i))
    tier.flush()
    assert torch.equal(tier.get(key(2), SHAPE, torch.float32), block(2))
    used = tier.used_bytes
    assert used == sum(f.stat().st_size for f in (tmp_path / "kv").glob("*.kv"))
    tier.close()
    (tmp_path / "kv" / f"{key(7).hex()}.kv.123.tmp").write_bytes(b"half a block")  # a crashed write

    again = disk()
    assert len(again) == 4 and again.used_bytes == used and again.load_bytes == 0
    assert not list((tmp_path / "kv").glob("*.tmp"))
    assert torch.equal(again.get(key(3), SHAPE, torch.float32), block(3))


def test_second_engine_on_the_same_directory_is_refused(disk):
    disk()
    with pytest.raises(DirectoryInUseError, match="in use by another engine"):
        disk()


def test_leftovers_beyond_the_budget_are_evicted_at_start(disk, tmp_path):
    tier = disk()
    size = tier.file_size(key(0), block(0))
    for i in range(6):
        tier.put(key(i), block(i))
        tier.flush()
        os.utime(tier.path_of(key(i)), (1000 + i, 1000 + i))  # a clear age order
    tier.close()
    small = disk(capacity=3 * size + 10)
    assert len(small) == 3 and small.used_bytes <= small.capacity_bytes and small.evictions == 3
    files = sorted(p.name for p in (tmp_path / "kv").glob("*.kv"))
    assert files == sorted(f"{key(i).hex()}.kv" for i in (3, 4, 5))  # the newest survive


def test_fill_the_budget_evicts_least_recently_used(disk, tmp_path):
    probe = disk(directory=tmp_path / "probe")
    size = probe.file_size(key(0), block(0))
    tier = disk(capacity=2 * size)
    for i in range(5):
        assert tier.put(key(i), block(i))
        assert tier.used_bytes <= tier.capacity_bytes
    tier.flush()
    assert tier.evictions == 3 and len(tier) == 2
    assert sum(f.stat().st_size for f in (tmp_path / "kv").glob("*.kv")) <= tier.capacity_bytes
    assert tier.get(key(0), SHAPE, torch.float32) is None
    assert torch.equal(tier.get(key(4), SHAPE, torch.float32), block(4))


def _rewrite_header(path: Path, **changes) -> None:
    raw = path.read_bytes()
    (hlen,) = struct.unpack_from("<I", raw, len(MAGIC))
    start = len(MAGIC) + 4
    meta = json.loads(raw[start : start + hlen])
    meta.update(changes)
    new = json.dumps(meta).encode()
    path.write_bytes(MAGIC + struct.pack("<I", len(new)) + new + raw[start + hlen :])


def _flip_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 100])


CORRUPTIONS = {
    "flip_byte": _flip_byte,
    "truncate": _truncate,
    "fingerprint": lambda p: _rewrite_header(p, identity="another-model|torch.float32|4"),
    "layout_version": lambda p: _rewrite_header(p, layout=99),
    "key": lambda p: _rewrite_header(p, key=key(42).hex()),
    "dtype": lambda p: _rewrite_header(p, dtype="float16"),
    "garbage": lambda p: p.write_bytes(b"not a kv block"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_file_is_a_miss_removed_and_counted(disk, kind, caplog):
    tier = disk()
    tier.put(key(1), block(1))
    tier.put(key(2), block(2))
    tier.flush()
    tier.close()
    tier = disk()  # a restart: the block is read from the file, not from the write queue
    path = tier.path_of(key(1))
    CORRUPTIONS[kind](path)
    with caplog.at_level(logging.WARNING, logger="pagoda.engine.offload"):
        assert tier.get(key(1), SHAPE, torch.float32) is None
    assert tier.verification_failures == 1
    assert not path.exists() and key(1) not in tier
    assert "dropping" in caplog.text
    assert torch.equal(tier.get(key(2), SHAPE, torch.float32), block(2))  # the others are fine


def test_a_file_that_vanished_is_a_miss(disk):
    tier = disk()
    tier.put(key(1), block(1))
    tier.flush()
    tier.path_of(key(1)).unlink()
    assert tier.get(key(1), SHAPE, torch.float32) is None
    assert tier.verification_failures == 1


# ---- planted links: the tier never follows a symlink out of its directory ---------------------------


def test_a_block_file_replaced_by_a_symlink_is_a_miss(disk, tmp_path):
    """A link planted at a block's name is never read through, even to a valid copy of that very block."""
    tier = disk()
    tier.put(key(1), block(1))
    tier.flush()
    tier.close()
    outside = tmp_path / "elsewhere.kv"
    tier_dir = tmp_path / "kv"
    path = tier_dir / tier.path_of(key(1)).name
    outside.write_bytes(path.read_bytes())  # a well-formed block file, outside the directory
    path.unlink()
    path.symlink_to(outside)
    tier = disk()  # a restart does not index the link...
    assert key(1) not in tier
    tier.close()
    tier = disk()
    tier.put(key(2), block(2))
    tier.flush()
    path2 = tier.path_of(key(2))
    outside2 = tmp_path / "elsewhere2.kv"
    outside2.write_bytes(path2.read_bytes())
    path2.unlink()
    path2.symlink_to(outside2)  # ...and a link swapped in behind an indexed block is not followed
    assert tier.get(key(2), SHAPE, torch.float32) is None
    assert tier.verification_failures == 1 and key(2) not in tier
    assert not path2.is_symlink() and not path2.exists()  # the link is removed...
    assert outside2.read_bytes()[: len(MAGIC)] == MAGIC  # ...and its target left alone


def test_a_fifo_at_a_block_name_does_not_hang_the_reader(disk):
    tier = disk()
    tier.put(key(1), block(1))
    tier.flush()
    path = tier.path_of(key(1))
    path.unlink()
    os.mkfifo(path)  # opening a FIFO for reading blocks until a writer comes: never
    assert tier.get(key(1), SHAPE, torch.float32) is None
    assert tier.verification_failures == 1


def test_planted_links_never_redirect_writes(disk, tmp_path):
    """Links at the names the tier writes (temporary names, block names, the start-up probe) stay links to
    untouched targets, or are replaced; nothing is ever written outside the directory."""
    tier_dir = tmp_path / "kv"
    tier_dir.mkdir()
    victims = {name: tmp_path / f"victim-{name}" for name in ("probe", "tmp", "final")}
    for victim in victims.values():
        victim.write_bytes(b"precious")
    (tier_dir / f".probe-{os.getpid()}.tmp").symlink_to(victims["probe"])  # the old, predictable probe name
    tier = disk(directory=tier_dir)
    assert tier.enabled and victims["probe"].read_bytes() == b"precious"
    # The writer's old temporary name was predictable (<hash>.kv.<thread id>.tmp): plant a link there too.
    final = tier.path_of(key(1))
    for ident in {tier._worker.ident, threading.get_ident()}:
        (tier_dir / f"{final.name}.{ident}.tmp").symlink_to(victims["tmp"])
    tier.path_of(key(2)).symlink_to(victims["final"])
    tier.put(key(1), block(1))
    tier.put(key(2), block(2))
    tier.flush()
    for name, victim in victims.items():
        assert victim.read_bytes() == b"precious", name
    for k in (1, 2):
        path = tier.path_of(key(k))
        assert path.is_file() and not path.is_symlink()
        assert torch.equal(tier.get(key(k), SHAPE, torch.float32), block(k))
    assert tier.enabled and tier.write_errors == 0


def test_a_lock_file_that_is_a_link_to_a_missing_target_creates_nothing(tmp_path, caplog):
    tier_dir = tmp_path / "kv"
    tier_dir.mkdir()
    target = tmp_path / "created-by-the-tier"
    (tier_dir / ".lock").symlink_to(target)
    with caplog.at_level(logging.WARNING, logger="pagoda.engine.offload"):
        tier = DiskTier(tier_dir, 10**6, ID)
    try:
        assert not target.exists()
        assert not tier.enabled and "lock" in (tier.disabled_reason or "")
    finally:
        tier.close()


def _make_read_only(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o555)
    if os.geteuid() == 0:  # root ignores permissions: make the directory immutable instead
        subprocess.run(["chattr", "+i", str(path)], check=True)


def _undo_read_only(path: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], check=False)
    os.chmod(path, 0o755)


def test_read_only_directory_disables_the_tier_with_one_warning(tmp_path, caplog):
    ro = tmp_path / "ro"
    _make_read_only(ro)
    try:
        with caplog.at_level(logging.WARNING, logger="pagoda.engine.offload"):
            tier = DiskTier(ro, 10**6, ID)
            assert not tier.enabled and tier.write_errors == 1
            assert not tier.put(key(1), block(1))
            assert tier.get(key(1), SHAPE, torch.float32) is None
        tier.close()
        assert caplog.text.count("disk KV tier disabled") == 1
        assert tier.snapshot()["disabled"] == 1.0
    finally:
        _undo_read_only(ro)


def test_full_disk_disables_the_tier_and_keeps_going(tmp_path):
    """A real short write: RLIMIT_FSIZE makes the kernel refuse to grow a file past 16 KiB (EFBIG),
    as a full filesystem would; the tier turns itself off after one warning."""
    code = textwrap.dedent(
        f"""
        import logging, resource, signal, torch
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        logging.basicConfig(level=logging.WARNING)
        from pagoda.engine.offload.disk_tier import DiskTier
        from pagoda.engine.kv_cache.hashing import hash_block_tokens
        tier = DiskTier({str(tmp_path / "kv")!r}, 10**8, "id")
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))
        for i in range(3):
            tier.put(hash_block_tokens(None, [i], ()), torch.ones(2, 2, 16, 1, 64))
        tier.flush()
        print("RESULT", tier.enabled, tier.write_errors, tier.used_bytes, len(tier))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")][0].split()
    assert result[1:] == ["False", "1", "0", "0"]
    assert proc.stderr.count("disk KV tier disabled") == 1
    assert not list((tmp_path / "kv").glob("*.tmp")) and not list((tmp_path / "kv").glob("*.kv"))


# ---- property: no tier ever exceeds its byte budget -------------------------------------------------

ops = st.lists(
    st.tuples(st.sampled_from(["put", "get", "get_disk"]), st.integers(0, 30), st.integers(1, 4)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=40, deadline=None)
@given(ops=ops, host_blocks=st.integers(0, 5), disk_blocks=st.integers(0, 8))
def test_no_tier_ever_exceeds_its_budget(tmp_path_factory, ops, host_blocks, disk_blocks):
    unit = torch.Size(SHAPE).numel() * 4
    directory = tmp_path_factory.mktemp("prop")
    disk = DiskTier(directory, disk_blocks * (unit + 400), ID)
    host = HostTier(host_blocks * unit + unit // 2, on_evict=disk.put)
    try:
        for op, i, scale in ops:
            shape = (scale, *SHAPE[1:])  # blocks of a few sizes, to stress the byte accounting
            if op == "put":
                host.put(key(i), torch.full(shape, float(i)))
            elif op == "get":
                got = host.get(key(i))
                assert got is None or float(got.flatten()[0]) == float(i)
            else:
                for s in range(1, 5):
                    got = disk.get(key(i), (s, *SHAPE[1:]), torch.float32)
                    assert got is None or float(got.flatten()[0]) == float(i)
            assert host.used_bytes <= host.capacity_bytes
            assert disk.used_bytes <= disk.capacity_bytes
        disk.flush()
        on_disk = sum(f.stat().st_size for f in directory.glob("*.kv"))
        assert on_disk == disk.used_bytes <= disk.capacity_bytes
    finally:
        disk.close()


def test_disk_tier_hashes_lists_what_it_holds_oldest_first(tmp_path):
    """What the router's tier sync publishes for the disk tier (engine/server/kv_routes.py)."""
    from pagoda.engine.kv_cache.hashing import BlockHash

    tier = DiskTier(tmp_path, capacity_bytes=1 << 20, identity="test")
    keys = [BlockHash(bytes([i]) * 32) for i in range(3)]
    for k in keys:
        assert tier.put(k, torch.full((2, 4), float(k[0])))
    tier.flush()
    assert tier.hashes() == keys
    tier.get(keys[0], (2, 4), torch.float32)  # a read makes it the newest
    assert tier.hashes() == [keys[1], keys[2], keys[0]]
    tier.close()
