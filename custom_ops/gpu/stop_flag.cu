// set_stop: reduce the per-request stop flags to one "is any request still
// running" int32 and publish it twice, without a host synchronisation:
//   * flag_device[0] for later kernels (and CUDA graphs) on the device;
//   * flag_host[0], pinned host memory written by the kernel through its
//     device mapping (unified virtual addressing), read by get_stop.
//
// Memory-ordering contract: the kernel runs on the current stream, so the
// host value is only meaningful once a CUDA event recorded after set_stop on
// that stream has completed (event.synchronize() or event.query() == true).
// Before that the host reads either the previous or the new value (an aligned
// 32-bit store is never torn). The kernel issues __threadfence_system() after
// its stores, so writes made earlier by the same thread are visible to the
// host no later than the flag.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

namespace fastdeploy {
namespace {

constexpr int kThreads = 256;

__global__ void set_stop_kernel(const bool* __restrict__ stop_flags, int64_t num_requests,
                                int32_t* __restrict__ flag_device, volatile int32_t* flag_host) {
  int running = 0;
  for (int64_t i = threadIdx.x; i < num_requests; i += blockDim.x) {
    running |= stop_flags[i] ? 0 : 1;
  }
  running = __syncthreads_or(running);
  if (threadIdx.x == 0) {
    const int32_t value = running ? 1 : 0;
    *flag_device = value;
    *flag_host = value;
    __threadfence_system();
  }
}

void set_stop(const at::Tensor& stop_flags, at::Tensor& flag_device, at::Tensor& flag_host) {
  TORCH_CHECK(stop_flags.is_cuda() && stop_flags.scalar_type() == at::kBool && stop_flags.is_contiguous(),
              "set_stop: stop_flags must be a contiguous bool CUDA tensor, got ", stop_flags.scalar_type(), " on ",
              stop_flags.device());
  TORCH_CHECK(flag_device.device() == stop_flags.device() && flag_device.scalar_type() == at::kInt &&
                  flag_device.numel() == 1,
              "set_stop: flag_device must be int32 with one element on ", stop_flags.device(), ", got ",
              flag_device.scalar_type(), " of shape ", flag_device.sizes(), " on ", flag_device.device());
  TORCH_CHECK(flag_host.device().is_cpu() && flag_host.scalar_type() == at::kInt && flag_host.numel() == 1,
              "set_stop: flag_host must be a pinned CPU int32 tensor with one element, got ", flag_host.scalar_type(),
              " of shape ", flag_host.sizes(), " on ", flag_host.device());
  TORCH_CHECK(flag_host.is_pinned(), "set_stop: flag_host must be in pinned memory (tensor.pin_memory())");
  const c10::cuda::CUDAGuard device_guard(stop_flags.device());
  void* host_on_device = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&host_on_device, flag_host.mutable_data_ptr(), 0));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  set_stop_kernel<<<1, kThreads, 0, stream>>>(stop_flags.const_data_ptr<bool>(), stop_flags.numel(),
                                              flag_device.mutable_data_ptr<int32_t>(),
                                              static_cast<int32_t*>(host_on_device));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace fastdeploy

TORCH_LIBRARY_IMPL(fastdeploy_ops, CUDA, m) { m.impl("set_stop", &fastdeploy::set_stop); }
