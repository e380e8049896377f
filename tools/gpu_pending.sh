#!/usr/bin/env bash
# The one-GPU measurements the open issues still need (docs/benchmarks.md, seventeenth session), in
# `run` calls that carry [".gpu"]; each step's output goes to its own file under OUT and a failed step
# does not stop the others. Sections (all by default; ~5, ~4 and ~2 minutes on an H200, so two calls):
#   bash tools/gpu_pending.sh OUT [graphs] [structured] [moe]
OUT=${1:?usage: tools/gpu_pending.sh OUT [graphs] [structured] [moe]}
shift
sections=${*:-graphs structured moe}
mkdir -p "$OUT"
source tools/gpu_env.sh
export PYTHONUNBUFFERED=1
MODEL=benchmarks/configs/llama-3.1-8b

# #19: the mixed-step graphs (--cuda-graph-max-tokens, off by default until this says they pay)
graphs() {
    # 1. the same greedy tokens as eager small steps, the decode graphs' tests beside them, and the
    #    routing kernels' tests on the GPU (the fused router's cross-program handoff is new)
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/worker/test_mixed_graphs.py \
        tests/worker/test_cuda_graphs.py tests/ops/test_triton_moe_routing.py > "$OUT/gpu_tests.log" 2>&1
    tail -n 3 "$OUT/gpu_tests.log"
    # 2. a lone 512-token prefill: wall against kernels, eager and replayed
    for tokens in 0 512; do
        timeout 120 python3 -m benchmarks.gpubench.profile_prefill $MODEL --prompt-len 512 --runs 20 --rows 0 \
            --cuda-graph-max-tokens $tokens 2>&1 | grep "^prompt" | sed "s/^/cuda_graph_max_tokens=$tokens /"
    done | tee "$OUT/prefill.txt"
    # 3. served: concurrency 1, the Poisson load and the burst, our client, without and with
    for tokens in 0 512; do
        timeout 200 python3 benchmarks/serving_compare.py --server fastdeploy --model $MODEL --tokenizer "$TOK" \
            --out "$OUT/cmp$tokens" --clients fastdeploy --workloads c1,poisson,burst --rate 30 \
            -- --cuda-graph-max-tokens $tokens > "$OUT/cmp$tokens.log" 2>&1
        grep '^| fastdeploy' "$OUT/cmp$tokens.log" | sed "s/^/cuda_graph_max_tokens=$tokens /"
    done
}

# #20: the structured-output ratio with torch's CPU thread pool as it is and cut to one thread (its
# threads spin after each parallel op and may take the cores the grammar threads need)
structured() {
    for omp in "" 1 "" 1; do
        echo "OMP_NUM_THREADS=${omp:-default} $(env ${omp:+OMP_NUM_THREADS=$omp} FD_STEP_TRACE=1 timeout 150 \
            python3 benchmarks/structured_outputs.py --model $MODEL --load-format dummy --tokenizer "$TOK" \
            --max-model-len 2048 --json 2> "$OUT/so_err.log" | grep '^{')"
    done | tee "$OUT/structured_outputs.jsonl"
}

# #18: a batch-1 FP8 decode step of the Qwen3-30B-A3B shape, the router's linear and top-k apart and
# fused (FD_MOE_FUSED_ROUTER_MAX_TOKENS, off by default until this says it pays)
moe() {
    for fused in 0 4; do
        FD_MOE_FUSED_ROUTER_MAX_TOKENS=$fused timeout 120 python3 -m benchmarks.gpubench.profile_decode \
            benchmarks/configs/qwen3-30b-a3b --batch 1 --quantization ptpc_fp8 --rows 16 > "$OUT/moe_b1_router$fused.txt" 2>&1
        echo "fused router max tokens $fused: $(grep '^batch 1' "$OUT/moe_b1_router$fused.txt")"
        grep -E "_router_topk|_topk_softmax|_small_m_linear" "$OUT/moe_b1_router$fused.txt" | cut -c1-60,100-150
    done
}

for section in $sections; do
    echo "== $section"
    $section
done
