// EXL3 GEMV for 1..8 rows: y = (had(had(x * suh) @ Q) * svh), Q decoded from the trellis on the fly.
//
// One launch does the whole layer:
//  1. each block rotates its own slice of the input (x * suh, 128-point Hadamard, -> fp16) into
//     shared memory, laid out so that one 8-byte load gives a lane its MMA B fragment;
//  2. the block's 8 warps walk the input tiles of their slice for one group of 128 output
//     features (8 tiles), decode each tile straight into an A fragment and issue one
//     m16n8k16 MMA per tile (the transposed problem y^T = Q^T u^T keeps the batch in N = 8);
//  3. split-K partial sums go to a workspace; the last block of a column group (atomic ticket)
//     adds them up, applies the output Hadamard and svh, and writes y. The ticket counter is
//     reset by that block, so the workspace needs no clearing between launches (and a CUDA
//     graph can replay the launch).
// Why one launch: at batch 1 a 4096x4096 layer at 4 bpw is 8 MB, 2 us at the H200's copy
// bandwidth; separate Hadamard kernels would cost as much as the matrix.
#pragma once

#include "exl3_common.cuh"
#include "trellis_ext.h"

namespace trellis {

constexpr int kGemvThreads = 256;          // 8 warps
constexpr int kGemvMaxChunks = 16;         // 128-feature input chunks per block (smem bound)
constexpr int kGemvMaxRows = 8;            // batch rows (MMA N)


template <int K, int CB>
__global__ void __launch_bounds__(kGemvThreads) exl3_gemv_kernel(const GemvArgs args) {
  constexpr int NR = TileGeom<K>::kRaw;
  constexpr int TW = TileGeom<K>::kWords;
  __shared__ uint2 u_s[kGemvMaxChunks * 8][kGemvMaxRows][4];  // [tile row][batch][quad] -> 4 halves
  __shared__ float red_s[kGemvMaxRows][128];
  __shared__ int last_s;

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = blockIdx.x;       // output column group (8 tiles, 128 features)
  const int s = blockIdx.y;       // input split
  const int m = args.m;
  const int n_chunks = args.in >> 7;
  const int c_begin = (int)((long long)s * n_chunks / args.splits);
  const int c_end = (int)((long long)(s + 1) * n_chunks / args.splits);
  const int nch = c_end - c_begin;
  const int tiles_out = args.out >> 4;

  // ---- 1. input rotation into shared memory (and clear the reduction buffer) -------------
  for (int i = threadIdx.x; i < kGemvMaxRows * 128; i += kGemvThreads) (&red_s[0][0])[i] = 0.0f;
  for (int item = warp; item < nch * kGemvMaxRows; item += kGemvThreads / 32) {
    const int c = item >> 3;
    const int n = item & 7;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (n < m) {
      const int f = ((c_begin + c) << 7) + 4 * lane;
      load4(args.x, args.x_dtype, (size_t)n * args.in + f, v);
      const uint2 su = *reinterpret_cast<const uint2*>(static_cast<const __half*>(args.suh) + f);
      const float2 s01 = __half22float2(u32_as_h2(su.x));
      const float2 s23 = __half22float2(u32_as_h2(su.y));
      v[0] *= s01.x; v[1] *= s01.y; v[2] *= s23.x; v[3] *= s23.y;
      warp_hadamard128(v, lane);
    }
    // features 4*lane .. 4*lane+3 of chunk c: tile row c*8 + lane/4, k = 4*(lane%4) + {0..3}
    const int row = c * 8 + (lane >> 2);
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int k = 4 * (lane & 3) + 2 * p;
      const uint32_t h = h2_as_u32(__floats2half2_rn(v[2 * p] * kRsqrt128, v[2 * p + 1] * kRsqrt128));
      uint32_t* dst = reinterpret_cast<uint32_t*>(&u_s[row][n][(k & 7) >> 1]);
      dst[k >> 3] = h;
    }
  }
  __syncthreads();

