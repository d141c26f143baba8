// The workspace split-K EXL3 GEMV for 1..16 rows: y = (had(had(x * suh) @ Q) * svh), Q decoded from
// the trellis on the fly. It is the portable GEMV (any sm_80+ GPU); where the GPU has thread-block
// clusters (sm_90+) the cluster split-K GEMV (exl3_gemv_cluster.cuh) runs instead.
//
// One launch does the whole layer:
//  1. each block rotates its own slice of the input (x * suh, 128-point Hadamard, -> fp16) into
//     shared memory, laid out so that one 8-byte load gives a lane its MMA B fragment;
//  2. the block's 8 warps walk the input tiles of their slice for one group of 128 output
//     features (8 tiles), decode each tile straight into an A fragment and issue one
//     m16n8k16 MMA per tile (the transposed problem y^T = Q^T u^T keeps the batch in N = 8);
//     9..16 rows are two column groups of N = 8 (the RG = 2 instances): each tile is decoded
//     once and its A fragment feeds the MMAs of both groups;
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
constexpr int kGemvMaxRows = 8;            // batch rows of one column group (MMA N)
constexpr int kGemvWideRows = 16;          // batch rows of the two-group (RG = 2) instances

// Column groups of N = 8 for m rows: one up to 8 rows, two up to 16, so that a speculative verify
// step of 9..16 rows reads and decodes each tile once instead of writing and reading the whole
// fp16 weight for a GEMM. Every kernel is instantiated per group count: the 1..8-row instances
// keep their shared memory, registers and occupancy.
__host__ __device__ constexpr int gemv_row_groups(int m) { return m > kGemvMaxRows ? 2 : 1; }
// Blocks per SM an instance is built for. Two groups hold twice the accumulators (64 floats a
// lane): they fit 128 registers at 2 blocks, not the 80 of 3 blocks.
__host__ __device__ constexpr int gemv_min_blocks(int rg) { return rg == 1 ? 3 : 2; }
// Input chunks per block of the workspace GEMV: its u_s is static shared memory (48 KB at most),
// so two groups take half the chunks (the same 32 KB).
__host__ __device__ constexpr int gemv_max_chunks(int rg) { return kGemvMaxChunks / rg; }

// Each warp streams its tile rows (8 tiles = one 128-column group) through a ring of
// shared-memory stages with cp.async, so several rows per warp are in flight at once: with one
// row of register prefetch the kernel was bound by DRAM latency, not by bytes or instructions
// (its time did not depend on the bits per weight).
template <int K>
struct GemvPipe {
  // Stage count keeps the block at <= ~70 KB of shared memory: 3 blocks (24 warps) per SM.
  static constexpr int kStages = K <= 4 ? 4 : (K <= 6 ? 3 : 2);
  static constexpr int kRowWords = 8 * TileGeom<K>::kWords;  // uint32 words per row of 8 tiles
  static constexpr int kSmemBytes = (kGemvThreads / 32) * kStages * kRowWords * 4;
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(gmem));
}
// Starts fetching the 128-byte line at `p` into L2 (no register, nothing to wait for).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }


// The decode skips the final fp16 rounding of each weight (section 6.2's bit-exact value would
// cost a PRMT/HADD2 or HFMA2 per weight pair):
//  - 3INST/MCG: the two fp16 halves of x go to the MMA as they are (each register holds (lo, hi)
//    of ONE weight, the activation is duplicated in B), so the tile takes two MMAs; the product
//    is (lo + hi) * u exactly instead of RN(lo + hi) * u;
//  - MUL1: the MMA multiplies h = 1024 + b (exact in fp16) and the block applies the affine
//    map afterwards: sum(h*k_inv + k_bias)*u = k_inv*sum(h*u) + k_bias*sum(u).
// Either way the deviation from the exact product is below one fp16 rounding per weight.
// Static shared memory of one GEMV block of RG column groups. It lives in the kernel, not in the
// block function: every <K, CB> instance of a function-scope __shared__ array would get its own
// storage, and the multi-matrix kernel inlines all eight K instances.
template <int RG>
struct GemvSmemT {
  uint2 u_s[gemv_max_chunks(RG) * 8][kGemvMaxRows * RG][4];  // [tile row][batch][quad] -> 4 halves
  float red_s[kGemvMaxRows * RG][128];
  float usum_s[kGemvMaxRows * RG];
  int last_s;
};
using GemvSmem = GemvSmemT<1>;

