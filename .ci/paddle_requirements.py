"""Print the Paddle CI environment's requirements: the base dependencies and the ``paddle-test`` extra,
less those that require torch (xgrammar), one per line (``pip install -r``)."""

from __future__ import annotations

from pathlib import Path

import tomllib

NEEDS_TORCH = ("xgrammar",)

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
for requirement in [*project["dependencies"], *project["optional-dependencies"]["paddle-test"]]:
    if not requirement.startswith(NEEDS_TORCH):
        print(requirement)
