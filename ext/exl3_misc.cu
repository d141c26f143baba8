// Reconstruct (decode Q to fp16) and the standalone blockwise Hadamard, for the large-batch
// path: rotate the input, decode Q once, cuBLAS, rotate the output.
#include "exl3_common.cuh"
#include "trellis_ext.h"

namespace trellis {

// One block = 8 warps = the 8 tiles of one (tile row, 128-column group); each warp decodes one
// tile into shared memory, then the block writes 16 rows x 128 columns with 16-byte stores.
template <int K, int CB>
__global__ void __launch_bounds__(256) reconstruct_kernel(const uint32_t* __restrict__ trellis, __half* __restrict__ q,
                                                          int out) {
  constexpr int TW = TileGeom<K>::kWords;
  constexpr int NR = TileGeom<K>::kRaw;
  __shared__ __align__(16) __half tile_s[16][128 + 8];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int a = blockIdx.y;
  const int b = blockIdx.x * 8 + warp;
  const int tiles_out = out >> 4;
  const uint32_t* p = trellis + ((size_t)a * tiles_out + b) * TW;
  const LanePlan<K> plan(lane);
  uint32_t raw[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) raw[i] = __ldg(p + plan.word[i]);
  uint32_t st[8];
  lane_states<K>(raw, plan.r, st);
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    const __half2 v = u32_as_h2(decode_pair<CB>(st[j], st[j + 1]));
    // storage p = 8*lane + j: row = 2*(lane%4) + (j%2) + 8*((j/2)%2), col = lane/4 + 8*(j/4)
    const int row = 2 * (lane & 3) + 8 * ((j >> 1) & 1);
    const int col = warp * 16 + (lane >> 2) + 8 * (j >> 2);
    tile_s[row][col] = __low2half(v);
    tile_s[row + 1][col] = __high2half(v);
  }
  __syncthreads();
  const int row = threadIdx.x >> 4;       // 16 rows
  const int c8 = (threadIdx.x & 15) * 8;  // 16 x 8 halves per row
  *reinterpret_cast<uint4*>(q + ((size_t)a * 16 + row) * out + blockIdx.x * 128 + c8) =
      *reinterpret_cast<const uint4*>(&tile_s[row][c8]);
}

template <int CB>
static void reconstruct_cb(const uint32_t* t, __half* q, int in, int out, int K, cudaStream_t stream) {
  dim3 grid(out / 128, in / 16);
  switch (K) {
#define TRELLIS_CASE(k) \
  case k: reconstruct_kernel<k, CB><<<grid, 256, 0, stream>>>(t, q, out); break;
    TRELLIS_CASE(1) TRELLIS_CASE(2) TRELLIS_CASE(3) TRELLIS_CASE(4)
    TRELLIS_CASE(5) TRELLIS_CASE(6) TRELLIS_CASE(7) TRELLIS_CASE(8)
#undef TRELLIS_CASE
    default: break;
  }
}

void launch_reconstruct(const uint32_t* trellis, void* q, int in, int out, int K, int codebook, cudaStream_t stream) {
  __half* qh = static_cast<__half*>(q);
  if (codebook == CB_3INST) reconstruct_cb<CB_3INST>(trellis, qh, in, out, K, stream);
  else if (codebook == CB_MCG) reconstruct_cb<CB_MCG>(trellis, qh, in, out, K, stream);
  else reconstruct_cb<CB_MUL1>(trellis, qh, in, out, K, stream);
}

// One warp per 128-element block of one row.
__global__ void __launch_bounds__(256) hadamard_kernel(const void* __restrict__ x, int x_dtype, void* __restrict__ y,
                                                       int y_dtype, const __half* __restrict__ pre,
                                                       const __half* __restrict__ post, long long blocks, int n) {
  const int lane = threadIdx.x & 31;
  const long long blk = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
  if (blk >= blocks) return;
  const int per_row = n >> 7;
  const long long row = blk / per_row;
  const int f = (int)(blk % per_row) * 128 + 4 * lane;
  const size_t idx = (size_t)row * n + f;
  float v[4];
  load4(x, x_dtype, idx, v);
  if (pre) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] *= __half2float(pre[f + i]);
  }
  warp_hadamard128(v, lane);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] *= kRsqrt128;
  if (post) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] *= __half2float(post[f + i]);
  }
  store4(y, y_dtype, idx, v);
}

void launch_hadamard(const void* x, int x_dtype, void* y, int y_dtype, const void* pre, const void* post,
                     long long rows, int n, cudaStream_t stream) {
  const long long blocks = rows * (n / 128);
  if (blocks == 0) return;
  hadamard_kernel<<<(unsigned)((blocks + 7) / 8), 256, 0, stream>>>(
      x, x_dtype, y, y_dtype, static_cast<const __half*>(pre), static_cast<const __half*>(post), blocks, n);
}

}  // namespace trellis