// The work of one block: output column group g (8 tiles, 128 features), input split s, batch rows
// in RG column groups of 8.
// kExpertRow: one row of the expert GEMV (exl3_expert_gemv.cu, m = 1): x holds only its first
// x_cols <= in features (a multiple of 4; the features beyond are read as zeros, the padded input of
// an expert whose width is not a multiple of 128), and y is fp32 whatever x's dtype (the experts'
// activation and mix run in fp32). Other instances compile as before.
template <int K, int CB, int RG = 1, bool kExpertRow = false>
__device__ __forceinline__ void gemv_block(const GemvArgs& args, const int g, const int s, GemvSmemT<RG>& sm,
                                           const int x_cols = 0) {
  constexpr int NR = TileGeom<K>::kRaw;
  constexpr int TW = TileGeom<K>::kWords;
  constexpr int R = kGemvMaxRows * RG;        // rows of u_s and red_s
  constexpr int kRowShift = RG == 1 ? 3 : 4;  // log2(R)
  auto& u_s = sm.u_s;
  auto& red_s = sm.red_s;
  auto& usum_s = sm.usum_s;
  int& last_s = sm.last_s;

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int m = args.m;
  const int n_chunks = args.in >> 7;
  const int c_begin = (int)((long long)s * n_chunks / args.splits);
  const int c_end = (int)((long long)(s + 1) * n_chunks / args.splits);
  const int nch = c_end - c_begin;
  const int tiles_out = args.out >> 4;

  // Start the first rows' copies now, so their DRAM latency overlaps the input rotation.
  using Pipe = GemvPipe<K>;
  constexpr int ST = Pipe::kStages;
  constexpr int RW = Pipe::kRowWords;
  extern __shared__ uint4 gemv_dyn_smem[];
  uint32_t* wbuf = reinterpret_cast<uint32_t*>(gemv_dyn_smem) + warp * ST * RW;
  const LanePlan<K> plan(lane);
  const uint32_t* base = args.trellis + ((size_t)(c_begin * 8) * tiles_out + (size_t)g * 8) * TW;
  const size_t row_stride = (size_t)tiles_out * TW;
  const int my_rows = nch;  // rows warp, warp + 8, ... (rows = 8 * nch)
  auto issue_row = [&](int i) {
    if (i < my_rows) {
      const uint4* src = reinterpret_cast<const uint4*>(base + (size_t)(warp + 8 * i) * row_stride);
      uint4* dst = reinterpret_cast<uint4*>(wbuf + (i % ST) * RW);
#pragma unroll
      for (int c = lane; c < RW / 4; c += 32) cp_async16(dst + c, src + c);
    }
    cp_async_commit();  // empty groups keep the group count uniform
  };
#pragma unroll
  for (int i = 0; i < ST - 1; ++i) issue_row(i);

  // ---- 1. input rotation into shared memory (and clear the reduction buffers) ------------
  for (int i = threadIdx.x; i < R * 128; i += kGemvThreads) (&red_s[0][0])[i] = 0.0f;
  if (threadIdx.x < R) usum_s[threadIdx.x] = 0.0f;
  __syncthreads();
  // Rows n >= m rotate zeros: the B fragments of absent rows read them.
  for (int item = warp; item < nch * R; item += kGemvThreads / 32) {
    const int c = item >> kRowShift;
    const int n = item & (R - 1);
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (n < m) {
      const int f = ((c_begin + c) << 7) + 4 * lane;
      if (!kExpertRow || f < x_cols) load4(args.x, args.x_dtype, (size_t)n * args.in + f, v);
      const uint2 su = *reinterpret_cast<const uint2*>(static_cast<const __half*>(args.suh) + f);
      const float2 s01 = __half22float2(u32_as_h2(su.x));
      const float2 s23 = __half22float2(u32_as_h2(su.y));
      v[0] *= s01.x; v[1] *= s01.y; v[2] *= s23.x; v[3] *= s23.y;
      warp_hadamard128(v, lane);
    }
    // features 4*lane .. 4*lane+3 of chunk c: tile row c*8 + lane/4, k = 4*(lane%4) + {0..3}
    const int row = c * 8 + (lane >> 2);
    float rsum = 0.f;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int k = 4 * (lane & 3) + 2 * p;
      const __half2 hv = __floats2half2_rn(v[2 * p] * kRsqrt128, v[2 * p + 1] * kRsqrt128);
      const float2 back = __half22float2(hv);
      rsum += back.x + back.y;
      uint32_t* dst = reinterpret_cast<uint32_t*>(&u_s[row][n][(k & 7) >> 1]);
      dst[k >> 3] = h2_as_u32(hv);
    }
    if constexpr (CB == CB_MUL1) {
      // sum of the fp16 activations the MMA sees, for the k_bias term
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) rsum += __shfl_xor_sync(0xFFFFFFFFu, rsum, o);
      if (lane == 0 && n < m) usum_s[n] += rsum;  // row n is always handled by warp n % 8
    }
  }
  __syncthreads();

  // ---- 2. decode + MMA over this block's tile rows ---------------------------------------
  float acc[RG][8][4];  // [column group][tile][C fragment]
