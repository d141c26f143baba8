// The whole EXL3 weight W = diag(suh) . H_in . Q . H_out . diag(svh) (docs/EXL3_FORMAT.md
// section 4, reconstructing a linear) in one pass, for the large-batch (prefill) path.
//
// Why: rotating the activations instead ((x * suh) H_in, decode Q, cuBLAS, rotate the output)
// takes two Hadamard passes over tokens x (in + out) numbers per linear. For a 4K prompt that is
// twice the numbers of the weight itself, so turning the weight into W once and running a plain
// GEMM in the activations' dtype moves fewer bytes (+8.8% prefill when it came in), and lets
// projections that share an input (q/k/v, gate/up) write into one buffer for one GEMM.
//
// One block per 128 x 128 piece of W (the Hadamard block size), the Hadamards on the tensor
// cores. The Sylvester H_128 is H_8 (x) H_16 with the tile index as the high factor
// (popc((16a+b) & (16a'+b')) = popc(a&a') + popc(b&b')), so for a 16 x 16 tile T the
// within-tile part of H T H is H_16 . T . H_16: two m16n8k16 MMAs each. A lane's 8 decoded
// values are already the B fragment of T (k = input features), the first product's accumulator
// is register-for-register the A fragment of the second (rounded to fp16; fp32 and fp16 outputs
// add the rounding remainder in a second MMA, so W keeps ~fp32 accuracy; bf16 output does not
// need it). What is left is H_8 across the 8 x 8 tiles of the piece: along the output features
// inside each warp's registers (warp w owns tile row w), then along the input features after one
// exchange through shared memory (warp w then owns tile column w). About 16 instructions per
// weight, against ~40 for the Hadamards as warp shuffles over fp32 rows in shared memory (that
// kernel was 2.4-2.7x slower, docs/KERNELS.md section 4).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <torch/extension.h>

#include <type_traits>

#include "exl3_common.cuh"
#include "float_types.cuh"
#include "hadamard.cuh"
#include "trellis_ext.h"

