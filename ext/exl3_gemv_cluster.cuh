// The cluster split-K EXL3 GEMV (1..16 rows, sm_90+): the workspace GEMV's block (exl3_gemv.cuh)
// without its serial fixed costs. It runs wherever the GPU has thread-block clusters; the
// workspace GEMV stays the portable one for older GPUs.
//
// Why: the workspace GEMV spends most of a 4096x4096 launch outside the decode loop. A launch is
// one wave of small blocks (2-3 input chunks each), and every block runs its phases in series:
// (1) the input rotation, all of it in warp n for batch row n (m = 1: one warp rotates every
// chunk, one L2 round trip each); (2) decode + MMA; (3) 32 shared-memory float atomicAdds per
// lane from 8 warps onto the same 128 columns (no native instruction: ATOMS.CAS spin loops,
// contended); (4) partial sums to global, __threadfence (MEMBAR.SC.GPU), an atomic ticket, the
// last block reading every split back from L2. Only (2) scales with the bytes; so time did not
// depend on K.
// This kernel keeps the decode loop and the math, and changes the rest:
//  - the input rotation is spread over all warps (items = live (chunk, row) pairs only) and each
//    warp loads its next 4 items before rotating them: one L2 round trip instead of up to 16;
//  - the 8 warps' sums go through plain shared stores + one fixed-order sum (no atomics,
//    deterministic), in the ring's memory (free once the loop is done);
//  - split-K across a thread-block cluster: the S blocks of a column group are one cluster, and
//    the block that owns batch row n sums the S blocks' shared sums through distributed shared
//    memory (DSMEM), in rank order, then rotates and stores. No workspace, no ticket, no fence.
//  - the activation tile u_s holds only the m live rows (m x 32 bytes per tile row, not 8 x 32),
//    so more blocks fit per SM; lanes of absent rows use a zero B fragment.
// The single and the multi-matrix GEMV are the same kernel (one matrix = a multi launch of one).
// 9..16 rows are two column groups of N = 8 (RG = 2 instances, exl3_gemv.cuh gemv_row_groups):
// each tile is decoded once and its A fragment feeds both groups' MMAs; the block sum runs per
// group through the same 8-row area, so only u_s (m rows) and the static sums grow.
// Same products and fp32 accumulation as the workspace GEMV (same decode functions, same MMAs per
// tile). Like it, the decode skips the final fp16 rounding of each weight (exl3_gemv.cuh).
//
// Int8 variant (I8, MUL1 only, 1..2 rows): a MUL1 weight is the byte sum of its hash
// x = s * 0x83DCD12D (plus an affine map), so sum_k u_k w_k needs no per-weight conversion at
// all: the hash word IS four u8 elements of an m16n8k32 integer MMA's A fragment, and B holds
// each input replicated in four consecutive k. That drops the dp4a per weight and the fp16 MMA.
// Inputs become 15-bit fixed point per (block, row), q = 128*hi + lo (hi signed, lo 0..127), and
// hi goes into B's columns 0..3, lo into columns 4..7 of the same MMA (at m <= 4 those columns are
// idle anyway), so precision stays near fp16's at no extra MMA. ExLlamaV3's int8 GEMV rounds the
// inputs to 8 bits (~0.6 % output error); this one to 15 bits (~1e-4 of the row's largest input).
#pragma once

#include <algorithm>
#include <type_traits>

#include "chained_launch.cuh"
#include "exl3_gemv.cuh"

