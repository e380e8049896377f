#!/usr/bin/env bash
# The one-GPU measurements the open issues still need (docs/benchmarks.md, sixteenth session), in one
# `run` call that carries [".gpu"]; each step's output goes to its own file under OUT and a failed step
# does not stop the others. About 10 minutes on an H200.
#   bash tools/gpu_pending.sh OUT
OUT=${1:?usage: tools/gpu_pending.sh OUT}
mkdir -p "$OUT"
source tools/gpu_env.sh
export PYTHONUNBUFFERED=1
MODEL=benchmarks/configs/llama-3.1-8b
# #20: the structured-output ratio (target 0.9), each fill twice in turn: the slices' one-thread fills
# (which keep the GIL) and xgrammar's threaded fill of all rows (which lets go of it); then the grammar
# work alone, with how much a mask being made slows plain Python beside it (loop_slowdown)
for fill in "" --threaded-fill "" --threaded-fill; do
    echo "fill=${fill:-slices} $(FD_STEP_TRACE=1 python3 benchmarks/structured_outputs.py --model $MODEL --load-format dummy \
        --tokenizer "$TOK" --max-model-len 2048 --json $fill 2>&1 | grep '^{')"
done > "$OUT/structured_outputs.jsonl"
for fill in "" --threaded-fill; do
    for switch_ms in 5 0.5; do  # how soon the mask threads get the GIL back from the loop's Python
        echo "fill=${fill:-slices} switch=$switch_ms $(python3 benchmarks/grammar_cost.py --tokenizer "$TOK" \
            --vocab-size 128256 --switch-interval-ms $switch_ms $fill 2>/dev/null | tail -n 1)"
    done
done > "$OUT/grammar_cost.jsonl"
# #18: the shared experts of ERNIE-4.5-21B-A3B beside the routed ones (FD_SIDE_STREAM) against one stream
for side in 0 1; do
    FD_SIDE_STREAM=$side python3 benchmarks/multi_gpu.py --sections moe --tp 1 --skip-one-gpu \
        --moe-model benchmarks/configs/ernie-4.5-21b-a3b --moe-quantizations none,ptpc_fp8 \
        --out "$OUT/ernie_side$side" > "$OUT/ernie_side$side.log" 2>&1
done
# #18: where a batch-1 FP8 decode step of the Qwen3-30B-A3B shape goes (3.3x its weight-read floor)
python3 -m benchmarks.gpubench.profile_decode benchmarks/configs/qwen3-30b-a3b --batch 1 --quantization ptpc_fp8 \
    --rows 40 > "$OUT/moe_batch1_profile.txt" 2>&1
cat "$OUT/structured_outputs.jsonl" "$OUT/grammar_cost.jsonl"
head -n 60 "$OUT/moe_batch1_profile.txt"
tail -n 6 "$OUT"/ernie_side*.log
