// Gathered read of a 2-8 bit KV cache store: rows `slots` of codes/scales, dequantized and rotated
// back to [n, kv_heads, D] in fp16 or bf16. Same function as QuantizedStore.dequantize
// (engine/cache/quantized.py); the inverse of quantize_write_kernel in ext/paged_attention.cu.
//
// Prefill attention reads every earlier position of a sequence through this once per layer and
// chunk, so it is meant to run at memory speed: thread t of the grid owns one 8-number unit
// (`bits` plane bytes in, 16 bytes out), so consecutive threads read consecutive plane bytes of a
// row and write consecutive 16-byte vectors of the output. A 32-number group is 4 consecutive
// units, hence 4 consecutive lanes (D is a multiple of 32, so groups never straddle a warp), and
// the group's inverse rotation is a butterfly in registers plus two rounds of lane shuffles.
//
// Precision: the codes minus the midpoint are half-integers, and their Walsh-Hadamard transform
// (sums of at most 32 of them) is exact in fp32; the only roundings are scale * 32^-1/2, that
// product times the transform, and the final cast, so results are within fp32 rounding of the
// torch path (which multiplies first and rotates with a matmul) before the cast to the output type.
//
// Graph-safe: no host sync, no allocation besides the output (torch's caching allocator); the
// launch shape depends only on the shapes.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <climits>
#include <cstdint>

#include "hadamard.cuh"
#include "trellis_ext.h"

namespace {

using trellis::hadamard32_lanes;  // hadamard.cuh

constexpr int kThreads = 256;
constexpr int kGroup = 32;  // quantization group = Hadamard size
constexpr float kInvSqrtGroup = 0.17677669529663687f;

// The plane bytes of one unit as two words: byte j of (lo, hi) = plane j (planes 4-7 in hi). The
// unit starts `BITS * unit` bytes into the codes, so 2/4/8-bit units take one aligned 2/4/8-byte
// load and 6-bit units three 2-byte loads; 3/5/7-bit units are read by byte (still coalesced:
// neighbouring lanes read neighbouring bytes).
template <int BITS>
__device__ __forceinline__ void load_planes(const uint8_t* __restrict__ p, unsigned& lo, unsigned& hi) {
  if constexpr (BITS == 2) {
    lo = __ldg(reinterpret_cast<const unsigned short*>(p));
    hi = 0;
  } else if constexpr (BITS == 4) {
    lo = __ldg(reinterpret_cast<const unsigned*>(p));
    hi = 0;
  } else if constexpr (BITS == 8) {
    const uint2 w = __ldg(reinterpret_cast<const uint2*>(p));
    lo = w.x;
    hi = w.y;
  } else if constexpr (BITS == 6) {
    const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
    lo = static_cast<unsigned>(__ldg(s)) | static_cast<unsigned>(__ldg(s + 1)) << 16;
    hi = __ldg(s + 2);
  } else {
    lo = 0;
    hi = 0;
#pragma unroll
    for (int j = 0; j < BITS; ++j) {
      const unsigned b = __ldg(p + j);
      if (j < 4) lo |= b << (8 * j);
      else hi |= b << (8 * (j - 4));
    }
  }
}

// Transpose the 8x8 bit matrix (row j = plane byte j, column i = number i) held in (lo, hi), so
// that byte i becomes the code of number i: three rounds of delta swaps (2x2, 4x4, 8x8 blocks).
// With at most 4 planes hi is zero and stays zero through the first two rounds, so only the
// last round (the nibble exchange between the halves) is needed there.
template <int BITS>
__device__ __forceinline__ void transpose_bits(unsigned& lo, unsigned& hi) {
  unsigned t = (lo ^ (lo >> 7)) & 0x00AA00AAu;
  lo ^= t ^ (t << 7);
  t = (lo ^ (lo >> 14)) & 0x0000CCCCu;
  lo ^= t ^ (t << 14);
  if constexpr (BITS > 4) {
    t = (hi ^ (hi >> 7)) & 0x00AA00AAu;
    hi ^= t ^ (t << 7);
    t = (hi ^ (hi >> 14)) & 0x0000CCCCu;
    hi ^= t ^ (t << 14);
  }
  t = (lo ^ (hi << 4)) & 0xF0F0F0F0u;
  lo ^= t;
  hi ^= t >> 4;
}

// Byte `i` (0-3) of w as a float: placed under the exponent of 2^23, then 2^23 subtracted (exact).
__device__ __forceinline__ float byte_to_float(unsigned w, int i) {
  return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540 + i)) - 8388608.0f;
}

template <typename T>
struct Pack;
template <>
struct Pack<__half> {
  static __device__ __forceinline__ unsigned two(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&h);
  }
};
template <>
struct Pack<__nv_bfloat16> {
  static __device__ __forceinline__ unsigned two(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&h);
  }
};