namespace trellis {
namespace {

// (H[i][j], H[i][j + 1]) of the unnormalised Sylvester H_16 as a half2: H[i][j] = (-1)^popc(i & j).
__device__ __forceinline__ uint32_t h16_pair(int i, int j) {
  const uint32_t lo = (__popc(i & j) & 1) ? 0xBC00u : 0x3C00u;
  const uint32_t hi = (__popc(i & (j + 1)) & 1) ? 0xBC00u : 0x3C00u;
  return lo | (hi << 16);
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) { return h2_as_u32(__floats2half2_rn(lo, hi)); }

// H_8 across 8 tiles held as acc[tile][n8 tile][accumulator register], per register.
__device__ __forceinline__ void hadamard8_across_tiles(float (&acc)[8][2][4]) {
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float v[8];
#pragma unroll
      for (int t = 0; t < 8; ++t) v[t] = acc[t][n][i];
      hadamard8(v);
#pragma unroll
      for (int t = 0; t < 8; ++t) acc[t][n][i] = v[t];
    }
}

template <typename T>
__device__ __forceinline__ void store_pair(T* p, float a, float b);
template <>
__device__ __forceinline__ void store_pair<__half>(__half* p, float a, float b) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}
template <>
__device__ __forceinline__ void store_pair<__nv_bfloat16>(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
template <>
__device__ __forceinline__ void store_pair<float>(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}

constexpr int kExchangeBytes = 8 * 8 * 2 * 32 * sizeof(float4);  // [tile row][tile col][half][lane]
// The finished piece is staged row-major in the same buffer so that the global stores are whole
// 16-byte vectors of consecutive output features. The row pitch is padded by 16 bytes: the pair
// stores of a warp (8 rows x 4 pairs) then hit 32 different banks.
template <typename T>
constexpr int kStagePitch = 128 + 16 / static_cast<int>(sizeof(T));  // elements
template <typename T>
constexpr int kWeightSmem =
    kExchangeBytes > 128 * kStagePitch<T> * static_cast<int>(sizeof(T)) ? kExchangeBytes
                                                                        : 128 * kStagePitch<T> * static_cast<int>(sizeof(T));

// Fragment positions used below (g = lane / 4, t = lane % 4), for a 16 x 16 tile with rows =
// input features i and columns = output features o:
//  - decoded values q[0..3] (decode_fragment order): B fragment of T for o in 0..7 is (q0, q2),
//    for o in 8..15 (q1, q3);
//  - accumulator c[n][0..3] of an n8 tile n: (i, o) = (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1),
//    o offset by 8n.
// 3 blocks per SM (<= 80 registers, with the shared memory carveout at its maximum).
// Grid (out / 128, in / 128, matrices). kStack: a stack of same-shaped matrices (a mixture's
// experts, trellis [E, in/16, out/16, 16K], suh [E, in], svh [E, out]) decodes in one launch,
// matrix z into w + z * w_matrix. Its own instantiation: the offsets cost the one-matrix kernel
// registers it has none to spare for (spills at 80).
template <int K, int CB, typename T, bool kStack>
__global__ void __launch_bounds__(256, 3) weight_kernel(const uint32_t* __restrict__ trellis,
                                                        const __half* __restrict__ suh,
                                                        const __half* __restrict__ svh, T* __restrict__ w,
                                                        int out, long long ld, int col0, long long w_matrix) {
  extern __shared__ float4 x4[];  // exchange buffer, then the staged piece (kWeightSmem<T> bytes)
  constexpr int TW = TileGeom<K>::kWords;
  constexpr int NR = TileGeom<K>::kRaw;
  constexpr bool kSplit = !std::is_same<T, __nv_bfloat16>::value;  // keep ~fp32 accuracy
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int tiles_out = out >> 4;
  if constexpr (kStack) {
    trellis += (size_t)blockIdx.z * gridDim.y * 8 * tiles_out * TW;
    suh += (size_t)blockIdx.z * gridDim.y * 128;
    svh += (size_t)blockIdx.z * out;
    w += blockIdx.z * w_matrix;
  }
  const LanePlan<K> plan(lane);
  // H_16 as an A fragment; by symmetry its B fragments are (h[0], h[2]) and (h[1], h[3]).
  const uint32_t h[4] = {h16_pair(g, 2 * t), h16_pair(g + 8, 2 * t), h16_pair(g, 2 * t + 8),
                         h16_pair(g + 8, 2 * t + 8)};

  // 1. Warp w: tile row w (16 input features), its 8 tiles along the output features:
  //    z[tj] = H_16 . T . H_16 on the tensor cores.
  float z[8][2][4];
#pragma unroll
  for (int tj = 0; tj < 8; ++tj) {
    const uint32_t* p = trellis + ((size_t)(blockIdx.y * 8 + warp) * tiles_out + blockIdx.x * 8 + tj) * TW;
    uint32_t raw[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) raw[i] = __ldg(p + plan.word[i]);
    uint32_t q[4];
    decode_fragment<K, CB>(raw, plan.r, q);
    float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
    mma_16816(c0, h, q[0], q[2]);  // H_16 . T, output features 0..7 of the tile
    mma_16816(c1, h, q[1], q[3]);  //            output features 8..15
    const uint32_t a[4] = {pack_half2(c0[0], c0[1]), pack_half2(c0[2], c0[3]), pack_half2(c1[0], c1[1]),
                           pack_half2(c1[2], c1[3])};
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) z[tj][n][i] = 0.f;
    mma_16816(z[tj][0], a, h[0], h[2]);  // (H_16 . T) . H_16
    mma_16816(z[tj][1], a, h[1], h[3]);
    if constexpr (kSplit) {  // the fp16 rounding remainder of the first product, in a second pass
      const float* cc[2] = {c0, c1};
      uint32_t r[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 f = __half22float2(u32_as_h2(a[k]));
        const float* c = cc[k >> 1] + 2 * (k & 1);
        r[k] = pack_half2(c[0] - f.x, c[1] - f.y);
      }
      mma_16816(z[tj][0], r, h[0], h[2]);
      mma_16816(z[tj][1], r, h[1], h[3]);
    }
  }
  hadamard8_across_tiles(z);  // H_8 along the output features: across the warp's 8 tiles
#pragma unroll
  for (int tj = 0; tj < 8; ++tj)
#pragma unroll
    for (int n = 0; n < 2; ++n)
      x4[((warp * 8 + tj) * 2 + n) * 32 + lane] = make_float4(z[tj][n][0], z[tj][n][1], z[tj][n][2], z[tj][n][3]);
  __syncthreads();

  // 2. Warp w: tile column w, its 8 tiles along the input features: H_8 across them, then the
  //    scales (both Hadamards unnormalised: 1/128 in all) and the stores.
  float y[8][2][4];
#pragma unroll
  for (int ti = 0; ti < 8; ++ti)
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const float4 f = x4[((ti * 8 + warp) * 2 + n) * 32 + lane];
      y[ti][n][0] = f.x; y[ti][n][1] = f.y; y[ti][n][2] = f.z; y[ti][n][3] = f.w;
    }
  hadamard8_across_tiles(y);
  const int oc = warp * 16 + 2 * t;  // this lane's first output feature in the piece
  float cs[2][2];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    cs[n][0] = __half2float(svh[blockIdx.x * 128 + oc + 8 * n]) * (1.0f / 128.0f);
    cs[n][1] = __half2float(svh[blockIdx.x * 128 + oc + 8 * n + 1]) * (1.0f / 128.0f);
  }
  __syncthreads();  // every warp has its exchange values in registers: the buffer is free
  T* stage = reinterpret_cast<T*>(x4);
