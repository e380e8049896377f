"""C++ kernels for CPUs, compiled on first use with ``torch.utils.cpp_extension`` and cached.

The build lives in ``FD_CACHE_DIR/torch_extensions/fastdeploy_cpu_ops_<key>``. The key hashes what the
compiled module depends on (sources and headers, compile and link flags, the compiler's version,
torch's version and include paths, the Python ABI, the CPU model and flags, as the build uses
``-march=native``) and not the checkout path: the sources are copied into ``<build dir>/src`` and
compiled from there, so ``build.ninja`` is the same for every checkout and they all reuse one build.

Concurrent starts (several workers or servers) take turns on an ``fcntl.flock`` of
``<build dir>/build.lock``. The OS releases it when its holder dies, so a killed build blocks nobody,
and the wait is bounded by ``FD_CPU_OPS_BUILD_TIMEOUT_S``, after which the waiter uses the torch
fallback. A build says what it does: a line when it starts, one every ``PROGRESS_INTERVAL_S`` while it
runs and one with the outcome, at WARNING so that they reach the console even from a process that
configured no logging (a worker process).

The kernels are written once against the 16-float vector of ``cpu_vec.h``, which compiles to
AVX-512 (F, BW, VL) or to AVX2 + FMA, whichever ``-march=native`` offers; the CPU flags are part of
the key, so each instruction set gets its own build. If the CPU has neither (checked before
compiling), the compiler, ninja or the sources are missing, or the build fails, ``load_cpu_ops()``
returns None and callers use their torch fallback; ``FD_DISABLE_CUSTOM_OPS=1`` forces that.
``python -m fastdeploy.ops.cpu_ops`` builds ahead of time (e.g. while building an image).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fastdeploy import envs

logger = logging.getLogger(__name__)

# fastdeploy.ops imports this module, so `python -m fastdeploy.ops.cpu_ops` finds it imported already;
# __main__ below hands over to that copy, which makes runpy's warning about it moot.
warnings.filterwarnings(
    "ignore", message="'fastdeploy.ops.cpu_ops' found in sys.modules", category=RuntimeWarning
)

SOURCES = [
    "cpu/bindings.cpp",
    "cpu/paged_attention.cpp",
    "cpu/prefill_attention.cpp",
    "cpu/layer_kernels.cpp",
]
HEADERS = ["cpu/cpu_ops.h", "cpu/cpu_vec.h"]
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")
LDFLAGS = ("-fopenmp", "-lmvec")

TYPICAL_BUILD_TIME = "2-3 min on 2 cores"
"""Measured on 2 busy cores: 111 s, and 171 s under ``nice`` (137 CPU-s, 4 files compiled in parallel)."""
PROGRESS_INTERVAL_S = 15.0
"""Seconds between the progress lines of a build or of a wait for another process's build."""
LOCK_FILE = "build.lock"
"""Our ``flock`` file in the build folder."""
TORCH_LOCK_FILE = "lock"
"""torch's own lock file (``FileBaton``), which a build killed inside ``load()`` leaves behind."""
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes the kernels handle (the ops take their torch path for the others)."""
REQUIRED_CPU_FLAGS = (("avx512f", "avx512bw", "avx512vl"), ("avx2", "fma"))
"""The instruction sets ``cpu_vec.h`` compiles to, preferred first: a CPU needs all the flags of one
of them; without any the build would fail after minutes of compiling, at every start."""


def _sources_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "custom_ops"


def _cpu_id() -> str:
    """The CPU's model name and feature flags: ``-march=native`` code may not run on another CPU."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "flags"):
                    fields.setdefault(name, value.strip())
                if len(fields) == 2:
                    break
    except OSError:
        pass
    return " ".join(
        [platform.machine(), platform.processor(), fields.get("model name", ""), fields.get("flags", "")]
    )


def missing_cpu_flags(cpu_id: str) -> list[str]:
    """What ``cpu_id`` (as :func:`_cpu_id` gives it) lacks for the kernels: empty when it has every
    flag of one of the :data:`REQUIRED_CPU_FLAGS` sets, else the flags of the least demanding set
    (AVX2 + FMA) that it lacks; empty off x86 (another architecture fails its own way, at compile
    time)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    flags = set(cpu_id.split())
    missing = [[flag for flag in isa if flag not in flags] for isa in REQUIRED_CPU_FLAGS]
    if any(not m for m in missing):
        return []
    return missing[-1]


def _compiler_id() -> str:
    """``$CXX --version`` (torch compiles with ``$CXX``, else ``c++``); just the name when it does not run."""
    cxx = os.environ.get("CXX", "c++")
    try:
        result = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return cxx
    return f"{cxx}: {result.stdout.strip()}"


def _torch_id() -> str:
    """torch's version and the include folders ``build.ninja`` names (another install, another build)."""
    from torch.utils.cpp_extension import include_paths

    return " ".join([torch.__version__, torch.version.git_version or "", *include_paths()])


