"""Grammar compile time of the structured-output benchmark's schemas, through the engine core's
``StructuredOutputManager`` (its compile threads and xgrammar's cache), without a model run.

Every schema is distinct (benchmarks/structured_outputs.py's ``make_schema``); all are submitted at
once, as the benchmark's requests arrive. ``FD_XGRAMMAR_CACHE_MB=0`` compiles without xgrammar's
cache (each schema from scratch), ``FD_GRAMMAR_COMPILE_THREADS`` sets the threads.

Examples:
    python benchmarks/grammar_compile.py                                   # the default model's tokenizer
    python benchmarks/grammar_compile.py --tokenizer TOK --vocab-size 128256   # the 8B shape
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from structured_outputs import make_schema  # noqa: E402

from fastdeploy import envs  # noqa: E402
from fastdeploy.core.sampling_params import StructuredOutputsParams  # noqa: E402
from fastdeploy.structured_output.manager import StructuredOutputManager  # noqa: E402


def load_tokenizer(path: str | None):
    """``path``'s tokenizer, or the embedded default model's."""
    if path:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    from fastdeploy.model_executor.model_loader.default_model import default_model_path
    from fastdeploy.model_executor.model_loader.gguf_loader import load_gguf_tokenizer

    return load_gguf_tokenizer(default_model_path())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder; default: the embedded SmolLM2")
    parser.add_argument("--vocab-size", type=int, default=None, help="the model's vocabulary (logits' width)")
    parser.add_argument("--num-schemas", type=int, default=128)
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.tokenizer)
    vocab = args.vocab_size or len(tokenizer)
    manager = StructuredOutputManager(lambda: tokenizer, vocab, [tokenizer.eos_token_id])
    try:
        manager.compiler()  # the tokenizer info, built once per engine: not part of a compile
        warm = manager.submit(StructuredOutputsParams(json_object=True))
        warm.result()
        start = time.perf_counter()
        futures = [
            manager.submit(StructuredOutputsParams(json=make_schema(2 * i))) for i in range(args.num_schemas)
        ]
        done = []
        for future in futures:
            future.result()
            done.append(time.perf_counter() - start)
        total = time.perf_counter() - start
    finally:
        manager.shutdown()
    result = {
        "num_schemas": args.num_schemas,
        "vocab_size": vocab,
        "compile_threads": envs.FD_GRAMMAR_COMPILE_THREADS,
        "xgrammar_cache_mb": envs.FD_XGRAMMAR_CACHE_MB,
        "all_compiled_s": round(total, 3),
        "ms_per_schema": round(total / args.num_schemas * 1000, 2),
        "median_ready_ms": round(sorted(done)[len(done) // 2] * 1000, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