namespace trellis {

constexpr int kClusterMaxSize = 16;        // non-portable cluster size (Hopper); 8 is always allowed
constexpr int kClusterRedStride = 132;     // padded row of a warp's partial sums (fewer bank conflicts)
constexpr int kClusterPrefetchItems = 4;   // rotation items a warp loads before rotating them (at most)

// Dynamic shared memory of a block (host and device agree on it):
//   [0, u_bytes): u_s, (tile row, batch row n < m, quad) -> uint2 B fragment (4 fp16)
//   [u_bytes, ...): the per-warp cp.async rings during the loop, then the per-warp sums.
__host__ __device__ constexpr int cluster_u_rows(int n_chunks, int splits) { return 8 * ((n_chunks + splits - 1) / splits); }
__host__ __device__ constexpr int cluster_u_bytes(int n_chunks, int splits, int m) {
  return cluster_u_rows(n_chunks, splits) * m * 32;
}
// Rows of the int8 variant. The layout holds 4 (B columns: hi 0..3, lo 4..7), but at 3-4 rows it
// is no faster than the fp16 kernel (docs/KERNELS.md, section 3.3), so it stops at 2.
constexpr int kClusterInt8MaxRows = 2;
// The per-warp sums; the int8 variant stores its hi and lo sums apart (two rows per batch row).
// Above 8 rows the column groups take turns in an 8-row area.
__host__ __device__ constexpr int cluster_red_bytes(int m) {
  return (kGemvThreads / 32) * (m <= kClusterInt8MaxRows ? 2 * m : (m < kGemvMaxRows ? m : kGemvMaxRows)) *
         kClusterRedStride * 4;
}
constexpr float kClusterInt8Range = 16383.f;  // |q| <= 2^14 - 1: hi = q >> 7 fits a signed byte

template <int RG>
struct alignas(16) GemvClusterSmem {
  float red_s[kGemvMaxRows * RG][128];              // this block's sums, read by the cluster
  float usum_s[kGemvMaxChunks][kGemvMaxRows * RG];  // MUL1 fp16: per (chunk, row) sums of u
  float wmax_s[kGemvThreads / 32][kClusterInt8MaxRows];  // int8: each warp's max |u| per row
  int wqsum_s[kGemvThreads / 32][kClusterInt8MaxRows];   // int8: each warp's sum of q per row
};

// max that keeps a NaN (fmaxf drops it): a NaN input row must give NaN outputs, as the fp16
// kernels do, not the finite garbage its fixed-point conversion would make of it.
__device__ __forceinline__ float max_nan(float a, float b) { return (b > a || b != b) ? b : a; }

// D = A * B + D on the integer tensor cores: A u8 (16 x 32, row), B s8 (32 x 8, col), s32 sums.
__device__ __forceinline__ void mma_16832_u8s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Cluster barrier; release/acquire makes this block's shared stores visible to the cluster.
__device__ __forceinline__ void cluster_sync_acq_rel() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Cluster barrier without memory ordering: only "every block got here" (the DSMEM reads before it
// have completed: their values were used).
__device__ __forceinline__ void cluster_sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
}
// 16 bytes of block `rank`'s shared memory at this block's address `p` (same layout in every block).
__device__ __forceinline__ float4 ld_dsmem_f4(const void* p, unsigned rank) {
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote));
  return v;
}

// v as x's dtype stores it (the value the next kernel would read back).
__device__ __forceinline__ float as_stored(int dtype, float v) {
  if (dtype == DT_F16) return __half2float(__float2half_rn(v));
  if (dtype == DT_BF16) return __bfloat162float(__float2bfloat16_rn(v));
  return v;
}

// What the epilogue's writer warp needs of the step's inputs, loaded before the cluster
// barrier (they are no kernel's output in the step's chain: see chained_launch.cuh).
struct EpilogueInputs {
  float c[4], s[4];  // cos and sin of outputs f..f+3 (rope)
  long long slot;    // cache row (cache)
};

__device__ __forceinline__ void epilogue_load(const GemvArgs& a, const GemvRopeEpilogue& e, int mat, int n, int f,
                                              EpilogueInputs& in) {
  if (e.rope[mat]) {
    const size_t at = (size_t)n * e.head_dim + (f & (e.head_dim - 1));
    load4(e.cos, a.x_dtype, at, in.c);
    load4(e.sin, a.x_dtype, at, in.s);
  }
  in.slot = e.cache[mat] != nullptr ? e.slots[n] : 0;
}

// Outputs f..f+3 of batch row n of matrix `mat` (lane's 4 of the warp's 128), which the plain
// kernel stores to y as they are: rotated by rotate-half RoPE where e.rope[mat], rounded as the
// RoPE kernel (ext/fused_ops.cu) rounds when it reads the stored output back, so the results are
// the two launches' bit for bit; then stored to the cache row slot where e.cache[mat], else to y.
// The partner of element i is element i +- head_dim/2, head_dim/8 lanes away; all lanes call this.
__device__ __forceinline__ void epilogue_store(const GemvArgs& a, const GemvRopeEpilogue& e, int mat, int n, int f,
                                               const EpilogueInputs& in, float (&v)[4]) {
  if (e.rope[mat]) {
    const int half = e.head_dim >> 1;
    const bool first = (f & (e.head_dim - 1)) < half;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float x = as_stored(a.x_dtype, v[j]);
      const float partner = __shfl_xor_sync(0xFFFFFFFFu, x, half >> 2);
      const float ps = as_stored(a.x_dtype, partner * in.s[j]);
      v[j] = as_stored(a.x_dtype, x * in.c[j]) + (first ? -ps : ps);
    }
  }
  if (e.cache[mat] == nullptr) {
    store4(a.y, a.x_dtype, (size_t)n * a.out + f, v);
  } else if (in.slot >= 0 && in.slot < e.num_slots) {
    store4(e.cache[mat], a.x_dtype, (size_t)in.slot * a.out + f, v);
  }
}

