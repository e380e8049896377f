"""``fastdeploy serve``: load a model and serve the OpenAI-compatible API."""

from __future__ import annotations

import argparse
import asyncio
import sys
import textwrap
from typing import Any

from fastdeploy.entrypoints.cli.args import ConfigFileError, add_engine_and_server_args, resolve_args


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Wraps flag help without breaking words at hyphens, so names like Qwen2-VL stay whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


DESCRIPTION = """\
Start the OpenAI-compatible HTTP server. With no model, the embedded
SmolLM2-135M-Instruct is served. Every engine option can also be set in a YAML
file given with --config (same keys as the flags); command-line flags win.
"""


def make_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``serve`` argument parser (a fresh one, or flags added to ``parser``)."""
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="fastdeploy serve", description=DESCRIPTION, formatter_class=HelpFormatter
        )
    return add_engine_and_server_args(parser)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to the top-level dispatcher."""
    parser = subparsers.add_parser(
        "serve",
        help="Serve a model over an OpenAI-compatible HTTP API.",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    make_parser(parser)
    parser.set_defaults(func=lambda args: run(args, parser))
    return parser


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Resolve the options (config file included) and run the server until SIGINT/SIGTERM."""
    try:
        args = resolve_args(args)
    except ConfigFileError as exc:
        if parser is None:
            raise
        parser.error(str(exc))
    from fastdeploy.entrypoints.openai.http_server import BindError, run_server

    try:
        asyncio.run(run_server(args))
    except KeyboardInterrupt:
        return 130
    except BindError as exc:
        print(f"fastdeploy serve: error: {exc.strerror}", file=sys.stderr)
        return 1
    return 0
