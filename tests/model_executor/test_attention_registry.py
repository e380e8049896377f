"""The attention-backend registry: which backend each device and model gets, the errors when a
named one cannot run, backends registered from outside, declared capabilities, and the declared
flashinfer + Triton-decode pairing (routing checked on CPU with the Triton kernel interpreted)."""

from __future__ import annotations

import itertools

import pytest
import torch
from paged_attention_cases import TOLERANCE, make_step, reference

from fastdeploy.config import EngineConfig
from fastdeploy.model_executor.attention import flashinfer_backend, registry
from fastdeploy.model_executor.attention.backend import AttentionBackend, AttentionSpec, PrefillDecodeBackend
from fastdeploy.model_executor.attention.flashinfer_backend import FlashInferAttentionBackend
from fastdeploy.model_executor.attention.registry import (
    ATTENTION_BACKENDS,
    AttentionBackendEntry,
    AttentionBackendUnavailable,
    choose_attention_backend,
    register_attention_backend,
)
from fastdeploy.model_executor.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from fastdeploy.platforms import get_attention_backend

triton_backend = pytest.importorskip("fastdeploy.model_executor.attention.triton_backend")
TritonAttentionBackend = triton_backend.TritonAttentionBackend
INTERPRETED = triton_backend.triton_interpreting()
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="Triton on a CPU needs TRITON_INTERPRET=1")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
CAPABILITIES = ("devices", "supports_cuda_graphs", "supports_fp8_kv_cache", "supports_mm_bidirectional")
CPU_KERNELS = object()
"""Stands in for the compiled C++ CPU kernels (the torch backend only stores them)."""


@pytest.fixture(autouse=True)
def _no_gpu_libraries(monkeypatch):
    """No C++ build; FlashInfer 'installed' (its wrappers are never built here) unless a test says not."""
    monkeypatch.setattr("fastdeploy.ops.cpu_ops.load_cpu_ops", lambda: CPU_KERNELS)
    monkeypatch.setattr(flashinfer_backend, "flashinfer_importable", lambda: True)
    monkeypatch.setattr(
        FlashInferAttentionBackend, "from_spec", classmethod(lambda cls, spec: object.__new__(cls))
    )
    monkeypatch.delenv("FD_TRITON_DECODE_MAX_BATCH", raising=False)


def _spec(device=CPU, dtype=torch.float32, head_dim=64, **kw) -> AttentionSpec:
    return AttentionSpec(device=device, dtype=dtype, head_dim=head_dim, **kw)


# ---- the choice per device and model ------------------------------------------------------------


def test_auto_on_a_cpu_is_torch_with_the_cpu_kernels_where_they_fit():
    backend = choose_attention_backend("auto", _spec(CPU, torch.float32, 64))
    assert type(backend) is TorchAttentionBackend and backend.cpu_kernels is CPU_KERNELS
    assert choose_attention_backend("auto", _spec(CPU, torch.bfloat16, 128)).cpu_kernels is CPU_KERNELS
    assert choose_attention_backend("auto", _spec(CPU, torch.float16, 64)).cpu_kernels is None
    assert choose_attention_backend("auto", _spec(CPU, torch.float32, 80)).cpu_kernels is None
    # triton runs on a CPU here (TRITON_INTERPRET=1) but has no priority there: auto never takes it
    assert (
        type(choose_attention_backend("auto", _spec(CPU, needs_mask_offsets=True))) is TorchAttentionBackend
    )


def test_auto_on_cuda_is_flashinfer_paired_with_triton_decode():
    backend = choose_attention_backend("auto", _spec(CUDA, torch.bfloat16, 128, num_heads=32, num_kv_heads=8))
    assert isinstance(backend, PrefillDecodeBackend) and backend.name == "flashinfer"
    assert type(backend.prefill) is FlashInferAttentionBackend
    assert type(backend.decode) is TritonAttentionBackend
    assert backend.decode_max_batch == 1024  # FD_TRITON_DECODE_MAX_BATCH's default
    assert backend.supports_cuda_graphs and not backend.supports_fp8_kv_cache
    assert backend.devices == ("cuda",)


def test_the_decode_pairing_follows_fd_triton_decode_max_batch(monkeypatch):
    monkeypatch.setenv("FD_TRITON_DECODE_MAX_BATCH", "8")
    assert choose_attention_backend("flashinfer", _spec(CUDA, torch.float16, 64)).decode_max_batch == 8
    monkeypatch.setenv("FD_TRITON_DECODE_MAX_BATCH", "0")  # FlashInfer serves every step itself
    assert (
        type(choose_attention_backend("flashinfer", _spec(CUDA, torch.float16, 64)))
        is FlashInferAttentionBackend
    )


