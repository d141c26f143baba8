// Tail-biting Viterbi encoder for EXL3 tiles (the converter's hot loop; issue 3).
//
// Same search as engine/convert/viterbi.py, which stays the definition:
//  - 65 536 16-bit states; step i shifts in K bits, so the predecessors of s are
//    h * 2^(16-K) + (s >> K) for h < 2^K;
//  - pass 1 runs over the tile rotated by 128 values and backtracks only to the state of value
//    255, whose low 16-K bits become the "overlap"; pass 2 forces the first state's high bits and
//    the last state's low bits to the overlap (exactly tail-biting).
//
// Layout: one CTA of 1024 threads per tile, both passes in one launch. With
// best[low] = min_h cost[h * 2^(16-K) + low], the cost of state s at step i is
// best_prev[s >> K] + err_i(s), so a step only needs the 2^(16-K)-entry best array (double
// buffered in shared memory: 2 x 64 KB at K=2) and the value of each state, computed
// arithmetically from the codebook (a few integer ops: cheaper than a 128 KB shared table, which
// would not fit beside the K=2 buffers anyway). A thread owns fixed "low" indices and loops over
// h, so the min over h is a register loop (K <= 6) or a 2/4-lane shuffle (K = 7, 8, where there
// are fewer lows than threads). Back-pointers (argmin h, one byte per low per step) go to a global
// workspace; thread 0 backtracks at the end of each pass.
//
// At K=1 the best array is 128 KB and two would not fit (227 KB per SM), so it is updated in
// place (in_place_step): a thread owns the lows 2m and 2m+1 for 16 values of m, whose
// predecessors' best are entries m and 2^14 + m; it reads all 32 of them into registers, the
// block meets at a barrier, and only then does anyone write.
//
// Float arithmetic mirrors the torch path so that ties break identically: per state
// err = fma(-2, x*v, v*v) (torch.addcmul(v2, x, v, value=-2) on CUDA is
// std::fma(alpha, t1 * t2, input) in ATen's pointwise_op_impl, torch 2.11), cost =
// best + err, min over h keeps the first (smallest h) on ties, the final argmin the smallest
// state (torch.min / argmin return the first index).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <torch/extension.h>

#include <cuda_fp16.h>
#include <algorithm>
#include <cstdint>

#include "exl3_common.cuh"
#include "trellis_ext.h"

