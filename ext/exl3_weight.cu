// The whole EXL3 weight W = diag(suh) . H_in . Q . H_out . diag(svh) (EXL3_FORMAT.md section 4)
// in one pass, for the large-batch (prefill) path.
//
// Why: prefill used to rotate the activations (x * suh) H_in, decode Q, run cuBLAS and rotate
// the output, i.e. two Hadamard passes over tokens x (in + out) numbers per linear. For a 4K
// prompt that is twice the numbers of the weight itself, so turning the weight into W once and
// running a plain GEMM in the activations' dtype moves fewer bytes, and lets projections that
// share an input (q/k/v, gate/up) write into one buffer for one GEMM.
//
// One block per 128 x 128 piece of W (the Hadamard block size): 8 warps decode its 64 tiles
// into shared memory (fp32), then transform every row (H_out), then every column (H_in), then
// scale and store. Element (r, c) of a 128-vector sits in lane (index % 32), register
// (index / 32) in both passes, so the column pass reads shared memory without bank conflicts;
// the butterfly of warp_hadamard128 is the same for any assignment of index bits to lane and
// register bits.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <torch/extension.h>

#include "exl3_common.cuh"
#include "trellis_ext.h"

namespace trellis {
namespace {

constexpr int kPitch = 129;  // floats per shared row: column reads hit 32 different banks
constexpr int kWeightSmem = 128 * kPitch * sizeof(float);

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }

template <int K, int CB, typename T>
__global__ void __launch_bounds__(256) weight_kernel(const uint32_t* __restrict__ trellis,
                                                     const __half* __restrict__ suh,
                                                     const __half* __restrict__ svh, T* __restrict__ w,
                                                     int out, long long ld, int col0) {
  extern __shared__ float s[];  // [128][kPitch]
  constexpr int TW = TileGeom<K>::kWords;
  constexpr int NR = TileGeom<K>::kRaw;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tiles_out = out >> 4;
  const int tile_row = blockIdx.y * 8 + warp;  // this warp's 16 input features
  const LanePlan<K> plan(lane);

  // 1. Decode: warp w owns tile row w of the piece (8 tiles along the output features).
#pragma unroll 2
  for (int t = 0; t < 8; ++t) {
    const uint32_t* p = trellis + ((size_t)tile_row * tiles_out + blockIdx.x * 8 + t) * TW;
    uint32_t raw[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) raw[i] = __ldg(p + plan.word[i]);
    uint32_t st[8];
    lane_states<K>(raw, plan.r, st);
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      const float2 v = __half22float2(u32_as_h2(decode_pair<CB>(st[j], st[j + 1])));
      // Storage position 8*lane + j of the tile (section 6.1, Table A).
      const int row = warp * 16 + 2 * (lane & 3) + 8 * ((j >> 1) & 1);
      const int col = t * 16 + (lane >> 2) + 8 * (j >> 2);
      s[row * kPitch + col] = v.x;
      s[(row + 1) * kPitch + col] = v.y;
    }
  }
  __syncthreads();

  // 2. H_out along each row (warp w: rows 16w .. 16w+15).
  for (int r = warp * 16; r < warp * 16 + 16; ++r) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = s[r * kPitch + lane + 32 * i];
    warp_hadamard128(v, lane);
#pragma unroll
    for (int i = 0; i < 4; ++i) s[r * kPitch + lane + 32 * i] = v[i];
  }
  __syncthreads();

  // 3. H_in along each column (warp w: columns 16w .. 16w+15), both normalisations, the scales.
  const int in0 = blockIdx.y * 128, out0 = blockIdx.x * 128;
  float row_scale[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) row_scale[i] = __half2float(suh[in0 + lane + 32 * i]) * (1.0f / 128.0f);
  for (int c = warp * 16; c < warp * 16 + 16; ++c) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = s[(lane + 32 * i) * kPitch + c];
    warp_hadamard128(v, lane);
    const float col_scale = __half2float(svh[out0 + c]);
#pragma unroll
    for (int i = 0; i < 4; ++i) s[(lane + 32 * i) * kPitch + c] = v[i] * row_scale[i] * col_scale;
  }
  __syncthreads();

  // 4. Store row by row: consecutive lanes write consecutive output features.
  for (int r = warp * 16; r < warp * 16 + 16; ++r) {
    T* dst = w + (size_t)(in0 + r) * ld + col0 + out0;
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[lane + 32 * i] = from_float<T>(s[r * kPitch + lane + 32 * i]);
  }
}

