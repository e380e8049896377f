"""Which compile or link flag of the CPU kernels (fastdeploy/ops/cpu_ops.py) turns a ``TORCH_CHECK``
thrown from the extension into a segmentation fault on the GPU host (docs/benchmarks.md, nineteenth
session: ``test_write_cache_skips_negative_slots_and_checks_bounds`` dies there, raises on the CI CPU).

Builds a one-function extension that throws, once per flag set, and calls it in a child process, so
a crash shows as that child's exit status instead of ending the probe. Prints one line a flag set:

    python tools/probe_cpu_ext_throw.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap

FLAG_SETS = {
    "none": ([], []),
    "O3": (["-O3"], []),
    "march": (["-O3", "-march=native"], []),
    "openmp": (["-O3", "-fopenmp"], ["-fopenmp"]),
    "fast-math": (["-O3", "-ffast-math"], []),
    "mvec": (["-O3"], ["-lmvec"]),
    "all (cpu_ops)": (["-O3", "-march=native", "-fopenmp", "-ffast-math"], ["-fopenmp", "-lmvec"]),
}

CHILD = textwrap.dedent(
    """
    import sys, torch
    from torch.utils.cpp_extension import load_inline
    cflags, ldflags, build_dir = sys.argv[1].split(), sys.argv[2].split(), sys.argv[3]
    source = '''
    #include <torch/extension.h>
    void throws(torch::Tensor t) { TORCH_CHECK(t.numel() < 0, "probe: numel ", t.numel(), " is not negative"); }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("throws", &throws); }
    '''
    mod = load_inline(name="fd_throw_probe", cpp_sources=source, extra_cflags=cflags,
                      extra_ldflags=ldflags, build_directory=build_dir, verbose=False)
    try:
        mod.throws(torch.ones(3))
    except RuntimeError as error:
        print("raised:", str(error).splitlines()[0])
    """
)


REAL = textwrap.dedent(
    """
    import torch
    from fastdeploy.ops.cpu_ops import load_cpu_ops
    kernels = load_cpu_ops()
    x = torch.randn(4, 64)
    try:
        kernels.rms_norm(torch.empty_like(x), x, torch.ones(32), 1e-5)
    except RuntimeError as error:
        print("rms_norm raised:", str(error).splitlines()[0])
    cache, src = torch.randn(4, 16, 3, 64), torch.randn(5, 3, 64)
    try:
        kernels.write_cache(src, cache, torch.tensor([0, 1, 2, 3, 64]))
    except RuntimeError as error:
        print("write_cache raised:", str(error).splitlines()[0])
    """
)


def main() -> None:
    """Build and call the throwing extension under each flag set; print how each call ended."""
    import torch

    print(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), cxx11 abi {torch._C._GLIBCXX_USE_CXX11_ABI}"
    )
    print(subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[0])
    for name, (cflags, ldflags) in FLAG_SETS.items():
        with tempfile.TemporaryDirectory() as build_dir:
            child = subprocess.run(
                [sys.executable, "-c", CHILD, " ".join(cflags), " ".join(ldflags), build_dir],
                capture_output=True,
                text=True,
                timeout=300,
            )
        outcome = child.stdout.strip().splitlines()[-1:] or child.stderr.strip().splitlines()[-1:]
        print(f"{name:>14}: exit {child.returncode}: {outcome[0] if outcome else ''}")
    child = subprocess.run([sys.executable, "-c", REAL], capture_output=True, text=True, timeout=600)
    print(f"{'cpu_ops':>14}: exit {child.returncode}: {' | '.join(child.stdout.strip().splitlines())}")


if __name__ == "__main__":
    main()
