// Conversions between the three activation dtypes (fp16, bf16, fp32) and float, for kernels
// templated on the element type. Round to nearest even, as torch stores an fp32 result.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace trellis {

template <typename T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f<float>(float v) { return v; }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }

// Calls f with a value of the CUDA element type that holds a tensor of `dtype` (the host side's
// dispatch of kernels templated on it); fp16, bf16 and fp32 only.
template <typename F>
void by_dtype(c10::ScalarType dtype, F&& f) {
  switch (dtype) {
    case c10::kHalf: f(__half{}); break;
    case c10::kBFloat16: f(__nv_bfloat16{}); break;
    case c10::kFloat: f(float{}); break;
    default: TORCH_CHECK(false, "unsupported dtype ", dtype, " (fp16, bf16 or fp32)");
  }
}

}  // namespace trellis
