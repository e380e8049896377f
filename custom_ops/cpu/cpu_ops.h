// Declarations of the CPU kernels bound in bindings.cpp.
#pragma once
#include <torch/extension.h>

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                            torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor token_idx, double scale);
void paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                             torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor q_start,
                             torch::Tensor q_lens, torch::Tensor limits, double scale);
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_embedding(torch::Tensor positions, torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                      int64_t rotated_heads, int64_t head_dim);
void silu_and_mul(torch::Tensor out, torch::Tensor gate_up);
void write_cache(torch::Tensor src, torch::Tensor cache, torch::Tensor slots);
