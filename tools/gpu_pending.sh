#!/usr/bin/env bash
# The one-GPU measurements the open issues still need (docs/benchmarks.md, fifteenth session: what
# was built after its lease), in one `run` call that carries [".gpu"]; each step's output goes to
# its own file under OUT and a failed step does not stop the others. About 8 minutes on an H200.
#   bash tools/gpu_pending.sh OUT
OUT=${1:?usage: tools/gpu_pending.sh OUT}
mkdir -p "$OUT"
source tools/gpu_env.sh
export PYTHONUNBUFFERED=1
MODEL=benchmarks/configs/llama-3.1-8b
# #20: the grammar rows' advance and fill per slice thread count, then the structured-output ratio
for threads in 1 2 4 8; do
    FD_GRAMMAR_COMPILE_THREADS=$threads python3 benchmarks/grammar_cost.py --tokenizer "$TOK" --vocab-size 128256
done > "$OUT/grammar_cost.jsonl" 2> "$OUT/grammar_cost.err"
FD_STEP_TRACE=1 python3 benchmarks/structured_outputs.py --model $MODEL --load-format dummy --tokenizer "$TOK" \
    --max-model-len 2048 --json > "$OUT/structured_outputs.log" 2>&1
# #18: the MoE layer (the expert sort's chunks) and the offline FP8 / bf16 figures
python3 -m benchmarks.gpubench.moe_bench --out "$OUT/moe_bench" --dtypes ptpc_fp8,bf16 \
    --tokens 1,16,256,2048,8192 > "$OUT/moe_bench.log" 2>&1
python3 benchmarks/multi_gpu.py --sections moe --tp 1 --skip-one-gpu --moe-quantizations ptpc_fp8,none \
    --out "$OUT/moe_offline" > "$OUT/moe_offline.log" 2>&1
grep -h '^{' "$OUT/structured_outputs.log"
tail -n 4 "$OUT/grammar_cost.jsonl" "$OUT/moe_offline.log"
