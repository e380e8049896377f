"""Build the CUDA custom-op extension ``fastdeploy_ops``.

Usage (on a machine with nvcc and a CUDA build of torch)::

    python setup_ops.py build_ext --inplace   # fastdeploy_ops*.so next to this file
    python setup_ops.py install               # into site-packages

``FD_CUDA_ARCHS`` (see fastdeploy/envs.py, default ``9.0a;8.0+PTX``) picks the
GPU architectures; ``MAX_JOBS`` caps the parallel compile jobs (ninja is
required: it is what honours MAX_JOBS). The CPU kernels in ``custom_ops/cpu``
are not built here: fastdeploy/ops/cpu_ops.py compiles them on first use.

Second target, PaddlePaddle (documented, not built or verified here: no GPU, and
``paddlepaddle-gpu`` on PyPI stops at 2.6.2, which has no torch-compat proxy; see
docs/paddle.md). Under ``--backend paddle`` the engine uses every op's tensor
fallback (the backend sets ``FD_DISABLE_CUSTOM_OPS=1``), because this extension links
against libtorch. A Paddle build of the same kernels would be::

    # custom_ops/gpu/paddle_ops.cc (to write): PD_BUILD_OP(reshape_and_cache_flash)
    # .Inputs({...}).SetKernelFn(PD_KERNEL(...)) wrappers that take paddle::Tensor and launch
    # the kernels of cache_kernels.cu / stop_flag.cu, whose launch code is to be split from their
    # ATen/c10 bindings (TORCH_LIBRARY, at::Tensor, c10::cuda streams and guards)
    from paddle.utils.cpp_extension import CUDAExtension, setup
    setup(name="fastdeploy_ops_paddle",
          ext_modules=CUDAExtension(sources=["custom_ops/gpu/paddle_ops.cc", <the split .cu files>],
                                    extra_compile_args={"nvcc": nvcc_flags(archs)}))

after which ``import fastdeploy_ops_paddle`` exposes the ops as Python functions, and
fastdeploy/ops/_ext.py would load it in place of ``torch.ops.fastdeploy_ops`` when the
paddle backend is active.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SOURCES = ["custom_ops/gpu/ops.cpp", "custom_ops/gpu/cache_kernels.cu", "custom_ops/gpu/stop_flag.cu"]
_ARCH = re.compile(r"^(\d+)\.(\d)([af]?)(\+PTX)?$")


def _load_envs():
    """fastdeploy/envs.py alone, without importing the fastdeploy package (and its dependencies)."""
    spec = importlib.util.spec_from_file_location("_fastdeploy_envs", ROOT / "fastdeploy" / "envs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cuda_arch_flags(archs: str) -> list[str]:
    """Translate ``"9.0a;8.0+PTX"`` into nvcc ``-gencode`` flags.

    Each entry is ``MAJOR.MINOR`` with an optional ``a``/``f`` suffix (the
    architecture-specific feature sets, e.g. sm_90a for Hopper's wgmma/TMA) and
    an optional ``+PTX`` that also embeds PTX, which the driver can JIT for
    newer GPUs. Entries are separated by ``;``, ``,`` or spaces.
    """
    entries = [e for e in re.split(r"[;,\s]+", archs.strip()) if e]
    if not entries:
        raise ValueError("FD_CUDA_ARCHS is empty; expected e.g. '9.0a;8.0+PTX'")
    flags: list[str] = []
    for entry in entries:
        match = _ARCH.match(entry)
        if match is None:
            raise ValueError(
                f"FD_CUDA_ARCHS entry {entry!r} is not MAJOR.MINOR[a|f][+PTX] (e.g. 9.0a, 8.0+PTX)"
            )
        major, minor, suffix, ptx = match.groups()
        num = f"{major}{minor}{suffix}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return list(dict.fromkeys(flags))


def nvcc_flags(archs: str) -> list[str]:
    """nvcc flags beyond torch's defaults (which add the C++ standard and the half/bf16 defines).

    No fast-math: the fp8 scale must be an IEEE division so that the kernel and
    the torch fallback store the same bits.
    """
    return ["-O3", "-lineinfo", *cuda_arch_flags(archs)]


def main() -> None:
    """Run setuptools with the fastdeploy_ops CUDAExtension and ninja-backed BuildExtension."""
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension, is_ninja_available

    if not is_ninja_available():
        sys.exit(
            "setup_ops.py: ninja is required (pip install ninja); it runs the compile jobs, MAX_JOBS at a time"
        )
    os.chdir(ROOT)  # SOURCES are relative, as setuptools wants
    archs = _load_envs().FD_CUDA_ARCHS
    print(f"setup_ops.py: building fastdeploy_ops for FD_CUDA_ARCHS={archs!r}")
    extension = CUDAExtension(
        name="fastdeploy_ops",
        sources=SOURCES,
        extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags(archs)},
    )
    setup(
        name="fastdeploy_ops",
        version="0.1.0",
        description="CUDA custom ops of FastDeploy (torch.ops.fastdeploy_ops)",
        ext_modules=[extension],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        py_modules=[],
    )


if __name__ == "__main__":
    main()