template <int K, int CB, bool I8, int RG>
__device__ __forceinline__ void gemv_cluster_block(const GemvArgs& args, const int g, const int s,
                                                   GemvClusterSmem<RG>& sm, uint32_t* dyn,
                                                   const GemvRopeEpilogue& epi, const int mat) {
  static_assert(!I8 || RG == 1, "the int8 variant takes 1..kClusterInt8MaxRows rows");
  constexpr int NR = TileGeom<K>::kRaw;
  constexpr int TW = TileGeom<K>::kWords;
  using Pipe = GemvPipe<K>;
  constexpr int ST = Pipe::kStages;
  constexpr int RW = Pipe::kRowWords;
  constexpr int kWarps = kGemvThreads / 32;

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int m = args.m;
  const int S = args.splits;  // = cluster size
  const int n_chunks = args.in >> 7;
  // 32-bit divisions (s * n_chunks < 2^31): a 64-bit one is a ~70-instruction sequence, and this
  // prologue runs once per block, cold, on the launch's critical path.
  const int c_begin = s * n_chunks / S;
  const int c_end = (s + 1) * n_chunks / S;
  const int nch = c_end - c_begin;  // <= ceil(n_chunks / S): fits u_s
  const int tiles_out = args.out >> 4;

  uint2* u_s = reinterpret_cast<uint2*>(dyn);  // [(tile row * m + n) * 4 + quad]
  uint32_t* area = dyn + cluster_u_bytes(n_chunks, S, m) / 4;
  uint32_t* wbuf = area + warp * ST * RW;

  // ---- start this warp's first rows: tile row (c_begin + i) * 8 + warp, column group g ------
  const LanePlan<K> plan(lane);
  const size_t row_step = (size_t)8 * tiles_out * TW;  // words between a warp's rows
  const uint32_t* src = args.trellis + ((size_t)(c_begin * 8 + warp) * tiles_out + (size_t)g * 8) * TW;
  int issued = 0, islot = 0;
  auto issue_next = [&]() {
    if (issued < nch) {
      const uint4* s4 = reinterpret_cast<const uint4*>(src);
      uint4* d4 = reinterpret_cast<uint4*>(wbuf + islot * RW);
#pragma unroll
      for (int c = lane; c < RW / 4; c += 32) cp_async16(d4 + c, s4 + c);
      src += row_step;
    }
    ++issued;
    islot = islot + 1 == ST ? 0 : islot + 1;
    cp_async_commit();  // empty groups keep the group count uniform
  };
#pragma unroll
  for (int i = 0; i < ST - 1; ++i) issue_next();
  // The input and output sign vectors are weights too: start them towards L2 now, so that their
  // loads after the wait (in the rotations) hit L2 instead of DRAM. Two 128-byte lines per chunk.
  if (lane < 2) {
    const __half* suh = static_cast<const __half*>(args.suh) + (c_begin << 7) + 64 * lane;
    for (int c = warp; c < nch; c += kWarps) prefetch_l2(suh + (c << 7));
    if (warp == 0 && s < m) prefetch_l2(static_cast<const __half*>(args.svh) + (g << 7) + 64 * lane);
  }
  // Chained (chained_launch.cuh), the block may start before the previous kernel has finished:
  // the weight copies above overlap its tail, and everything that reads its output (x) or writes
  // (y) comes after this wait. Unchained it returns at once. The trellis is no kernel's output.
  chain_wait();

  // ---- 1. input rotation: items (chunk c, row n < m), P loads in flight per warp -------------
  // P (1, 2 or 4) follows the item count, so a warp rotates no more absent (all-zero) items than
  // it must: a block of few chunks (most decode GEMVs) has at most 1-2 items per warp.
  const int items = nch * m;
  // item / m as a multiply and shift: exact for m <= 16 and item < 4096 (items <= 16 * 16).
  const uint32_t inv_m = (65536u + m - 1) / m;
  float wmax[kClusterInt8MaxRows] = {};  // int8: this warp's max |u| per row
  auto rotate = [&](auto batch) {
    constexpr int P = decltype(batch)::value;
    for (int base = warp; base < items; base += kWarps * P) {
      float v[P][4];
#pragma unroll
      for (int j = 0; j < P; ++j) {
        const int item = base + kWarps * j;
        v[j][0] = v[j][1] = v[j][2] = v[j][3] = 0.f;
        if (item < items) {  // warp-uniform
          const int c = (item * inv_m) >> 16, n = item - c * m;
          const int f = ((c_begin + c) << 7) + 4 * lane;
          load4(args.x, args.x_dtype, (size_t)n * args.in + f, v[j]);
          const uint2 su = *reinterpret_cast<const uint2*>(static_cast<const __half*>(args.suh) + f);
          const float2 s01 = __half22float2(u32_as_h2(su.x));
          const float2 s23 = __half22float2(u32_as_h2(su.y));
          v[j][0] *= s01.x; v[j][1] *= s01.y; v[j][2] *= s23.x; v[j][3] *= s23.y;
        }
      }
      // Unconditional (absent items rotate zeros), so the shuffle chains can interleave.
#pragma unroll
      for (int j = 0; j < P; ++j) warp_hadamard128(v[j], lane);
#pragma unroll
      for (int j = 0; j < P; ++j) {
        const int item = base + kWarps * j;
        if (item < items) {
          const int c = (item * inv_m) >> 16, n = item - c * m;
          // features 4*lane .. 4*lane+3 of chunk c: tile row c*8 + lane/4, k = 4*(lane%4) + {0..3}
          const int row = c * 8 + (lane >> 2);
          uint32_t* frag = reinterpret_cast<uint32_t*>(u_s + (row * m + n) * 4);
          float rsum = 0.f, rmax = 0.f;
#pragma unroll
          for (int p = 0; p < 2; ++p) {
            const int k = 4 * (lane & 3) + 2 * p;
            const __half2 hv = __floats2half2_rn(v[j][2 * p] * kRsqrt128, v[j][2 * p + 1] * kRsqrt128);
            const float2 back = __half22float2(hv);
            rsum += back.x + back.y;
            rmax = max_nan(rmax, max_nan(fabsf(back.x), fabsf(back.y)));
            frag[((k & 7) >> 1) * 2 + (k >> 3)] = h2_as_u32(hv);  // quad (k%8)/2, half k/8
          }
          if constexpr (I8) {
#pragma unroll
            for (int r = 0; r < kClusterInt8MaxRows; ++r) wmax[r] = r == n ? max_nan(wmax[r], rmax) : wmax[r];
          } else if constexpr (CB == CB_MUL1) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) rsum += __shfl_xor_sync(0xFFFFFFFFu, rsum, o);
            if (lane == 0) sm.usum_s[c][n] = rsum;
          }
        }
      }
    }
  };
  if (items <= kWarps) rotate(std::integral_constant<int, 1>{});
  else if (items <= 2 * kWarps) rotate(std::integral_constant<int, 2>{});
  else rotate(std::integral_constant<int, kClusterPrefetchItems>{});
  if constexpr (I8) {
#pragma unroll
    for (int r = 0; r < kClusterInt8MaxRows; ++r) {
      // |u| >= 0 or a NaN with a clear sign bit: as unsigned integers they order as max_nan does
      // (a NaN above +inf), so one warp reduction instruction takes the max.
      wmax[r] = __uint_as_float(__reduce_max_sync(0xFFFFFFFFu, __float_as_uint(wmax[r])));
      if (lane == 0) sm.wmax_s[warp][r] = wmax[r];  // 0 where the warp had no item of row r
    }
  }
  __syncthreads();

  // ---- 1b. int8: u -> q = round(u * 16383 / max|u|) = 128 hi + lo, in place ----------------
  // Entry e of u_s (tile row, batch row n, quad c) holds u[2c], u[2c+1], u[2c+8], u[2c+9] of its
  // tile row; it becomes two words, hi bytes then lo bytes, each in the order u[2c], u[2c+8],
  // u[2c+1], u[2c+9]: the B operands of the even and the odd MMA of a tile (see the loop). Each
  // warp converts the tile rows it will read itself (i*8 + warp), so no block barrier follows.
  if constexpr (I8) {
    static_assert(kClusterInt8MaxRows == 2, "row and entry indices below assume m <= 2");
    float inv[kClusterInt8MaxRows];
#pragma unroll
    for (int r = 0; r < kClusterInt8MaxRows; ++r) {
      float amax = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) amax = max_nan(amax, sm.wmax_s[w][r]);
      inv[r] = amax > 0.f ? kClusterInt8Range / amax : 0.f;
    }
    uint32_t* q_s = reinterpret_cast<uint32_t*>(u_s);
    int qsum[kClusterInt8MaxRows] = {};
    for (int t = lane; t < nch * 4 * m; t += 32) {  // (chunk i, row n, quad c) of this warp
      const int i = (t >> 2) >> (m - 1), n = (t >> 2) & (m - 1), c = t & 3;
      const int e = ((i * 8 + warp) * m + n) * 4 + c;
      const float scale = n == 0 ? inv[0] : inv[1];
      const uint2 u = u_s[e];
      const float2 u01 = __half22float2(u32_as_h2(u.x)), u89 = __half22float2(u32_as_h2(u.y));
      const int q[4] = {__float2int_rn(u01.x * scale), __float2int_rn(u89.x * scale),
                        __float2int_rn(u01.y * scale), __float2int_rn(u89.y * scale)};
      uint32_t hi = 0u, lo = 0u;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        hi |= (static_cast<uint32_t>(q[b] >> 7) & 0xFFu) << (8 * b);
        lo |= (static_cast<uint32_t>(q[b]) & 0x7Fu) << (8 * b);
      }
      q_s[2 * e] = hi;
      q_s[2 * e + 1] = lo;
      const int part = q[0] + q[1] + q[2] + q[3];
      qsum[0] += n == 0 ? part : 0;
      qsum[1] += n == 0 ? 0 : part;
    }
