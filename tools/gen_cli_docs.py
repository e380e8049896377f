"""Regenerate the flag tables of docs/cli.md from the config dataclasses.

The tables sit between ``<!-- BEGIN FLAGS -->`` and ``<!-- END FLAGS -->``;
the rest of the file is hand-written. Run ``python tools/gen_cli_docs.py``
after adding a config field; ``--check`` exits 1 if the file is stale.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fastdeploy.config import MULTI_VALUE_FLAGS  # noqa: E402
from fastdeploy.entrypoints.cli.args import FlagSpec, all_flag_specs  # noqa: E402

DOC = ROOT / "docs" / "cli.md"
BEGIN, END = "<!-- BEGIN FLAGS -->", "<!-- END FLAGS -->"


def _flag_cell(spec: FlagSpec) -> str:
    if spec.kind == "bool":
        return f"`{spec.flag}` / `--no-{spec.flag[2:]}`"
    if spec.key in MULTI_VALUE_FLAGS:
        return f"`{spec.flag} {spec.key.upper()} [{spec.key.upper()} ...]`"
    return f"`{spec.flag} {spec.key.upper()}`"


def _default_cell(spec: FlagSpec) -> str:
    if spec.default is None or spec.default == {}:
        return "—"
    if spec.kind == "json":
        return f"`{json.dumps(spec.default)}`"
    return f"`{spec.default}`"


def flag_tables() -> str:
    """Markdown tables of every flag, one per config section."""
    out: list[str] = []
    section = None
    for spec in all_flag_specs():
        if spec.section != section:
            section = spec.section
            out += [
                "",
                f"#### {section} options",
                "",
                "| flag | default | description |",
                "| --- | --- | --- |",
            ]
        text = spec.help.replace("|", "\\|")
        if spec.kind == "json":
            text += " Value: a JSON object."
        out.append(f"| {_flag_cell(spec)} | {_default_cell(spec)} | {text} |")
    return "\n".join(out).strip("\n")


def render(current: str) -> str:
    """``current`` with the text between the markers replaced by fresh tables."""
    head, rest = current.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{flag_tables()}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is out of date")
    args = parser.parse_args()
    current = DOC.read_text(encoding="utf-8")
    fresh = render(current)
    if args.check:
        if fresh != current:
            print("docs/cli.md is out of date; run python tools/gen_cli_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
