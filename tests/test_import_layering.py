"""The package's floors: ``core/`` at the bottom, the scheduler and metrics below the engine.

Every import statement of a module is read with ``ast`` (function-level and
``TYPE_CHECKING`` imports included), so a layering break fails here even when it
is only reached at run time.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fastdeploy"

CORE_MAY_IMPORT = ("fastdeploy.core", "fastdeploy.envs", "fastdeploy.config")
"""The only parts of fastdeploy that ``fastdeploy/core/`` may import."""

ABOVE_SCHEDULER = ("fastdeploy.engine", "fastdeploy.entrypoints")
"""What drives the scheduler: ``scheduler/`` and ``metrics/`` must not import it."""


def _module_name(path: Path) -> str:
    """``fastdeploy/core/request.py`` → ``fastdeploy.core.request`` (a package's ``__init__`` → the package)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports, as absolute dotted names (``from a import b`` gives ``a.b``)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.extend(f"{base}.{alias.name}" for alias in node.names)
    return names


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _modules(subpackage: str) -> list[Path]:
    files = sorted((PACKAGE / subpackage).rglob("*.py"))
    assert files, f"no modules under fastdeploy/{subpackage}"
    return files


def test_core_imports_only_the_ground_floor() -> None:
    bad = [
        f"{_module_name(path)} imports {name}"
        for path in _modules("core")
        for name in _imports(path)
        if _within(name, ("fastdeploy",)) and not _within(name, CORE_MAY_IMPORT)
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("subpackage", ["scheduler", "metrics"])
def test_scheduler_and_metrics_sit_below_the_engine(subpackage: str) -> None:
    bad = [
        f"{_module_name(path)} imports {name}"
        for path in _modules(subpackage)
        for name in _imports(path)
        if _within(name, ABOVE_SCHEDULER)
    ]
    assert not bad, "\n".join(bad)


def test_importing_core_loads_no_upper_floor() -> None:
    """At run time too: importing every core module (and the package's ``__init__``) loads nothing above it."""
    modules = [_module_name(path) for path in _modules("core")]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "upper = ('engine', 'scheduler', 'worker', 'entrypoints', 'model_executor', 'multimodal', 'metrics')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[:2][-1] in upper and m.startswith('fastdeploy.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