def test_auto_on_cuda_falls_back_from_flashinfer_to_triton_to_torch(monkeypatch):
    assert type(choose_attention_backend("auto", _spec(CUDA, torch.float32, 128))) is TritonAttentionBackend
    fp8 = _spec(CUDA, torch.bfloat16, 128, kv_cache_dtype="fp8_e4m3")
    assert type(choose_attention_backend("auto", fp8)) is TritonAttentionBackend
    masks = _spec(CUDA, torch.bfloat16, 128, needs_mask_offsets=True)
    assert type(choose_attention_backend("auto", masks)) is TritonAttentionBackend
    torch_backend = choose_attention_backend("auto", _spec(CUDA, torch.bfloat16, 80))
    assert type(torch_backend) is TorchAttentionBackend and torch_backend.cpu_kernels is None
    monkeypatch.setattr(flashinfer_backend, "flashinfer_importable", lambda: False)
    assert type(choose_attention_backend("auto", _spec(CUDA, torch.bfloat16, 128))) is TritonAttentionBackend


def _if_chain_choice(name, device, dtype, head_dim, kv_cache_dtype, mask, flashinfer_installed) -> str:
    """The backend the replaced if-chain of ``platforms/__init__.py`` chose (with triton installed),
    or "error" where it, or the runner's fp8 check after it, refused."""
    cuda = device.type == "cuda"
    if name == "flashinfer" or (name == "auto" and cuda and flashinfer_installed):
        if (
            dtype in (torch.float16, torch.bfloat16)
            and head_dim in (64, 128, 256)
            and kv_cache_dtype == "auto"
        ):
            if not mask and cuda and flashinfer_installed:
                return "flashinfer"
        if name == "flashinfer":
            return "error"
    power_of_two = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    if name == "triton" or (name == "auto" and cuda):
        if name == "triton" and not power_of_two:
            return "error"
        if name == "triton" and not cuda and not INTERPRETED:
            return "error"
        if power_of_two:
            return "triton"
    if name in ("auto", "torch"):
        return "torch" if kv_cache_dtype == "auto" else "error"
    return "error"


@pytest.mark.parametrize("name", ["auto", "torch", "triton", "flashinfer"])
def test_every_choice_is_the_one_the_if_chain_made(name, monkeypatch):
    grid = itertools.product(
        (CPU, CUDA),
        (torch.float32, torch.bfloat16),
        (64, 80, 128),
        ("auto", "fp8_e4m3"),
        (False, True),
        (False, True),
    )
    for device, dtype, head_dim, kv, mask, installed in grid:
        monkeypatch.setattr(
            flashinfer_backend, "flashinfer_importable", lambda installed=installed: installed
        )
        config = EngineConfig()
        config.device.attention_backend = name
        case = (name, device, dtype, head_dim, kv, mask, installed)
        try:
            got = get_attention_backend(
                config, device, dtype, head_dim, kv_cache_dtype=kv, needs_mask_offsets=mask
            ).name
        except AttentionBackendUnavailable:
            got = "error"
        assert got == _if_chain_choice(*case), case


# ---- a named backend that cannot run: one error naming it and why --------------------------------


@pytest.mark.parametrize(
    "name, spec, why",
    [
        ("flashinfer", _spec(CPU, torch.bfloat16, 64), "it runs on CUDA devices only"),
        ("flashinfer", _spec(CUDA, torch.float32, 64), "it runs float16/bfloat16 models only"),
        ("flashinfer", _spec(CUDA, torch.bfloat16, 96), r"head_dim must be one of \(64, 128, 256\), got 96"),
        (
            "flashinfer",
            _spec(CUDA, torch.bfloat16, 64, needs_mask_offsets=True),
            "it has no attention-mask offsets",
        ),
        (
            "flashinfer",
            _spec(CUDA, torch.bfloat16, 64, kv_cache_dtype="fp8_e4m3"),
            "kv_cache_dtype fp8_e4m3 needs the triton attention",
        ),
        ("triton", _spec(CUDA, torch.bfloat16, 80), "it needs a power-of-two head_dim >= 16, got 80"),
        (
            "torch",
            _spec(CPU, kv_cache_dtype="fp8_e4m3"),
            "kv_cache_dtype fp8_e4m3 needs the triton attention",
        ),
    ],
)
def test_a_named_backend_that_cannot_run_says_why(name, spec, why):
    with pytest.raises(
        AttentionBackendUnavailable, match=f"^--attention-backend {name} is not available: {why}"
    ):
        choose_attention_backend(name, spec)


