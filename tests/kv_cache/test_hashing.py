import os
import subprocess
import sys

import pytest
from pagoda.engine.kv_cache.hashing import encode_extra_keys, hash_block_tokens, hash_full_blocks

# Pinned: the disk tier names files by these values, so a change here orphans every cache on disk.
GOLDEN = "1eddaf180d11ccc268d6703d6fb3a49f1d95ae990bc6424e7d0b7db2ebc9cc08"


def test_hash_is_pinned_and_32_bytes():
    h = hash_block_tokens(None, [1, 2, 3, 4], ("m", "fp16"))
    assert len(h) == 32
    assert h.hex() == GOLDEN


@pytest.mark.parametrize("seed", ["0", "1", "12345"])
def test_hash_is_stable_across_processes(seed):
    code = (
        "from pagoda.engine.kv_cache.hashing import hash_block_tokens;"
        "print(hash_block_tokens(None, [1, 2, 3, 4], ('m', 'fp16')).hex())"
    )
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == GOLDEN


def test_every_input_changes_the_hash():
    base = hash_block_tokens(None, [1, 2, 3, 4], ("m", "fp16"))
    parent = hash_block_tokens(None, [9, 9, 9, 9])
    assert hash_block_tokens(parent, [1, 2, 3, 4], ("m", "fp16")) != base
    assert hash_block_tokens(None, [1, 2, 4, 3], ("m", "fp16")) != base
    assert hash_block_tokens(None, [1, 2, 3], ("m", "fp16")) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("m", "fp8_e4m3")) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("other-model", "fp16")) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("m",)) != base


def test_extra_keys_are_length_prefixed():
    assert encode_extra_keys(("ab", "c")) != encode_extra_keys(("a", "bc"))
    assert hash_block_tokens(None, [1], ("ab", "c")) != hash_block_tokens(None, [1], ("a", "bc"))


def test_encoded_and_plain_extra_keys_agree():
    keys = ("fingerprint", "auto")
    assert hash_block_tokens(None, [5, 6], keys) == hash_block_tokens(None, [5, 6], encode_extra_keys(keys))
    assert hash_block_tokens(None, [5, 6]) == hash_block_tokens(None, [5, 6], encode_extra_keys(()))


def test_full_blocks_chain_and_skip_the_partial_block():
    tokens = list(range(10))
    hashes = hash_full_blocks(tokens, 4, ("k",))
    assert len(hashes) == 2
    h0 = hash_block_tokens(None, tokens[0:4], ("k",))
    assert hashes == [h0, hash_block_tokens(h0, tokens[4:8], ("k",))]


def test_full_blocks_resume_from_a_parent():
    tokens = list(range(40))
    whole = hash_full_blocks(tokens, 4)
    tail = hash_full_blocks(tokens, 4, parent=whole[3], start_block=4)
    assert whole[4:] == tail
    assert hash_full_blocks(tokens, 4, parent=whole[3], start_block=4, max_blocks=2) == whole[4:6]


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="token_ids"):
        hash_block_tokens(None, [2**64])
    with pytest.raises(ValueError, match="extra_keys"):
        encode_extra_keys(("ok", 3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        hash_full_blocks([1, 2], 0)