#pragma unroll
  for (int q = 0; q < RG; ++q)
#pragma unroll
    for (int t = 0; t < 8; ++t) acc[q][t][0] = acc[q][t][1] = acc[q][t][2] = acc[q][t][3] = 0.f;

  for (int i = 0; i < my_rows; ++i) {
    const int r = warp + 8 * i;
    cp_async_wait<ST - 2>();  // row i has landed (this lane's copies) ...
    __syncwarp();             // ... and every lane's; stage (i-1) % ST is free again
    uint32_t cur[8][NR];
    const uint32_t* stage = wbuf + (i % ST) * RW;
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int w = 0; w < NR; ++w) cur[t][w] = stage[t * TW + plan.word[w]];
    issue_row(i + ST - 1);
    uint2 b[RG];  // column group q: batch row 8q + lane/4
#pragma unroll
    for (int q = 0; q < RG; ++q) b[q] = u_s[r][8 * q + (lane >> 2)][lane & 3];
    if constexpr (CB != CB_MUL1) {
      // B for the even-k MMA: (u[2t], u[2t]) and (u[2t+8], u[2t+8]); odd-k: u[2t+1], u[2t+9].
      uint32_t be0[RG], be1[RG], bo0[RG], bo1[RG];
#pragma unroll
      for (int q = 0; q < RG; ++q) {
        be0[q] = __byte_perm(b[q].x, 0, 0x1010), be1[q] = __byte_perm(b[q].y, 0, 0x1010);
        bo0[q] = __byte_perm(b[q].x, 0, 0x3232), bo1[q] = __byte_perm(b[q].y, 0, 0x3232);
      }
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        uint32_t st[8];
        lane_states<K>(cur[t], plan.r, st);
        uint32_t x[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = inst_halves<CB>(st[j]);
        const uint32_t ae[4] = {x[0], x[4], x[2], x[6]};
        const uint32_t ao[4] = {x[1], x[5], x[3], x[7]};
#pragma unroll
        for (int q = 0; q < RG; ++q) {  // one decode, the MMAs of every column group
          mma_16816(acc[q][t], ae, be0[q], be1[q]);
          mma_16816(acc[q][t], ao, bo0[q], bo1[q]);
        }
      }
    } else {
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        uint32_t a[4];
        decode_fragment_mul1_raw<K>(cur[t], plan.r, a);
#pragma unroll
        for (int q = 0; q < RG; ++q) mma_16816(acc[q][t], a, b[q].x, b[q].y);
      }
    }
    __syncwarp();  // all lanes done reading this stage before it is refilled
  }
  cp_async_wait<0>();

  // C fragment: c0 = (out 16t + lane/4, batch 8q + 2*(lane%4)), c1 = batch + 1, c2/c3 = out + 8.
#pragma unroll
  for (int q = 0; q < RG; ++q) {
    const int n0 = 8 * q + 2 * (lane & 3);
    const int col = lane >> 2;
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      if (n0 < m) {
        atomicAdd(&red_s[n0][16 * t + col], acc[q][t][0]);
        atomicAdd(&red_s[n0][16 * t + col + 8], acc[q][t][2]);
      }
      if (n0 + 1 < m) {
        atomicAdd(&red_s[n0 + 1][16 * t + col], acc[q][t][1]);
        atomicAdd(&red_s[n0 + 1][16 * t + col + 8], acc[q][t][3]);
      }
    }
  }
  __syncthreads();
  if constexpr (CB == CB_MUL1) {
    const float k_inv = __half2float(__ushort_as_half(0x1EEE));
    const float k_bias = __half2float(__ushort_as_half(0xC931));
    for (int i = threadIdx.x; i < m * 128; i += kGemvThreads) {
      const int n = i >> 7, c = i & 127;
      red_s[n][c] = fmaf(k_inv, red_s[n][c], k_bias * usum_s[n]);
    }
    __syncthreads();
  }

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
    // One thread per (row, column): a sum over the splits with 8 independent loads in flight.
    const size_t split_stride = (size_t)m * args.out;
    for (int e = threadIdx.x; e < m * 128; e += kGemvThreads) {
      const float* p = args.partial + (size_t)(e >> 7) * args.out + (g << 7) + (e & 127);
      float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      int q = 0;
      for (; q + 8 <= args.splits; q += 8) {
#pragma unroll
        for (int u = 0; u < 8; ++u) a[u] += __ldcg(p + (size_t)(q + u) * split_stride);
      }
      for (; q < args.splits; ++q) a[0] += __ldcg(p + (size_t)q * split_stride);
      red_s[e >> 7][e & 127] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    }
    if (threadIdx.x == 0) args.counters[g] = 0;
    __syncthreads();
  }
