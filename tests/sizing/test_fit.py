"""Start-up fit: max_model_len None / auto / int against the KV memory the engine measured."""

import pytest
from pagoda.engine.sizing import SizingError, fit_max_model_len, num_blocks_for
from pagoda.engine.sizing.units import GiB, MiB

KV = 131_072  # Llama-3.1-8B bf16, bytes per token


def test_num_blocks_for():
    assert num_blocks_for(512 * MiB, KV, 16) == 256  # 4096 tokens
    assert num_blocks_for(512 * MiB - 1, KV, 16) == 255
    assert num_blocks_for(-5, KV, 16) == 0
    with pytest.raises(SizingError):
        num_blocks_for(1, 0, 16)


def test_none_means_the_model_limit_when_it_fits():
    assert fit_max_model_len(None, 4096, KV, 512 * MiB, 16) == 4096


def test_auto_takes_the_model_limit_or_the_largest_block_multiple():
    assert fit_max_model_len("auto", 4096, KV, 1 * GiB, 16) == 4096
    got = fit_max_model_len("auto", 131072, KV, 1 * GiB + 5 * MiB, 16)
    assert got == 8192 + 32  # a block is 16 x 131072 B = 2 MiB: 5 MiB more holds two more blocks
    assert fit_max_model_len("auto", 131072, KV, 1 * GiB + 5 * MiB, 32) % 32 == 0


def test_int_that_fits_is_kept():
    assert fit_max_model_len(1000, 131072, KV, 512 * MiB, 16) == 1000
    assert fit_max_model_len("2048", 131072, KV, 512 * MiB, 16) == 2048


def test_int_that_does_not_fit_gives_one_message_with_everything():
    with pytest.raises(SizingError) as e:
        fit_max_model_len(32768, 131072, KV, 1 * GiB, 16, weights_bytes=15 * GiB, activation_bytes=2 * GiB,
                          device="cuda")  # fmt: skip
    msg = str(e.value)
    assert "max_model_len=32768" in msg
    assert "needs 4.00 GiB of KV cache" in msg  # needed for one sequence
    assert (
        "only 1.00 GiB is available for the KV cache after 15.00 GiB of weights and 2.00 GiB of activations"
        in msg
    )
    assert "the largest max_model_len that fits is 8192" in msg
    assert "--max-model-len" in msg and "--gpu-memory-utilization" in msg
    assert "\n" not in msg


def test_cpu_message_names_kv_cache_memory_bytes():
    with pytest.raises(SizingError, match="--kv-cache-memory-bytes") as e:
        fit_max_model_len(8192, 8192, 46_080, 64 * MiB, 16, device="cpu")
    assert "--gpu-memory-utilization" not in str(e.value)
    assert "the largest max_model_len that fits is 1456" in str(e.value)


def test_model_limit_that_does_not_fit_without_a_request():
    with pytest.raises(
        SizingError, match="the model's limit of 131072 tokens .* largest max_model_len that fits is 4096"
    ):
        fit_max_model_len(None, 131072, KV, 512 * MiB, 16)


def test_nothing_fits():
    with pytest.raises(SizingError, match="not even one block"):
        fit_max_model_len("auto", 4096, KV, 1 * MiB, 16)


def test_longer_than_the_model_and_bad_values():
    with pytest.raises(SizingError, match="longer than the model's limit of 4096"):
        fit_max_model_len(8192, 4096, KV, 100 * GiB, 16)
    with pytest.raises(SizingError, match="integer or 'auto'"):
        fit_max_model_len("lots", 4096, KV, 100 * GiB, 16)
    with pytest.raises(SizingError, match="at least 1"):
        fit_max_model_len(0, 4096, KV, 100 * GiB, 16)
