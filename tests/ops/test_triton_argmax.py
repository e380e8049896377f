"""The Triton row argmax against ``torch.argmax`` on random logits, ties, -inf rows and NaN.

On a CPU-only machine the kernels run in Triton's interpreter; the GPU copy also checks
the dispatch the sampler uses (``layer_ops.argmax_rows``) and a CUDA-graph replay.
"""

from __future__ import annotations

import os

import pytest
import torch

triton_argmax = pytest.importorskip("fastdeploy.ops.triton_argmax")

from fastdeploy.ops import layer_ops  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU and the Triton interpreter is off"
)


def _logits(rows: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, n, generator=g) * 4).to(dtype).to(DEVICE)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("n", [5, 4096, 4097, 10000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_argmax(rows, n, dtype):
    x = _logits(rows, n, dtype, seed=n + rows)
    assert torch.equal(triton_argmax.argmax_rows(x).cpu(), x.argmax(dim=-1).cpu())


def test_ties_take_the_first_index_across_chunks():
    x = _logits(2, 9000, torch.float32, seed=1)
    x[0, 8500] = x[0, 300] = 100.0  # tie across two chunks: the first wins
    x[1, 4100] = x[1, 4095] = 100.0  # tie straddling the chunk border
    assert triton_argmax.argmax_rows(x).tolist() == [300, 4095]


def test_inf_nan_and_strided_rows():
    base = _logits(4, 6000, torch.float32, seed=2)
    base[0] = float("-inf")  # all -inf: index 0, as torch
    base[1, 5000] = float("nan")  # NaN counts as the largest, as torch
    base[2, 4500] = float("inf")
    x = base[:, :5500]  # row stride 6000, 5500 columns
    got = triton_argmax.argmax_rows(x).cpu()
    assert got.tolist()[:3] == [0, 5000, 4500]
    assert torch.equal(got, x.argmax(dim=-1).cpu())


def test_rejects_bad_input_and_handles_no_rows():
    with pytest.raises(ValueError, match="2-D"):
        triton_argmax.argmax_rows(torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="unit column stride"):
        triton_argmax.argmax_rows(torch.zeros(4, 4, device=DEVICE).T)
    assert triton_argmax.argmax_rows(torch.zeros(0, 7, device=DEVICE)).shape == (0,)


@pytest.mark.gpu
def test_sampler_dispatch_and_graph_replay_on_gpu():
    x = _logits(2, 128256, torch.float32, seed=3)
    assert torch.equal(layer_ops.argmax_rows(x), x.argmax(dim=-1))
    static = x.clone()
    out = layer_ops.argmax_rows(static)  # compiled outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer_ops.argmax_rows(static)
    for seed in (4, 5):
        static.copy_(_logits(2, 128256, torch.float32, seed=seed))
        graph.replay()
        assert torch.equal(out, static.argmax(dim=-1))


def test_programmatic_dependent_launch_is_off_off_gpu():
    from fastdeploy.ops.triton_pdl import pdl_kwargs

    assert pdl_kwargs(torch.zeros(1)) == {"USE_PDL": False}
