#!/usr/bin/env bash
# The one-GPU measurements the open issues still need (docs/benchmarks.md, eighteenth session), in
# `run` calls that carry [".gpu"]. Each section works in /tmp/gpu_pending/SECTION and leaves one
# tarball, OUT/SECTION.tgz (the device tool returns at most 8 files a call); its summary lines go to
# stdout. A failed step does not stop the others. Sections (all by default; minutes on an H200):
#   poisson (~5)  the Poisson load with --cuda-graph-max-tokens 512 (the default) and 1024 (its
#                 ~600-token steps, a prompt beside the decodes, replayed too), and which forward
#                 paths its steps took (the worker's forward-stats log lines, every 5 s)
#   budget (~4)   the burst with --max-num-batched-tokens 4096, 6144, 8192: throughput against the
#                 longest inter-token gaps (the prefill steps)
#   prefill (~2)  one 8,192-token prefill step (16 prompts of 512): wall, kernels, kernel table
#   structured (~5) the structured-output ratio without and with 8 grammar processes, alternated,
#                 two pairs, each also with its grammars compiled (--repeat-structured)
#   structured_threads (~6) the compile threads (FD_GRAMMAR_COMPILE_THREADS 8 / 1 / 2), alternated
#   structured_gil (~6) Python's switch interval 5 / 0.5 ms, and 8 grammar processes, alternated
#   structured_default (~7) the default (auto: 8 grammar processes here) 4 runs against threads 2
#   structured_guidance (~6) threads with llguidance (the auto backend) against the processes
#   first_burst (~2) the host profile of the first step of three bursts of 256 short prompts
#   structured_nice (~7) the compiles at a lower CPU priority or not (FD_GRAMMAR_COMPILE_NICE 0 / 10),
#                 xgrammar's cache primed or not (FD_GRAMMAR_PRIME_LENGTH 128 / 0)
#   tests (~8)    the GPU tests (one pytest a file, all at once; the two GEMV files compile many
#                 kernels: 150 s was too short beside the others), then whether a thrown TORCH_CHECK
#                 still crashes there (it does under every flag: the tests that throw skip on a GPU)
#   moe_e2e (~6) the whole Qwen3-30B-A3B shape offline in FP8, Triton experts against the grouped mm
#   moe_budget (~5) the same run with a token budget of 8,192 (as above), 16,384 and 32,768
#   moe_prefill (~3) one 8,192-token prefill step of that shape: wall, kernels, kernel table
#   moe_phases (~4) the same FP8 run's step times by phase and a decode window's kernels
#   moe_vllm (~5) vLLM's FP8 run of that shape the same way (vLLM carried and installed first)
#   moe_fair (~6) ours, FP8 and bf16 (MOE_FAIR_QUANTS picks), with the run's routing spread (moe_load_imbalance)
#   offline_ratio (~2) #19's online / offline throughput of our engine on the burst (serving_breakdown.py)
#   fp8_channel (~8) the per-channel FP8 linears at 32-1,024 rows: row-wise _scaled_mm against the Triton
#                 per-channel GEMM, and that GEMM's tile sweep
#   gemv_sweep (~8) the batch-1 qkv / o FP8 GEMV's configurations (long loads, 8 warps among them)
#   moe_router (~4) the batch-1 FP8 decode step, the MoE router split-K (FD_MOE_ROUTER_SPLIT) or not
#   moe_split (~5) the MoE layer's two grouped GEMMs tuned apart at 256 and 8,192 tokens (FP8 per channel)
#   moe_vllm_fair (~7) vLLM's bar runs with uniform simulated routing (FP8, bf16), and FP8 as before
#   moe_fusions (~4) the batch-1 FP8 / bf16 step with the norm inside the router (FD_MOE_ROUTER_NORM_FUSION)
#                 off / on
#   moe_tma (~5)  the expert weights through TMA descriptors (FD_MOE_TMA_WEIGHTS) or pointer loads: its
#                 test on the GPU, then the MoE layer at 256 and 8,192 tokens, FP8 per channel and bf16
#   moe_pdl (~4)  the kernels that now take programmatic dependent launch (FP8 quantization, the per-channel
#                 FP8 GEMM, the MoE's SiLU + quantization and top-k sum) and the expert sort (one program up
#                 to 256 pairs, atomics beyond) on the GPU: their test files, then the MoE layer at 256 / 8,192
#                 tokens; then the offline runs: moe_fair (and moe_vllm_fair beside it)
#   moe_ranks (~3) the pairs' ranks taken by the routing kernel (FD_MOE_RANKS_IN_ROUTER) and the layout
#                 kernel placing a decode batch's pairs: their GPU tests, then the MoE layer at 256 / 8,192 FP8
#                 tokens with the ranks in the router off / on
#   decode256 (~4) a batch-256 FP8 decode step (profile_decode, 32-token prompts): as it is, with the ranks in the
#                 router (FD_MOE_RANKS_IN_ROUTER=1), and with that and the w8a16 dot form for the linears of
#                 up to 256 rows (FD_FP8_SMALL_M_MAX=256: no activation quantization before qkv / o)
#   attn_prefill (~6) the attention kernels' GPU tests (SPLIT_INTERIOR among them), the unified kernel's tiles
#                 on prefill shapes (16 x 512 causal, Qwen3-30B-A3B's 32/4 and Llama-8B's 32/8 heads; 4 x 2,048)
#                 with and without the unmasked interior tiles (and longest query blocks first), and the decode
#                 kernel's choice with and without those tiles
#   moe_persistent_sweep (~4) the grouped GEMM's tile candidates on the persistent grid at 8,192 tokens (FP8)
#   moe (~6)      a batch-1 FP8 and bf16 decode step of the Qwen3-30B-A3B shape, kernel table;
#                 the experts' GEMV configuration sweep at one token
#   bash tools/gpu_pending.sh OUT [section ...]
# Run it without `| tail` in the `run` call: a call stopped at its time limit returns only what it
# already printed (twice in the twentieth session a tail held back every line of a 600 s call).
OUT=${1:?usage: tools/gpu_pending.sh OUT [structured_nice] [structured_threads] [structured_gil] [structured_default] [structured_guidance] [first_burst] [structured] [tests] [moe_e2e] [moe_budget] [moe_prefill] [moe_phases] [moe_vllm] [moe_fair] [moe_split] [fp8_channel] [moe_router] [gemv_sweep] [moe_vllm_fair] [moe_fusions] [moe_tma] [moe_pdl] [moe_ranks] [decode256] [attn_prefill] [moe_persistent_sweep] [offline_ratio] [poisson] [prefill] [moe] [budget]}
shift
sections=${*:-structured_nice tests moe_e2e poisson prefill moe budget}
mkdir -p "$OUT"
source tools/gpu_env.sh
source tools/vllm_env.sh  # keeps the .vllm parts a call carries for a later gpu_vllm_compare.sh call
export PYTHONUNBUFFERED=1
MODEL=benchmarks/configs/llama-3.1-8b