def test_flashinfer_named_without_the_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(flashinfer_backend, "flashinfer_importable", lambda: False)
    with pytest.raises(
        AttentionBackendUnavailable, match=r"flashinfer is not available: .*pip install flashinfer"
    ):
        choose_attention_backend("flashinfer", _spec(CUDA, torch.bfloat16, 128))


@needs_interpreter
def test_triton_named_on_a_cpu_needs_the_interpreter(monkeypatch):
    assert (
        type(choose_attention_backend("triton", _spec(CPU))) is TritonAttentionBackend
    )  # TRITON_INTERPRET=1
    monkeypatch.setattr(triton_backend, "triton_interpreting", lambda: False)
    with pytest.raises(AttentionBackendUnavailable, match="triton is not available: .*TRITON_INTERPRET=1"):
        choose_attention_backend("triton", _spec(CPU))


def test_unknown_and_unimportable_backends_are_clear_errors(monkeypatch):
    with pytest.raises(
        AttentionBackendUnavailable, match="unknown attention backend 'xformers'; available: auto, torch"
    ):
        choose_attention_backend("xformers", _spec())
    entry = AttentionBackendEntry("ghost", "fastdeploy.no_such_module:GhostBackend", {"cpu": 99})
    monkeypatch.setitem(ATTENTION_BACKENDS, "ghost", entry)
    with pytest.raises(
        AttentionBackendUnavailable, match="ghost is not available: it cannot be imported: No module"
    ):
        choose_attention_backend("ghost", _spec())
    assert type(choose_attention_backend("auto", _spec())) is TorchAttentionBackend  # auto skips it


def test_auto_with_nothing_available_lists_every_candidates_reason():
    with pytest.raises(
        AttentionBackendUnavailable, match=r"on cpu: torch: kv_cache_dtype fp8_e4m3 needs the triton"
    ):
        choose_attention_backend("auto", _spec(CPU, kv_cache_dtype="fp8_e4m3"))


# ---- a backend registered from outside ----------------------------------------------------------


class EvenHeadsBackend(AttentionBackend):
    """A test backend: CPU only, serves even head sizes, attends with nothing."""

    name = "even"
    devices = ("cpu",)
    supports_cuda_graphs = False
    supports_fp8_kv_cache = False
    supports_mm_bidirectional = False

    def __init__(self, spec: AttentionSpec):
        self.spec = spec

    @classmethod
    def unavailable_reason(cls, spec: AttentionSpec) -> str | None:
        return None if spec.head_dim % 2 == 0 else f"odd head_dim {spec.head_dim}"

    @classmethod
    def from_spec(cls, spec: AttentionSpec) -> EvenHeadsBackend:
        return cls(spec)

    def build(self, common):
        return common

    def forward(self, layer, q, k, v, meta):
        return torch.zeros_like(q)


@pytest.fixture
def scratch_registry(monkeypatch):
    """The registry's entries, restored after the test."""
    monkeypatch.setattr(registry, "ATTENTION_BACKENDS", dict(ATTENTION_BACKENDS))
    return registry.ATTENTION_BACKENDS


def test_a_registered_backend_with_the_top_priority_is_chosen(scratch_registry):
    register_attention_backend("even", EvenHeadsBackend, priority={"cpu": 100})
    backend = choose_attention_backend("auto", _spec(CPU, torch.float32, 64))
    assert type(backend) is EvenHeadsBackend and backend.spec.head_dim == 64
    assert type(choose_attention_backend("auto", _spec(CPU, torch.float32, 65))) is TorchAttentionBackend
    assert (
        type(choose_attention_backend("auto", _spec(CPU, needs_mask_offsets=True))) is TorchAttentionBackend
    )
    assert type(choose_attention_backend("auto", _spec(CUDA, torch.bfloat16, 64))) is PrefillDecodeBackend
    with pytest.raises(AttentionBackendUnavailable, match="even is not available: odd head_dim 65"):
        choose_attention_backend("even", _spec(CPU, torch.float32, 65))
    with pytest.raises(ValueError, match="'even' is already registered"):
        register_attention_backend("even", EvenHeadsBackend, priority={"cpu": 1})