  // ---- 2. decode + MMA over this block's tile rows ---------------------------------------
  const LanePlan<K> plan(lane);
  float acc[8][4];
#pragma unroll
  for (int t = 0; t < 8; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;

  const int rows = nch * 8;
  const int a0 = c_begin * 8;
  const uint32_t* base = args.trellis + ((size_t)a0 * tiles_out + (size_t)g * 8) * TW;
  const size_t row_stride = (size_t)tiles_out * TW;

  uint32_t cur[8][NR], nxt[8][NR];
  if (warp < rows) {
    const uint32_t* p = base + (size_t)warp * row_stride;
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int i = 0; i < NR; ++i) cur[t][i] = __ldg(p + t * TW + plan.word[i]);
  }
  for (int r = warp; r < rows; r += kGemvThreads / 32) {
    const int rn = r + kGemvThreads / 32;
    if (rn < rows) {
      const uint32_t* p = base + (size_t)rn * row_stride;
#pragma unroll
      for (int t = 0; t < 8; ++t)
#pragma unroll
        for (int i = 0; i < NR; ++i) nxt[t][i] = __ldg(p + t * TW + plan.word[i]);
    }
    const uint2 b = u_s[r][lane >> 2][lane & 3];
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      uint32_t a[4];
      decode_fragment<K, CB>(cur[t], plan.r, a);
      mma_16816(acc[t], a, b.x, b.y);
    }
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int i = 0; i < NR; ++i) cur[t][i] = nxt[t][i];
  }

  // C fragment: c0 = (out 16t + lane/4, batch 2*(lane%4)), c1 = batch + 1, c2/c3 = out + 8.
  {
    const int n0 = 2 * (lane & 3);
    const int col = lane >> 2;
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      if (n0 < m) {
        atomicAdd(&red_s[n0][16 * t + col], acc[t][0]);
        atomicAdd(&red_s[n0][16 * t + col + 8], acc[t][2]);
      }
      if (n0 + 1 < m) {
        atomicAdd(&red_s[n0 + 1][16 * t + col], acc[t][1]);
        atomicAdd(&red_s[n0 + 1][16 * t + col + 8], acc[t][3]);
      }
    }
  }
  __syncthreads();

  // ---- 3. split-K reduction (last block of the column group) and output rotation ----------
  if (args.splits > 1) {
    for (int i = threadIdx.x; i < m * 128; i += kGemvThreads) {
      const int n = i >> 7, c = i & 127;
      args.partial[((size_t)s * m + n) * args.out + (g << 7) + c] = red_s[n][c];
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last_s = (atomicAdd(&args.counters[g], 1) == args.splits - 1);
    __syncthreads();
    if (!last_s) return;
    __threadfence();
    for (int i = threadIdx.x; i < m * 128; i += kGemvThreads) {
      const int n = i >> 7, c = i & 127;
      float sum = 0.f;
      for (int q = 0; q < args.splits; ++q) sum += __ldcg(&args.partial[((size_t)q * m + n) * args.out + (g << 7) + c]);
      red_s[n][c] = sum;
    }
    if (threadIdx.x == 0) args.counters[g] = 0;
    __syncthreads();
  }
  if (warp < m) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = red_s[warp][4 * lane + i];
    warp_hadamard128(v, lane);
    const int f = (g << 7) + 4 * lane;
    const uint2 sv = *reinterpret_cast<const uint2*>(static_cast<const __half*>(args.svh) + f);
    const float2 s01 = __half22float2(u32_as_h2(sv.x));
    const float2 s23 = __half22float2(u32_as_h2(sv.y));
    v[0] *= kRsqrt128 * s01.x; v[1] *= kRsqrt128 * s01.y;
    v[2] *= kRsqrt128 * s23.x; v[3] *= kRsqrt128 * s23.y;
    store4(args.y, args.x_dtype, (size_t)warp * args.out + f, v);
  }
}

template <int K, int CB>
void launch_gemv(const GemvArgs& a, cudaStream_t stream) {
  dim3 grid(a.out >> 7, a.splits);
  exl3_gemv_kernel<K, CB><<<grid, kGemvThreads, 0, stream>>>(a);
}

template <int K, int CB>
int gemv_blocks_per_sm() {
  static int cached = -1;
  if (cached < 0) {
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, exl3_gemv_kernel<K, CB>, kGemvThreads, 0);
    cached = n > 0 ? n : 1;
  }
  return cached;
}

}  // namespace trellis