serve() {  # serve NAME WORKLOADS [our server's flags]: our server and client, summary rows to stdout
    local name=$1 workloads=$2
    shift 2
    timeout 200 python3 benchmarks/serving_compare.py --server fastdeploy --model $MODEL --tokenizer "$TOK" \
        --out "$W/$name" --clients fastdeploy --workloads "$workloads" --rate 30 -- "$@" > "$W/$name.log" 2>&1
    grep '^| fastdeploy' "$W/$name.log" | sed "s/^/$name /"
    grep -h "forward passes since start" "$W/$name"/*server*.log 2>/dev/null | tail -n 1 | sed "s/^/$name /"
}

# #19: the Poisson load's steps (a 512-token prompt beside ~100 decodes) as graphs too
poisson() {
    for tokens in 512 1024 512 1024; do
        FD_FORWARD_STATS_LOG_S=5 serve "poisson$tokens" poisson,c1 --cuda-graph-max-tokens $tokens
    done
}

# #19: the burst's P99 inter-token latency is its prefill steps' length; the budget sets it
budget() {
    for budget in 4096 6144 8192; do
        serve "budget$budget" burst --max-num-batched-tokens $budget
    done
}

# #18: the whole Qwen3-30B-A3B shape offline in per-channel FP8 (batch-1 ITL, 256 x 512/256 output
# tok/s, 11,308 in the sixteenth session), the experts of large steps on Triton or on torch's grouped mm
moe_e2e() {
    for mm in 0 1024; do
        FD_MOE_GROUPED_MM_MIN_TOKENS=$mm timeout 280 python3 benchmarks/multi_gpu.py --sections moe --tp 1 \
            --moe-quantizations ptpc_fp8 --out "$W/moe_e2e$mm" > "$W/moe_e2e$mm.log" 2>&1
        echo "grouped mm from $mm tokens: $(grep -o "'batch1_[a-z_]*': [0-9.]*\|'output_tok_per_s': [0-9.]*" \
            "$W/moe_e2e$mm.log" | tr '\n' ' ')"
    done
}

# #18: the FP8 throughput run's token budget: 8,192 (multi_gpu.py's, the 11,517 tok/s above) against
# 16,384 and 32,768 (more tokens per expert in a prefill step: the grouped GEMM runs at a higher rate)
moe_budget() {
    for budget in 16384 8192 32768; do
        timeout 190 python3 benchmarks/multi_gpu.py --sections moe --tp 1 --moe-quantizations ptpc_fp8 \
            --max-num-batched-tokens $budget --out "$W/moe_budget$budget" > "$W/moe_budget$budget.log" 2>&1
        echo "budget $budget: $(grep -o "'batch1_itl_ms_mean': [0-9.]*\|'output_tok_per_s': [0-9.]*" \
            "$W/moe_budget$budget.log" | tr '\n' ' ')"
    done
}

# #18: one 8,192-token prefill step of the FP8 Qwen3-30B-A3B shape (16 prompts of 512): its kernels
# (the throughput run's prefill steps take ~2x their FLOPs at the grouped GEMM's measured rate)
moe_prefill() {
    timeout 250 python3 -m benchmarks.gpubench.profile_prefill benchmarks/configs/qwen3-30b-a3b \
        --quantization ptpc_fp8 --prompt-len 512 --batch 16 --runs 10 --rows 30 > "$W/moe_prefill.txt" 2>&1
    grep "^prompt" "$W/moe_prefill.txt"
    grep -A 32 "Name" "$W/moe_prefill.txt" | cut -c1-60,100-190
}

# #18: where the FP8 throughput run's time goes (11,308 tok/s against the 17,194 target): step times
# by phase (prefill-carrying against decode-only steps) and a decode window's kernels at batch 256
moe_phases() {
    timeout 400 python3 -m benchmarks.gpubench.profile_throughput benchmarks/configs/qwen3-30b-a3b \
        --quantization ptpc_fp8 --max-num-batched-tokens 8192 > "$W/moe_phases.txt" 2>&1
    grep -v "^WARNING" "$W/moe_phases.txt" | tail -n 40
}

# #18: vLLM's FP8 run of the same shape step by step (its decode step at batch 256 kernel by kernel, to
# set beside moe_phases'): needs vLLM installed by earlier calls of this lease (tools/vllm_env.sh)
moe_vllm() {
    [ -f /tmp/vllm-site/.installed ] || { echo "vllm is not installed on this machine yet"; return; }
    timeout 400 python3 benchmarks/vllm_offline.py --model benchmarks/configs/qwen3-30b-a3b --tokenizer "$TOK" \
        --quantization fp8 --max-num-batched-tokens 8192 --profile-window 100 > "$W/vllm_moe_phases.txt" 2>&1
    grep -v "WARNING\|INFO" "$W/vllm_moe_phases.txt" | tail -n 40
}

# #18: ours in FP8 and bf16 (batch-1 ITL, 256 x 512/256 tok/s) with the routing spread of the run's
# end (moe_load_imbalance: ~1 uniform, up to 16 when every token picks the same 8 of 128 experts)
moe_fair() {
    timeout 420 python3 benchmarks/multi_gpu.py --sections moe --tp 1 --moe-quantizations ${MOE_FAIR_QUANTS:-ptpc_fp8,none} \
        --out "$W/moe_fair" > "$W/moe_fair.log" 2>&1
    grep -o "'quantization': [^,]*\|'batch1_itl_ms_mean': [0-9.]*\|'output_tok_per_s': [0-9.]*\|'moe_load_imbalance': [^,}]*\|'max_num_batched_tokens': [0-9]*" \
        "$W/moe_fair.log" | tr '\n' ' '
    echo
}

# #18: the MoE layer's two grouped GEMMs tuned apart (down's K = 768 is a short loop) at the decode
# batch and a prefill step, FP8 per channel (the twenty-fourth session: down's best was the shared table's)
moe_split() {
    timeout 500 python3 -m benchmarks.gpubench.moe_bench --out "$W/moe_split" --sweep-split --tokens 256,8192 \
        --dtypes ptpc_fp8 > "$W/moe_split.log" 2>&1
    grep "|" "$W/moe_split/results.md" | tail -n 2
}

# #18: the per-channel FP8 linears of a decode batch (qkv, o of Qwen3-30B-A3B at 32-512 rows):
# row-wise torch._scaled_mm (the default) against the Triton per-channel GEMM, then that GEMM's tiles
# (FD_FP8_CHANNEL_TRITON_MAX_M and CHANNEL_CONFIGS come from these)
fp8_channel() {
    local shapes=qwen3_30b_a3b.qkv,qwen3_30b_a3b.o
    timeout 200 python3 -m benchmarks.gpubench.fp8_gemm_bench --out "$W/fp8" --shapes $shapes \
        --rows 32,64,128,256,512,1024 > "$W/fp8.log" 2>&1
    grep -E "^### |^\| M|^\| [0-9]" "$W/fp8/fp8_gemm.md" | cut -c1-400
    timeout 360 python3 -m benchmarks.gpubench.fp8_gemm_bench --out "$W/fp8_sweep" --shapes $shapes \
        --sweep gemm-channel > "$W/fp8_sweep.log" 2>&1
    grep "|" "$W/fp8_sweep/fp8_gemm.md"
}

# #18: the batch-1 qkv / o FP8 GEMVs (2 x 8.1 us a layer in the twenty-fifth session, ~1.4 TB/s): the
# GEMV's configurations swept at 1-16 rows, the long-load 8-warp candidates among them
gemv_sweep() {
    timeout 500 python3 -m benchmarks.gpubench.fp8_gemm_bench --out "$W/gemv" --shapes qwen3_30b_a3b.qkv,qwen3_30b_a3b.o \
        --sweep gemv > "$W/gemv.log" 2>&1
    grep "|" "$W/gemv/fp8_gemm.md" | head -n 14
}

# #18: the batch-1 FP8 decode step with the MoE router as split-K partials summed by the top-k kernel
# (FD_MOE_ROUTER_SPLIT=1) against the small-M GEMV (0), alternated; the router's kernels by name
moe_router() {
    for split in 0 1 0 1; do
        FD_MOE_ROUTER_SPLIT=$split timeout 150 python3 -m benchmarks.gpubench.profile_decode \
            benchmarks/configs/qwen3-30b-a3b --batch 1 --quantization ptpc_fp8 --rows 16 > "$W/b1_$split.txt" 2>&1
        echo "FD_MOE_ROUTER_SPLIT=$split: $(grep '^batch 1' "$W/b1_$split.txt")"
        grep -E "router|topk|small_m_linear" "$W/b1_$split.txt" | cut -c1-60,100-150 | head -n 4
    done
}

# #18: vLLM's run of the issue's bar (vllm_offline.py, batch-1 ITL and 256 x 512/256 tok/s) with its
# routing simulated uniform (VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random: its dummy weights,
# U(-1e-3, 1e-3) and the same values in every layer, send the tokens to a few experts; its decode step's
# fused_moe_kernel took 1.6 ms against our 7.9 ms reading every expert), FP8 and bf16, then FP8 as
# it was measured for the bar (its own dummy routing); needs vLLM installed by earlier calls
moe_vllm_fair() {
    [ -f /tmp/vllm-site/.installed ] || { echo "vllm is not installed on this machine yet"; return; }
    # routing:quantization ('': vLLM's dummy routing); MOE_VLLM_RUNS picks some of them
    for run in ${MOE_VLLM_RUNS:-uniform_random:fp8 uniform_random:none :fp8}; do
        local strategy=${run%%:*} quant=${run#*:}
        VLLM_MOE_ROUTING_SIMULATION_STRATEGY=$strategy timeout 240 python3 benchmarks/vllm_offline.py \
            --model benchmarks/configs/qwen3-30b-a3b --tokenizer "$TOK" \
            $([ "$quant" = none ] || echo --quantization $quant) > "$W/vllm_$quant$strategy.log" 2>&1
        echo "vllm routing '${strategy:-dummy}' $quant: $(grep '^{' "$W/vllm_$quant$strategy.log")"
    done
}

# #19: the kernels of the burst's 8,192-token prefill step (against vLLM's, ~4% shorter)
prefill() {
    timeout 200 python3 -m benchmarks.gpubench.profile_prefill $MODEL --prompt-len 512 --batch 16 --runs 10 \
        --rows 30 > "$W/prefill8192.txt" 2>&1
    grep "^prompt" "$W/prefill8192.txt"
    grep -A 14 "Name" "$W/prefill8192.txt" | cut -c1-60,100-190
}

structured_run() {  # structured_run LABEL: one benchmark run under the caller's FD_* settings, its JSON line
    echo "$1 $(FD_STEP_TRACE=1 timeout 150 python3 benchmarks/structured_outputs.py --model $MODEL \
        --load-format dummy --tokenizer "$TOK" --max-model-len 2048 --repeat-structured --json \
        2>> "$W/so_err.log" | grep '^{')"
}

# #20: the grammar processes against threads, alternated (the nineteenth session's pairs: 0.888-0.916
# with 8 processes, 0.883-0.889 without); each run also says how long the structured requests waited
# for their compile and which requests ended it (benchmarks/structured_outputs.py)
structured() {
    for processes in 0 8 0 8; do
        FD_GRAMMAR_PROCESSES=$processes structured_run "processes $processes"
    done | tee "$W/structured_outputs.jsonl"
}

# #20: the twentieth session's changes against the nineteenth's behaviour, in turn: the compiles at a
# lower CPU priority (FD_GRAMMAR_COMPILE_NICE) and xgrammar's cache primed (FD_GRAMMAR_PRIME_LENGTH)
structured_nice() {
    for run in "10 128 0" "0 0 0" "10 0 0" "0 128 0" "10 128 0" "10 128 8"; do
        set -- $run
        FD_GRAMMAR_COMPILE_NICE=$1 FD_GRAMMAR_PRIME_LENGTH=$2 FD_GRAMMAR_PROCESSES=$3 \
            structured_run "nice $1 prime $2 processes $3"
    done | tee "$W/structured_outputs.jsonl"
}

# #20: how many threads compile the burst of new schemas (FD_GRAMMAR_COMPILE_THREADS; the default 8 on
# 16 cores), the mask threads left at theirs: compile threads take the GIL from the engine loop too
structured_threads() {
    for threads in 8 1 2 8 1 2; do
        FD_GRAMMAR_COMPILE_THREADS=$threads structured_run "compile threads $threads"
    done | tee "$W/structured_outputs.jsonl"
}

# #20: what the compiles' GIL costs the engine loop (its steps past their median while they run):
# Python's switch interval 0.5 ms (FD_SWITCH_INTERVAL_MS), and compiles in 8 processes (no GIL shared)
structured_gil() {
    for run in "0 0" "0.5 0" "0 8" "0 0" "0.5 0" "0 8"; do
        set -- $run
        FD_SWITCH_INTERVAL_MS=$1 FD_GRAMMAR_PROCESSES=$2 structured_run "switch $1 processes $2"
    done | tee "$W/structured_outputs.jsonl"
}

# #20: the default (FD_GRAMMAR_PROCESSES=auto: 8 grammar processes on this 16-core GPU host, started
# with the engine and ready before it is) against threads (FD_GRAMMAR_PROCESSES=0), 4 runs to 2;
# then the grammar-process tests (the masks page-locked at the start or once the processes run)
structured_default() {
    for processes in auto auto 0 auto auto 0; do
        FD_GRAMMAR_PROCESSES=$processes structured_run "processes $processes"
    done | tee "$W/structured_outputs.jsonl"
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/structured_output/test_grammar_processes.py \
        > "$W/grammar_process_tests.log" 2>&1
    echo "grammar process tests: exit $? $(tail -n 1 "$W/grammar_process_tests.log")"
}

# #20: llguidance (in the bundle since the twenty-second session; until then the GPU runs had xgrammar
# alone): threads with the auto backend (llguidance first: a grammar in ~1 ms, xgrammar's compile
# later for repeats) against the default grammar processes (xgrammar only), alternated
structured_guidance() {
    for processes in 0 auto 0 auto 0 auto; do
        FD_GRAMMAR_PROCESSES=$processes structured_run "processes $processes"
    done | tee "$W/structured_outputs.jsonl"
}

# #19: why a first burst is slower than the next one with nothing compiled in it (cold_start: 0.18
# against 0.11 s): the host profile of each burst's first step
# #19: online / offline output throughput of our engine on the burst (256 x 512/256, dummy 8B),
# with the serving path's per-request breakdown (the target: online >= 0.97 x offline)
offline_ratio() {
    timeout 300 python3 benchmarks/serving_breakdown.py --model $MODEL --num-threads 0 \
        --engine-args device=cuda,max_model_len=2048,max_num_batched_tokens=4096,tokenizer=$TOK --num-prompts 256 --input-len 512 \
        --output-len 256 --dtype bfloat16 > "$W/ratio.log" 2>&1
    grep -iE "offline|online|ratio" "$W/ratio.log" | grep -v WARNING | tail -n 8
}

first_burst() {
    timeout 200 python3 -m benchmarks.gpubench.first_burst $MODEL > "$W/first_burst.txt" 2>&1
    grep -v "^WARNING" "$W/first_burst.txt" | grep -A 16 "^burst"
}

tests() {  # one pytest a file, all at once (small tests; one GPU is enough): a crash hides no other file
    local i=0 pids=() targets=(tests/ops/test_triton_gemv.py tests/ops/test_triton_fp8_gemv.py
        tests/worker/test_mixed_graphs.py tests/structured_output/test_grammar_processes.py
        "tests/model_executor/test_triton_attention.py::test_qwen3_cache_write_in_the_qk_norm_kernel_gives_the_same_tokens"
        "tests/ops/test_triton_fused_moe.py -k grouped_mm" tests/ops/test_layer_ops.py
        "tests/ops/test_triton_moe_routing.py tests/model_executor/test_moe_router.py"
        "tests/ops/test_triton_fp8_gemm.py tests/ops/test_fp8_linear_cuda.py tests/ops/test_triton_fp8_quant.py"
        tests/model_executor/test_fused_moe_fp8.py tests/ops/test_triton_moe_gemv.py)
    for target in "${targets[@]}"; do
        timeout 400 python3 -X faulthandler -m pytest -q -p no:cacheprovider $target > "$W/gpu_tests_$i.log" 2>&1 &
        pids+=($!)
        i=$((i + 1))
    done
    for i in "${!targets[@]}"; do
        wait "${pids[$i]}"
        echo "${targets[$i]}: exit $? $(grep -E '(passed|failed|error)' "$W/gpu_tests_$i.log" | tail -n 1)"
    done
    timeout 120 python3 tools/probe_cpu_ext_throw.py 2>&1 | tee "$W/throw_probe.txt"
}

# #18: the batch-1 decode step of the Qwen3-30B-A3B shape with the MoE input's residual add + RMSNorm
# inside the split router's kernel (FD_MOE_ROUTER_NORM_FUSION) off and on (the twenty-seventh session:
# 2.396 -> 2.308 ms FP8, 2.709 -> 2.625 bf16; that run also timed the one-pass few-token MoE, since
# dropped: 4x slower than the two GEMV kernels)
moe_fusions() {
    for quant in ptpc_fp8 bf16; do
        for fusion in 0 1; do
            FD_MOE_ROUTER_NORM_FUSION=$fusion timeout 120 python3 -m benchmarks.gpubench.profile_decode \
                benchmarks/configs/qwen3-30b-a3b --batch 1 $([ $quant = bf16 ] || echo --quantization $quant) \
                --rows 14 > "$W/b1_${quant}_$fusion.txt" 2>&1
            echo "$quant norm fusion $fusion: $(grep '^batch 1' "$W/b1_${quant}_$fusion.txt" | head -n 1)"
            grep -E "norm|router" "$W/b1_${quant}_$fusion.txt" | cut -c1-60,100-160
        done
    done
}

# #18: the grouped GEMM's weight tiles through TMA tensor descriptors against pointer loads (the
# prefill steps' grouped GEMM ran at ~890 TFLOP/s in FP8, the twenty-third session)
moe_tma() {
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/test_triton_fused_moe.py -k tma_desc \
        > "$W/tma_test.log" 2>&1
    echo "tma test: $(tail -n 1 "$W/tma_test.log")"
    for tma in 0 1; do
        FD_MOE_TMA_WEIGHTS=$tma timeout 150 python3 -m benchmarks.gpubench.moe_bench --out "$W/tma$tma" \
            --tokens 256,8192 --dtypes ptpc_fp8,bf16 > "$W/tma$tma.log" 2>&1
        echo "FD_MOE_TMA_WEIGHTS=$tma"
        grep "|" "$W/tma$tma/results.md" | tail -n 4 | cut -c1-200
    done
}

# #18: the kernels that take programmatic dependent launch since the twenty-eighth session and the expert
# sort's two paths, on the GPU; then the MoE layer (the session's first lease: FP8 at 256 tokens 193.2 µs,
# 8,192 974.8 before the atomic sort and the persistent grid, 927.4 with both)
moe_pdl() {
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/ops/test_triton_fused_moe.py tests/ops/test_triton_moe_routing.py \
        tests/ops/test_triton_fp8_gemm.py tests/ops/test_triton_fp8_quant.py tests/ops/test_fp8_linear_cuda.py \
        > "$W/pdl_test.log" 2>&1
    echo "tests: $(tail -n 1 "$W/pdl_test.log")"
    grep -E "^FAILED|Error" "$W/pdl_test.log" | head -n 5
    timeout 150 python3 -m benchmarks.gpubench.moe_bench --out "$W/layer" --tokens 256,8192 --dtypes ptpc_fp8 \
        > "$W/layer.log" 2>&1
    grep "|" "$W/layer/results.md" | tail -n 2 | cut -c1-200
}

# #18: the expert sort with the ranks taken in the routing kernel (one launch fewer a layer) and the pairs
# placed by the layout kernel up to 2,048 pairs (one more fewer at the decode batch)
moe_ranks() {
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/test_triton_moe_routing.py tests/ops/test_triton_fused_moe.py \
        -k "ranks or atomic or align" > "$W/ranks_test.log" 2>&1
    echo "tests: $(tail -n 1 "$W/ranks_test.log")"
    grep -E "^FAILED|Error" "$W/ranks_test.log" | head -n 5
    for on in 0 1; do
        FD_MOE_RANKS_IN_ROUTER=$on timeout 150 python3 -m benchmarks.gpubench.moe_bench --out "$W/layer$on" \
            --tokens 256,8192 --dtypes ptpc_fp8 > "$W/layer$on.log" 2>&1
        echo "FD_MOE_RANKS_IN_ROUTER=$on"
        grep "|" "$W/layer$on/results.md" | tail -n 2 | cut -c1-200
    done
}

# #18: the batch-256 decode step's kernels (the throughput run's decode steps: 73% of its time)
decode256() {
    for setting in FD_MOE_RANKS_IN_ROUTER=0 FD_MOE_RANKS_IN_ROUTER=1 "FD_MOE_RANKS_IN_ROUTER=1 FD_FP8_SMALL_M_MAX=256"; do
        local name=${setting// /_}
        env $setting timeout 150 python3 -m benchmarks.gpubench.profile_decode benchmarks/configs/qwen3-30b-a3b \
            --batch 256 --quantization ptpc_fp8 --rows 24 > "$W/$name.txt" 2>&1
        echo "$setting: $(grep '^batch 256' "$W/$name.txt" | head -n 1)"
        grep -E "kernel|nvjet|Memcpy" "$W/$name.txt" | cut -c1-60,100-160 | head -n 24
    done
}

# #18: the prefill attention (~11% of an 8,192-token FP8 prefill step of Qwen3-30B-A3B in the twenty-third
# session: ~94 TFLOP/s) and the unmasked interior tiles (SPLIT_INTERIOR: on for prefill since the twenty-ninth)
attn_prefill() {
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/model_executor/test_triton_attention.py -k gpu \
        > "$W/attn_test.log" 2>&1
    echo "tests: $(tail -n 1 "$W/attn_test.log")"
    grep -E "^FAILED|Error" "$W/attn_test.log" | head -n 5
    timeout 300 python3 -m benchmarks.gpubench.attention_sweep --prefill --out "$W/prefill" > "$W/prefill.log" 2>&1
    grep "^|" "$W/prefill.log" | cut -c1-400
    timeout 120 python3 -m benchmarks.gpubench.attention_sweep --no-grid --out "$W/decode" > "$W/decode.log" 2>&1
    grep "^|" "$W/decode.log" | cut -c1-300
}

# #18: the tile table's candidates on the persistent grid (its best tiles may not be one-program-a-tile's)
moe_persistent_sweep() {
    FD_MOE_PERSISTENT_MIN_TOKENS=1 timeout 280 python3 -m benchmarks.gpubench.moe_bench --out "$W/sweep" --sweep \
        --tokens 8192 --dtypes ptpc_fp8 > "$W/sweep.log" 2>&1
    grep "|" "$W/sweep/results.md" | tail -n 1 | cut -c1-300
}

# #18: the batch-1 decode step of the Qwen3-30B-A3B shape after this session's kernel changes
moe() {
    for quant in ptpc_fp8 bf16; do
        timeout 150 python3 -m benchmarks.gpubench.profile_decode benchmarks/configs/qwen3-30b-a3b --batch 1 \
            $([ $quant = bf16 ] || echo --quantization $quant) --rows 16 > "$W/moe_b1_$quant.txt" 2>&1
        echo "$quant: $(grep '^batch 1' "$W/moe_b1_$quant.txt")"
        grep -E "kernel|nvjet|Memcpy" "$W/moe_b1_$quant.txt" | cut -c1-60,100-150 | head -n 14
    done
    # the per-channel FP8 experts of large steps on torch._scaled_grouped_mm (CUTLASS) against Triton
    for mm in 0 1024; do
        FD_MOE_GROUPED_MM_MIN_TOKENS=$mm timeout 200 python3 -m benchmarks.gpubench.moe_bench --out "$W/moe_mm$mm" \
            --tokens 256,2048,8192 --dtypes ptpc_fp8 > "$W/moe_mm$mm.log" 2>&1
        echo "FD_MOE_GROUPED_MM_MIN_TOKENS=$mm"
        grep "|" "$W/moe_mm$mm/results.md" | tail -n 3
    done
    # the experts' two GEMV kernels at one token, narrow tiles among the candidates now
    timeout 400 python3 -m benchmarks.gpubench.moe_bench --out "$W/moe_sweep" --sweep --tokens 1 \
        --dtypes ptpc_fp8,bf16 > "$W/moe_sweep.log" 2>&1
    grep "|" "$W/moe_sweep/results.md" | tail -n 4
}

for section in $sections; do
    echo "== $section"
    W=/tmp/gpu_pending/$section
    rm -rf "$W" && mkdir -p "$W"
    $section
    tar czf "$OUT/$section.tgz" -C /tmp/gpu_pending "$section"
done
