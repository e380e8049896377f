#!/usr/bin/env bash
# Builds .vllm/ (git-ignored): vLLM 0.25.1 for a side-by-side run on a device machine, whose image
# lacks it and which takes at most 64 MiB a call. The vllm wheel is unpacked and trimmed of what a
# Hopper (H100/H200) run does not load (FlashAttention 2, the Rust front end, SM100-only kernels,
# other Pythons' builds), the wheels of the runtime dependencies that neither the image nor .gpu/
# (tools/gpu_bundle.sh) holds are added, and the whole goes into one tar.xz cut into parts of 58 MiB:
# .vllm/part-aa, part-ab, ... and .vllm/MANIFEST (the tar's md5, each part's md5 and size).
# On the device machine, carry one part a call (with .vllm/MANIFEST, which is small, every time) and
# `source tools/vllm_env.sh` after tools/gpu_env.sh: it gathers the parts in /tmp/vllm-parts and,
# once all are there, installs into /tmp/vllm-site (run: python3 -m vllm.entrypoints.cli.main serve ...).
# Usage: tools/vllm_bundle.sh   (needs PyPI; about 250 MB downloaded, a few minutes of xz)
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM=0.25.1
grep -qx '/.vllm/' .git/info/exclude || echo '/.vllm/' >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/dl" "$work/site" "$work/wheels"
pyflags=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp)
platforms=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_31_x86_64 manylinux_2_35_x86_64)
allplat=(); for p in "${platforms[@]}"; do allplat+=(--platform "$p"); done