namespace trellis {
namespace {

constexpr int kThreads = 1024;
constexpr int kValues = 256;  // values per tile
constexpr int kHalf = kValues / 2;

template <int K>
struct VGeom {
  static constexpr int kLow = 1 << (16 - K);                                // entries of best[]
  static constexpr int kHi = 1 << K;                                        // predecessors per low
  static constexpr int kGroup = kLow >= kThreads ? 1 : kThreads / kLow;     // threads per low
  static constexpr int kLowsPerThread = kLow >= kThreads ? kLow / kThreads : 1;
  static constexpr int kHPerThread = kHi / kGroup;
  static constexpr bool kInPlace = K == 1;  // one best[] buffer, updated in place (see above)
  static constexpr size_t kSmem = (kInPlace ? 1 : 2) * kLow * sizeof(float) + kValues * sizeof(float);
  static constexpr size_t kWsPerTile = static_cast<size_t>(kValues - 1) * kLow;  // bytes
};

// Values of two states (s0, s1) as floats, bit-exact with the codebook tables.
template <int CB>
__device__ __forceinline__ float2 state_values(uint32_t s0, uint32_t s1) {
  return __half22float2(u32_as_h2(decode_pair<CB>(s0, s1)));
}

// (value, index) lexicographic minimum: smaller value, then smaller index.
__device__ __forceinline__ void min_pair(float& v, int& i, float ov, int oi) {
  if (ov < v || (ov == v && oi < i)) {
    v = ov;
    i = oi;
  }
}

// One K=1 step on the single best[] buffer (VGeom<1>::kInPlace). Successor lows 2m, 2m+1 (h = 0, 1
// are states low and 2^15 + low) read best[m] and best[2^14 + m]: all reads, a barrier, all
// writes, a barrier. Same float operations and tie rules as the general loop.
template <int CB>
__device__ __forceinline__ void in_place_step(float* best, uint8_t* back, float xi, bool last, int overlap,
                                              float& fin_v, int& fin_s) {
  constexpr int kLow = VGeom<1>::kLow;
  constexpr int kPairs = kLow / 2 / kThreads;
  const int tid = threadIdx.x;
  float pred0[kPairs], pred1[kPairs];
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int m = tid + j * kThreads;
    pred0[j] = best[m];
    pred1[j] = best[kLow / 2 + m];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int m = tid + j * kThreads;
    float b[2];
    uint8_t a[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint32_t s0 = 2 * m + q;  // h = 0
      const uint32_t s1 = s0 + kLow;  // h = 1
      const float2 v = state_values<CB>(s0, s1);
      const float e0 = __fmaf_rn(-2.f, __fmul_rn(xi, v.x), __fmul_rn(v.x, v.x));
      const float e1 = __fmaf_rn(-2.f, __fmul_rn(xi, v.y), __fmul_rn(v.y, v.y));
      const float c0 = __fadd_rn(pred0[j], e0);
      const float c1 = __fadd_rn(pred1[j], e1);
      b[q] = c0;  // the first candidate as is, then strict <: ties keep h = 0
      a[q] = 0;
      if (c1 < b[q]) {
        b[q] = c1;
        a[q] = 1;
      }
      if (last && (overlap < 0 || static_cast<int>(s0) == overlap)) {
        min_pair(fin_v, fin_s, c0, static_cast<int>(s0));
        min_pair(fin_v, fin_s, c1, static_cast<int>(s1));
      }
    }
    if (!last) {
      reinterpret_cast<float2*>(best)[m] = make_float2(b[0], b[1]);
      back[2 * m] = a[0];
      back[2 * m + 1] = a[1];
    }
  }
  __syncthreads();
}

template <int K, int CB>
__global__ void __launch_bounds__(kThreads, 1)
    viterbi_kernel(const float* __restrict__ x, int32_t* __restrict__ out, uint8_t* __restrict__ ws) {
  using G = VGeom<K>;
  extern __shared__ float smem[];
  float* buf0 = smem;
  float* buf1 = G::kInPlace ? smem : smem + G::kLow;
  float* xs = smem + (G::kInPlace ? 1 : 2) * G::kLow;
  __shared__ float red_v[kThreads / 32];
  __shared__ int red_i[kThreads / 32];
  __shared__ int overlap_s;

  const int tid = threadIdx.x;
  const int tile = blockIdx.x;
  uint8_t* back = ws + static_cast<size_t>(tile) * G::kWsPerTile;
  if (tid < kValues) xs[tid] = x[static_cast<size_t>(tile) * kValues + tid];
  // For K = 7, 8: lanes g = 0..kGroup-1 of a low are adjacent; lane g takes h in
  // [g * kHPerThread, (g + 1) * kHPerThread).
  const int g = tid % G::kGroup;
  const int h0 = g * G::kHPerThread;
  const float inf = __int_as_float(0x7f800000);

  for (int pass = 0; pass < 2; ++pass) {
    const int overlap = pass ? overlap_s : -1;
    // best_{-1}: 0 everywhere (pass 1), or only at the overlap (pass 2: first state's high bits).
    for (int j = tid; j < G::kLow; j += kThreads) buf0[j] = (pass == 0 || j == overlap) ? 0.f : inf;
    __syncthreads();

    float fin_v = inf;
    int fin_s = 0x7fffffff;
    for (int i = 0; i < kValues; ++i) {
      const float* prev = (i & 1) ? buf1 : buf0;
      float* next = (i & 1) ? buf0 : buf1;
      const float xi = xs[pass == 0 ? ((i + kHalf) & (kValues - 1)) : i];
      const bool last = i == kValues - 1;
      if constexpr (G::kInPlace) {
        in_place_step<CB>(buf0, back + static_cast<size_t>(i) * G::kLow, xi, last, overlap, fin_v, fin_s);
        continue;
      }
#pragma unroll 1
      for (int lj = 0; lj < G::kLowsPerThread; ++lj) {
        const int low = (G::kGroup == 1) ? tid + lj * kThreads : tid / G::kGroup;
        float best = inf;
        int arg = 0;
        bool first = true;
#pragma unroll 8
        for (int hh = 0; hh < G::kHPerThread; hh += 2) {
          const int h = h0 + hh;
          const uint32_t s0 = static_cast<uint32_t>(h) * G::kLow + low;
          const uint32_t s1 = s0 + G::kLow;
          const float2 v = state_values<CB>(s0, s1);
          const float e0 = __fmaf_rn(-2.f, __fmul_rn(xi, v.x), __fmul_rn(v.x, v.x));
          const float e1 = __fmaf_rn(-2.f, __fmul_rn(xi, v.y), __fmul_rn(v.y, v.y));
          const float c0 = __fadd_rn(prev[s0 >> K], e0);
          const float c1 = __fadd_rn(prev[s1 >> K], e1);
          if (!last) {
            // Strict < keeps the first h on ties; the very first candidate is taken as is
            // (so an all-inf row yields h = 0, as torch's min does).
            if (first || c0 < best) {
              best = c0;
              arg = h;
            }
            first = false;
            if (c1 < best) {
              best = c1;
              arg = h + 1;
            }
          } else if (overlap < 0 || low == overlap) {
            // Final step: the argmin over all (pass 2: overlap-constrained) states.
            min_pair(fin_v, fin_s, c0, static_cast<int>(s0));
            min_pair(fin_v, fin_s, c1, static_cast<int>(s1));
          }
        }
        if (!last) {
          if constexpr (G::kGroup > 1) {
#pragma unroll
            for (int off = 1; off < G::kGroup; off <<= 1) {
              const float ob = __shfl_xor_sync(0xffffffffu, best, off);
              const int oa = __shfl_xor_sync(0xffffffffu, arg, off);
              min_pair(best, arg, ob, oa);
            }
          }
          if (g == 0) {
            next[low] = best;
            back[static_cast<size_t>(i) * G::kLow + low] = static_cast<uint8_t>(arg);
          }
        }
      }
      __syncthreads();
    }

    // Block argmin of the final state.
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, fin_v, off);
      const int oi = __shfl_xor_sync(0xffffffffu, fin_s, off);
      min_pair(fin_v, fin_s, ov, oi);
    }
    if ((tid & 31) == 0) {
      red_v[tid >> 5] = fin_v;
      red_i[tid >> 5] = fin_s;
    }
    __syncthreads();
    if (tid == 0) {
      float v = red_v[0];
      int s = red_i[0];
      for (int w = 1; w < kThreads / 32; ++w) min_pair(v, s, red_v[w], red_i[w]);
      // Backtrack: back[(i-1) * kLow + low] holds the h of the predecessor of step i's state.
      int32_t* o = out + static_cast<size_t>(tile) * kValues;
      if (pass) o[kValues - 1] = s;
      for (int i = kValues - 1; i > 0; --i) {
        const int low = s >> K;
        s = static_cast<int>(back[static_cast<size_t>(i - 1) * G::kLow + low]) * G::kLow + low;
        if (pass) {
          o[i - 1] = s;
        } else if (i - 1 == kHalf - 1) {
          // Rotated step 127 is value 255: its low 16-K bits are the overlap.
          overlap_s = s & (G::kLow - 1);
          break;
        }
      }
    }
    __syncthreads();
  }
}

