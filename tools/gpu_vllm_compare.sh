#!/usr/bin/env bash
# Issue #19's side by side on one GPU: `fastdeploy serve` or `vllm serve` on the dummy Llama-3.1-8B,
# driven by both clients (`vllm bench serve`, `fastdeploy bench serve`) on the burst, c1, Poisson
# and chat workloads (benchmarks/serving_compare.py). One server a call (each takes 5-7 minutes:
# every `vllm bench serve` run imports vLLM, ~20 s), so that neither is cut by the 10-minute limit.
# vLLM must be installed by tools/vllm_env.sh first (its parts carried one a call in a warm lease:
# see tools/vllm_bundle.sh); without it our server runs under our client only. The outputs go to
# OUT/SERVER.tgz (the device tool returns at most 8 files a call), the summaries to stdout.
#   bash tools/gpu_vllm_compare.sh OUT fastdeploy|vllm [--rate R] [--workloads W,W,...] [-- extra flags of our server]
# (a workload named twice runs twice: --workloads burst,burst,poisson,poisson for the targets' repeats)
OUT=${1:?usage: tools/gpu_vllm_compare.sh OUT fastdeploy|vllm [--rate R] [-- flags of our server]}
SERVER=${2:?usage: tools/gpu_vllm_compare.sh OUT fastdeploy|vllm [--rate R] [-- flags of our server]}
shift 2
RATE=29.5
if [ "$1" = --rate ]; then RATE=$2; shift 2; fi
WORKLOADS=burst,c1,poisson,chat
if [ "$1" = --workloads ]; then WORKLOADS=$2; shift 2; fi
[ "$1" = -- ] && shift
mkdir -p "$OUT"
source tools/gpu_env.sh > /dev/null 2>&1
source tools/vllm_env.sh
export PYTHONUNBUFFERED=1
MODEL=benchmarks/configs/llama-3.1-8b
W=/tmp/gpu_vllm_compare/$SERVER
rm -rf "$W" && mkdir -p "$W"
clients=fastdeploy
python3 -c "import vllm.entrypoints.cli.benchmark.main" 2> /dev/null && clients=vllm,fastdeploy
if [ "$SERVER" = vllm ] && [ "$clients" = fastdeploy ]; then
    echo "vllm is not installed: nothing to run"
    exit 0
fi
extra=()
[ "$SERVER" = fastdeploy ] && [ $# -gt 0 ] && extra=(-- "$@")
timeout 560 python3 benchmarks/serving_compare.py --server "$SERVER" --model $MODEL --tokenizer "$TOK" \
    --out "$W/cmp" --clients $clients --workloads "$WORKLOADS" --rate "$RATE" "${extra[@]}" \
    > "$W/$SERVER.log" 2>&1
grep '^{' "$W/$SERVER.log" | cut -c1-400
tar czf "$OUT/$SERVER.tgz" -C /tmp/gpu_vllm_compare "$SERVER"
