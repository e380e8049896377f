"""One-copy upload of a step's host arrays: values, dtypes and shapes survive, on CPU and GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdeploy.ops.upload import upload


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.integers(-(2**40), 2**40, size=7),  # int64, odd length: the next array must still align
        rng.integers(0, 1000, size=(3, 5)).astype(np.int32),
        rng.random(4) < 0.5,  # bool
        np.zeros(0, dtype=np.int64),  # empty
        rng.integers(0, 9, size=(4, 3)).astype(np.int32)[:, 1],  # non-contiguous
        rng.random(3).astype(np.float32),
    ]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_upload_keeps_values_dtypes_and_shapes(device):
    arrays = _arrays()
    tensors = upload(arrays, torch.device(device))
    assert len(tensors) == len(arrays)
    for array, tensor in zip(arrays, tensors):
        assert tensor.device.type == device
        assert tensor.shape == array.shape
        assert tensor.dtype == torch.from_numpy(np.ascontiguousarray(array)).dtype
        assert np.array_equal(tensor.cpu().numpy(), array)


@pytest.mark.gpu
def test_upload_tensors_are_writable_views_of_one_buffer():
    first, second = upload([np.arange(3), np.arange(5, dtype=np.int32)], torch.device("cuda"))
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    first[0] = 42  # the runner writes the in-flight step's tokens into its input ids
    assert first.tolist() == [42, 1, 2] and second.tolist() == [0, 1, 2, 3, 4]