#pragma unroll
  for (int q = 0; q < RG; ++q) {  // warp w writes rows w and w + 8
    const int n = warp + 8 * q;
    if (n >= m) break;
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = red_s[n][4 * lane + i];
    warp_hadamard128(v, lane);
    const int f = (g << 7) + 4 * lane;
    const uint2 sv = *reinterpret_cast<const uint2*>(static_cast<const __half*>(args.svh) + f);
    const float2 s01 = __half22float2(u32_as_h2(sv.x));
    const float2 s23 = __half22float2(u32_as_h2(sv.y));
    v[0] *= kRsqrt128 * s01.x; v[1] *= kRsqrt128 * s01.y;
    v[2] *= kRsqrt128 * s23.x; v[3] *= kRsqrt128 * s23.y;
    store4(args.y, kExpertRow ? DT_F32 : args.x_dtype, (size_t)n * args.out + f, v);
  }
}

// Three blocks per SM (1..8 rows): one warp issues only every several cycles (the decode's
// dependency chains), so occupancy, not bandwidth, sets the speed. Two at 9..16 rows, whose
// warps issue twice the MMAs per decoded tile (gemv_min_blocks).
template <int K, int CB, int RG>
__global__ void __launch_bounds__(kGemvThreads, gemv_min_blocks(RG)) exl3_gemv_kernel(const GemvArgs args) {
  __shared__ GemvSmemT<RG> sm;
  gemv_block<K, CB, RG>(args, blockIdx.x, blockIdx.y, sm);
}

// Several GEMVs of one input in one launch (q/k/v, gate/up): the 1-D grid is matrix 0's blocks,
// then matrix 1's, ...; each matrix has its own K, split count, workspace and ticket region.
// A block's K is block-uniform, so the switch costs one branch, and every block does exactly
// what the single-matrix kernel's block (g, s) does (same sums; only the order of the 8 warps'
// shared-memory atomics varies, run to run, in either kernel).
template <int CB, int RG>
__global__ void __launch_bounds__(kGemvThreads, gemv_min_blocks(RG))
    exl3_gemv_multi_kernel(const GemvMultiArgs args) {
  __shared__ GemvSmemT<RG> sm;
  const int b = blockIdx.x;
  // begin[1], begin[2] of absent matrices are INT_MAX, so i < count.
  const int i = (b >= args.begin[1]) + (b >= args.begin[2]);
  const GemvArgs& a = args.mat[i];
  const int local = b - args.begin[i];
  const int groups = a.out >> 7;
  const int g = local % groups, s = local / groups;
  switch (args.K[i]) {
#define TRELLIS_MULTI_CASE(k) \
  case k: gemv_block<k, CB, RG>(a, g, s, sm); break;
    TRELLIS_MULTI_CASE(1) TRELLIS_MULTI_CASE(2) TRELLIS_MULTI_CASE(3) TRELLIS_MULTI_CASE(4)
    TRELLIS_MULTI_CASE(5) TRELLIS_MULTI_CASE(6) TRELLIS_MULTI_CASE(7) TRELLIS_MULTI_CASE(8)
#undef TRELLIS_MULTI_CASE
    default: break;
  }
}

template <int K, int CB, int RG>
void gemv_allow_smem() {
  static bool done = false;  // once per instantiation (per process; one GPU model assumed)
  if (!done) {
    cudaFuncSetAttribute(exl3_gemv_kernel<K, CB, RG>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         GemvPipe<K>::kSmemBytes);
    done = true;
  }
}

template <int K, int CB, int RG>
void launch_gemv(const GemvArgs& a, cudaStream_t stream) {
  gemv_allow_smem<K, CB, RG>();
  dim3 grid(a.out >> 7, a.splits);
  exl3_gemv_kernel<K, CB, RG><<<grid, kGemvThreads, GemvPipe<K>::kSmemBytes, stream>>>(a);
}

