"""The ``fastdeploy`` console script: a dispatcher over subcommand modules.

Each subcommand lives in its own module exposing ``register(subparsers)``,
which adds its parser and sets ``func`` (called with the parsed namespace).
Adding a subcommand (``bench``, ...) is one entry in :data:`SUBCOMMAND_MODULES`.

SIGINT and SIGTERM are handled from the first line of :func:`main` on (see
:data:`~fastdeploy.engine.ipc.STOP_SIGNALS`): at any point they end the command
quietly with status 130 or 143.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

import fastdeploy
from fastdeploy.engine.ipc import STOP_SIGNALS

SUBCOMMAND_MODULES: tuple[str, ...] = (
    "fastdeploy.entrypoints.cli.serve",
    "fastdeploy.entrypoints.cli.run_batch",
    "fastdeploy.entrypoints.cli.bench",
)
"""Modules that each register one subcommand, in the order ``--help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="fastdeploy",
        description="FastDeploy: an LLM inference serving engine with an OpenAI-compatible API.",
    )
    parser.add_argument("--version", action="version", version=f"fastdeploy {fastdeploy.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def normalize_flag_names(argv: Sequence[str]) -> list[str]:
    """``argv`` with underscores in long option names made dashes (``--max_model_len 512`` →
    ``--max-model-len 512``, ``--max_model_len=512`` too), as ``vllm serve`` accepts them; values,
    and everything after a bare ``--``, are left as they are."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + list(argv[i:])
        if arg.startswith("--") and "_" in arg.partition("=")[0]:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen subcommand; returns the exit code.

    Run as the program (``argv`` None), ``serve`` and ``run-batch`` end the process once it
    has cleaned up: the interpreter's teardown of torch would add a second or more
    to every shutdown, and nothing is left for it to do.
    """
    command = None
    with STOP_SIGNALS.installed():
        try:
            parser = build_parser()
            args = parser.parse_args(normalize_flag_names(sys.argv[1:] if argv is None else argv))
            command = args.command
            code = _run(parser, args)
        except KeyboardInterrupt:  # SIGINT or SIGTERM before the command could stop by itself
            code = STOP_SIGNALS.exit_code or 130
    if argv is None and command in ("serve", "run-batch"):
        _exit_now(code)
    return code


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    with STOP_SIGNALS.shielded():
        # torch's C++ module init calls back into Python: an interrupt raised there cannot pass
        # through pybind11 and aborts the process, so a SIGTERM or SIGINT waits for the import
        import torch  # noqa: F401

    from fastdeploy.engine.async_llm import EngineStartupError

    try:
        return int(func(args) or 0)
    except EngineStartupError as exc:  # a bad option or model: its cause, not the worker's traceback
        lines = [line for line in str(exc).splitlines() if line.strip()] or [repr(exc)]
        summary = lines[0] if len(lines) == 1 else f"the engine failed to start: {lines[-1].strip()}"
        print(f"fastdeploy {args.command}: {summary}", file=sys.stderr)
        print("(FD_LOG_LEVEL=DEBUG logs the engine's traceback)", file=sys.stderr)
        return 1


def _exit_now(code: int) -> None:
    """Flush the logs and standard streams, then end the process with ``code`` at once (``os._exit``)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