// out[i, h, :] = dequantize(codes[slots[i], h], scales[slots[i], h]) for every i < n, h < heads.
template <typename T, int BITS>
__global__ void __launch_bounds__(kThreads) quantized_cache_read_kernel(
    const uint8_t* __restrict__ codes, const __half* __restrict__ scales, const int64_t* __restrict__ slots,
    T* __restrict__ out, int units, int heads, int units_per_row, long long num_slots) {
  // 32-bit thread indices (the host checks units < 2^31): the divisions below are the costliest
  // instructions per unit, and 64-bit ones take several times as many.
  const int unit = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  const int lane = threadIdx.x % 32;
  // Lanes past the end take part in the shuffles with zeros (whole groups of 4 lanes, since the
  // unit count is a multiple of 4) and store nothing.
  const bool active = unit < units;
  float x[8];
  size_t src_unit = 0;
  if (active) {
    const int row = unit / units_per_row;  // i * heads + h
    const int u = unit - row * units_per_row;
    const int i = row / heads, h = row - i * heads;
    const long long slot = slots[i];
    CUDA_KERNEL_ASSERT(slot >= 0 && slot < num_slots);
    src_unit = (static_cast<size_t>(slot) * heads + h) * units_per_row + u;
    unsigned lo, hi;
    load_planes<BITS>(codes + src_unit * BITS, lo, hi);
    transpose_bits<BITS>(lo, hi);
    constexpr float kHalf = 0.5f * static_cast<float>((1 << BITS) - 1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[i] = byte_to_float(lo, i) - kHalf;
      x[4 + i] = byte_to_float(hi, i) - kHalf;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = 0.0f;
  }
  hadamard32_lanes(x, lane);
  if (!active) return;
  // Scale row of the source = its unit / 4 (4 units per group): lanes of a group read one address.
  const float s = __half2float(__ldg(scales + src_unit / 4)) * kInvSqrtGroup;
  uint4 v;
  v.x = Pack<T>::two(x[0] * s, x[1] * s);
  v.y = Pack<T>::two(x[2] * s, x[3] * s);
  v.z = Pack<T>::two(x[4] * s, x[5] * s);
  v.w = Pack<T>::two(x[6] * s, x[7] * s);
  reinterpret_cast<uint4*>(out)[unit] = v;
}

template <typename T>
void launch(int bits, const uint8_t* codes, const __half* scales, const int64_t* slots, T* out, int units,
            int heads, int units_per_row, long long num_slots, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((static_cast<long long>(units) + kThreads - 1) / kThreads);
#define TRELLIS_QCR_CASE(B)                                                                                       \
  case B:                                                                                                         \
    quantized_cache_read_kernel<T, B>                                                                             \
        <<<blocks, kThreads, 0, stream>>>(codes, scales, slots, out, units, heads, units_per_row, num_slots); \
    break;
  switch (bits) {
    TRELLIS_QCR_CASE(2)
    TRELLIS_QCR_CASE(3)
    TRELLIS_QCR_CASE(4)
    TRELLIS_QCR_CASE(5)
    TRELLIS_QCR_CASE(6)
    TRELLIS_QCR_CASE(7)
    TRELLIS_QCR_CASE(8)
    default: TORCH_CHECK(false, "quantized_cache_read: bits must be 2..8, got ", bits);
  }
#undef TRELLIS_QCR_CASE
}

at::Tensor quantized_cache_read(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& slots,
                                int64_t bits, at::ScalarType out_dtype) {
  TORCH_CHECK(bits >= 2 && bits <= 8, "bits must be 2..8, got ", bits);
  TORCH_CHECK(codes.is_cuda() && codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.dim() == 4 &&
                  codes.size(3) == bits,
              "codes must be contiguous uint8 [slots, kv_heads, dim/8, ", bits, "] on the GPU");
  const int64_t num_slots = codes.size(0), heads = codes.size(1), D = codes.size(2) * 8;
  TORCH_CHECK(D % kGroup == 0 && D > 0, "head_dim must be a multiple of 32, got ", D);
  TORCH_CHECK(scales.is_cuda() && scales.is_contiguous() && scales.scalar_type() == at::kHalf && scales.dim() == 3 &&
                  scales.size(0) == num_slots && scales.size(1) == heads && scales.size(2) == D / kGroup,
              "scales must be contiguous fp16 [slots, kv_heads, dim/32] matching codes");
  TORCH_CHECK(slots.is_cuda() && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1,
              "slots must be a contiguous int64 vector on the GPU");
  TORCH_CHECK(codes.device() == scales.device() && codes.device() == slots.device(), "tensors on different devices");
  TORCH_CHECK(out_dtype == at::kHalf || out_dtype == at::kBFloat16, "out_dtype must be fp16 or bf16");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(codes.data_ptr()) % 8 == 0, "codes must be 8-byte aligned");
  const int64_t n = slots.size(0);
  at::Tensor out = at::empty({n, heads, D}, codes.options().dtype(out_dtype));
  const int64_t units64 = n * heads * (D / 8);
  TORCH_CHECK(units64 <= INT_MAX - kThreads, "quantized_cache_read: too many rows for one launch");
  if (units64 == 0) return out;
  const int units = static_cast<int>(units64);
  const c10::cuda::CUDAGuard guard(codes.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto* c = codes.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const __half*>(scales.data_ptr<at::Half>());
  const auto* sl = slots.data_ptr<int64_t>();
  const int b = static_cast<int>(bits), h = static_cast<int>(heads), upr = static_cast<int>(D / 8);
  if (out_dtype == at::kHalf)
    launch<__half>(b, c, s, sl, reinterpret_cast<__half*>(out.data_ptr<at::Half>()), units, h, upr, num_slots, stream);
  else
    launch<__nv_bfloat16>(b, c, s, sl, reinterpret_cast<__nv_bfloat16*>(out.data_ptr<at::BFloat16>()), units, h, upr,
                          num_slots, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

namespace trellis {
void bind_quantized_cache_read(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("quantized_cache_read", &quantized_cache_read,
        "gather rows `slots` of a 2-8 bit cache store (codes, scales) and dequantize them to "
        "[n, kv_heads, dim] in out_dtype (fp16 or bf16)",
        py::arg("codes"), py::arg("scales"), py::arg("slots"), py::arg("bits"), py::arg("out_dtype"));
}
}  // namespace trellis
