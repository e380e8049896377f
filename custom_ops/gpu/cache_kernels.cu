// reshape_and_cache_flash: scatter this step's keys and values into the paged
// KV cache (NHD layout, [num_blocks, block_size, num_heads, head_dim]).
//
// kv_cache_dtype "auto" copies the values unchanged (the cache has the input's
// dtype). "fp8_e4m3" (alias "fp8") quantises every (token, head) vector of
// head_dim values with its own dynamic scale:
//     scale = max(absmax(x) / 448, 1e-12)      (float32)
//     cache = e4m3(x / scale), saturating to +-448, rounding to nearest even
//     k_scale / v_scale[block, offset, head] = scale
// so that dequantisation is cache.float() * scale[..., None]. The torch
// fallback in fastdeploy/ops/cache_ops.py implements the same definition.
// (NaN inputs are not part of the contract: fmaxf ignores them in the absmax.)

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace fastdeploy {
namespace {

constexpr float kFp8E4m3Max = 448.0f;
constexpr float kFp8ScaleFloor = 1e-12f;
constexpr int kWarpSize = 32;
constexpr int kMaxThreads = 512;

// Strides of a [tokens, heads, head_dim] input and of a 4-D cache, in elements
// of the type the kernel moves (a 16-byte vector or one scalar).
struct TokenStrides {
  int64_t token;
  int64_t head;
};

struct CacheStrides {
  int64_t block;
  int64_t page;
  int64_t head;
};

template <typename SlotT>
__device__ __forceinline__ int64_t load_slot(const SlotT* slot_mapping, int64_t stride, int64_t token) {
  return static_cast<int64_t>(slot_mapping[token * stride]);
}

// One thread block per token; threads walk the heads * vecs_per_head vectors.
template <typename VecT, typename SlotT>
__global__ void copy_to_cache_kernel(const VecT* __restrict__ key, const VecT* __restrict__ value,
                                     VecT* __restrict__ key_cache, VecT* __restrict__ value_cache,
                                     const SlotT* __restrict__ slot_mapping, int64_t slot_stride,
                                     TokenStrides key_strides, TokenStrides value_strides,
                                     CacheStrides key_cache_strides, CacheStrides value_cache_strides,
                                     int block_size, int num_heads, int vecs_per_head) {
  const int64_t token = blockIdx.x;
  const int64_t slot = load_slot(slot_mapping, slot_stride, token);
  if (slot < 0) return;  // padding token
  const int64_t block = slot / block_size;
  const int64_t page = slot % block_size;
  const int total = num_heads * vecs_per_head;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int head = i / vecs_per_head;
    const int vec = i % vecs_per_head;
    key_cache[block * key_cache_strides.block + page * key_cache_strides.page + head * key_cache_strides.head +
              vec] = key[token * key_strides.token + head * key_strides.head + vec];
    value_cache[block * value_cache_strides.block + page * value_cache_strides.page +
                head * value_cache_strides.head + vec] =
        value[token * value_strides.token + head * value_strides.head + vec];
  }
}

// One warp quantises one head_dim vector: absmax by warp shuffle, then x / scale.
template <typename scalar_t>
__device__ __forceinline__ void quantize_vector(const scalar_t* __restrict__ src, uint8_t* __restrict__ dst,
                                                float* __restrict__ scale_out, int head_dim, int lane) {
  float amax = 0.0f;
  for (int d = lane; d < head_dim; d += kWarpSize) {
    amax = fmaxf(amax, fabsf(static_cast<float>(src[d])));
  }
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  const float scale = fmaxf(amax / kFp8E4m3Max, kFp8ScaleFloor);
  for (int d = lane; d < head_dim; d += kWarpSize) {
    dst[d] = static_cast<uint8_t>(
        __nv_cvt_float_to_fp8(static_cast<float>(src[d]) / scale, __NV_SATFINITE, __NV_E4M3));
  }
  if (lane == 0) *scale_out = scale;
}

// One thread block per token, one warp per head (warps loop over the heads).
template <typename scalar_t, typename SlotT>
__global__ void quantize_to_cache_kernel(const scalar_t* __restrict__ key, const scalar_t* __restrict__ value,
                                         uint8_t* __restrict__ key_cache, uint8_t* __restrict__ value_cache,
                                         float* __restrict__ k_scale, float* __restrict__ v_scale,
                                         const SlotT* __restrict__ slot_mapping, int64_t slot_stride,
                                         TokenStrides key_strides, TokenStrides value_strides,
                                         CacheStrides key_cache_strides, CacheStrides value_cache_strides,
                                         CacheStrides k_scale_strides, CacheStrides v_scale_strides,
                                         int block_size, int num_heads, int head_dim) {
  const int64_t token = blockIdx.x;
  const int64_t slot = load_slot(slot_mapping, slot_stride, token);
  if (slot < 0) return;  // the whole block leaves together: no warp is split
  const int64_t block = slot / block_size;
  const int64_t page = slot % block_size;
  const int lane = threadIdx.x % kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  for (int head = threadIdx.x / kWarpSize; head < num_heads; head += num_warps) {
    quantize_vector(key + token * key_strides.token + head * key_strides.head,
                    key_cache + block * key_cache_strides.block + page * key_cache_strides.page +
                        head * key_cache_strides.head,
                    k_scale + block * k_scale_strides.block + page * k_scale_strides.page +
                        head * k_scale_strides.head,
                    head_dim, lane);
    quantize_vector(value + token * value_strides.token + head * value_strides.head,
                    value_cache + block * value_cache_strides.block + page * value_cache_strides.page +
                        head * value_cache_strides.head,
                    v_scale + block * v_scale_strides.block + page * v_scale_strides.page +
                        head * v_scale_strides.head,
                    head_dim, lane);
  }
}

TokenStrides token_strides(const at::Tensor& t, int64_t elems_per_vec) {
  return {t.stride(0) / elems_per_vec, t.stride(1) / elems_per_vec};
}

CacheStrides cache_strides(const at::Tensor& t, int64_t elems_per_vec) {
  return {t.stride(0) / elems_per_vec, t.stride(1) / elems_per_vec, t.stride(2) / elems_per_vec};
}

int round_up_threads(int64_t work) {
  const int64_t warps = (std::min<int64_t>(work, kMaxThreads) + kWarpSize - 1) / kWarpSize;
  return static_cast<int>(std::max<int64_t>(warps, 1) * kWarpSize);
}

// True when every stride and data pointer allows moving `elems` elements as one 16-byte vector.
bool can_vectorize(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, int64_t elems) {
  if (key.size(2) % elems != 0) return false;
  for (const at::Tensor* t : {&key, &value}) {
    if (t->stride(0) % elems != 0 || t->stride(1) % elems != 0) return false;
  }
  for (const at::Tensor* t : {&key_cache, &value_cache}) {
    if (t->stride(0) % elems != 0 || t->stride(1) % elems != 0 || t->stride(2) % elems != 0) return false;
  }
  for (const at::Tensor* t : {&key, &value, &key_cache, &value_cache}) {
    if (reinterpret_cast<uintptr_t>(t->const_data_ptr()) % 16 != 0) return false;
  }
  return true;
}

template <typename VecT, typename SlotT>
void launch_copy(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                 const at::Tensor& slot_mapping, int64_t elems_per_vec, cudaStream_t stream) {
  const int num_heads = static_cast<int>(key.size(1));
  const int vecs_per_head = static_cast<int>(key.size(2) / elems_per_vec);
  const int threads = round_up_threads(static_cast<int64_t>(num_heads) * vecs_per_head);
  copy_to_cache_kernel<VecT, SlotT><<<static_cast<unsigned>(slot_mapping.size(0)), threads, 0, stream>>>(
      static_cast<const VecT*>(key.const_data_ptr()), static_cast<const VecT*>(value.const_data_ptr()),
      static_cast<VecT*>(key_cache.mutable_data_ptr()), static_cast<VecT*>(value_cache.mutable_data_ptr()),
      slot_mapping.const_data_ptr<SlotT>(), slot_mapping.stride(0), token_strides(key, elems_per_vec),
      token_strides(value, elems_per_vec), cache_strides(key_cache, elems_per_vec),
      cache_strides(value_cache, elems_per_vec), static_cast<int>(key_cache.size(1)), num_heads, vecs_per_head);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename SlotT>
void copy_to_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                   const at::Tensor& slot_mapping, cudaStream_t stream) {
  const int64_t elem_size = key.element_size();
  const int64_t elems_per_vec = 16 / elem_size;
  if (can_vectorize(key, value, key_cache, value_cache, elems_per_vec)) {
    launch_copy<uint4, SlotT>(key, value, key_cache, value_cache, slot_mapping, elems_per_vec, stream);
  } else if (elem_size == 2) {
    launch_copy<uint16_t, SlotT>(key, value, key_cache, value_cache, slot_mapping, 1, stream);
  } else {
    launch_copy<uint32_t, SlotT>(key, value, key_cache, value_cache, slot_mapping, 1, stream);
  }
}

template <typename scalar_t, typename SlotT>
void quantize_to_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, at::Tensor& k_scale, at::Tensor& v_scale,
                       const at::Tensor& slot_mapping, cudaStream_t stream) {
  const int num_heads = static_cast<int>(key.size(1));
  const int threads = round_up_threads(static_cast<int64_t>(num_heads) * kWarpSize);
  quantize_to_cache_kernel<scalar_t, SlotT><<<static_cast<unsigned>(slot_mapping.size(0)), threads, 0, stream>>>(
      static_cast<const scalar_t*>(key.const_data_ptr()), static_cast<const scalar_t*>(value.const_data_ptr()),
      static_cast<uint8_t*>(key_cache.mutable_data_ptr()), static_cast<uint8_t*>(value_cache.mutable_data_ptr()),
      k_scale.mutable_data_ptr<float>(), v_scale.mutable_data_ptr<float>(), slot_mapping.const_data_ptr<SlotT>(),
      slot_mapping.stride(0), token_strides(key, 1), token_strides(value, 1), cache_strides(key_cache, 1),
      cache_strides(value_cache, 1), cache_strides(k_scale, 1), cache_strides(v_scale, 1),
      static_cast<int>(key_cache.size(1)), num_heads, static_cast<int>(key.size(2)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename SlotT>
void quantize_dispatch(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, at::Tensor& k_scale, at::Tensor& v_scale,
                       const at::Tensor& slot_mapping, cudaStream_t stream) {
  switch (key.scalar_type()) {
    case at::kHalf:
      quantize_to_cache<c10::Half, SlotT>(key, value, key_cache, value_cache, k_scale, v_scale, slot_mapping, stream);
      break;
    case at::kBFloat16:
      quantize_to_cache<c10::BFloat16, SlotT>(key, value, key_cache, value_cache, k_scale, v_scale, slot_mapping,
                                              stream);
      break;
    default:
      quantize_to_cache<float, SlotT>(key, value, key_cache, value_cache, k_scale, v_scale, slot_mapping, stream);
  }
}

bool is_float_input(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat; }

void check_scale(const std::optional<at::Tensor>& scale, const char* name, const at::Tensor& cache) {
  TORCH_CHECK(scale.has_value() && scale->defined(), "reshape_and_cache_flash: kv_cache_dtype fp8_e4m3 needs ",
              name, " of shape [num_blocks, block_size, heads] = ", cache.sizes().slice(0, 3), " (float32)");
  TORCH_CHECK(scale->scalar_type() == at::kFloat, "reshape_and_cache_flash: ", name, " must be float32, got ",
              scale->scalar_type());
  TORCH_CHECK(scale->dim() == 3 && scale->sizes() == cache.sizes().slice(0, 3), "reshape_and_cache_flash: ", name,
              " must be [num_blocks, block_size, heads] = ", cache.sizes().slice(0, 3), ", got ", scale->sizes());
  TORCH_CHECK(scale->device() == cache.device(), "reshape_and_cache_flash: ", name, " is on ", scale->device(),
              " but the cache is on ", cache.device());
}

void check_common(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(),
              "reshape_and_cache_flash: key and value must both be [tokens, heads, head_dim]; got ", key.sizes(),
              " and ", value.sizes());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "reshape_and_cache_flash: key_cache and value_cache must both be "
              "[num_blocks, block_size, heads, head_dim]; got ",
              key_cache.sizes(), " and ", value_cache.sizes());
  TORCH_CHECK(key.sizes().slice(1) == key_cache.sizes().slice(2), "reshape_and_cache_flash: key heads/head_dim ",
              key.sizes().slice(1), " do not match the cache's ", key_cache.sizes().slice(2));
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) <= key.size(0),
              "reshape_and_cache_flash: slot_mapping must be 1-D with at most ", key.size(0), " entries; got ",
              slot_mapping.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt,
              "reshape_and_cache_flash: slot_mapping must be int32 or int64, got ", slot_mapping.scalar_type());
  TORCH_CHECK(key.scalar_type() == value.scalar_type() && is_float_input(key.scalar_type()),
              "reshape_and_cache_flash: key and value must share one of float16/bfloat16/float32; got ",
              key.scalar_type(), " and ", value.scalar_type());
  for (const at::Tensor* t : {&value, &key_cache, &value_cache, &slot_mapping}) {
    TORCH_CHECK(t->device() == key.device(), "reshape_and_cache_flash: all tensors must be on one device; got ",
                key.device(), " and ", t->device());
  }
  TORCH_CHECK(key.is_cuda(), "reshape_and_cache_flash: the CUDA kernel needs CUDA tensors, got ", key.device());
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1,
              "reshape_and_cache_flash: key and value need unit stride in head_dim; got strides ", key.strides(),
              " and ", value.strides());
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "reshape_and_cache_flash: the caches need unit stride in head_dim; got strides ", key_cache.strides(),
              " and ", value_cache.strides());
}

