"""The tensor-parallel collectives on real gloo process groups (two CPU processes)."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from fastdeploy import distributed as fdist


def _collectives(rank: int, size: int, init_method: str, results: dict) -> None:
    fdist.init_tensor_parallel(size, rank, init_method, torch.device("cpu"))
    try:
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)
        summed = fdist.tp_all_reduce(x.clone())
        gathered = fdist.tp_all_gather(x, dim=-1)
        b = fdist.tp_broadcast(torch.full((2,), float(rank)), src=1)
        results[rank] = (summed, gathered, b, fdist.tp_info())
    finally:
        fdist.destroy_tensor_parallel()


def test_collectives_over_two_gloo_ranks():
    size = 2
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_collectives, args=(size, fdist.free_port_init_method(), results), nprocs=size, join=True)
        results = dict(results)
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    for rank in range(size):
        summed, gathered, b, info = results[rank]
        torch.testing.assert_close(summed, base * 3)
        torch.testing.assert_close(gathered, torch.cat([base, base * 2], dim=-1))
        torch.testing.assert_close(b, torch.ones(2))
        assert info == fdist.TensorParallelInfo(rank=rank, size=size)


def test_one_rank_is_a_no_op():
    x = torch.randn(3, 4)
    assert fdist.tp_all_reduce(x) is x
    assert fdist.tp_all_gather(x) is x
    assert fdist.tp_info() == fdist.TensorParallelInfo()
    assert fdist.divide(8, 2, "heads") == 4
    try:
        fdist.divide(9, 2, "attention heads")
    except ValueError as exc:
        assert "attention heads (9)" in str(exc)
    else:
        raise AssertionError("9 heads over 2 ranks must be refused")