template <int K, int CB>
void launch(const float* x, int32_t* out, uint8_t* ws, int tiles, cudaStream_t stream) {
  using G = VGeom<K>;
  auto kern = viterbi_kernel<K, CB>;
  // Idempotent and cheap; needed above 48 KB of dynamic shared memory (K <= 4).
  C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(G::kSmem)));
  kern<<<tiles, kThreads, G::kSmem, stream>>>(x, out, ws);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int CB>
void launch_k(int K, const float* x, int32_t* out, uint8_t* ws, int tiles, cudaStream_t stream) {
  switch (K) {
    case 1: launch<1, CB>(x, out, ws, tiles, stream); break;
    case 2: launch<2, CB>(x, out, ws, tiles, stream); break;
    case 3: launch<3, CB>(x, out, ws, tiles, stream); break;
    case 4: launch<4, CB>(x, out, ws, tiles, stream); break;
    case 5: launch<5, CB>(x, out, ws, tiles, stream); break;
    case 6: launch<6, CB>(x, out, ws, tiles, stream); break;
    case 7: launch<7, CB>(x, out, ws, tiles, stream); break;
    case 8: launch<8, CB>(x, out, ws, tiles, stream); break;
    default: TORCH_CHECK(false, "viterbi_encode: K must be 1..8, got ", K);
  }
}

size_t ws_per_tile(int K) { return static_cast<size_t>(kValues - 1) << (16 - K); }

// x (N, 256) fp32 tiles in storage order -> states (N, 256) int32. Tiles run in chunks so the
// back-pointer workspace stays under max_ws_bytes.
at::Tensor viterbi_encode(const at::Tensor& x, int64_t K, int64_t codebook, int64_t max_ws_bytes) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == kValues &&
                  x.is_contiguous(),
              "viterbi_encode: x must be a contiguous fp32 CUDA tensor (N, 256)");
  TORCH_CHECK(K >= 1 && K <= 8, "viterbi_encode: K must be 1..8, got ", K);
  TORCH_CHECK(codebook >= 0 && codebook <= 2, "viterbi_encode: codebook id must be 0..2");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.size(0);
  auto out = at::empty({n, kValues}, x.options().dtype(at::kInt));
  if (n == 0) return out;
  const size_t per = ws_per_tile(static_cast<int>(K));
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(n, max_ws_bytes / static_cast<int64_t>(per)));
  auto ws = at::empty({static_cast<int64_t>(chunk * per)}, x.options().dtype(at::kByte));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (int64_t t0 = 0; t0 < n; t0 += chunk) {
    const int tiles = static_cast<int>(std::min(chunk, n - t0));
    const float* xp = x.data_ptr<float>() + t0 * kValues;
    int32_t* op = out.data_ptr<int32_t>() + t0 * kValues;
    uint8_t* wp = ws.data_ptr<uint8_t>();
    if (codebook == CB_3INST) launch_k<CB_3INST>(static_cast<int>(K), xp, op, wp, tiles, stream);
    else if (codebook == CB_MCG) launch_k<CB_MCG>(static_cast<int>(K), xp, op, wp, tiles, stream);
    else launch_k<CB_MUL1>(static_cast<int>(K), xp, op, wp, tiles, stream);
  }
  return out;
}

}  // namespace

void bind_viterbi(pybind11::module_& m) {
  m.def("viterbi_encode", &viterbi_encode, "Tail-biting Viterbi over EXL3 tiles (K 1..8): states (N, 256) int32",
        pybind11::arg("x"), pybind11::arg("K"), pybind11::arg("codebook"), pybind11::arg("max_ws_bytes"));
}

}  // namespace trellis