def test_a_registered_backend_below_the_default_is_chosen_only_by_name(scratch_registry):
    register_attention_backend("even", EvenHeadsBackend, priority={"cpu": 5})
    assert type(choose_attention_backend("auto", _spec())) is TorchAttentionBackend
    assert type(choose_attention_backend("even", _spec())) is EvenHeadsBackend


def test_a_declared_decode_partner_is_paired_by_the_registry(scratch_registry):
    class WithEvenDecodes(EvenHeadsBackend):
        name = "with-even-decodes"
        decode_backend = "even"

        @classmethod
        def decode_backend_max_batch(cls) -> int:
            return 4

    register_attention_backend("even", EvenHeadsBackend, priority={})
    register_attention_backend("with-even-decodes", WithEvenDecodes, priority={"cpu": 100})
    backend = choose_attention_backend("auto", _spec(head_dim=64))
    assert isinstance(backend, PrefillDecodeBackend) and backend.name == "with-even-decodes"
    assert type(backend.prefill) is WithEvenDecodes and type(backend.decode) is EvenHeadsBackend
    assert backend.decode_max_batch == 4


# ---- declared capabilities ----------------------------------------------------------------------


def test_every_registered_backend_declares_its_capabilities():
    declared = {}
    for name, entry in ATTENTION_BACKENDS.items():
        cls = entry.load()
        assert cls.name == name
        assert all(field in vars(cls) for field in CAPABILITIES), name  # its own, not the base's defaults
        declared[name] = (cls.supports_cuda_graphs, cls.supports_fp8_kv_cache, cls.supports_mm_bidirectional)
    assert declared == {
        "torch": (False, False, True),
        "triton": (True, True, True),
        "flashinfer": (True, False, False),
    }
    assert FlashInferAttentionBackend.decode_backend == "triton"
    assert TorchAttentionBackend.decode_backend is None and TritonAttentionBackend.decode_backend is None


def test_a_pairing_has_a_capability_only_when_both_halves_do():
    pair = PrefillDecodeBackend(TorchAttentionBackend(), TritonAttentionBackend(), 8)
    assert pair.name == "torch" and pair.devices == ("cpu", "cuda")
    assert not pair.supports_cuda_graphs and not pair.supports_fp8_kv_cache and pair.supports_mm_bidirectional
    both = PrefillDecodeBackend(TritonAttentionBackend(), TritonAttentionBackend(), 8)
    assert both.supports_cuda_graphs and both.supports_fp8_kv_cache


# ---- the pairing's routing, with real kernels ------------------------------------------------------

DECODES = [(0, 1), (15, 1), (40, 1), (130, 1)]
MIXED = [(7, 9), (20, 1), (33, 5)]  # every prefill over cached context: the torch path reads the cache


@needs_interpreter
def test_a_pairing_routes_small_decode_steps_to_its_decode_backend():
    """Torch for prefills paired with interpreted Triton for decodes of up to 4 requests: each step's
    metadata comes from, and goes back to, the backend the step belongs to, and both are exact."""
    pair = PrefillDecodeBackend(
        TorchAttentionBackend(), TritonAttentionBackend(), decode_max_batch=len(DECODES)
    )
    for shapes, max_batch, expected in (
        (DECODES, len(DECODES), triton_backend.TritonAttentionMetadata),
        (DECODES, len(DECODES) - 1, TorchAttentionMetadata),
        (MIXED, len(DECODES), TorchAttentionMetadata),
    ):
        pair.decode_max_batch = max_batch
        layer, q, common = make_step(shapes, 4, 2, 32, torch.float32, seed=len(shapes) + max_batch)
        meta = pair.build(common)
        assert type(meta) is expected
        out = pair.forward(layer, q, None, None, meta)
        tol = TOLERANCE[torch.float32]
        torch.testing.assert_close(out.double(), reference(layer, q, common), atol=tol, rtol=tol)
    pair.decode_max_batch = len(DECODES)
    _, _, common = make_step(DECODES, 4, 2, 32, torch.float32)
    graph_meta = pair.build_graph_metadata(common)  # Triton's graph metadata; Torch has none
    assert type(graph_meta) is triton_backend.TritonAttentionMetadata
    pair.update_graph_metadata(graph_meta, common)
    pair.decode_max_batch = 2
    with pytest.raises(NotImplementedError, match="torch attention backend has no CUDA graphs"):
        pair.build_graph_metadata(common)