template <int K, int CB, int RG>
int gemv_blocks_per_sm() {
  static int cached = -1;
  if (cached < 0) {
    gemv_allow_smem<K, CB, RG>();
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, exl3_gemv_kernel<K, CB, RG>, kGemvThreads,
                                                  GemvPipe<K>::kSmemBytes);
    cached = n > 0 ? n : 1;
  }
  return cached;
}

// Dynamic shared memory of a block of K bits per weight (host side).
inline int gemv_smem_bytes(int K) {
  switch (K) {
    case 1: return GemvPipe<1>::kSmemBytes;
    case 2: return GemvPipe<2>::kSmemBytes;
    case 3: return GemvPipe<3>::kSmemBytes;
    case 4: return GemvPipe<4>::kSmemBytes;
    case 5: return GemvPipe<5>::kSmemBytes;
    case 6: return GemvPipe<6>::kSmemBytes;
    case 7: return GemvPipe<7>::kSmemBytes;
    default: return GemvPipe<8>::kSmemBytes;
  }
}

inline int gemv_max_smem_bytes() {
  int n = 0;
  for (int k = 1; k <= 8; ++k) n = n > gemv_smem_bytes(k) ? n : gemv_smem_bytes(k);
  return n;
}

// Launch the multi-matrix GEMV over `blocks` blocks (blocks_per_sm == nullptr), or query its
// occupancy at the largest stage ring any K uses.
template <int CB, int RG>
void gemv_multi_run_groups(const GemvMultiArgs& a, int blocks, cudaStream_t stream, int* blocks_per_sm) {
  static bool ready = false;
  static int bps = 1;
  if (!ready) {
    cudaFuncSetAttribute(exl3_gemv_multi_kernel<CB, RG>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         gemv_max_smem_bytes());
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, exl3_gemv_multi_kernel<CB, RG>, kGemvThreads,
                                                  gemv_max_smem_bytes());
    bps = n > 0 ? n : 1;
    ready = true;
  }
  if (blocks_per_sm) {
    *blocks_per_sm = bps;
    return;
  }
  int smem = 0;  // the largest ring among this launch's matrices
  for (int i = 0; i < a.count; ++i) smem = smem > gemv_smem_bytes(a.K[i]) ? smem : gemv_smem_bytes(a.K[i]);
  exl3_gemv_multi_kernel<CB, RG><<<blocks, kGemvThreads, smem, stream>>>(a);
}

// The multi-matrix GEMV at the column-group count of its rows (a.mat[0].m, every matrix's).
template <int CB>
void gemv_multi_run(const GemvMultiArgs& a, int blocks, cudaStream_t stream, int* blocks_per_sm) {
  if (gemv_row_groups(a.mat[0].m) == 2) gemv_multi_run_groups<CB, 2>(a, blocks, stream, blocks_per_sm);
  else gemv_multi_run_groups<CB, 1>(a, blocks, stream, blocks_per_sm);
}

// The single-matrix GEMV of codebook CB for a runtime K and a.m rows (launch, or query occupancy
// when blocks_per_sm is set). Each codebook's .cu file instantiates it, so ninja compiles them in
// parallel.
template <int CB, int RG>
void gemv_dispatch_groups(int K, const GemvArgs& a, cudaStream_t stream, int* blocks_per_sm) {
  switch (K) {
#define TRELLIS_CASE(k)                                                  \
  case k:                                                                \
    if (blocks_per_sm) *blocks_per_sm = gemv_blocks_per_sm<k, CB, RG>(); \
    else launch_gemv<k, CB, RG>(a, stream);                              \
    break;
    TRELLIS_CASE(1) TRELLIS_CASE(2) TRELLIS_CASE(3) TRELLIS_CASE(4)
    TRELLIS_CASE(5) TRELLIS_CASE(6) TRELLIS_CASE(7) TRELLIS_CASE(8)
#undef TRELLIS_CASE
    default: break;
  }
}

template <int CB>
void gemv_dispatch(int K, const GemvArgs& a, cudaStream_t stream, int* blocks_per_sm) {
  if (gemv_row_groups(a.m) == 2) gemv_dispatch_groups<CB, 2>(K, a, stream, blocks_per_sm);
  else gemv_dispatch_groups<CB, 1>(K, a, stream, blocks_per_sm);
}

}  // namespace trellis
