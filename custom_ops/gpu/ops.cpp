// The fastdeploy_ops operator library: operator schemas, the host-side kernels
// and the Python module entry point.
//
// Every op is callable as torch.ops.fastdeploy_ops.<name> once this shared
// object is loaded (by `import fastdeploy_ops` or torch.ops.load_library).
// The CUDA kernels register themselves from their own .cu files with
// TORCH_LIBRARY_IMPL(fastdeploy_ops, CUDA, m).

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>

namespace fastdeploy {

// Reads the "is any request still running" flag that set_stop wrote into
// pinned host memory. No CUDA call, no synchronisation: the caller orders this
// read after the producing kernel (by waiting on a CUDA event recorded after
// set_stop). The value is read through a volatile pointer so that the compiler
// never reuses an earlier read, and an acquire fence keeps later host reads of
// other GPU-written pinned buffers from moving before it.
bool get_stop(const at::Tensor& flag_host) {
  TORCH_CHECK(flag_host.device().is_cpu(), "get_stop: flag_host must be a CPU (pinned) tensor, got ",
              flag_host.device());
  TORCH_CHECK(flag_host.scalar_type() == at::kInt && flag_host.numel() == 1,
              "get_stop: flag_host must be int32 with one element, got ", flag_host.scalar_type(), " of shape ",
              flag_host.sizes());
  const volatile int32_t* flag = flag_host.const_data_ptr<int32_t>();
  const int32_t value = *flag;
  std::atomic_thread_fence(std::memory_order_acquire);
  return value != 0;
}

}  // namespace fastdeploy

TORCH_LIBRARY(fastdeploy_ops, m) {
  m.def(
      "reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, str kv_cache_dtype, Tensor(c!)? k_scale, Tensor(d!)? v_scale) -> ()");
  m.def("set_stop(Tensor stop_flags, Tensor(a!) flag_device, Tensor(b!) flag_host) -> ()");
  m.def("get_stop(Tensor flag_host) -> bool");
}

TORCH_LIBRARY_IMPL(fastdeploy_ops, CPU, m) { m.impl("get_stop", &fastdeploy::get_stop); }

// A Python module with no functions: importing it runs the static registrars above.
extern "C" PyObject* PyInit_fastdeploy_ops(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "fastdeploy_ops",                                   // m_name
      "FastDeploy CUDA ops: see torch.ops.fastdeploy_ops",  // m_doc
      -1,                                                 // m_size
      nullptr,                                            // m_methods
  };
  return PyModule_Create(&module_def);
}
