"""A step's host arrays reach the device in one asynchronous copy from pinned memory (engine/worker/uploads.py);
on the CPU they stay where they are. The CUDA tests live here so that `make gpu-check` runs them."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from pagoda.engine.worker.uploads import ALIGN, upload


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.integers(0, 50_000, 37, dtype=np.int64),  # token ids
        np.arange(37, dtype=np.int64),  # positions
        np.array([0, 1, 2, 30, 37], dtype=np.int32),  # query start locations
        rng.integers(0, 900, (4, 13), dtype=np.int32),  # block tables
        np.zeros(0, dtype=np.int64),  # an empty selection
        rng.integers(-1, 10_000, 37, dtype=np.int64)[::2],  # strided: copied contiguous
    ]


def test_on_the_cpu_the_arrays_are_shared_not_copied():
    arrays = _arrays()[:4]
    tensors = upload(arrays, torch.device("cpu"))
    for a, t in zip(arrays, tensors, strict=True):
        assert t.data_ptr() == a.ctypes.data and np.array_equal(t.numpy(), a)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_one_asynchronous_copy_gives_aligned_views_of_the_same_values():
    arrays = _arrays()
    upload(arrays, torch.device("cuda"))  # the caching host allocator's first pinned block
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tensors = upload(arrays, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not [w for w in caught if "synchroniz" in str(w.message)], "the upload waited for the device"
    base = tensors[0].untyped_storage().data_ptr()
    for a, t in zip(arrays, tensors, strict=True):
        assert t.device.type == "cuda" and t.untyped_storage().data_ptr() == base  # one buffer, one copy
        assert (t.numel() == 0 or t.data_ptr() % ALIGN == 0) and t.is_contiguous()
        assert t.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype and tuple(t.shape) == a.shape
        assert np.array_equal(t.cpu().numpy(), a)
