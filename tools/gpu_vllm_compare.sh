#!/usr/bin/env bash
# Issue #19's side by side on one GPU: `fastdeploy serve` and `vllm serve` on the dummy Llama-3.1-8B,
# each driven by both clients (`vllm bench serve`, `fastdeploy bench serve`) on the burst, c1,
# Poisson and chat workloads (benchmarks/serving_compare.py). vLLM must be installed by
# tools/vllm_env.sh first (its parts carried one a call in a warm lease: see tools/vllm_bundle.sh);
# without it only our server runs. About 8 minutes on an H200.
#   bash tools/gpu_vllm_compare.sh OUT [extra flags for our server, e.g. --cuda-graph-max-tokens 512]
OUT=${1:?usage: tools/gpu_vllm_compare.sh OUT [extra flags of our server]}
shift
mkdir -p "$OUT"
source tools/gpu_env.sh > /dev/null 2>&1
source tools/vllm_env.sh
export PYTHONUNBUFFERED=1
MODEL=benchmarks/configs/llama-3.1-8b
clients=fastdeploy
python3 -c "import vllm.entrypoints.cli.benchmark.main" 2> /dev/null && clients=vllm,fastdeploy
timeout 250 python3 benchmarks/serving_compare.py --server fastdeploy --model $MODEL --tokenizer "$TOK" \
    --out "$OUT/cmp" --clients $clients --workloads burst,c1,poisson,chat -- "$@" > "$OUT/fastdeploy.log" 2>&1
grep '^| fastdeploy' "$OUT/fastdeploy.log"
rate=$(grep -o 'poisson rate: [0-9.]*' "$OUT/fastdeploy.log" | awk '{print $3}')
if [ "$clients" = vllm,fastdeploy ]; then
    timeout 330 python3 benchmarks/serving_compare.py --server vllm --model $MODEL --tokenizer "$TOK" \
        --out "$OUT/cmp" --workloads burst,c1,poisson,chat --rate "${rate:-29}" > "$OUT/vllm.log" 2>&1
    grep '^{' "$OUT/vllm.log" | cut -c1-400
else
    echo "vllm is not installed: our server only"
fi