#pragma unroll
    for (int r = 0; r < kClusterInt8MaxRows; ++r) {
      qsum[r] = __reduce_add_sync(0xFFFFFFFFu, qsum[r]);
      if (lane == 0) sm.wqsum_s[warp][r] = qsum[r];  // read after the loop's block barriers
    }
    __syncwarp();  // this warp's q words are written before it reads them
  }

  // ---- 2. decode + MMA over this warp's rows (the workspace GEMV's math) -------------------
  float acc[RG][8][4];  // [column group][tile][C fragment]
  int acci[8][4];  // int8 variant
#pragma unroll
  for (int t = 0; t < 8; ++t) acci[t][0] = acci[t][1] = acci[t][2] = acci[t][3] = 0;
#pragma unroll
  for (int q = 0; q < RG; ++q)
#pragma unroll
    for (int t = 0; t < 8; ++t) acc[q][t][0] = acc[q][t][1] = acc[q][t][2] = acc[q][t][3] = 0.f;
  const int bn = lane >> 2;            // B fragment column (batch row 8q + bn of group q) of this lane
  bool b_live[RG];
  const uint2* u_lane[RG];
#pragma unroll
  for (int q = 0; q < RG; ++q) {
    b_live[q] = 8 * q + bn < m;
    u_lane[q] = u_s + (warp * m + (b_live[q] ? 8 * q + bn : 0)) * 4 + (lane & 3);
  }
  const int u_step = 8 * m * 4;        // uint2 between this warp's tile rows
  // int8: B column bn < 4 takes row bn's hi bytes, bn >= 4 row bn - 4's lo bytes.
  const int q_row = bn & 3;
  const bool q_live = q_row < m;
  const uint32_t* q_lane = reinterpret_cast<const uint32_t*>(u_s) +
                           ((warp * m + (q_live ? q_row : 0)) * 4 + (lane & 3)) * 2 + (bn >> 2);
  int slot = 0;
  for (int i = 0; i < nch; ++i) {
    cp_async_wait<ST - 2>();  // row i has landed (this lane's copies) ...
    __syncwarp();             // ... and every lane's; the slot of row i-1 is free again
    uint32_t cur[8][NR];
    const uint32_t* stage = wbuf + slot * RW;
    // Two column groups read each tile's words right before its decode: their 64 accumulators
    // leave no registers for the whole row's words (that spilled).
    if constexpr (RG == 1) {
#pragma unroll
      for (int t = 0; t < 8; ++t)
#pragma unroll
        for (int w = 0; w < NR; ++w) cur[t][w] = stage[t * TW + plan.word[w]];
    }
    issue_next();  // row i + ST - 1 into the slot of row i - 1 (not this row's)
    if constexpr (I8) {
      // The even MMA of a tile takes the lane's weights of inputs 2c and 2c+8 (states 0, 4, 2, 6:
      // rows r, r+8 at k-slots 4c.. and 16+4c..), the odd one inputs 2c+1 and 2c+9; each slot
      // holds that input's q byte four times.
      uint32_t w = q_lane[i * 2 * u_step];
      if (!q_live) w = 0u;
      const uint32_t be0 = __byte_perm(w, 0, 0x0000), be1 = __byte_perm(w, 0, 0x1111);
      const uint32_t bo0 = __byte_perm(w, 0, 0x2222), bo1 = __byte_perm(w, 0, 0x3333);
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        uint32_t st[8];
        lane_states<K>(cur[t], plan.r, st);
        uint32_t h[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) h[j] = st[j] * 0x83DCD12Du;
        const uint32_t ae[4] = {h[0], h[4], h[2], h[6]};
        const uint32_t ao[4] = {h[1], h[5], h[3], h[7]};
        mma_16832_u8s8(acci[t], ae, be0, be1);
        mma_16832_u8s8(acci[t], ao, bo0, bo1);
      }
    } else {
      // One weight per A register, each input twice in B (see inst_halves / mul1_halves).
      uint32_t be0[RG], be1[RG], bo0[RG], bo1[RG];
#pragma unroll
      for (int q = 0; q < RG; ++q) {
        uint2 b = u_lane[q][i * u_step];
        if (!b_live[q]) b = make_uint2(0u, 0u);
        be0[q] = __byte_perm(b.x, 0, 0x1010), be1[q] = __byte_perm(b.y, 0, 0x1010);
        bo0[q] = __byte_perm(b.x, 0, 0x3232), bo1[q] = __byte_perm(b.y, 0, 0x3232);
      }
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        if constexpr (RG == 2) {
#pragma unroll
          for (int w = 0; w < NR; ++w) cur[t][w] = stage[t * TW + plan.word[w]];
        }
        uint32_t st[8];
        lane_states<K>(cur[t], plan.r, st);
        uint32_t x[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = CB == CB_MUL1 ? mul1_halves(st[j]) : inst_halves<CB>(st[j]);
        const uint32_t ae[4] = {x[0], x[4], x[2], x[6]};
        const uint32_t ao[4] = {x[1], x[5], x[3], x[7]};
#pragma unroll
        for (int q = 0; q < RG; ++q) {  // one decode, the MMAs of every column group
          mma_16816(acc[q][t], ae, be0[q], be1[q]);
          mma_16816(acc[q][t], ao, bo0[q], bo1[q]);
        }
      }
    }
    __syncwarp();  // all lanes done reading this slot before it is refilled
    slot = slot + 1 == ST ? 0 : slot + 1;
  }
  cp_async_wait<0>();
  // A chained next kernel may launch now (it waits for our completion before it touches our
  // output); no effect on unchained launches.
  chain_release();
  __syncthreads();  // every warp is done with its ring: the area now holds the warps' sums

  // ---- 3. block sum: per-warp stores, one fixed-order sum ---------------------------------
  float* red_w = reinterpret_cast<float*>(area);  // [warp][n][kClusterRedStride]
  // Two column groups take turns in an area of 8 rows (cluster_red_bytes); one uses m rows.
  const int mr = RG == 1 ? m : kGemvMaxRows;