# 1. the vllm wheel (cp38-abi3, ~250 MB): the first platform tag, then more of them, until pip finds one
got=
for n in $(seq 1 ${#platforms[@]}); do
    plat=(); for p in "${platforms[@]:0:n}"; do plat+=(--platform "$p"); done
    if pip download -q "${pyflags[@]}" "${plat[@]}" -d "$work/dl" "vllm==$VLLM"; then got=1; break; fi
done
[ -n "$got" ] || { echo "no vllm==$VLLM wheel for ${platforms[*]}"; exit 1; }
whl=$(ls "$work"/dl/vllm-*.whl)
echo "wheel: $(basename "$whl") $(du -m "$whl" | cut -f1) MB"

# 2. unpack (unzip keeps the .so files' modes) and trim; the 25 largest files first, to see what weighs
unzip -q "$whl" -d "$work/site"
echo "25 largest files (bytes):"
(cd "$work/site" && find . -type f -printf '%s %P\n' | sort -rn | sed -n 1,25p)
before=$(du -sm "$work/site" | cut -f1)
# Each is dropped only if nothing a Hopper run imports needs it:
# - FlashAttention 2: imported under try/except (flash_attn_interface.py); on SM90 vLLM picks FA3
#   (fa_utils.get_flash_attn_version), FA2 only for ALiBi or a forced flash_attn_version=2;
# - vllm-rs: the Rust front end, started only with VLLM_USE_RUST_FRONTEND=1;
# - third_party/fmha_sm100: Blackwell-only attention of MiniMax M3, imported inside functions;
# - DeepGEMM's extension built for the other Pythons (the machine has 3.12);
# - stub files and docs.
drop=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/third_party/fmha_sm100
      vllm/third_party/deep_gemm/_C.cpython-3{10,11,13,14}-x86_64-linux-gnu.so)
echo "removed:"
for f in "${drop[@]}"; do
    [ -e "$work/site/$f" ] || { echo "  (not in the wheel: $f)"; continue; }
    echo "  $(du -sh "$work/site/$f" | cut -f1)	$f"
    rm -rf "${work:?}/site/$f"
done
(cd "$work/site" && find vllm \( -name '*.pyi' -o -name '*.md' \) -type f -printf '  %s B\t%p\n' -delete)
echo "vllm tree: $before MB -> $(du -sm "$work/site" | cut -f1) MB"
test -f "$work/site/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"   # (what Hopper runs on must stay)

# 3. runtime dependencies, without their dependencies: vllm's Requires-Dist (and theirs, in turn) less
# what the image or .gpu holds and less the GPU stacks that are either in the image (torch, triton,
# nvidia-*, cupy) or not wanted (flashinfer: VLLM_USE_FLASHINFER_SAMPLER=0; tilelang, quack-kernels,
# nvidia-cutlass-dsl, tokenspeed-mla, humming-kernels, torchcodec, PyNvVideoCodec: kernels vLLM imports
# only for models or options that need them). Left out too: anthropic (vllm 0.25.1 never imports it),
# mcp (only for --tool-server, and it brings a dozen more) and fastapi[standard]'s extras other than
# python-multipart (needed by the speech-to-text routes' Form()). Versions as resolved against vllm's pins.
pip download -q "${pyflags[@]}" "${allplat[@]}" -d "$work/wheels" \
    cachetools==8.0.2 blake3==1.0.11 cbor2==6.3.0 msgspec==0.22.0 pybase64==1.5.1 ijson==3.6.0 \
    setproctitle==1.3.8 watchfiles==1.3.0 python-json-logger==4.2.0 partial-json-parser==0.2.1.1.post7 \
    prometheus-fastapi-instrumentator==8.1.0 python-multipart==0.0.34 loguru==0.7.3 \
    compressed-tensors==0.17.0 depyf==0.20.0 astor==0.8.1 dill==0.4.1 \
    lm-format-enforcer==0.11.3 interegular==0.3.3 llguidance==1.7.6 outlines-core==0.2.14 \
    diskcache==5.6.3 lark==1.2.2 openai-harmony==0.0.8 \
    mistral-common==1.13.1 pydantic-extra-types==2.11.1 pycountry==26.2.16 \
    model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0 \
    opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
    opentelemetry-semantic-conventions-ai==0.5.1 opentelemetry-exporter-otlp==1.45.2 \
    opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
    opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-common==0.66b2 \
    opentelemetry-exporter-http-transport==0.66b2 opentelemetry-proto==1.45.2 \
    googleapis-common-protos==1.76.0 nvtx==0.2.15 fastsafetensors==0.5.0
# a check, for a later version bump: every requirement (vllm's, then the wheels') that is neither in
# the image (the device's KINDS.md list), nor in .gpu (tools/gpu_bundle.sh), nor left out on purpose,
# nor met by a wheel above, is printed
sed -n '/^pip download/,/^python/p' tools/gpu_bundle.sh | tr ' ' '\n' | grep -v '^-\|^\$\|^"\$\|\\' \
    | tr -d '"' | sed 's/[=<>].*//' > "$work/gpu_names"
python3 - "$work" <<'PY'
import glob, os, re, sys, zipfile
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as cn
from packaging.version import Version

work = sys.argv[1]
image = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython einops filelock flatbuffers fonttools frozenlist fsspec
grpcio h11 h5py hf-xet httpcore httpx huggingface-hub idna jinja2 joblib llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl ml-dtypes mpmath msgpack multidict networkx ninja numba numpy nvidia-ml-py onnx
opencv-python-headless packaging pandas pillow pip pluggy portalocker prometheus-client propcache protobuf psutil
pyarrow pybind11 py-cpuinfo pygments pyparsing python-dateutil pyyaml regex requests rich safetensors scipy
sentencepiece setuptools shellingham simplejson six sympy tabulate threadpoolctl tiktoken tokenizers torch
torchaudio torchvision tqdm transformers triton typer typing-extensions typing-inspect urllib3 uvloop werkzeug
wheel wrapt xxhash yarl zipp""".split()
gpu = open(f"{work}/gpu_names").read().split()
covered = {cn(n) for n in image + gpu}
skip = re.compile(r"^(torch.*|triton|flashinfer.*|nvidia-.*|cupy.*|ray|xformers|tilelang|quack-kernels|"
                  r"tokenspeed-mla|humming-kernels|pynvvideocodec|apache-tvm-ffi|anthropic|mcp)$")
env = dict(python_version="3.12", python_full_version="3.12.3", platform_machine="x86_64", sys_platform="linux",
           platform_system="Linux", os_name="posix", implementation_name="cpython",
           platform_python_implementation="CPython", extra="")

def requires(whl):
    z = zipfile.ZipFile(whl)
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1])
            if not r.marker or r.marker.evaluate(env):
                yield r

def versions(pattern):
    return {cn(os.path.basename(w).split("-")[0]): (Version(os.path.basename(w).split("-")[1]), w)
            for w in glob.glob(pattern)}

wheels, in_gpu = versions(f"{work}/wheels/*.whl"), versions(".gpu/whl/*.whl")
gaps, notes = [], []
for src in glob.glob(f"{work}/dl/vllm-*.whl") + [w for _, w in wheels.values()]:
    for r in requires(src):
        n, who = cn(r.name), os.path.basename(src).split("-")[0]
        if n in in_gpu and not r.specifier.contains(in_gpu[n][0], prereleases=True):
            notes.append(f"{who} asks {r}, .gpu has {in_gpu[n][0]}")
        if n in covered or skip.match(n):
            continue
        if n not in wheels or not r.specifier.contains(wheels[n][0], prereleases=True):
            gaps.append(f"{who} needs {r}")
print(f"{len(wheels)} dependency wheels; requirements not met: {len(gaps)}")
for g in gaps:
    print("  " + g)
for g in notes:
    print("  (version only, kept as .gpu has it) " + g)
PY
(cd "$work/wheels" && du -ch -- *.whl | tail -1 | sed 's/total/dependency wheels in all/')

# 4. one tar.xz (xz: FA3's library shrinks to a quarter of its gzip size), cut into 58 MiB parts
tar -C "$work" -cf - site wheels | xz -T0 -6 > "$work/vllm.tar.xz"
rm -rf .vllm && mkdir .vllm
split -b 58M "$work/vllm.tar.xz" .vllm/part-
{
    echo "# vllm $VLLM for a Hopper device machine, made by tools/vllm_bundle.sh on $(date -u +%F)"
    echo "md5 $(md5sum < "$work/vllm.tar.xz" | cut -d' ' -f1) $(stat -c %s "$work/vllm.tar.xz")"
    for p in .vllm/part-*; do echo "$(basename "$p") $(md5sum < "$p" | cut -d' ' -f1) $(stat -c %s "$p")"; done
} > .vllm/MANIFEST
cat .vllm/MANIFEST
ls -l .vllm/part-* | awk '{printf "%s %.1f MiB\n", $NF, $5 / 1048576}'