template <int CB, typename T>
void launch_weight_cb(const uint32_t* t, const __half* suh, const __half* svh, T* w, int in, int out, int K,
                      long long ld, int col0, cudaStream_t stream) {
  const dim3 grid(out / 128, in / 128);
  switch (K) {
#define TRELLIS_CASE(k)                                                                               \
  case k:                                                                                             \
    cudaFuncSetAttribute(weight_kernel<k, CB, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, kWeightSmem); \
    weight_kernel<k, CB, T><<<grid, 256, kWeightSmem, stream>>>(t, suh, svh, w, out, ld, col0);      \
    break;
    TRELLIS_CASE(1) TRELLIS_CASE(2) TRELLIS_CASE(3) TRELLIS_CASE(4)
    TRELLIS_CASE(5) TRELLIS_CASE(6) TRELLIS_CASE(7) TRELLIS_CASE(8)
#undef TRELLIS_CASE
    default: break;
  }
}

template <typename T>
void launch_weight(const uint32_t* t, const __half* suh, const __half* svh, T* w, int in, int out, int K,
                   int codebook, long long ld, int col0, cudaStream_t stream) {
  if (codebook == CB_3INST) launch_weight_cb<CB_3INST, T>(t, suh, svh, w, in, out, K, ld, col0, stream);
  else if (codebook == CB_MCG) launch_weight_cb<CB_MCG, T>(t, suh, svh, w, in, out, K, ld, col0, stream);
  else launch_weight_cb<CB_MUL1, T>(t, suh, svh, w, in, out, K, ld, col0, stream);
}

// Writes W (in, out) of one EXL3 linear into columns [col0, col0 + out) of `w` (in, >= col0 + out).
void exl3_weight_into(const at::Tensor& trellis, const at::Tensor& suh, const at::Tensor& svh, int64_t codebook,
                      at::Tensor& w, int64_t col0) {
  TORCH_CHECK(trellis.is_cuda() && trellis.dim() == 3 && trellis.scalar_type() == at::kShort &&
                  trellis.is_contiguous(),
              "trellis must be a contiguous int16 CUDA tensor (in/16, out/16, 16K)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(trellis.data_ptr()) % 16 == 0, "trellis must be 16-byte aligned");
  const int64_t words = trellis.size(2);
  TORCH_CHECK(words % 16 == 0 && words / 16 >= 1 && words / 16 <= 8, "trellis last dim must be 16*K, K in 1..8");
  TORCH_CHECK(trellis.size(0) % 8 == 0 && trellis.size(1) % 8 == 0, "in and out must be multiples of 128");
  TORCH_CHECK(codebook >= 0 && codebook <= 2, "codebook must be 0 (3inst), 1 (mcg) or 2 (mul1)");
  const int K = static_cast<int>(words / 16);
  const int in = static_cast<int>(trellis.size(0) * 16), out = static_cast<int>(trellis.size(1) * 16);
  for (const auto* v : {&suh, &svh}) {
    TORCH_CHECK(v->is_cuda() && v->scalar_type() == at::kHalf && v->is_contiguous() && v->dim() == 1,
                "suh/svh must be contiguous fp16 CUDA vectors");
  }
  TORCH_CHECK(suh.size(0) == in && svh.size(0) == out, "suh must have ", in, " and svh ", out, " entries");
  TORCH_CHECK(w.is_cuda() && w.dim() == 2 && w.stride(1) == 1 && w.size(0) == in, "w must be (", in,
              ", n) with unit column stride");
  TORCH_CHECK(col0 >= 0 && col0 + out <= w.size(1), "columns [", col0, ", ", col0 + out, ") do not fit in w");
  const c10::cuda::CUDAGuard guard(trellis.device());
  const auto stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto* t = reinterpret_cast<const uint32_t*>(trellis.data_ptr());
  const auto* su = reinterpret_cast<const __half*>(suh.data_ptr());
  const auto* sv = reinterpret_cast<const __half*>(svh.data_ptr());
  const long long ld = w.stride(0);
  const int cb = static_cast<int>(codebook), c0 = static_cast<int>(col0);
  switch (w.scalar_type()) {
    case at::kHalf:
      launch_weight(t, su, sv, reinterpret_cast<__half*>(w.data_ptr()), in, out, K, cb, ld, c0, stream);
      break;
    case at::kBFloat16:
      launch_weight(t, su, sv, reinterpret_cast<__nv_bfloat16*>(w.data_ptr()), in, out, K, cb, ld, c0, stream);
      break;
    case at::kFloat:
      launch_weight(t, su, sv, w.data_ptr<float>(), in, out, K, cb, ld, c0, stream);
      break;
    default:
      TORCH_CHECK(false, "w must be fp16, bf16 or fp32");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void bind_exl3_weight(pybind11::module_& m) {
  m.def("exl3_weight_into", &exl3_weight_into,
        "write W = diag(suh) H Q H diag(svh) (in, out) into columns [col0, col0 + out) of w",
        py::arg("trellis"), py::arg("suh"), py::arg("svh"), py::arg("codebook"), py::arg("w"), py::arg("col0") = 0);
}

}  // namespace trellis
