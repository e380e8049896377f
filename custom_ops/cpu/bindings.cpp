// Python bindings of the CPU kernels (module built by fastdeploy/ops/cpu_ops.py).
#include "cpu_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over the paged NHD cache: out[token_idx[r]] for each request r");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "attention of query chunks (with cached context) over the paged NHD cache, causal or with key limits");
  m.def("rms_norm", &rms_norm, "out = weight * x / rms(x)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = weight * residual / rms(residual), in place");
  m.def("rotary_embedding", &rotary_embedding, "NeoX rotary embedding of the first rotated_heads heads of qkv, in place");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(gate) * up for gate_up = [gate, up]");
  m.def("write_cache", &write_cache, "cache.view(-1, H, D)[slots[t]] = src[t] for slots[t] >= 0");
}
