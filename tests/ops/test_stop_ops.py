"""set_stop / get_stop: the "any request still running" flag, torch fallback and CUDA kernel."""

from __future__ import annotations

import pytest
import torch
from op_impls import IMPL_PARAMS, Impl, select_impl

from fastdeploy.ops import _ext, alloc_stop_flag, get_stop, set_stop, set_stop_torch, stop_ops
from fastdeploy.ops._ext import cuda_op


@pytest.fixture(params=IMPL_PARAMS)
def impl(request) -> Impl:
    # the kernel through the public wrapper: it validates in Python (an exception thrown inside
    # the extension crashed the process on the H200 image), then calls the kernel for CUDA tensors
    chosen = select_impl(request.param, set_stop_torch, set_stop)
    assert chosen.name != "kernel-cuda" or cuda_op("set_stop") is not None
    return chosen


def _random_flags(gen: torch.Generator, n: int, case: str) -> torch.Tensor:
    flags = torch.rand(n, generator=gen) < 0.5
    if case == "all_stopped":
        flags[:] = True
    elif case == "one_running" and n:
        flags[:] = True
        flags[int(torch.randint(n, (1,), generator=gen))] = False
    return flags


@pytest.mark.parametrize("case", ["random", "all_stopped", "one_running"])
@pytest.mark.parametrize("n", [0, 1, 7, 300, 4099])
def test_flag_is_one_while_any_request_runs(impl, n, case):
    gen = torch.Generator().manual_seed(n)
    flags = _random_flags(gen, n, case)
    expected = not bool(flags.all())
    flag_device, flag_host = alloc_stop_flag(impl.device)
    flag_device.fill_(7)  # a stale value that must be overwritten
    flag_host.fill_(7)
    impl.fn(flags.to(impl.device), flag_device, flag_host)
    if impl.device == "cuda":
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
    assert get_stop(flag_host) is expected
    assert int(flag_host[0]) == int(expected)
    assert int(flag_device[0].item()) == int(expected)


@pytest.mark.gpu
def test_set_stop_does_not_wait_for_the_device(impl):
    if impl.device != "cuda":
        pytest.skip("asynchrony only matters on a CUDA stream")
    flags = torch.tensor([True, False, True], device="cuda")
    flag_device, flag_host = alloc_stop_flag("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # ~0.3 s of GPU time queued ahead of set_stop
    impl.fn(flags, flag_device, flag_host)
    done = torch.cuda.Event()
    done.record()
    assert not done.query(), "set_stop blocked until the queued GPU work finished"
    assert int(flag_host[0]) == 0  # not yet published
    done.synchronize()
    assert get_stop(flag_host) is True


@pytest.mark.gpu
def test_kernel_matches_a_second_call_with_new_flags(impl):
    if impl.device != "cuda":
        pytest.skip("CUDA only")
    flag_device, flag_host = alloc_stop_flag("cuda")
    for flags in ([False, True], [True, True], [False, False], [True]):
        impl.fn(torch.tensor(flags, device="cuda"), flag_device, flag_host)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        assert get_stop(flag_host) is (not all(flags))


def test_stop_flags_of_any_shape_are_reduced(impl):
    gen = torch.Generator().manual_seed(2)
    flags = torch.ones(6, 1, dtype=torch.bool)  # FastDeploy keeps stop flags as [batch, 1]
    flag_device, flag_host = alloc_stop_flag(impl.device)
    impl.fn(flags.to(impl.device), flag_device, flag_host)
    if impl.device == "cuda":
        torch.cuda.synchronize()
    assert get_stop(flag_host) is False
    flags[int(torch.randint(6, (1,), generator=gen))] = False
    impl.fn(flags.to(impl.device), flag_device, flag_host)
    if impl.device == "cuda":
        torch.cuda.synchronize()
    assert get_stop(flag_host) is True


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"stop_flags": torch.tensor([0, 1], dtype=torch.int32)}, "bool"),
        ({"flag_device": torch.zeros(1, dtype=torch.int64)}, "flag_device must be int32"),
        ({"flag_device": torch.zeros(2, dtype=torch.int32)}, "flag_device must be int32"),
        ({"flag_host": torch.zeros(1, dtype=torch.float32)}, "flag_host must be"),
    ],
)
def test_invalid_arguments_are_refused(impl, changes, message):
    args = {"stop_flags": torch.tensor([True, False]), "flag_device": torch.zeros(1, dtype=torch.int32)}
    args = {name: t.to(impl.device) for name, t in args.items()}
    args["flag_host"] = alloc_stop_flag(impl.device)[1]
    for name, t in changes.items():
        args[name] = t if name == "flag_host" else t.to(impl.device)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        impl.fn(args["stop_flags"], args["flag_device"], args["flag_host"])


@pytest.mark.gpu
def test_unpinned_host_flag_is_refused_for_cuda(impl):
    if impl.device != "cuda":
        pytest.skip("CUDA only")
    flag_device = torch.zeros(1, dtype=torch.int32, device="cuda")
    with pytest.raises((ValueError, RuntimeError), match="pinned"):
        impl.fn(torch.tensor([True], device="cuda"), flag_device, torch.zeros(1, dtype=torch.int32))


def test_get_stop_refuses_a_wrong_buffer():
    with pytest.raises((ValueError, RuntimeError), match="int32"):
        get_stop(torch.zeros(1, dtype=torch.int64))


def test_alloc_stop_flag_on_cpu_is_plain_memory():
    flag_device, flag_host = alloc_stop_flag("cpu")
    assert flag_device.dtype == flag_host.dtype == torch.int32
    assert flag_device.shape == flag_host.shape == (1,)
    assert flag_device.data_ptr() != flag_host.data_ptr()


def test_public_set_stop_takes_the_kernel_only_for_cuda_tensors(monkeypatch):
    calls = []
    monkeypatch.setattr(_ext, "_load", lambda: True)  # pretend fastdeploy_ops is loaded
    monkeypatch.setattr(stop_ops, "cuda_op", lambda name: lambda *args: calls.append(name))
    monkeypatch.setenv("FD_DISABLE_CUSTOM_OPS", "0")
    flag_device, flag_host = alloc_stop_flag("cpu")
    set_stop(torch.tensor([True, False, True]), flag_device, flag_host)
    assert calls == [] and int(flag_host[0]) == 1
    monkeypatch.setenv("FD_DISABLE_CUSTOM_OPS", "1")
    assert get_stop(flag_host) is True and calls == []