#pragma unroll
  for (int ti = 0; ti < 8; ++ti) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // input feature g or g + 8 of the tile
      const int row = ti * 16 + g + 8 * half;
      const float rs = __half2float(suh[blockIdx.y * 128 + row]);
#pragma unroll
      for (int n = 0; n < 2; ++n)
        store_pair<T>(stage + row * kStagePitch<T> + oc + 8 * n, y[ti][n][2 * half] * rs * cs[n][0],
                      y[ti][n][2 * half + 1] * rs * cs[n][1]);
    }
  }
  __syncthreads();

  // 3. Warp w stores rows 16w .. 16w+15 of the piece, 16 bytes per lane.
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte vector
  constexpr int kLanesPerRow = 128 / kVec;
#pragma unroll
  for (int r = warp * 16 + lane / kLanesPerRow; r < warp * 16 + 16; r += 32 / kLanesPerRow) {
    const int c = (lane % kLanesPerRow) * kVec;
    *reinterpret_cast<uint4*>(w + (size_t)(blockIdx.y * 128 + r) * ld + col0 + blockIdx.x * 128 + c) =
        *reinterpret_cast<const uint4*>(stage + r * kStagePitch<T> + c);
  }
}

template <int CB, typename T, bool kStack>
void launch_weight_cb(const uint32_t* t, const __half* suh, const __half* svh, T* w, int in, int out, int K,
                      long long ld, int col0, int matrices, long long w_matrix, cudaStream_t stream) {
  const dim3 grid(out / 128, in / 128, matrices);
  switch (K) {
#define TRELLIS_CASE(k)                                                                                     \
  case k:                                                                                                   \
    cudaFuncSetAttribute(weight_kernel<k, CB, T, kStack>, cudaFuncAttributeMaxDynamicSharedMemorySize,       \
                         kWeightSmem<T>);                                                                   \
    cudaFuncSetAttribute(weight_kernel<k, CB, T, kStack>, cudaFuncAttributePreferredSharedMemoryCarveout, 100); \
    weight_kernel<k, CB, T, kStack><<<grid, 256, kWeightSmem<T>, stream>>>(t, suh, svh, w, out, ld, col0,     \
                                                                          w_matrix);                       \
    break;
    TRELLIS_CASE(1) TRELLIS_CASE(2) TRELLIS_CASE(3) TRELLIS_CASE(4)
    TRELLIS_CASE(5) TRELLIS_CASE(6) TRELLIS_CASE(7) TRELLIS_CASE(8)
#undef TRELLIS_CASE
    default: break;
  }
}