#pragma unroll
  for (int grp = 0; grp < RG; ++grp) {
    if (grp > 0) __syncthreads();  // the previous group's sums have been read
    // this group's rows: batch rows 8 grp .. 8 grp + gm - 1
    const int gm = RG == 1 ? m : min(m - kGemvMaxRows * grp, kGemvMaxRows);
    if constexpr (I8) {
      // C columns 0..3 hold sum(b * hi) of rows n = 0..3, columns 4..7 sum(b * lo): lanes with
      // lane % 4 == 0 store the hi sums of rows 0, 1 and lanes with lane % 4 == 2 the lo sums, as
      // integers ([warp][hi/lo][n][kClusterRedStride]); the block sum combines them (no shuffles here).
      const int q = lane & 3, col = lane >> 2;
      int* rw = reinterpret_cast<int*>(red_w) + (warp * 2 + (q >> 1)) * m * kClusterRedStride;
      if ((q & 1) == 0) {
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          rw[16 * t + col] = acci[t][0];
          rw[16 * t + col + 8] = acci[t][2];
          if (m > 1) {
            rw[kClusterRedStride + 16 * t + col] = acci[t][1];
            rw[kClusterRedStride + 16 * t + col + 8] = acci[t][3];
          }
        }
      }
    } else {
      // C fragment: c0 = (out 16t + lane/4, batch 8 grp + 2*(lane%4)), c1 = batch + 1, c2/c3 = out + 8.
      const int n0 = 2 * (lane & 3);
      const int col = lane >> 2;
      float* rw = red_w + warp * mr * kClusterRedStride;
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        if (n0 < gm) {
          rw[n0 * kClusterRedStride + 16 * t + col] = acc[grp][t][0];
          rw[n0 * kClusterRedStride + 16 * t + col + 8] = acc[grp][t][2];
        }
        if (n0 + 1 < gm) {
          rw[(n0 + 1) * kClusterRedStride + 16 * t + col] = acc[grp][t][1];
          rw[(n0 + 1) * kClusterRedStride + 16 * t + col + 8] = acc[grp][t][3];
        }
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < gm * 128; e += kGemvThreads) {
      const int n = e >> 7, c = e & 127;  // row n of the group (batch row 8 grp + n)
      float a = 0.f;
      if constexpr (I8) {
        // sum(b * q) = 128 * hi part + lo part per warp, then the warps in order
        const int* ri = reinterpret_cast<const int*>(red_w);
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          const int hi = ri[((w * 2) * m + n) * kClusterRedStride + c];
          const int lo = ri[((w * 2 + 1) * m + n) * kClusterRedStride + c];
          a += fmaf(128.f, static_cast<float>(hi), static_cast<float>(lo));
        }
      } else {
#pragma unroll
        for (int w = 0; w < kWarps; ++w) a += red_w[(w * mr + n) * kClusterRedStride + c];
      }
      if constexpr (I8) {
        // sum_k u_k w_k with w = (1024 + b) k_inv + k_bias and u = q max|u| / 16383:
        // (max|u| / 16383) (k_inv sum(b q) + (1024 k_inv + k_bias) sum(q)).
        const float k_inv = __half2float(__ushort_as_half(0x1EEE));
        const float k_off = 1024.f * k_inv + __half2float(__ushort_as_half(0xC931));  // exact in fp32
        float amax = 0.f;
        int qsum = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) amax = max_nan(amax, sm.wmax_s[w][n]), qsum += sm.wqsum_s[w][n];
        a = amax / kClusterInt8Range * fmaf(k_inv, a, k_off * static_cast<float>(qsum));
      } else if constexpr (CB == CB_MUL1) {
        // sum(h*k_inv + k_bias)*u = k_inv*sum(h*u) + k_bias*sum(u), per block (linear in the splits)
        float us = 0.f;
        for (int q = 0; q < nch; ++q) us += sm.usum_s[q][kGemvMaxRows * grp + n];
        a = fmaf(__half2float(__ushort_as_half(0x1EEE)), a, __half2float(__ushort_as_half(0xC931)) * us);
      }
      sm.red_s[kGemvMaxRows * grp + n][c] = a;
    }
  }

  // ---- 4. split sum across the cluster (DSMEM), output rotation, store --------------------
  // Batch rows n = s, s + S, ... belong to this block, one per warp (and one more per warp at 16
  // rows and S = 1: warp w writes rows w and w + 8).
  const int n = s + warp * S;
  const int f = (g << 7) + 4 * lane;
  uint2 sv[RG];  // loaded before the barrier, so their latency hides behind it
