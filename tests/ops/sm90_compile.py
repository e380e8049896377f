"""Compiling Triton kernels for Hopper (sm_90) on a machine without a GPU, for the compile tests.

The CPU interpreter runs code the GPU compiler rejects, and CI has no GPU: Triton's bundled
``ptxas`` builds the cubin ahead of time and its ``cuobjdump`` reports the registers and the
stack (spills). A test lists its cases in ``_compile_all()`` and runs its own file in a
subprocess without ``TRITON_INTERPRET`` (:func:`run_compile_script`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest


def _bundled(tool: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def compile_sm90(
    kernel, types: dict[str, str], constexprs: dict, options: dict, not_aligned: tuple[str, ...] = ()
) -> dict[str, int]:
    """Compile ``kernel`` for sm_90 (arguments not in ``constexprs`` typed by ``types``, else
    ``i32``; pointers and ``stride_*`` arguments but ``not_aligned`` marked 16-aligned, as they are
    in practice); ``{"regs": n, "stack": bytes}`` from its cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if signature[n].startswith("*") or (n.startswith("stride_") and n not in not_aligned)
    }
    source = ASTSource(kernel, signature, constexprs, aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run(
            [_bundled("cuobjdump"), "--dump-resource-usage", cubin.name], capture_output=True, text=True
        )
    fields = dict(
        item.split(":", 1) for line in report.stdout.splitlines() if "REG:" in line for item in line.split()
    )
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"])}


def run_compile_script(test_file: str, timeout: int) -> dict[str, dict[str, int]]:
    """Run ``test_file`` as a script (its ``_compile_all()`` printed as JSON) without the
    interpreter; its results. Skips where Triton has no bundled ptxas."""
    pytest.importorskip("triton")
    if not os.path.exists(_bundled("ptxas")):
        pytest.skip("this triton build has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run(
        [sys.executable, test_file], capture_output=True, text=True, env=env, cwd=root, timeout=timeout
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def spills(results: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The cases whose kernels use stack (spilled registers)."""
    return {case: usage for case, usage in results.items() if usage["stack"] > 0}