void reshape_and_cache_flash(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                             at::Tensor& value_cache, const at::Tensor& slot_mapping,
                             c10::string_view kv_cache_dtype, const std::optional<at::Tensor>& k_scale,
                             const std::optional<at::Tensor>& v_scale) {
  check_common(key, value, key_cache, value_cache, slot_mapping);
  const bool fp8 = kv_cache_dtype == "fp8_e4m3" || kv_cache_dtype == "fp8";
  TORCH_CHECK(fp8 || kv_cache_dtype == "auto", "reshape_and_cache_flash: unsupported kv_cache_dtype '",
              kv_cache_dtype, "' (expected auto, fp8_e4m3 or fp8)");
  const c10::cuda::CUDAGuard device_guard(key.device());
  if (fp8) {
    int major = 0;
    int minor = 0;
    const int device = key.get_device();
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    TORCH_CHECK(major * 10 + minor >= 89, "reshape_and_cache_flash: kv_cache_dtype fp8_e4m3 needs a GPU of compute ",
                "capability 8.9 or newer; cuda:", device, " is ", major, ".", minor);
    for (const at::Tensor* t : {&key_cache, &value_cache}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat8_e4m3fn || t->scalar_type() == at::kByte,
                  "reshape_and_cache_flash: fp8_e4m3 caches must be float8_e4m3fn or uint8, got ", t->scalar_type());
    }
    check_scale(k_scale, "k_scale", key_cache);
    check_scale(v_scale, "v_scale", value_cache);
  } else {
    TORCH_CHECK(key_cache.scalar_type() == key.scalar_type() && value_cache.scalar_type() == key.scalar_type(),
                "reshape_and_cache_flash: with kv_cache_dtype auto the caches must have the input dtype ",
                key.scalar_type(), "; got ", key_cache.scalar_type(), " and ", value_cache.scalar_type());
  }
  if (slot_mapping.size(0) == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool int64_slots = slot_mapping.scalar_type() == at::kLong;
  if (fp8) {
    at::Tensor k_scale_t = *k_scale;
    at::Tensor v_scale_t = *v_scale;
    if (int64_slots) {
      quantize_dispatch<int64_t>(key, value, key_cache, value_cache, k_scale_t, v_scale_t, slot_mapping, stream);
    } else {
      quantize_dispatch<int32_t>(key, value, key_cache, value_cache, k_scale_t, v_scale_t, slot_mapping, stream);
    }
  } else if (int64_slots) {
    copy_to_cache<int64_t>(key, value, key_cache, value_cache, slot_mapping, stream);
  } else {
    copy_to_cache<int32_t>(key, value, key_cache, value_cache, slot_mapping, stream);
  }
}

}  // namespace
}  // namespace fastdeploy

TORCH_LIBRARY_IMPL(fastdeploy_ops, CUDA, m) {
  m.impl("reshape_and_cache_flash", &fastdeploy::reshape_and_cache_flash);
}