def _python_id() -> str:
    """The Python version and extension ABI, and its include folder (which ``build.ninja`` names)."""
    return " ".join(
        [
            platform.python_version(),
            sys.implementation.cache_tag or "",
            str(sysconfig.get_config_var("EXT_SUFFIX")),
            sysconfig.get_paths()["include"],
        ]
    )


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    """Everything the compiled module depends on; :attr:`name` (a hash of it) names its build folder.

    The checkout path is deliberately not part of it: the files are compiled from copies in the build
    folder, so two checkouts with the same files, flags and toolchain share one build.
    """

    sources: tuple[tuple[str, bytes], ...]
    """(path relative to ``custom_ops``, contents) of each compiled file."""
    headers: tuple[tuple[str, bytes], ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    compiler: str
    torch: str
    python: str
    cpu: str

    @property
    def name(self) -> str:
        """The extension's module name (and its build folder's): ``fastdeploy_cpu_ops_<key>``."""
        digest = hashlib.sha256()
        for path, data in self.sources + self.headers:
            digest.update(f"{path}\0{len(data)}\0".encode())
            digest.update(data)
        config = (self.cflags, self.ldflags, self.compiler, self.torch, self.python, self.cpu)
        digest.update(repr(config).encode())
        return f"fastdeploy_cpu_ops_{digest.hexdigest()[:16]}"


def build_spec(sources_dir: Path) -> BuildSpec | None:
    """The spec of the build from ``sources_dir`` in this environment; None when a file is missing
    (an installed package without ``custom_ops``)."""
    if not all((sources_dir / path).is_file() for path in SOURCES + HEADERS):
        return None
    return BuildSpec(
        sources=tuple((path, (sources_dir / path).read_bytes()) for path in SOURCES),
        headers=tuple((path, (sources_dir / path).read_bytes()) for path in HEADERS),
        cflags=CFLAGS,
        ldflags=LDFLAGS,
        compiler=_compiler_id(),
        torch=_torch_id(),
        python=_python_id(),
        cpu=_cpu_id(),
    )


def _write_sources(spec: BuildSpec, build_dir: str) -> list[str]:
    """Copy the spec's files to ``<build_dir>/src`` (only those that differ: a new mtime would make
    ninja recompile) and return the paths of the compiled ones."""
    src = Path(build_dir) / "src"
    for path, data in spec.sources + spec.headers:
        target = src / path
        if target.is_file() and target.read_bytes() == data:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        partial.write_bytes(data)
        os.replace(partial, target)
    return [str(src / path) for path, _ in spec.sources]


def _compile(name: str, sources: list[str], build_dir: str, spec: BuildSpec) -> Any:
    """Build (ninja does nothing when the build is current) and import the extension."""
    from torch.utils.cpp_extension import load

    includes = sorted({f"-I{Path(source).parent}" for source in sources})
    return load(
        name=name,
        sources=sources,
        extra_cflags=[*spec.cflags, *includes],
        extra_ldflags=list(spec.ldflags),
        build_directory=build_dir,
        verbose=False,
    )


@contextlib.contextmanager
def _build_lock(build_dir: str, timeout_s: float) -> Iterator[bool]:
    """Hold ``<build_dir>/build.lock`` (yields True), or give up after ``timeout_s`` (yields False).

    An ``flock`` rather than torch's lock file: the OS releases it when its holder dies, so a killed
    build never blocks the next start, and this wait has a bound where torch's has none.
    """
    path = os.path.join(build_dir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = time.monotonic()
        next_report = 0.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited >= timeout_s:
                    yield False
                    return
                if waited >= next_report:
                    logger.warning(
                        "another process is compiling the CPU kernels; waited %.0f s of at most %.0f s "
                        "(FD_CPU_OPS_BUILD_TIMEOUT_S) for %s",
                        waited,
                        timeout_s,
                        path,
                    )
                    next_report += PROGRESS_INTERVAL_S
                time.sleep(min(0.1, max(timeout_s - waited, 0.0)))
        yield True
    finally:
        os.close(fd)  # releases the lock


def _remove_torch_lock(build_dir: str) -> None:
    """Remove torch's lock file left by a build killed inside ``load()``: torch would wait on it
    forever. Only called under our lock, when no other build of this folder can be running."""
    lock = os.path.join(build_dir, TORCH_LOCK_FILE)
    with contextlib.suppress(FileNotFoundError):
        os.remove(lock)
        logger.warning("removed the lock file of a killed CPU-kernel build: %s", lock)


@contextlib.contextmanager
def _progress(message: str, interval_s: float) -> Iterator[None]:
    """Log ``message % seconds_elapsed`` every ``interval_s`` while the body runs (a silent
    multi-minute build looks like a hang)."""
    done = threading.Event()
    start = time.monotonic()

    def report() -> None:
        while not done.wait(interval_s):
            logger.warning(message, time.monotonic() - start)

    thread = threading.Thread(target=report, name="cpu-ops-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def build_and_load(sources_dir: Path, cache_dir: str, timeout_s: float) -> Any | None:
    """The extension built from ``sources_dir``, compiled first unless ``cache_dir`` holds a build of
    the same :class:`BuildSpec`; None, with a warning saying why, when it cannot be had."""
    try:
        spec = build_spec(sources_dir)
        if spec is None:
            logger.info("CPU kernel sources not found in %s: using the torch fallback", sources_dir)
            return None
        build_dir = os.path.join(cache_dir, "torch_extensions", spec.name)
        os.makedirs(build_dir, exist_ok=True)
        with _build_lock(build_dir, timeout_s) as locked:
            if not locked:
                logger.warning(
                    "CPU kernels unavailable, using the torch fallback: another process held %s for "
                    "more than %.0f s (FD_CPU_OPS_BUILD_TIMEOUT_S)",
                    os.path.join(build_dir, LOCK_FILE),
                    timeout_s,
                )
                return None
            _remove_torch_lock(build_dir)
            cached = os.path.isfile(os.path.join(build_dir, f"{spec.name}.so"))
            if not cached:
                logger.warning(
                    "compiling CPU kernels (first start only, %s) in %s ...", TYPICAL_BUILD_TIME, build_dir
                )
            start = time.monotonic()
            sources = _write_sources(spec, build_dir)
            with _progress("still compiling CPU kernels: %.0f s elapsed", PROGRESS_INTERVAL_S):
                module = _compile(spec.name, sources, build_dir, spec)
            if not cached:
                logger.warning("compiled CPU kernels in %.0f s", time.monotonic() - start)
            return module
    except Exception as exc:  # no compiler, no ninja, a build error: fall back to torch
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        logger.warning("CPU kernels unavailable, using the torch fallback: %s", reason)
        return None


@functools.cache
def load_cpu_ops() -> Any | None:
    """The compiled CPU extension module, or None when it cannot be had (callers use torch)."""
    if envs.FD_DISABLE_CUSTOM_OPS:
        return None
    missing = missing_cpu_flags(_cpu_id())
    if missing:
        logger.warning(
            "CPU kernels unavailable, using the torch fallback: they need AVX-512 or AVX2 + FMA "
            "and this CPU lacks %s",
            ", ".join(missing),
        )
        return None
    return build_and_load(_sources_dir(), envs.FD_CACHE_DIR, envs.FD_CPU_OPS_BUILD_TIMEOUT_S)


def preload_cpu_ops(device: torch.device, dtype: torch.dtype) -> None:
    """Build or load the kernels now if a worker on ``device`` computing in ``dtype`` uses them.

    Workers call this while starting, before they report ready: otherwise the first forward pass
    would compile them (or wait for another worker's build) while ``/health`` already says 200.
    """
    if device.type == "cpu" and dtype in KERNEL_DTYPES:
        load_cpu_ops()


def main() -> int:
    """``python -m fastdeploy.ops.cpu_ops``: build the kernels now (e.g. in an image) or report the
    cached build. Exit status 1 when they cannot be had."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load_cpu_ops()
    if module is None:
        print("CPU kernels unavailable: FastDeploy will use its torch fallback (the reason is above)")
        return 1
    print(f"CPU kernels ready: {module.__file__}")
    return 0


if __name__ == "__main__":
    from fastdeploy.ops import cpu_ops  # the copy the rest of FastDeploy uses

    sys.exit(cpu_ops.main())
