#!/usr/bin/env bash
# Builds .gpu/ (git-ignored, < 64 MiB): what a device machine's image lacks, for `run` calls that
# carry [".gpu"]. .gpu/whl: the Python 3.12 manylinux wheels of the server's dependencies, without
# their dependencies (torch, triton and the CUDA libraries come with the image); .gpu/tok: the
# default model's tokenizer as Hugging Face files (the benchmarks' TOK). On the device machine,
# `source tools/gpu_env.sh` installs and sets them up. Usage: tools/gpu_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/whl
platforms=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform any)
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .gpu/whl \
    fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions \
    uvicorn h11 httptools uvloop orjson pyzmq msgpack gguf prometheus-client python-multipart \
    httpx httpcore anyio idna certifi jsonschema jsonschema-specifications referencing rpds-py attrs \
    "xgrammar==0.2.8" "llguidance==1.9.1" apache-tvm-ffi opentelemetry-api openai httpx2 sniffio distro jiter psutil bce-python-sdk pycryptodome future six pytest iniconfig
python - <<'PY'
from fastdeploy.config import ModelConfig
from fastdeploy.model_executor.model_loader import load_tokenizer, resolve_model

config = ModelConfig()
load_tokenizer(config, resolve_model(config)).save_pretrained(".gpu/tok")
PY
du -sh .gpu
