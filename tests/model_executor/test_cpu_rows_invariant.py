"""``rows_invariant``: on a CPU with ``FD_CPU_BATCH_INVARIANT`` every matmul call takes 2 to 32 rows
(a single row beside a zero row), so a row's bits do not depend on how many rows share its call."""

from __future__ import annotations

import pytest
import torch

from fastdeploy.model_executor.layers.linear import CPU_INVARIANT_ROWS, rows_invariant


@pytest.mark.parametrize("rows", [0, 1, 2, 32, 33, 64, 65, 70])
def test_calls_take_two_to_32_rows(rows, monkeypatch):
    monkeypatch.setenv("FD_CPU_BATCH_INVARIANT", "1")
    w = torch.randn(8, 16)
    x = torch.randn(rows, 16)
    calls = []

    def matmul(part: torch.Tensor) -> torch.Tensor:
        calls.append(part.shape[0])
        return part @ w.t()

    out = rows_invariant(x, matmul)
    torch.testing.assert_close(out, x @ w.t())
    assert out.shape == (rows, 8)
    if rows:
        assert all(2 <= n <= CPU_INVARIANT_ROWS for n in calls), calls
    assert sum(calls) == rows + (rows % CPU_INVARIANT_ROWS == 1)  # (one padding row at most)


def test_one_call_without_the_setting(monkeypatch):
    monkeypatch.setenv("FD_CPU_BATCH_INVARIANT", "0")
    calls = []
    rows_invariant(torch.randn(65, 4), lambda part: calls.append(part.shape[0]) or part)
    assert calls == [65]