template <typename T, bool kStack = false>
void launch_weight(const uint32_t* t, const __half* suh, const __half* svh, T* w, int in, int out, int K,
                   int codebook, long long ld, int col0, int matrices, long long w_matrix, cudaStream_t stream) {
  if (codebook == CB_3INST)
    launch_weight_cb<CB_3INST, T, kStack>(t, suh, svh, w, in, out, K, ld, col0, matrices, w_matrix, stream);
  else if (codebook == CB_MCG)
    launch_weight_cb<CB_MCG, T, kStack>(t, suh, svh, w, in, out, K, ld, col0, matrices, w_matrix, stream);
  else
    launch_weight_cb<CB_MUL1, T, kStack>(t, suh, svh, w, in, out, K, ld, col0, matrices, w_matrix, stream);
}

// The checks both bindings share: trellis (matrices, in/16, out/16, 16K), suh/svh one row per
// matrix, w (matrices, in, >= col0 + out) with 16-byte aligned pitches. Returns K.
int check_weight_args(const at::Tensor& trellis, const at::Tensor& suh, const at::Tensor& svh, int64_t codebook,
                      const at::Tensor& w, int64_t col0) {
  TORCH_CHECK(trellis.is_cuda() && trellis.dim() == 4 && trellis.scalar_type() == at::kShort &&
                  trellis.is_contiguous() && trellis.size(0) >= 1 && trellis.size(0) <= 65535,
              "trellis must be a contiguous int16 CUDA tensor ([1..65535 matrices,] in/16, out/16, 16K)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(trellis.data_ptr()) % 16 == 0, "trellis must be 16-byte aligned");
  const int64_t words = trellis.size(3);
  TORCH_CHECK(words % 16 == 0 && words / 16 >= 1 && words / 16 <= 8, "trellis last dim must be 16*K, K in 1..8");
  TORCH_CHECK(trellis.size(1) % 8 == 0 && trellis.size(2) % 8 == 0, "in and out must be multiples of 128");
  TORCH_CHECK(codebook >= 0 && codebook <= 2, "codebook must be 0 (3inst), 1 (mcg) or 2 (mul1)");
  const int64_t matrices = trellis.size(0), in = trellis.size(1) * 16, out = trellis.size(2) * 16;
  for (const auto* v : {&suh, &svh}) {
    TORCH_CHECK(v->is_cuda() && v->scalar_type() == at::kHalf && v->is_contiguous() && v->dim() == 2 &&
                    v->size(0) == matrices,
                "suh/svh must be contiguous fp16 CUDA vectors, one per matrix");
  }
  TORCH_CHECK(suh.size(1) == in && svh.size(1) == out, "suh must have ", in, " and svh ", out, " entries");
  TORCH_CHECK(w.is_cuda() && w.dim() == 3 && w.size(0) == matrices && w.stride(2) == 1 && w.size(1) == in,
              "w must be ([", matrices, ",] ", in, ", n) with unit column stride");
  TORCH_CHECK(col0 >= 0 && col0 + out <= w.size(2), "columns [", col0, ", ", col0 + out, ") do not fit in w");
  // The kernel stores 16-byte vectors: w's start, pitches and col0 must keep them aligned.
  const int64_t vec = 16 / w.element_size();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0 && w.stride(1) % vec == 0 &&
                  (matrices == 1 || w.stride(0) % vec == 0) && col0 % vec == 0,
              "w must be 16-byte aligned, with row pitch and col0 multiples of 16 bytes");
  return static_cast<int>(words / 16);
}

