"""The torch APIs the paddle shim closes, checked for torch's meaning under whichever backend runs.

Under torch these pin down the semantics the engine relies on; under Paddle
(``FD_BACKEND=paddle``) they check each gap of the proxy that
:mod:`fastdeploy.platforms.paddle_shim` closes, against NumPy on random inputs.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from torch import nn

from fastdeploy.platforms.backend import BackendError, activate, active_backend

RNG = np.random.default_rng(0)


def _t(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def test_narrow_of_a_view_writes_at_the_view_offset():
    base = torch.zeros(6, 4)
    src = RNG.standard_normal((1, 4)).astype(np.float32)
    base.narrow(0, 2, 3).narrow(0, 1, 1).copy_(_t(src))  # row 3 of base
    expected = np.zeros((6, 4), np.float32)
    expected[3] = src
    np.testing.assert_array_equal(base.numpy(), expected)
    cols = torch.zeros(3, 6)
    torch.narrow(cols.narrow(1, 2, 4), 1, 3, 1).copy_(torch.ones(3, 1))
    assert cols.numpy()[:, 5].tolist() == [1, 1, 1] and cols.sum().item() == 3


def test_index_copy_into_a_view():
    cache = torch.zeros(4, 6)
    src = RNG.standard_normal((2, 2, 3)).astype(np.float32)
    cache.view(-1, 2, 3).index_copy_(0, torch.tensor([3, 0]), _t(src))
    expected = np.zeros((4, 2, 3), np.float32)
    expected[[3, 0]] = src
    np.testing.assert_array_equal(cache.numpy(), expected.reshape(4, 6))


def test_mixed_int32_int64_operators_promote_to_int64():
    a = torch.tensor([1, 5, 7], dtype=torch.int32)
    b = torch.tensor([4, 5, 6], dtype=torch.int64)
    assert (a < b).tolist() == [True, False, False]
    assert (b[None, :] < a[:, None]).tolist() == (
        np.array([4, 5, 6])[None] < np.array([1, 5, 7])[:, None]
    ).tolist()
    total = a + b
    assert total.dtype == torch.int64 and total.tolist() == [5, 10, 13]


def test_where_with_a_scalar_keeps_the_tensor_dtype():
    codes = torch.tensor([3, 4, 5], dtype=torch.int32)
    hits = torch.where(torch.tensor([True, False, True]), codes, 0)
    assert hits.dtype == torch.int32 and hits.tolist() == [3, 0, 5]


def test_split_takes_sizes_and_dim():
    x = _t(RNG.standard_normal((2, 9)).astype(np.float32))
    q, k, v = x.split([5, 2, 2], dim=-1)
    assert [tuple(t.shape) for t in (q, k, v)] == [(2, 5), (2, 2), (2, 2)]
    np.testing.assert_array_equal(v.numpy(), x.numpy()[:, 7:])
    assert [tuple(t.shape) for t in x.split(4, dim=1)] == [(2, 4), (2, 4), (2, 1)]  # torch: chunks of 4


def test_small_gaps():
    assert torch.eye(3, dtype=torch.bool).tolist() == np.eye(3, dtype=bool).tolist()
    flag = torch.zeros(1, dtype=torch.int32)
    flag.view(-1).copy_(torch.tensor([True]).any().to(torch.int32).view(1))  # a 0-d view
    assert flag.tolist() == [1]
    assert (torch.float32.itemsize, torch.bfloat16.itemsize, torch.int64.itemsize) == (4, 2, 8)
    assert torch.device("cpu").type == "cpu"
    with torch.inference_mode():
        assert torch.ones(2).sum().item() == 2
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1


def test_linear_takes_the_weight_as_out_by_in():
    x = RNG.standard_normal((3, 5)).astype(np.float32)
    w = RNG.standard_normal((4, 5)).astype(np.float32)
    got = nn.functional.linear(_t(x), _t(w)).numpy()
    np.testing.assert_allclose(got, x @ w.T, rtol=1e-5, atol=1e-5)
    assert tuple(nn.Linear(5, 4).weight.shape) == (4, 5)


def test_the_other_backend_cannot_be_chosen_once_torch_is_bound():
    other = "torch" if active_backend() == "paddle" else "paddle"
    assert "torch" in sys.modules
    with pytest.raises(BackendError):
        activate(other)
    with pytest.raises(BackendError, match="unknown backend"):
        activate("tensorflow")
    assert activate(active_backend()) == active_backend()