#pragma unroll
  for (int grp = 0; grp < RG; ++grp) {
    const int nr = n + grp * kWarps * S;
    sv[grp] = make_uint2(0u, 0u);
    if (nr < m) sv[grp] = *reinterpret_cast<const uint2*>(static_cast<const __half*>(args.svh) + f);
  }
  // The q/k/v epilogue is a runtime branch of the int8 kernel, not a kernel of its own: as its own
  // instantiation it made each layer slower than the launch it saved (its code cold in the
  // instruction caches where the other GEMVs of the layer run the plain kernel; docs/KERNELS.md,
  // section 3.5).
  const bool epi_on = I8 && epi.on;
  EpilogueInputs ein;
  if (epi_on && n < m) epilogue_load(args, epi, mat, n, f, ein);
  // Every block's red_s is complete and visible to the cluster; a cluster of one block needs
  // only the block barrier (a cluster barrier costs hundreds of cycles more on this path).
  if (S == 1) __syncthreads();
  else cluster_sync_acq_rel();
#pragma unroll
  for (int grp = 0; grp < RG; ++grp) {
    const int nr = n + grp * kWarps * S;
    if (nr >= m) break;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    for (int q0 = 0; q0 < S; q0 += 8) {
      float4 part[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // all loads first, then the sums in rank order
        if (q0 + j < S) part[j] = ld_dsmem_f4(&sm.red_s[nr][4 * lane], q0 + j);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (q0 + j < S) {
          v[0] += part[j].x; v[1] += part[j].y; v[2] += part[j].z; v[3] += part[j].w;
        }
      }
    }
    warp_hadamard128(v, lane);
    const float2 s01 = __half22float2(u32_as_h2(sv[grp].x));
    const float2 s23 = __half22float2(u32_as_h2(sv[grp].y));
    v[0] *= kRsqrt128 * s01.x; v[1] *= kRsqrt128 * s01.y;
    v[2] *= kRsqrt128 * s23.x; v[3] *= kRsqrt128 * s23.y;
    if (epi_on) epilogue_store(args, epi, mat, nr, f, ein, v);  // int8: one group, nr == n
    else store4(args.y, args.x_dtype, (size_t)nr * args.out + f, v);
  }
  if (S > 1) cluster_sync_relaxed();  // no block leaves (freeing its shared memory) while others read it
}
#endif

