"""``fastdeploy run-batch``: run a file of OpenAI Batch API requests offline (as ``vllm run-batch``).

The runner itself is :mod:`fastdeploy.entrypoints.openai.run_batch`; this module is its command
line: the input and output files, and every engine and server flag of ``fastdeploy serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from fastdeploy.entrypoints.cli.args import ConfigFileError, add_engine_and_server_args, resolve_args
from fastdeploy.entrypoints.cli.serve import (
    HelpFormatter,
    check_backend,
    check_chat_template,
    check_generation_config,
    check_model_path,
    check_reasoning_parser,
    check_tool_call_parser,
)

DESCRIPTION = """\
Run a file of OpenAI Batch API requests (one JSON object a line: custom_id, method POST,
url /v1/chat/completions, /v1/completions, /v1/embeddings or /v1/responses, and body) through
the engine, and write OpenAI's batch output lines (custom_id, response.status_code,
response.body), in the input's order. The file is checked whole before the model loads. The
other flags are those of `fastdeploy serve`.
"""


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``run-batch`` subcommand to the top-level dispatcher."""
    parser = subparsers.add_parser(
        "run-batch",
        help="Run a file of OpenAI Batch API requests offline.",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    files = parser.add_argument_group("batch files")
    files.add_argument(
        "-i", "--input-file", required=True, help="the batch input file (JSONL; - for standard input)"
    )
    files.add_argument(
        "-o", "--output-file", required=True, help="where the output goes (JSONL; - for standard output)"
    )
    add_engine_and_server_args(parser)
    parser.set_defaults(func=lambda args: run(args, parser))
    return parser


def check_output_file(path: str) -> str | None:
    """Why the output cannot be written there (no such folder, or a folder given), or None."""
    if path == "-":
        return None
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"argument --output-file: {path!r} is a folder"
    if not os.path.isdir(folder):
        return f"argument --output-file: the folder {folder!r} does not exist"
    return None


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Check the files and options, then run the batch. Returns 2 for a bad option or input file
    (nothing loaded), 1 when some request failed on the server's side (a 5xx: the engine died),
    else 0 (requests the API refused with a 4xx are lines of the output, not failures)."""
    from fastdeploy.entrypoints.openai.run_batch import BatchFileError, parse_batch_file, read_input

    try:
        args = resolve_args(args)
    except ConfigFileError as exc:
        if parser is None:
            raise
        parser.error(str(exc))
    problem = (
        check_output_file(args.output_file)
        or check_model_path(args)
        or check_chat_template(args)
        or check_generation_config(args)
        or check_reasoning_parser(args)
        or check_tool_call_parser(args)
        or check_backend(args)
    )
    if problem is None:
        try:
            requests = parse_batch_file(read_input(args.input_file))
        except OSError as exc:
            problem = f"argument --input-file: {exc}"
        except BatchFileError as exc:
            problem = f"{args.input_file}: {exc}"
    if problem is not None:
        print(f"fastdeploy run-batch: error: {problem}", file=sys.stderr)
        return 2
    return asyncio.run(_run_batch(args, requests))


async def _run_batch(args: argparse.Namespace, requests: list[Any]) -> int:
    """Start the engine, run ``requests`` through the server's app, write the output, shut down."""
    from fastdeploy.engine.ipc import STOP_SIGNALS
    from fastdeploy.entrypoints.cli.args import engine_config_from_args, server_config_from_args
    from fastdeploy.entrypoints.openai.api_server import build_app
    from fastdeploy.entrypoints.openai.http_server import (
        default_served_model_names,
        start_engine,
        stop_served,
    )
    from fastdeploy.entrypoints.openai.run_batch import run_batch

    config = engine_config_from_args(args)
    engine: Any = None
    app: Any = None
    try:
        engine = await start_engine(config)
        app = build_app(engine, default_served_model_names(config), server_config_from_args(args))
        results = await run_batch(app, requests, args.output_file)
    finally:
        with STOP_SIGNALS.shielded():
            stop_served(app, engine)
    refused = sum(1 for r in results if 400 <= r.status_code < 500)
    failed = sum(1 for r in results if r.status_code >= 500)
    print(
        f"fastdeploy run-batch: {len(results)} requests: {len(results) - refused - failed} answered, "
        f"{refused} refused (4xx), {failed} failed (5xx); output in {args.output_file}",
        file=sys.stderr,
    )
    return 1 if failed else 0