// Writes W (in, out) of one EXL3 linear into columns [col0, col0 + out) of `w` (in, >= col0 + out).
void exl3_weight_into(const at::Tensor& trellis, const at::Tensor& suh, const at::Tensor& svh, int64_t codebook,
                      at::Tensor& w, int64_t col0) {
  TORCH_CHECK(trellis.dim() == 3 && suh.dim() == 1 && svh.dim() == 1 && w.dim() == 2,
              "trellis must be (in/16, out/16, 16K), suh and svh vectors, w (in, n)");
  const int K = check_weight_args(trellis.unsqueeze(0), suh.unsqueeze(0), svh.unsqueeze(0), codebook,
                                  w.unsqueeze(0), col0);
  const int in = static_cast<int>(trellis.size(0) * 16), out = static_cast<int>(trellis.size(1) * 16);
  const c10::cuda::CUDAGuard guard(trellis.device());
  const auto stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto* t = reinterpret_cast<const uint32_t*>(trellis.data_ptr());
  const auto* su = reinterpret_cast<const __half*>(suh.data_ptr());
  const auto* sv = reinterpret_cast<const __half*>(svh.data_ptr());
  const long long ld = w.stride(0);
  const int cb = static_cast<int>(codebook), c0 = static_cast<int>(col0);
  switch (w.scalar_type()) {
    case at::kHalf:
      launch_weight(t, su, sv, reinterpret_cast<__half*>(w.data_ptr()), in, out, K, cb, ld, c0, 1, 0, stream);
      break;
    case at::kBFloat16:
      launch_weight(t, su, sv, reinterpret_cast<__nv_bfloat16*>(w.data_ptr()), in, out, K, cb, ld, c0, 1, 0,
                    stream);
      break;
    case at::kFloat:
      launch_weight(t, su, sv, w.data_ptr<float>(), in, out, K, cb, ld, c0, 1, 0, stream);
      break;
    default:
      TORCH_CHECK(false, "w must be fp16, bf16 or fp32");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Writes W (in, out) of each of a stack of same-shaped EXL3 linears (a mixture's experts: trellis
// [E, in/16, out/16, 16K], suh [E, in], svh [E, out]) into columns [col0, col0 + out) of its
// matrix of `w` (E, in, >= col0 + out), bf16 (the grouped GEMM's dtype), in one launch.
void exl3_weight_stack_into(const at::Tensor& trellis, const at::Tensor& suh, const at::Tensor& svh,
                            int64_t codebook, at::Tensor& w, int64_t col0) {
  const int K = check_weight_args(trellis, suh, svh, codebook, w, col0);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "a stack decodes to bf16 weights");
  const int in = static_cast<int>(trellis.size(1) * 16), out = static_cast<int>(trellis.size(2) * 16);
  const c10::cuda::CUDAGuard guard(trellis.device());
  launch_weight<__nv_bfloat16, true>(
      reinterpret_cast<const uint32_t*>(trellis.data_ptr()), reinterpret_cast<const __half*>(suh.data_ptr()),
      reinterpret_cast<const __half*>(svh.data_ptr()), reinterpret_cast<__nv_bfloat16*>(w.data_ptr()), in, out, K,
      static_cast<int>(codebook), w.stride(1), static_cast<int>(col0), static_cast<int>(trellis.size(0)),
      w.stride(0), c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void bind_exl3_weight(pybind11::module_& m) {
  m.def("exl3_weight_into", &exl3_weight_into,
        "write W = diag(suh) H Q H diag(svh) (in, out) into columns [col0, col0 + out) of w",
        py::arg("trellis"), py::arg("suh"), py::arg("svh"), py::arg("codebook"), py::arg("w"), py::arg("col0") = 0);
  m.def("exl3_weight_stack_into", &exl3_weight_stack_into,
        "write each W of a stack of same-shaped EXL3 linears into columns [col0, col0 + out) of its matrix of w "
        "(E, in, n), in one launch",
        py::arg("trellis"), py::arg("suh"), py::arg("svh"), py::arg("codebook"), py::arg("w"), py::arg("col0") = 0);
}

}  // namespace trellis