// Grid: matrix 0's (groups x S) blocks, then matrix 1's, ...; within a matrix block g*S + s, so
// the S splits of a column group are one cluster of S consecutive blocks (begin[] are multiples
// of S, so no cluster straddles two matrices; every block of a cluster has the same K).
template <int CB, bool I8, int RG>
__global__ void __launch_bounds__(kGemvThreads, gemv_min_blocks(RG))
    exl3_gemv_cluster_kernel(const GemvMultiArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ GemvClusterSmem<RG> sm;
  extern __shared__ uint4 gemv_cluster_dyn_smem[];
  uint32_t* dyn = reinterpret_cast<uint32_t*>(gemv_cluster_dyn_smem);
  const int b = blockIdx.x;
  const int i = (b >= args.begin[1]) + (b >= args.begin[2]);  // absent matrices: INT_MAX
  const GemvArgs& a = args.mat[i];
  const int local = b - args.begin[i];
  const int g = local / a.splits, s = local - g * a.splits;
  switch (args.K[i]) {
#define TRELLIS_CLUSTER_CASE(k) \
  case k: gemv_cluster_block<k, CB, I8, RG>(a, g, s, sm, dyn, args.epi, i); break;
    TRELLIS_CLUSTER_CASE(1) TRELLIS_CLUSTER_CASE(2) TRELLIS_CLUSTER_CASE(3) TRELLIS_CLUSTER_CASE(4)
    TRELLIS_CLUSTER_CASE(5) TRELLIS_CLUSTER_CASE(6) TRELLIS_CLUSTER_CASE(7) TRELLIS_CLUSTER_CASE(8)
#undef TRELLIS_CLUSTER_CASE
    default: break;
  }
#endif
}

// At least any launch's need: u_s <= 32 KB at 8 rows, 64 KB at 16 (16 chunks); area <= 36 KB.
constexpr int kClusterMaxDynSmem = 100 * 1024;
static_assert(cluster_u_bytes(kGemvMaxChunks, 1, kGemvWideRows) +
                      std::max({GemvPipe<1>::kSmemBytes, GemvPipe<2>::kSmemBytes, GemvPipe<3>::kSmemBytes,
                                GemvPipe<4>::kSmemBytes, GemvPipe<5>::kSmemBytes, GemvPipe<6>::kSmemBytes,
                                GemvPipe<7>::kSmemBytes, GemvPipe<8>::kSmemBytes,
                                cluster_red_bytes(kGemvWideRows)}) <=
                  kClusterMaxDynSmem,
              "a 16-row launch at 16 chunks a block must fit kClusterMaxDynSmem");

// Host side. mode 0: launch `blocks` blocks in clusters of `splits` with `smem` bytes (returns
// the cudaError_t of the launch; pdl: a chained launch, see chained_launch.cuh);
// mode 1: return blocks per SM at `smem` bytes; mode 2: return how many clusters of `splits`
// blocks can be co-resident at `smem` bytes (0: that cluster size cannot be launched).
template <int CB, bool I8, int RG>
int gemv_cluster_run(int mode, const GemvMultiArgs* a, int blocks, int splits, int smem, cudaStream_t stream,
                bool pdl) {
  auto kern = exl3_gemv_cluster_kernel<CB, I8, RG>;
  static bool ready = false;
  if (!ready) {
    cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kClusterMaxDynSmem);
    cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    ready = true;
  }
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = splits;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.blockDim = dim3(kGemvThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  if (mode == 1) {
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, kGemvThreads, smem);
    return n;
  }
  if (mode == 2) {
    cfg.gridDim = dim3(splits * 64);  // any multiple of the cluster size
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kern, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky-free error of an unsupported size
      n = 0;
    }
    return n;
  }
  cfg.gridDim = dim3(blocks);
  cfg.numAttrs = pdl ? 2 : 1;
  return static_cast<int>(cudaLaunchKernelEx(&cfg, kern, *a));  // cudaError_t
}

// The kernel variants: fp16 (the fp16 MMA) of one or two column groups (rg, gemv_row_groups) and,
// for MUL1 only, int8 (the integer MMA, one group; the binding checks the codebook and the rows).
template <int CB>
int gemv_cluster_dispatch(bool int8, int rg, int mode, const GemvMultiArgs* a, int blocks, int splits, int smem,
                          cudaStream_t stream, bool pdl) {
  if (int8) {
    if constexpr (CB == CB_MUL1) {
      if (rg == 1) return gemv_cluster_run<CB, true, 1>(mode, a, blocks, splits, smem, stream, pdl);
    }
    return -1;
  }
  if (rg == 2) return gemv_cluster_run<CB, false, 2>(mode, a, blocks, splits, smem, stream, pdl);
  return gemv_cluster_run<CB, false, 1>(mode, a, blocks, splits, smem, stream, pdl);
}

}  // namespace trellis
