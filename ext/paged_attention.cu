// Decode attention read straight from the paged KV cache, and the fused quantize-and-write of a
// 2-8 bit cache (engine/cache/quantized.py describes the layout; engine/kernels/attention.py dispatches here).
//
// Attention (flash decoding): one query per sequence. The grid is splits x (kv heads x head
// chunks) x batch; a block takes every query head of one kv head (up to kMaxHeads, more heads
// take more chunks), so each key and value is read from memory once per chunk. The split count
// depends only on the padded page table's width, never on the lengths, so a captured CUDA graph
// stays valid when the lengths change; blocks past a sequence's end only mark their split empty.
//
// Inside a block, lane u of a key's L = D/8 lanes owns numbers 8u..8u+7 of that key: one 16-byte
// vector of a dense cache, or one bit-plane unit (``bits`` bytes) of a quantized one, so a key's
// lanes read one contiguous row. A warp spans at most 256 numbers of a key (32 lanes): head_dim
// 512 (Gemma 4's full layers) splits each key over two warps, one half each (version 2 below).
// Quantized keys stay rotated: the query is rotated once (its 32-number groups by the same
// Hadamard matrix) and dotted with the codes directly. Quantized values are accumulated rotated
// and the output is rotated back once, in the combine kernel.
// Everything accumulates in fp32; the softmax runs in base 2 with the scale folded into q.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "chained_launch.cuh"
#include "hadamard.cuh"
#include "trellis_ext.h"

namespace {

using trellis::chain_release;  // chained_launch.cuh
using trellis::chain_wait;
using trellis::hadamard32_lanes;  // hadamard.cuh
using trellis::launch_chained;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kGroup = 32;     // quantization group = Hadamard size (the kernels need head_dim % 32 == 0)
constexpr int kMaxHeads = 8;   // query heads per block
constexpr int kWarpDim = 256;  // numbers of a key one warp of version 2 covers (a unit per lane)
constexpr int kMinSplitKeys = 64;  // 2 loop iterations of a v2 block at head_dim 128 (short contexts: more SMs)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kInvSqrtGroup = 0.17677669529663687f;
constexpr unsigned kFull = 0xffffffffu;

struct Side {              // one of keys / values
  const void* dense;       // [slots, kv_heads, D] in q's dtype (bits == 16)
  const uint8_t* codes;    // [slots, kv_heads, D/8, bits] bit planes
  const __half* scales;    // [slots, kv_heads, D/32]
  int bits;                // 2..8, or 16 for dense
};

struct Params {
  const void* q;           // [B, H, D]
  float* part_acc;         // [B, H, splits, D]
  float* part_m;           // [B, H, splits] running max (base 2), -inf: empty split
  float* part_l;           // [B, H, splits]
  const int* block_tables; // [B, max_pages]
  const int* lengths;      // [B]
  Side k, v;
  int heads, kv_heads, group, head_chunks, max_pages, page_size, page_shift, splits, pages_per_split, window;
  float scale, softcap;
};

__device__ __forceinline__ void load8(const __half* p, float (&x)[8]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&x)[8]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ float load1(const __half* p) { return __half2float(p[0]); }
__device__ __forceinline__ float load1(const __nv_bfloat16* p) { return __bfloat162float(p[0]); }
__device__ __forceinline__ float load1(const float* p) { return p[0]; }
__device__ __forceinline__ void store1(__half* p, float v) { p[0] = __float2half_rn(v); }
__device__ __forceinline__ void store1(__nv_bfloat16* p, float v) { p[0] = __float2bfloat16_rn(v); }

// The `bits` plane bytes of one 8-number unit, plane j in byte j. Widths 2, 4, 8 and 6 are read
// with aligned 2/4/8-byte loads (a unit starts at a multiple of `bits` bytes), the odd ones by byte.
__device__ __forceinline__ unsigned long long load_planes(const uint8_t* p, int bits) {
  switch (bits) {
    case 2: return __ldg(reinterpret_cast<const unsigned short*>(p));
    case 4: return __ldg(reinterpret_cast<const unsigned int*>(p));
    case 8: return __ldg(reinterpret_cast<const unsigned long long*>(p));
    case 6: {
      const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
      return static_cast<unsigned long long>(__ldg(s)) | static_cast<unsigned long long>(__ldg(s + 1)) << 16 |
             static_cast<unsigned long long>(__ldg(s + 2)) << 32;
    }
    default: {
      unsigned long long x = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < bits) x |= static_cast<unsigned long long>(__ldg(p + j)) << (8 * j);
      return x;
    }
  }
}

// Codes of one unit as floats 0..2^bits-1, for at most 4 planes (byte j of x holds bit j of all 8
// numbers; the upper four planes are zero). An 8x8 bit-matrix transpose makes byte i the code of
// number i, and OR-ing a byte under the exponent of 2^23 turns it into a float with one PRMT and
// one FADD (no int-to-float unit). With 4 planes the transpose's first two swaps stay inside 32
// bits and the third reduces to splitting nibbles.
__device__ __forceinline__ void unpack_codes4(unsigned x, float (&c)[8]) {
  unsigned t = (x ^ (x >> 7)) & 0x00AA00AAu;
  x ^= t ^ (t << 7);
  t = (x ^ (x >> 14)) & 0x0000CCCCu;
  x ^= t ^ (t << 14);
  const unsigned lo = x & 0x0F0F0F0Fu, hi = (x >> 4) & 0x0F0F0F0Fu;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    c[i] = __uint_as_float(__byte_perm(lo, 0x4B000000u, 0x7540 + i)) - 8388608.0f;
    c[4 + i] = __uint_as_float(__byte_perm(hi, 0x4B000000u, 0x7540 + i)) - 8388608.0f;
  }
}

// unpack_codes4's transpose for 5-8 planes on the two 32-bit halves (lo: planes 0-3, hi: planes
// 4-7): the first two swaps never cross the halves and the third is one exchange of nibbles
// between them, so no 64-bit shifts.
__device__ __forceinline__ void unpack_codes8(unsigned lo, unsigned hi, float (&c)[8]) {
  unsigned t = (lo ^ (lo >> 7)) & 0x00AA00AAu, v = (hi ^ (hi >> 7)) & 0x00AA00AAu;
  lo ^= t ^ (t << 7);
  hi ^= v ^ (v << 7);
  t = (lo ^ (lo >> 14)) & 0x0000CCCCu;
  v = (hi ^ (hi >> 14)) & 0x0000CCCCu;
  lo ^= t ^ (t << 14);
  hi ^= v ^ (v << 14);
  t = (lo ^ (hi << 4)) & 0xF0F0F0F0u;
  lo ^= t;
  hi ^= t >> 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    c[i] = __uint_as_float(__byte_perm(lo, 0x4B000000u, 0x7540 + i)) - 8388608.0f;
    c[4 + i] = __uint_as_float(__byte_perm(hi, 0x4B000000u, 0x7540 + i)) - 8388608.0f;
  }
}

// The 32-number transform of hadamard32_lanes (hadamard.cuh) when lane l of a warp holds number l
// of the group.
__device__ __forceinline__ float hadamard32_warp(float x, int lane) {
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const float o = __shfl_xor_sync(kFull, x, m);
    x = (lane & m) ? o - x : x + o;
  }
  return x;
}

// ---------------------------------------------------------------------------------------------
// Version 2 (the caches version 3 does not take: mixed widths, 3/5/6/7 bits, head_dim 256 at
// 8 or 16 bits, every cache at head_dim 512). Built for memory-level
// parallelism: a kernel that loads each step's key/value inside a branch and uses it at once makes
// a warp wait for four serial page-table + cache round trips per loop iteration, so its time is
// latency whatever the load (docs/KERNELS.md, section 5). Here every load of an iteration is
// issued unconditionally (positions past the end are clamped to the last key and masked to -inf),
// one iteration ahead (raw, still-encoded words in registers), with the page-table entries two
// iterations ahead; decoding happens at use. No per-head branches inside the loop: heads past the
// chunk's end have a zero query and are simply not stored.
//
// Head_dim 512: a lane holding 16 numbers of every head's query and accumulator would need 256
// registers for those alone at 8 heads, so a key is split over a pair of warps instead, each with
// the head_dim 256 layout on its half (same registers per thread as head_dim 256). The pair adds
// its partial scores through shared memory once per iteration (one 64-thread barrier), and both
// warps then run the same softmax on the same totals (a + b == b + a bit for bit, so their maxima
// and weights agree exactly) and accumulate their own halves of the values. A block of 4 warps
// takes 2 keys side by side instead of 4: its loads in flight stay the same number of bytes.

// One 8-number unit as read from memory: 16 bytes of a dense cache, or the bit planes (2/4/8 bits:
// w.x | w.y << 32; 6 bits: three 16-bit words in w.x, w.y, w.z) and the raw fp16 scale bits in w.w:
// four registers a unit, so two iterations of units fit beside the accumulators.
struct RawUnit {
  uint4 w;
};

// Barrier `id` (1..15; 0 is __syncthreads) over two warps: a warp pair of a head_dim-512 block.
__device__ __forceinline__ void pair_sync(int id) { asm volatile("bar.sync %0, 64;" ::"r"(id) : "memory"); }

__device__ __forceinline__ int page_index(const Params& p, int pos) {
  return p.page_shift >= 0 ? pos >> p.page_shift : pos / p.page_size;
}

__device__ __forceinline__ size_t cache_row(const Params& p, int page, int pos, int kvh) {
  const int in_page = pos - page_index(p, pos) * p.page_size;
  return (static_cast<size_t>(page) * p.page_size + in_page) * p.kv_heads + kvh;
}

template <int D, typename T>
__device__ __forceinline__ void fetch_unit(const Side& s, size_t row, int u, RawUnit& r) {
  if (s.bits >= 16) {
    r.w = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(s.dense) + row * D + u * 8));
    return;
  }
  const uint8_t* c = s.codes + (row * (D / 8) + u) * s.bits;
  r.w = make_uint4(0u, 0u, 0u, 0u);
  switch (s.bits) {
    case 2: r.w.x = __ldg(reinterpret_cast<const unsigned short*>(c)); break;
    case 4: r.w.x = __ldg(reinterpret_cast<const unsigned int*>(c)); break;
    case 8: {
      const uint2 t = __ldg(reinterpret_cast<const uint2*>(c));
      r.w.x = t.x;
      r.w.y = t.y;
      break;
    }
    case 6: {
      const unsigned short* h = reinterpret_cast<const unsigned short*>(c);
      r.w.x = __ldg(h);
      r.w.y = __ldg(h + 1);
      r.w.z = __ldg(h + 2);
      break;
    }
    default: {  // odd widths (rare): combined here, at the cost of a wait
      const unsigned long long x = load_planes(c, s.bits);
      r.w.x = static_cast<unsigned>(x);
      r.w.y = static_cast<unsigned>(x >> 32);
    }
  }
  r.w.w = __ldg(reinterpret_cast<const unsigned short*>(s.scales) + row * (D / kGroup) + u / 4);
}

__device__ __forceinline__ void dense8(const uint4& w, __half, float (&x)[8]) {
  const __half2* h = reinterpret_cast<const __half2*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void dense8(const uint4& w, __nv_bfloat16, float (&x)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

// Dense numbers, or codes 0..2^bits-1 as floats (the caller applies scale and midpoint).
template <typename T>
__device__ __forceinline__ void decode_unit(const RawUnit& r, int bits, float (&x)[8]) {
  if (bits >= 16) {
    dense8(r.w, T(), x);
    return;
  }
  if (bits <= 4) {  // planes in w.x (2 bits: its low half; 3 bits: combined by fetch_unit)
    unpack_codes4(r.w.x, x);
    return;
  }
  if (bits == 6) {  // three 16-bit words: planes 0-1, 2-3, 4-5
    unpack_codes8(r.w.x | r.w.y << 16, r.w.z, x);
    return;
  }
  unpack_codes8(r.w.x, r.w.y, x);
}

__device__ __forceinline__ float scale_of(const RawUnit& r) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(r.w.w)));
}

// Each of 16 scores summed over its key's L lanes, every lane ending with all 16 totals: a
// reduce-scatter (each round a lane sends half the values it carries and keeps the other half:
// 15 SHFL in all instead of 16 x log2 L), then a gather of the totals from the lanes holding them
// (16 SHFL). After the reduce-scatter the lane u of a key holds total u (L = 16), totals 2u and
// 2u + 1 (L = 8), or total u / 2 (L = 32, whose last round is a plain sum).
template <int L>
__device__ __forceinline__ void sum_over_key_lanes(float (&v)[16], int lane) {
  static_assert(L == 8 || L == 16 || L == 32, "16 scores over 8, 16 or 32 lanes");
  constexpr int kRounds = L == 8 ? 3 : (L == 16 ? 4 : 5);
  float r[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) r[j] = v[j];
#pragma unroll
  for (int t = 0; t < kRounds; ++t) {
    const int o = L >> (t + 1), n = 16 >> t;
    if (n > 1) {
      const bool upper = (lane & o) != 0;
#pragma unroll
      for (int j = 0; j < n / 2; ++j) {
        const float send = upper ? r[j] : r[j + n / 2];
        const float keep = upper ? r[j + n / 2] : r[j];
        r[j] = keep + __shfl_xor_sync(kFull, send, o);
      }
    } else {
      r[0] += __shfl_xor_sync(kFull, r[0], o);
    }
  }
  const int first = lane & ~(L - 1);  // the key's first lane
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    if (L == 16) v[j] = __shfl_sync(kFull, r[0], first + j);
    else if (L == 8) v[j] = __shfl_sync(kFull, r[j % 2], first + j / 2);
    else v[j] = __shfl_sync(kFull, r[0], 2 * j);
  }
}

template <int D, typename T, int MAXH>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel_v2(const Params p) {
  constexpr int DW = D < kWarpDim ? D : kWarpDim;  // numbers of a key per warp
  constexpr int kParts = D / DW;                   // warps per key: 2 at head_dim 512
  constexpr int kKeyWarps = kWarps / kParts;       // warps (or pairs) taking different keys
  constexpr int L = DW / 8;
  constexpr int KPW = 32 / L;
  constexpr int kSteps = MAXH <= 4 ? 4 : 2;  // keys per lane per iteration: 8 heads need the registers
  constexpr int KPI = KPW * kSteps;
  constexpr int kScores = kSteps * MAXH;
  static_assert(D % kGroup == 0 && D % DW == 0 && (kParts == 1 || kParts == 2) && L <= 32,
                "head_dim must be 64, 128, 256 or 512");
  static_assert(kScores % 4 == 0, "partial scores are exchanged as float4");
  __shared__ float s_m[kKeyWarps][MAXH], s_l[kKeyWarps][MAXH];
  __shared__ float s_acc[kKeyWarps][MAXH][D];
  // A pair's partial scores, double-buffered: one barrier an iteration keeps a warp at most one
  // iteration ahead of its partner, so it never overwrites what the partner has still to read.
  __shared__ float4 s_part[2][kParts > 1 ? kWarps : 1][kScores / 4];

  const int split = blockIdx.x, b = blockIdx.z;
  const int kvh = blockIdx.y / p.head_chunks, chunk = blockIdx.y % p.head_chunks;
  const int h0 = kvh * p.group + chunk * MAXH;
  const int nh = min(MAXH, p.group - chunk * MAXH);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int dpart = warp % kParts, kw = warp / kParts;  // part of the head dim, key slot of the block
  // u: the lane's unit of the whole row; sub: which of the warp's side-by-side keys.
  const int u = dpart * L + lane % L, sub = lane / L;
  // Lengths and tables are the step's inputs, complete before its first chained kernel, so they
  // are read before waiting for the previous kernel (chained_launch.cuh): their L2 round trips
  // overlap its tail. The caches and q, which it writes, only after.
  const int len = p.lengths[b];
  const int lo = p.window > 0 ? max(0, len - p.window) : 0;
  const int span = p.pages_per_split * p.page_size;
  const int start = max(lo, split * span), end = min(len, (split + 1) * span);
  const size_t part = (static_cast<size_t>(b) * p.heads + h0) * p.splits + split;
  const int last = end - 1, stride = kKeyWarps * KPI;
  const int* table = p.block_tables + static_cast<size_t>(b) * p.max_pages;
  int base = start + kw * KPI;
  int pg[kSteps];
  if (start < end) {
#pragma unroll
    for (int k = 0; k < kSteps; ++k) pg[k] = __ldg(table + page_index(p, min(base + k * KPW + sub, last)));
  }
  chain_wait();  // the caches and q come from earlier kernels of the step
  chain_release();
  if (start >= end) {
    if (threadIdx.x < nh) {
      p.part_m[part + threadIdx.x * p.splits] = -INFINITY;
      p.part_l[part + threadIdx.x * p.splits] = 0.0f;
    }
    return;
  }

  // Start the first loads before the query's setup.
  RawUnit rk[kSteps], rv[kSteps];
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int pos = min(base + k * KPW + sub, last);
    const size_t row = cache_row(p, pg[k], pos, kvh);
    fetch_unit<D, T>(p.k, row, u, rk[k]);
    fetch_unit<D, T>(p.v, row, u, rv[k]);
  }
#pragma unroll
  for (int k = 0; k < kSteps; ++k) pg[k] = __ldg(table + page_index(p, min(base + stride + k * KPW + sub, last)));

  const bool krot = p.k.bits < 16, vq = p.v.bits < 16;
  const float qmul = p.scale * (p.softcap > 0.0f ? 1.0f : kLog2e) * (krot ? kInvSqrtGroup : 1.0f);
  float qr[MAXH][8], qsum[MAXH];
#pragma unroll
  for (int h = 0; h < MAXH; ++h) {
    qsum[h] = 0.0f;
    if (h < nh) {
      load8(static_cast<const T*>(p.q) + (static_cast<size_t>(b) * p.heads + h0 + h) * D + u * 8, qr[h]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) qr[h][i] = 0.0f;
    }
    if (krot) hadamard32_lanes(qr[h], lane);  // all lanes take part (warp shuffles)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      qr[h][i] *= qmul;
      qsum[h] += qr[h][i];
    }
  }
  const float khalf = krot ? 0.5f * static_cast<float>((1 << p.k.bits) - 1) : 0.0f;
  const float vhalf = vq ? 0.5f * static_cast<float>((1 << p.v.bits) - 1) : 0.0f;
  const float cap = p.softcap > 0.0f ? p.softcap * kLog2e : 0.0f;
  const float inv_cap = p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f;

  float m[MAXH], l[MAXH], acc[MAXH][8];
#pragma unroll
  for (int h = 0; h < MAXH; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[h][i] = 0.0f;
  }

  int buf = 0;  // s_part's buffer (head_dim 512)
  for (; base < end; base += stride) {
    // Next iteration's units (tables read last iteration), then the page entries after that.
    RawUnit nk[kSteps], nv[kSteps];
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      const int pos = min(base + stride + k * KPW + sub, last);
      const size_t row = cache_row(p, pg[k], pos, kvh);
      fetch_unit<D, T>(p.k, row, u, nk[k]);
      fetch_unit<D, T>(p.v, row, u, nv[k]);
    }
#pragma unroll
    for (int k = 0; k < kSteps; ++k)
      pg[k] = __ldg(table + page_index(p, min(base + 2 * stride + k * KPW + sub, last)));

    float s[kSteps * MAXH];  // key k, head h at k * MAXH + h
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      float kx[8];
      decode_unit<T>(rk[k], p.k.bits, kx);
      const float ks = krot ? scale_of(rk[k]) : 1.0f;
#pragma unroll
      for (int h = 0; h < MAXH; ++h) {
        float d0 = 0.0f, d1 = 0.0f;  // two chains: shorter dependency
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
          d0 = fmaf(qr[h][i], kx[i], d0);
          d1 = fmaf(qr[h][i + 1], kx[i + 1], d1);
        }
        s[k * MAXH + h] = (d0 + d1 - khalf * qsum[h]) * ks;
      }
    }
    sum_over_key_lanes<L>(s, lane);
    if constexpr (kParts > 1) {  // plus the partner's half of each key (every lane holds all totals)
      if (lane == 0) {
#pragma unroll
        for (int j = 0; j < kScores / 4; ++j)
          s_part[buf][warp][j] = make_float4(s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3]);
      }
      pair_sync(1 + kw);
#pragma unroll
      for (int j = 0; j < kScores / 4; ++j) {
        const float4 o = s_part[buf][warp ^ 1][j];
        s[4 * j] += o.x;
        s[4 * j + 1] += o.y;
        s[4 * j + 2] += o.z;
        s[4 * j + 3] += o.w;
      }
      buf ^= 1;
    }
    // Online softmax once per iteration (kSteps keys per lane); exp2 of -inf gives 0, and a lane
    // with no visible key yet keeps m = -inf without producing NaN (ms = 0 then).
#pragma unroll
    for (int h = 0; h < MAXH; ++h) {
      float mx = m[h];
#pragma unroll
      for (int k = 0; k < kSteps; ++k) {
        if (cap > 0.0f) s[k * MAXH + h] = cap * tanhf(s[k * MAXH + h] * inv_cap);
        if (base + k * KPW + sub > last) s[k * MAXH + h] = -INFINITY;
        mx = fmaxf(mx, s[k * MAXH + h]);
      }
      const float ms = mx == -INFINITY ? 0.0f : mx;
      const float corr = exp2f(m[h] - ms);
      m[h] = mx;
      l[h] *= corr;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] *= corr;
#pragma unroll
      for (int k = 0; k < kSteps; ++k) {
        s[k * MAXH + h] = exp2f(s[k * MAXH + h] - ms);
        l[h] += s[k * MAXH + h];
      }
    }
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      float vx[8];
      decode_unit<T>(rv[k], p.v.bits, vx);
      if (vq) {
        const float vs = scale_of(rv[k]), voff = -vhalf * vs;
#pragma unroll
        for (int i = 0; i < 8; ++i) vx[i] = fmaf(vx[i], vs, voff);
      }
#pragma unroll
      for (int h = 0; h < MAXH; ++h)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(s[k * MAXH + h], vx[i], acc[h][i]);
    }
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      rk[k] = nk[k];
      rv[k] = nv[k];
    }
  }

  // Merge the warp's side-by-side keys (lanes L apart), then the key slots (shared memory). The
  // warps of a pair hold equal m and l, and each its own half of the accumulators.
#pragma unroll
  for (int off = L; off < 32; off <<= 1) {
#pragma unroll
    for (int h = 0; h < MAXH; ++h) {
      const float om = __shfl_xor_sync(kFull, m[h], off), ol = __shfl_xor_sync(kFull, l[h], off);
      const float mx = fmaxf(m[h], om);
      const float a = mx == -INFINITY ? 0.0f : exp2f(m[h] - mx);
      const float c = mx == -INFINITY ? 0.0f : exp2f(om - mx);
      l[h] = l[h] * a + ol * c;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] = acc[h][i] * a + __shfl_xor_sync(kFull, acc[h][i], off) * c;
      m[h] = mx;
    }
  }
  if (sub == 0) {
#pragma unroll
    for (int h = 0; h < MAXH; ++h) {
      if (h >= nh) continue;
#pragma unroll
      for (int i = 0; i < 8; ++i) s_acc[kw][h][u * 8 + i] = acc[h][i];
      if (u == 0) {
        s_m[kw][h] = m[h];
        s_l[kw][h] = l[h];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < nh * D; idx += kThreads) {
    const int h = idx / D, d = idx % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kKeyWarps; ++w) mx = fmaxf(mx, s_m[w][h]);
    float a = 0.0f, den = 0.0f;
#pragma unroll
    for (int w = 0; w < kKeyWarps; ++w) {
      const float c = s_m[w][h] == -INFINITY ? 0.0f : exp2f(s_m[w][h] - mx);
      a += c * s_acc[w][h][d];
      den += c * s_l[w][h];
    }
    const size_t at = part + static_cast<size_t>(h) * p.splits;
    p.part_acc[at * D + d] = a;
    if (d == 0) {
      p.part_m[at] = mx;
      p.part_l[at] = den;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Version 3: quantized caches (keys and values both 2, 4 or 8 bits) and dense fp16/bf16 caches
// (head_dim <= 128) with q.k and p.v on the tensor cores (mma.m16n8k16, fp32 accumulate; fp16
// operands for codes, the cache's own type for a dense cache). The binding's tensor_cores=false
// runs version 2 instead (tests and benchmarks compare the two); other widths use version 2.
//
// A dense cache skips the decoding below: its units go into the MMA as stored, the query is not
// rotated, and the scores need no per-group offset or scale. For bf16 the query and P are rounded
// to bf16 for the MMA, as a bf16 flash attention does; version 2 computes in fp32 on the CUDA
// cores (~110 warp instructions per key and kv head, see above), too many to keep up with SDPA.
//
// Why: version 2 spends ~16 lanes x ~225 instructions per key (each lane dots its 8 numbers with
// every head, 31 shuffles per 16 scores, the softmax repeated in all 16 lanes of a key), so the
// quantized cache, though 2-4x fewer bytes, is slower than the dense cache there. Here a warp
// takes 16 keys at a time and the per-key work is decoding its numbers once, in fp16:
//   S^T[16 keys x 8 heads] = K[16 x D] . Q^T[D x 8]    (A = keys, B = the query, D/16 MMAs)
//   O^T[D x 8 heads]      += V^T[D x 16] . P^T[16 x 8] (A = values, B = the probabilities, D/16 MMAs)
// Lane (g = lane / 4, t = lane % 4) holds, in the MMA fragments, keys g and g + 8 and heads 2t,
// 2t + 1 of S, so the softmax is 4 exp2 per lane (3 shuffle rounds for the maxima) and its
// rescaling of O touches only the lane's own accumulators.
//
// The dot products do not care in which order d runs, so each fragment's d positions are chosen
// to be whole 8-number bit-plane units: for q.k the lane decodes unit 4c + t (group c) of keys g
// and g + 8 and holds the same unit of the (rotated) query of head g; for p.v it decodes units
// g + 8w of keys 2t, 2t + 1, 2t + 8, 2t + 9, and its accumulator rows are those units' numbers.
// A unit becomes 8 code bytes with the bit-plane transpose, each pair of bytes an fp16 pair with
// one PRMT (0x64 exponent: 1024 + code) and one HSUB2 (the exact codes). Keys go in as codes, one
// accumulator per 32-number group started at -midpoint x the group's query sum, and the group's
// scale multiplies it per key in fp32: q.k is exact but for q's rounding to fp16. Values are
// dequantized in fp16 with one HFMA2 (scale, -midpoint x scale: one rounding per number, as an
// fp16 cache has, plus that of -midpoint x scale). P goes to fp16 for the MMA as in flash
// attention; its transpose from the score layout to the p.v operand layout goes through 512 bytes
// of shared memory per warp.
//
// Instructions per 16 keys and lane at head_dim 128, 8-bit (4-bit: transposes 11 instead of 21):
// keys 8 units x 21 transpose + 32 pairs x 2 + 8 scales + 16 FFMA; values 8 x 21 + 32 pairs x 3.5
// + 4; softmax ~50 + 32 rescales; loads/addresses ~80; 16 MMAs: ~680, i.e. ~43 warp instructions
// per key and kv head (version 2: ~110), with no shuffle chain per key.

template <int BITS>
struct PlaneWord {
  using type = unsigned;  // 2-4 planes: one 32-bit word (2 planes: its low half)
};
template <>
struct PlaneWord<8> {
  using type = uint2;  // planes 0-3, 4-7
};

template <int BITS>
__device__ __forceinline__ typename PlaneWord<BITS>::type fetch_planes(const uint8_t* c) {
  if constexpr (BITS == 8) {
    return __ldg(reinterpret_cast<const uint2*>(c));
  } else if constexpr (BITS == 4) {
    return __ldg(reinterpret_cast<const unsigned*>(c));
  } else {
    static_assert(BITS == 2, "the tensor-core kernel takes 2, 4 or 8 bits");
    return static_cast<unsigned>(__ldg(reinterpret_cast<const unsigned short*>(c)));
  }
}

// The codes of one unit as bytes: byte i of lo = number i, byte i of hi = number 4 + i (the
// transposes of unpack_codes4 / unpack_codes8 without the conversion to float).
__device__ __forceinline__ void planes_to_bytes(unsigned x, unsigned& lo, unsigned& hi) {
  unsigned t = (x ^ (x >> 7)) & 0x00AA00AAu;
  x ^= t ^ (t << 7);
  t = (x ^ (x >> 14)) & 0x0000CCCCu;
  x ^= t ^ (t << 14);
  lo = x & 0x0F0F0F0Fu;
  hi = (x >> 4) & 0x0F0F0F0Fu;
}

__device__ __forceinline__ void planes_to_bytes(uint2 w, unsigned& lo, unsigned& hi) {
  lo = w.x;
  hi = w.y;
  unsigned t = (lo ^ (lo >> 7)) & 0x00AA00AAu, v = (hi ^ (hi >> 7)) & 0x00AA00AAu;
  lo ^= t ^ (t << 7);
  hi ^= v ^ (v << 7);
  t = (lo ^ (lo >> 14)) & 0x0000CCCCu;
  v = (hi ^ (hi >> 14)) & 0x0000CCCCu;
  lo ^= t ^ (t << 14);
  hi ^= v ^ (v << 14);
  t = (lo ^ (hi << 4)) & 0xF0F0F0F0u;
  lo ^= t;
  hi ^= t >> 4;
}

__device__ __forceinline__ __half2 u32_as_h2(unsigned u) { return *reinterpret_cast<const __half2*>(&u); }
__device__ __forceinline__ unsigned h2_as_u32(__half2 h) { return *reinterpret_cast<const unsigned*>(&h); }

// Two code bytes of `bytes` (picked by `sel`: 0x4140 bytes 0, 1; 0x4342 bytes 2, 3) as the
// stored numbers, (code - midpoint) * scale, in fp16: 1024 + code exactly by putting the byte
// under an fp16 exponent, minus 1024 exactly, then one FMA.
__device__ __forceinline__ unsigned dequant_pair(unsigned bytes, unsigned sel, __half2 scale, __half2 offset) {
  const __half2 magic = u32_as_h2(__byte_perm(bytes, 0x64646464u, sel));
  const __half2 code = __hsub2(magic, __floats2half2_rn(1024.0f, 1024.0f));
  return h2_as_u32(__hfma2(code, scale, offset));
}

// Two code bytes as exact fp16 codes (0 .. 255), no scale: the keys' scales are applied per group
// after the MMA, in fp32.
__device__ __forceinline__ unsigned code_pair(unsigned bytes, unsigned sel) {
  const __half2 magic = u32_as_h2(__byte_perm(bytes, 0x64646464u, sel));
  return h2_as_u32(__hsub2(magic, __floats2half2_rn(1024.0f, 1024.0f)));
}

// D += A . B, m16n8k16, fp16 operands, fp32 accumulators (sm_80+).
__device__ __forceinline__ void mma_16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same MMA with bf16 operands (a dense bf16 cache: its keys and values go in as stored).
__device__ __forceinline__ void mma_16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1, __nv_bfloat16) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1, __half) {
  mma_16816(d, a0, a1, a2, a3, b0, b1);
}

// Two floats as an operand register of the MMA type (round to nearest even).
__device__ __forceinline__ unsigned pack2(float a, float b, __half) { return h2_as_u32(__floats2half2_rn(a, b)); }
__device__ __forceinline__ unsigned pack2(float a, float b, __nv_bfloat16) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}
__device__ __forceinline__ __half to_mma(float a, __half) { return __float2half_rn(a); }
__device__ __forceinline__ __nv_bfloat16 to_mma(float a, __nv_bfloat16) { return __float2bfloat16_rn(a); }

// N 32-bit words (2N fp16 scales: one key's row of group scales) in one vector load.
template <int N>
__device__ __forceinline__ void load_words(const __half* p, unsigned (&w)[N]) {
  if constexpr (N == 1) {
    w[0] = __ldg(reinterpret_cast<const unsigned*>(p));
  } else if constexpr (N == 2) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x;
    w[1] = v.y;
  } else {
    static_assert(N == 4, "head_dim 64, 128 or 256");
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
  }
}

constexpr int kTile = 16;  // keys per warp per step of the tensor-core kernel

// A lane's raw (still encoded) share of one 16-key tile: the key units of keys g and g + 8 and
// the value units of keys 2t, 2t + 1, 2t + 8, 2t + 9 (see above), with those keys' scale rows.
template <int D, int KB, int VB>
struct TileUnits {
  static constexpr int NG = D / kGroup, NW = NG / 2;
  typename PlaneWord<KB>::type k[2][NG];
  typename PlaneWord<VB>::type v[4][NW];
  unsigned ks[2][NW], vs[4][NW];
};

// A dense (fp16/bf16) cache: the same units, as stored (8 numbers = 16 bytes each), no scales.
// The MMA reads them without any conversion; only p.v interleaves two keys per register (PRMT).
template <int D>
struct TileUnits<D, 16, 16> {
  static constexpr int NG = D / kGroup, NW = NG / 2;
  uint4 k[2][NG];
  uint4 v[4][NW];
};

// Tile offsets of the lane's keys: 0-1 for q.k (rows g, g + 8), 2-5 for p.v (2t, 2t+1, 2t+8, 2t+9).
__device__ __forceinline__ int tile_key(int i, int g, int t) {
  return i < 2 ? g + 8 * i : 2 * t + ((i - 2) & 1) + 8 * ((i - 2) >> 1);
}

__device__ __forceinline__ void tile_pages(const Params& p, const int* table, int base, int last, int g, int t,
                                           int (&pg)[6]) {
#pragma unroll
  for (int i = 0; i < 6; ++i) pg[i] = __ldg(table + page_index(p, min(base + tile_key(i, g, t), last)));
}

template <int D, int KB, int VB>
__device__ __forceinline__ void fetch_tile(const Params& p, int base, int last, int kvh, int g, int t,
                                           const int (&pg)[6], TileUnits<D, KB, VB>& r) {
  constexpr int NG = D / kGroup, NW = NG / 2;
  if constexpr (KB == 16) {  // dense: unit u of a row is 16 bytes at element 8u
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const size_t row = cache_row(p, pg[i], min(base + tile_key(i, g, t), last), kvh);
      const uint4* c = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.k.dense) + row * D);
#pragma unroll
      for (int cg = 0; cg < NG; ++cg) r.k[i][cg] = __ldg(c + 4 * cg + t);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const size_t row = cache_row(p, pg[2 + j], min(base + tile_key(2 + j, g, t), last), kvh);
      const uint4* c = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.v.dense) + row * D);
#pragma unroll
      for (int w = 0; w < NW; ++w) r.v[j][w] = __ldg(c + g + 8 * w);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const size_t row = cache_row(p, pg[i], min(base + tile_key(i, g, t), last), kvh);
      const uint8_t* c = p.k.codes + row * (D / 8) * KB;
#pragma unroll
      for (int cg = 0; cg < NG; ++cg) r.k[i][cg] = fetch_planes<KB>(c + (4 * cg + t) * KB);
      load_words<NW>(p.k.scales + row * NG, r.ks[i]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const size_t row = cache_row(p, pg[2 + j], min(base + tile_key(2 + j, g, t), last), kvh);
      const uint8_t* c = p.v.codes + row * (D / 8) * VB;
#pragma unroll
      for (int w = 0; w < NW; ++w) r.v[j][w] = fetch_planes<VB>(c + (g + 8 * w) * VB);
      load_words<NW>(p.v.scales + row * NG, r.vs[j]);
    }
  }
}

// At most 168 registers up to head_dim 128: 3 blocks (12 warps) per multiprocessor.
template <int D, typename T, int KB, int VB>
__global__ void __launch_bounds__(kThreads, D <= 128 ? 3 : 1) paged_decode_kernel_mma(const Params p) {
  constexpr int MAXH = kMaxHeads;  // 8 heads = the MMA's N; fewer heads leave columns of zeros
  constexpr int NG = D / kGroup, NW = NG / 2, NKC = D / 16, NMT = D / 16;
  // A dense cache (KB = VB = 16) goes into the MMA as stored, in its own type (MT); quantized
  // codes become exact fp16.
  constexpr bool kDense = KB == 16;
  static_assert(kDense == (VB == 16), "keys and values both dense or both quantized");
  using MT = std::conditional_t<kDense, T, __half>;
  // Loads one tile ahead where the registers allow it (head_dim 256, or a dense tile above head_dim
  // 64: at use, other warps hide it).
  constexpr bool kPrefetch = kDense ? D <= 64 : D <= 128;
  static_assert(MAXH == 8, "the MMA's N is 8 heads");
  __shared__ float s_m[kWarps][MAXH], s_l[kWarps][MAXH];
  __shared__ float s_acc[kWarps][MAXH][D];
  __shared__ __align__(16) MT s_p[kWarps][2][MAXH][kTile];  // P^T per warp, double-buffered
  __shared__ __align__(16) float s_qoff[kWarps][NG][MAXH];       // see qoff below (registers)

  const int split = blockIdx.x, b = blockIdx.z;
  const int kvh = blockIdx.y / p.head_chunks, chunk = blockIdx.y % p.head_chunks;
  const int h0 = kvh * p.group + chunk * MAXH;
  const int nh = min(MAXH, p.group - chunk * MAXH);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
  // Lengths and tables before the wait, as in version 2.
  const int len = p.lengths[b];
  const int lo = p.window > 0 ? max(0, len - p.window) : 0;
  const int span = p.pages_per_split * p.page_size;
  const int start = max(lo, split * span), end = min(len, (split + 1) * span);
  const size_t part = (static_cast<size_t>(b) * p.heads + h0) * p.splits + split;
  const int last = end - 1, stride = kWarps * kTile;
  const int* table = p.block_tables + static_cast<size_t>(b) * p.max_pages;
  int base = start + warp * kTile;
  int pg[6];
  if (start < end) tile_pages(p, table, base, last, g, t, pg);
  chain_wait();  // the caches and q come from earlier kernels of the step
  chain_release();
  if (start >= end) {
    if (threadIdx.x < nh) {
      p.part_m[part + threadIdx.x * p.splits] = -INFINITY;
      p.part_l[part + threadIdx.x * p.splits] = 0.0f;
    }
    return;
  }

  TileUnits<D, KB, VB> cur;
  fetch_tile<D, KB, VB>(p, base, last, kvh, g, t, pg, cur);
  tile_pages(p, table, base + stride, last, g, t, pg);

  // The query of head g (zero past the chunk's heads; rotated for a quantized cache), unit 4c + t
  // of each group c, scale and log2 e folded in, as the B fragments of the D/16 k-steps: numbers
  // (0,1), (2,3) | (4,5), (6,7).
  const float qmul = p.scale * (p.softcap > 0.0f ? 1.0f : kLog2e) * (kDense ? 1.0f : kInvSqrtGroup);
  unsigned qf[NKC][2];
#pragma unroll
  for (int cg = 0; cg < NG; ++cg) {
    float x[8];
    if (g < nh) {
      load8(static_cast<const T*>(p.q) + (static_cast<size_t>(b) * p.heads + h0 + g) * D + (4 * cg + t) * 8, x);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = 0.0f;
    }
    if constexpr (!kDense) hadamard32_lanes(x, lane);  // the group's 4 units: lanes 4g .. 4g + 3
#pragma unroll
    for (int i = 0; i < 4; ++i) qf[2 * cg + i / 2][i % 2] = pack2(x[2 * i] * qmul, x[2 * i + 1] * qmul, MT());
  }
  // Keys enter the MMA as exact codes, one group (two k-steps) per accumulator started at
  // -midpoint x (the group's sum of the fp16 query), so it ends as sum q (code - midpoint); the
  // group's scale multiplies it per key in fp32. Lane (g, t) needs heads 2t, 2t + 1 of each group.
  // Kept in shared memory (one copy per warp, one 8-byte load per group and tile): registers.
  if constexpr (!kDense) {
#pragma unroll
    for (int cg = 0; cg < NG; ++cg) {
      float part = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(u32_as_h2(qf[2 * cg + i / 2][i % 2]));
        part += f.x + f.y;
      }
      part += __shfl_xor_sync(kFull, part, 1);
      part += __shfl_xor_sync(kFull, part, 2);  // head g's group sum, in its 4 lanes
      if (t == 0) s_qoff[warp][cg][g] = -0.5f * static_cast<float>((1 << KB) - 1) * part;
    }
    __syncwarp();
  }
  const __half2 nvhalf = __float2half2_rn(-0.5f * static_cast<float>((1 << VB) - 1));
  const unsigned vsel = (g & 4) ? 0x7632u : 0x5410u;  // unit g + 8w is in group g / 4 + 2w: word w, half (g / 4) & 1
  const float cap = p.softcap > 0.0f ? p.softcap * kLog2e : 0.0f;
  const float inv_cap = p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f;

  // Heads 2t, 2t + 1: running max / sum (this lane's keys only for l; reduced at the end) and
  // O^T accumulators: M-tile j rows g, g + 8 = numbers 2(j % 4), 2(j % 4) + 1 of unit g + 8(j / 4).
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float acc[NMT][4];
#pragma unroll
  for (int j = 0; j < NMT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;

  // Units one tile ahead (kPrefetch) or fetched after the math (head_dim 256). Unrolling twice to
  // swap the buffers instead of copying them cost registers (d 64: 106 -> 141) and spilled at 8 bits.
  int buf = 0;
  for (; base < end; base += stride, buf ^= 1) {
    TileUnits<D, KB, VB> nxt;
    if constexpr (kPrefetch) {
      fetch_tile<D, KB, VB>(p, base + stride, last, kvh, g, t, pg, nxt);
      tile_pages(p, table, base + 2 * stride, last, g, t, pg);
    }

    // S^T = K . Q^T: k-step 2c + h takes numbers 4h .. 4h + 3 of unit 4c + t, one accumulator per
    // group c (its scale differs per key), scaled into the scores in fp32.
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if constexpr (kDense) {
      // Keys as stored: unit 4c + t of keys g, g + 8 = numbers (0,1), (2,3) of k-step 2c and
      // (4,5), (6,7) of k-step 2c + 1, one fp32 accumulator for all of d.
#pragma unroll
      for (int cg = 0; cg < NG; ++cg) {
        const uint4 a = cur.k[0][cg], b = cur.k[1][cg];
        mma_16816(s, a.x, b.x, a.y, b.y, qf[2 * cg][0], qf[2 * cg][1], MT());
        mma_16816(s, a.z, b.z, a.w, b.w, qf[2 * cg + 1][0], qf[2 * cg + 1][1], MT());
      }
    } else {
#pragma unroll
      for (int cg = 0; cg < NG; ++cg) {
        unsigned klo[2], khi[2];
        float ksf[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          planes_to_bytes(cur.k[i][cg], klo[i], khi[i]);
          ksf[i] = __half2float(__ushort_as_half(static_cast<unsigned short>(cur.ks[i][cg / 2] >> (16 * (cg & 1)))));
        }
        const float2 qo = *reinterpret_cast<const float2*>(&s_qoff[warp][cg][2 * t]);
        float c[4] = {qo.x, qo.y, qo.x, qo.y};
        mma_16816(c, code_pair(klo[0], 0x4140u), code_pair(klo[1], 0x4140u), code_pair(klo[0], 0x4342u),
                  code_pair(klo[1], 0x4342u), qf[2 * cg][0], qf[2 * cg][1]);
        mma_16816(c, code_pair(khi[0], 0x4140u), code_pair(khi[1], 0x4140u), code_pair(khi[0], 0x4342u),
                  code_pair(khi[1], 0x4342u), qf[2 * cg + 1][0], qf[2 * cg + 1][1]);
#pragma unroll
        for (int i = 0; i < 4; ++i) s[i] = fmaf(ksf[i >> 1], c[i], s[i]);
      }
    }
    // Scores s[2r + e]: key g + 8r, head 2t + e. Online softmax per head over the tile's 16 keys
    // (a max over the 8 lanes of equal t); the tile's first key is always visible, so the new max
    // is finite and exp2(-inf) = 0 covers the first tile and the masked keys.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (cap > 0.0f) s[i] = cap * tanhf(s[i] * inv_cap);
      if (base + g + 8 * (i >> 1) > last) s[i] = -INFINITY;
    }
    float corr[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float mx = fmaxf(s[e], s[2 + e]);
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
      const float mn = fmaxf(m[e], mx);
      corr[e] = exp2f(m[e] - mn);
      m[e] = mn;
      s[e] = exp2f(s[e] - mn);
      s[2 + e] = exp2f(s[2 + e] - mn);
      l[e] = l[e] * corr[e] + s[e] + s[2 + e];
    }
#pragma unroll
    for (int j = 0; j < NMT; ++j) {
      acc[j][0] *= corr[0];
      acc[j][1] *= corr[1];
      acc[j][2] *= corr[0];
      acc[j][3] *= corr[1];
    }
    // P^T as the B operand: lane (g, t) needs head g at keys 2t, 2t + 1 and 2t + 8, 2t + 9.
    MT(*sp)[kTile] = s_p[warp][buf];
#pragma unroll
    for (int i = 0; i < 4; ++i) sp[2 * t + (i & 1)][g + 8 * (i >> 1)] = to_mma(s[i], MT());
    __syncwarp();
    const unsigned pb0 = *reinterpret_cast<const unsigned*>(&sp[g][2 * t]);
    const unsigned pb1 = *reinterpret_cast<const unsigned*>(&sp[g][2 * t + 8]);

    // O^T += V^T . P^T: unit g + 8w of keys 2t, 2t + 1 (columns 2t, 2t + 1) and 2t + 8, 2t + 9.
    if constexpr (kDense) {
      // Word q of a unit holds numbers 2q (low half: row g) and 2q + 1 (high half: row g + 8);
      // the A fragment pairs two keys per register.
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const unsigned v0[4] = {cur.v[0][w].x, cur.v[0][w].y, cur.v[0][w].z, cur.v[0][w].w};
        const unsigned v1[4] = {cur.v[1][w].x, cur.v[1][w].y, cur.v[1][w].z, cur.v[1][w].w};
        const unsigned v2[4] = {cur.v[2][w].x, cur.v[2][w].y, cur.v[2][w].z, cur.v[2][w].w};
        const unsigned v3[4] = {cur.v[3][w].x, cur.v[3][w].y, cur.v[3][w].z, cur.v[3][w].w};
#pragma unroll
        for (int q = 0; q < 4; ++q)
          mma_16816(acc[4 * w + q], __byte_perm(v0[q], v1[q], 0x5410u), __byte_perm(v0[q], v1[q], 0x7632u),
                    __byte_perm(v2[q], v3[q], 0x5410u), __byte_perm(v2[q], v3[q], 0x7632u), pb0, pb1, MT());
      }
    } else {
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        unsigned vlo[4], vhi[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) planes_to_bytes(cur.v[j][w], vlo[j], vhi[j]);
        const __half2 vs01 = u32_as_h2(__byte_perm(cur.vs[0][w], cur.vs[1][w], vsel));
        const __half2 vs23 = u32_as_h2(__byte_perm(cur.vs[2][w], cur.vs[3][w], vsel));
        const __half2 vo01 = __hmul2(vs01, nvhalf), vo23 = __hmul2(vs23, nvhalf);
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // numbers 2q (row g), 2q + 1 (row g + 8)
          const unsigned sel = (q & 1) ? 0x7362u : 0x5140u;  // bytes (2q) % 4, +1 of the two keys, interleaved
          const unsigned w01 = __byte_perm(q < 2 ? vlo[0] : vhi[0], q < 2 ? vlo[1] : vhi[1], sel);
          const unsigned w23 = __byte_perm(q < 2 ? vlo[2] : vhi[2], q < 2 ? vlo[3] : vhi[3], sel);
          mma_16816(acc[4 * w + q], dequant_pair(w01, 0x4140u, vs01, vo01), dequant_pair(w01, 0x4342u, vs01, vo01),
                    dequant_pair(w23, 0x4140u, vs23, vo23), dequant_pair(w23, 0x4342u, vs23, vo23), pb0, pb1);
        }
      }
    }

    if constexpr (kPrefetch) {
      cur = nxt;
    } else {
      fetch_tile<D, KB, VB>(p, base + stride, last, kvh, g, t, pg, cur);
      tile_pages(p, table, base + 2 * stride, last, g, t, pg);
    }
  }

  // l over the 8 lanes of equal t (m is already equal there), then the warps via shared memory.
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) l[e] += __shfl_xor_sync(kFull, l[e], o);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int h = 2 * t + e;
    if (h >= nh) continue;
#pragma unroll
    for (int j = 0; j < NMT; ++j) {
      const int d = 8 * (g + 8 * (j / 4)) + 2 * (j % 4);
      s_acc[warp][h][d] = acc[j][e];
      s_acc[warp][h][d + 1] = acc[j][2 + e];
    }
    if (g == 0) {
      s_m[warp][h] = m[e];
      s_l[warp][h] = l[e];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < nh * D; idx += kThreads) {
    const int h = idx / D, d = idx % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_m[w][h]);
    float a = 0.0f, den = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float c = s_m[w][h] == -INFINITY ? 0.0f : exp2f(s_m[w][h] - mx);
      a += c * s_acc[w][h][d];
      den += c * s_l[w][h];
    }
    const size_t at = part + static_cast<size_t>(h) * p.splits;
    p.part_acc[at * D + d] = a;
    if (d == 0) {
      p.part_m[at] = mx;
      p.part_l[at] = den;
    }
  }
}

// Sum the splits of one (sequence, head): one thread per output number, one warp per group, so
// quantized values rotate back with warp shuffles. At batch 1 the grid is small and there are
// many splits (32 at 4K for the Llama-8B shape), so the loads are issued kCombineChunk splits at a
// time, none depending on another: a chunk costs one L2 round trip (a table of one chunk, the
// short contexts, one round trip in all: its maxes come with its accumulators). (Loading a split's
// accumulator only after testing its max would make each split a dependent L2 round trip;
// docs/KERNELS.md, section 5.) Indices past the end are clamped to the
// last split; an empty split's unwritten accumulator is read but never used (a select, not a
// product).
//
// Learned attention sinks (GPT-OSS; `sinks` [heads] fp32 logits, nullptr: none) join here, once
// per head and not per split: one more term exp(sink) in the denominator, with no value. The
// sink, in base 2 like the splits' maxima, starts the running max, so exp2 of neither the sink
// nor a split can overflow; without sinks the max starts at -inf and the sums are unchanged.
constexpr int kCombineChunk = 16;

template <typename T>
__global__ void combine_kernel(const float* __restrict__ part_acc, const float* __restrict__ part_m,
                               const float* __restrict__ part_l, const float* __restrict__ sinks,
                               T* __restrict__ out, int heads, int splits, int D, bool rotated) {
  // A weight, not an output of the step's kernels: read before the chain wait.
  const float sink = sinks != nullptr ? sinks[blockIdx.x] * kLog2e : -INFINITY;
  chain_wait();
  chain_release();
  const int row = blockIdx.y * heads + blockIdx.x, d = threadIdx.x;
  const size_t base = static_cast<size_t>(row) * splits;
  float ms[kCombineChunk], a[kCombineChunk], lv[kCombineChunk];
  auto load_chunk = [&](int s0) {  // every load of the chunk in flight at once
#pragma unroll
    for (int i = 0; i < kCombineChunk; ++i) {
      const size_t at = base + min(s0 + i, splits - 1);
      ms[i] = part_m[at];
      lv[i] = part_l[at];
      a[i] = part_acc[at * D + d];
    }
  };
  float mx = sink, num = 0.0f, den = 0.0f;
  auto add_chunk = [&](int s0) {
#pragma unroll
    for (int i = 0; i < kCombineChunk; ++i) {
      if (s0 + i < splits && ms[i] != -INFINITY) {  // an empty split wrote no accumulator
        const float w = exp2f(ms[i] - mx);
        num += w * a[i];
        den += w * lv[i];
      }
    }
  };
  if (splits <= kCombineChunk) {  // one chunk (a short table): its max and its sums from one round trip
    load_chunk(0);
#pragma unroll
    for (int i = 0; i < kCombineChunk; ++i) mx = fmaxf(mx, ms[i]);  // a repeated last split: same max
    add_chunk(0);
  } else {  // the maxes first, then each chunk again with its accumulators
    for (int s0 = 0; s0 < splits; s0 += kCombineChunk) {
#pragma unroll
      for (int i = 0; i < kCombineChunk; ++i) ms[i] = part_m[base + min(s0 + i, splits - 1)];
#pragma unroll
      for (int i = 0; i < kCombineChunk; ++i) mx = fmaxf(mx, ms[i]);
    }
    for (int s0 = 0; s0 < splits; s0 += kCombineChunk) {
      load_chunk(s0);
      add_chunk(s0);
    }
  }
  if (sink != -INFINITY) den += exp2f(sink - mx);  // the sink's share: no value row
  float o = den > 0.0f ? num / den : 0.0f;
  if (rotated) o = hadamard32_warp(o, threadIdx.x % 32) * kInvSqrtGroup;
  store1(out + static_cast<size_t>(row) * D + d, o);
}

// Quantize x [n, kv_heads, D] (32-number groups: rotate, absmax scale, round half to even) and
// scatter to the store's rows `slots`: one warp per group, lane l holding number l.
template <typename T>
__global__ void quantize_write_kernel(const T* __restrict__ x, const int64_t* __restrict__ slots,
                                      uint8_t* __restrict__ codes, __half* __restrict__ scales, int n, int kv_heads,
                                      int D, int bits) {
  chain_wait();
  chain_release();
  const int lane = threadIdx.x % 32;
  const long long gw = static_cast<long long>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int groups = D / kGroup;
  if (gw >= static_cast<long long>(n) * kv_heads * groups) return;  // whole warps leave together
  const int g = static_cast<int>(gw % groups);
  const long long src_row = gw / groups;  // token * kv_heads + head
  const int head = static_cast<int>(src_row % kv_heads);
  const long long token = src_row / kv_heads;
  const float r = hadamard32_warp(load1(x + src_row * D + g * kGroup + lane), lane) * kInvSqrtGroup;
  float amax = fabsf(r);
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, m));
  const int levels = (1 << bits) - 1;
  const float half = 0.5f * static_cast<float>(levels);
  const __half scale = __float2half_rn(fmaxf(amax / half, 1e-8f));
  const float q = fminf(fmaxf(rintf(r / __half2float(scale) + half), 0.0f), static_cast<float>(levels));
  const unsigned code = static_cast<unsigned>(q);
  const size_t dst_row = static_cast<size_t>(slots[token]) * kv_heads + head;
  uint8_t* dst = codes + (dst_row * (D / 8) + g * 4) * bits;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j >= bits) break;
    const unsigned plane = __ballot_sync(kFull, (code >> j) & 1u);
    if (lane < 4) dst[lane * bits + j] = static_cast<uint8_t>(plane >> (8 * lane));
  }
  if (lane == 0) scales[dst_row * groups + g] = scale;
}

// ---------------------------------------------------------------------------------------------
// Host side

struct SideTensors {
  Side side{};
  int64_t kv_heads = 0;
};

SideTensors check_side(const c10::optional<at::Tensor>& dense, const c10::optional<at::Tensor>& codes,
                       const c10::optional<at::Tensor>& scales, int64_t bits, const at::Tensor& q, int64_t D,
                       const char* name) {
  SideTensors r;
  r.side.bits = static_cast<int>(bits);
  if (bits >= 16) {
    TORCH_CHECK(dense.has_value(), name, ": a dense side needs its tensor");
    const at::Tensor& t = *dense;
    TORCH_CHECK(t.is_cuda() && t.device() == q.device() && t.is_contiguous() && t.dim() == 3 && t.size(2) == D &&
                    t.scalar_type() == q.scalar_type(),
                name, " must be a contiguous [slots, kv_heads, ", D, "] tensor of q's dtype on q's device");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
    r.side.dense = t.data_ptr();
    r.kv_heads = t.size(1);
    return r;
  }
  TORCH_CHECK(bits >= 2 && bits <= 8, name, ": bits must be 2..8 or 16, got ", bits);
  TORCH_CHECK(codes.has_value() && scales.has_value(), name, ": a quantized side needs codes and scales");
  const at::Tensor& c = *codes;
  const at::Tensor& s = *scales;
  TORCH_CHECK(c.is_cuda() && c.device() == q.device() && c.is_contiguous() && c.scalar_type() == at::kByte &&
                  c.dim() == 4 && c.size(2) == D / 8 && c.size(3) == bits,
              name, " codes must be contiguous uint8 [slots, kv_heads, ", D / 8, ", ", bits, "]");
  TORCH_CHECK(s.is_cuda() && s.device() == q.device() && s.is_contiguous() && s.scalar_type() == at::kHalf &&
                  s.dim() == 3 && s.size(0) == c.size(0) && s.size(1) == c.size(1) && s.size(2) == D / kGroup,
              name, " scales must be contiguous fp16 [slots, kv_heads, ", D / kGroup, "]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(c.data_ptr()) % 8 == 0, name, " codes must be 8-byte aligned");
  r.side.codes = c.data_ptr<uint8_t>();
  r.side.scales = reinterpret_cast<const __half*>(s.data_ptr<at::Half>());
  r.kv_heads = c.size(1);
  return r;
}

// The tensor-core kernel for this case, or nullptr: keys and values quantized to the same width
// of 2, 4 or 8 bits (8 only up to head_dim 128), scale rows aligned for one vector load; or both
// dense (fp16/bf16) up to head_dim 128 (256 needs more than 255 registers: version 2).
template <int D, typename T>
void (*mma_kernel(const Params& p))(const Params) {
  if (p.k.bits == 16 || p.v.bits == 16) {
    if constexpr (D <= 128) {
      if (p.k.bits == 16 && p.v.bits == 16) return paged_decode_kernel_mma<D, T, 16, 16>;
    }
    return nullptr;
  }
  const uintptr_t align = (D / kGroup) * 2;
  if (p.k.bits != p.v.bits || reinterpret_cast<uintptr_t>(p.k.scales) % align != 0 ||
      reinterpret_cast<uintptr_t>(p.v.scales) % align != 0)
    return nullptr;
  switch (p.k.bits) {
    case 2: return paged_decode_kernel_mma<D, T, 2, 2>;
    case 4: return paged_decode_kernel_mma<D, T, 4, 4>;
    case 8:  // head_dim 256 at 8 bits needs more than 255 registers: version 2
      if constexpr (D <= 128) return paged_decode_kernel_mma<D, T, 8, 8>;
      return nullptr;
    default: return nullptr;
  }
}

// Launch, or with `occupancy` set only report how many blocks fit on one multiprocessor.
// tensor_cores: version 3 where it applies; false: version 2 everywhere.
template <int D, typename T>
void launch_decode(const Params& p, dim3 grid, cudaStream_t stream, int* occupancy, bool tensor_cores) {
  auto kernel = p.group <= 4 ? paged_decode_kernel_v2<D, T, 4>  // Llama: 4
                             : paged_decode_kernel_v2<D, T, kMaxHeads>;
  if constexpr (D <= 256) {  // head_dim 512: version 2 only (O^T alone would take 128 registers a lane)
    if (tensor_cores) {
      if (auto v3 = mma_kernel<D, T>(p)) kernel = v3;
    }
  }
  if (occupancy) {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(occupancy, kernel, kThreads, 0));
    return;
  }
  launch_chained(kernel, grid, dim3(kThreads), 0, stream, p);
}

template <typename T>
void launch_decode_dim(int D, const Params& p, dim3 grid, cudaStream_t stream, int* occupancy, bool tensor_cores) {
  switch (D) {
    case 64: launch_decode<64, T>(p, grid, stream, occupancy, tensor_cores); break;
    case 128: launch_decode<128, T>(p, grid, stream, occupancy, tensor_cores); break;
    case 256: launch_decode<256, T>(p, grid, stream, occupancy, tensor_cores); break;
    case 512: launch_decode<512, T>(p, grid, stream, occupancy, tensor_cores); break;
    default: TORCH_CHECK(false, "paged_decode_attention: head_dim must be 64, 128, 256 or 512, got ", D);
  }
}

// Splits: as many as fill one wave of resident blocks (`capacity` = blocks per multiprocessor x
// multiprocessors; a partial second wave would double the time of the longest blocks), with at
// least kMinSplitKeys keys each. Depends only on shapes (batch, heads, table width), never on the
// lengths, so a graph captured once fits every length.
int choose_splits(int rows, int max_pages, int page_size, int capacity) {
  const int want = std::max(1, capacity / rows);
  const int min_pages = std::max(1, (kMinSplitKeys + page_size - 1) / page_size);
  const int pps = std::max((max_pages + want - 1) / want, min_pages);
  return (max_pages + pps - 1) / pps;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const c10::optional<at::Tensor>& k_dense,
                                  const c10::optional<at::Tensor>& k_codes, const c10::optional<at::Tensor>& k_scales,
                                  int64_t k_bits, const c10::optional<at::Tensor>& v_dense,
                                  const c10::optional<at::Tensor>& v_codes, const c10::optional<at::Tensor>& v_scales,
                                  int64_t v_bits, const at::Tensor& block_tables, const at::Tensor& lengths,
                                  int64_t page_size, double scale, int64_t window, double softcap, int64_t splits,
                                  bool tensor_cores, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.is_cuda() && q.is_contiguous() && q.dim() == 3, "q must be a contiguous [batch, heads, dim] CUDA tensor");
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, "q must be fp16 or bf16");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(D == 64 || D == 128 || D == 256 || D == 512, "head_dim must be 64, 128, 256 or 512, got ", D);
  const SideTensors ks = check_side(k_dense, k_codes, k_scales, k_bits, q, D, "keys");
  const SideTensors vs = check_side(v_dense, v_codes, v_scales, v_bits, q, D, "values");
  TORCH_CHECK(ks.kv_heads == vs.kv_heads && ks.kv_heads > 0 && H % ks.kv_heads == 0,
              "heads must be a multiple of kv_heads (keys and values alike)");
  TORCH_CHECK(block_tables.is_cuda() && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == B,
              "block_tables must be contiguous int32 [batch, max_pages] on the GPU");
  TORCH_CHECK(lengths.is_cuda() && lengths.scalar_type() == at::kInt && lengths.is_contiguous() &&
                  lengths.numel() == B,
              "lengths must be contiguous int32 [batch] on the GPU");
  TORCH_CHECK(page_size >= 1 && B >= 1 && block_tables.size(1) >= 1, "empty batch or page table");
  const float* sink_logits = nullptr;  // nullptr: no sink term (every model but GPT-OSS)
  if (sinks.has_value()) {
    const at::Tensor& t = *sinks;
    TORCH_CHECK(t.is_cuda() && t.device() == q.device() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.dim() == 1 && t.size(0) == H,
                "sinks must be a contiguous fp32 [heads] tensor on q's device (", H, " heads)");
    sink_logits = t.data_ptr<float>();
  }
  const c10::cuda::CUDAGuard guard(q.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  Params p{};
  p.q = q.data_ptr();
  p.block_tables = block_tables.data_ptr<int>();
  p.lengths = lengths.data_ptr<int>();
  p.k = ks.side;
  p.v = vs.side;
  p.heads = static_cast<int>(H);
  p.kv_heads = static_cast<int>(ks.kv_heads);
  p.group = static_cast<int>(H / ks.kv_heads);
  p.head_chunks = (p.group + kMaxHeads - 1) / kMaxHeads;
  p.max_pages = static_cast<int>(block_tables.size(1));
  p.page_size = static_cast<int>(page_size);
  p.page_shift = (page_size & (page_size - 1)) == 0 ? __builtin_ctzll(page_size) : -1;  // -1: divide
  p.window = window > 0 ? static_cast<int>(window) : 0;
  p.scale = static_cast<float>(scale);
  p.softcap = softcap > 0 ? static_cast<float>(softcap) : 0.0f;
  const int rows = static_cast<int>(B) * p.kv_heads * p.head_chunks;
  const bool half = q.scalar_type() == at::kHalf;
  if (splits <= 0) {
    int sms = 0, per_sm = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, q.get_device()));
    if (half) launch_decode_dim<__half>(static_cast<int>(D), p, dim3(), stream, &per_sm, tensor_cores);
    else launch_decode_dim<__nv_bfloat16>(static_cast<int>(D), p, dim3(), stream, &per_sm, tensor_cores);
    splits = choose_splits(rows, p.max_pages, p.page_size, std::max(1, per_sm) * sms);
  }
  splits = std::min<int64_t>(splits, p.max_pages);
  p.pages_per_split = static_cast<int>((p.max_pages + splits - 1) / splits);
  p.splits = static_cast<int>((p.max_pages + p.pages_per_split - 1) / p.pages_per_split);

  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor part_acc = at::empty({B, H, p.splits, D}, f32);
  at::Tensor part_ml = at::empty({2, B, H, p.splits}, f32);
  p.part_acc = part_acc.data_ptr<float>();
  p.part_m = part_ml.data_ptr<float>();
  p.part_l = p.part_m + B * H * p.splits;
  at::Tensor out = at::empty_like(q);

  const dim3 grid(p.splits, p.kv_heads * p.head_chunks, static_cast<unsigned>(B));
  const dim3 cgrid(static_cast<unsigned>(H), static_cast<unsigned>(B));
  const bool rotated = p.v.bits < 16;
  if (half) {
    launch_decode_dim<__half>(static_cast<int>(D), p, grid, stream, nullptr, tensor_cores);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    launch_chained(combine_kernel<__half>, cgrid, dim3(static_cast<unsigned>(D)), 0, stream, p.part_acc, p.part_m,
                   p.part_l, sink_logits, reinterpret_cast<__half*>(out.data_ptr<at::Half>()), p.heads, p.splits,
                   static_cast<int>(D), rotated);
  } else {
    launch_decode_dim<__nv_bfloat16>(static_cast<int>(D), p, grid, stream, nullptr, tensor_cores);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    launch_chained(combine_kernel<__nv_bfloat16>, cgrid, dim3(static_cast<unsigned>(D)), 0, stream, p.part_acc,
                   p.part_m, p.part_l, sink_logits, reinterpret_cast<__nv_bfloat16*>(out.data_ptr<at::BFloat16>()),
                   p.heads, p.splits, static_cast<int>(D), rotated);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

void quantized_cache_write(const at::Tensor& x, const at::Tensor& slots, at::Tensor& codes, at::Tensor& scales,
                           int64_t bits) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == 3, "x must be a contiguous [n, kv_heads, dim] CUDA tensor");
  const int64_t n = x.size(0), kvh = x.size(1), D = x.size(2);
  TORCH_CHECK(D % kGroup == 0, "head_dim must be a multiple of 32, got ", D);
  TORCH_CHECK(bits >= 2 && bits <= 8, "bits must be 2..8");
  TORCH_CHECK(slots.is_cuda() && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == n,
              "slots must be contiguous int64 [n] on the GPU");
  TORCH_CHECK(codes.is_cuda() && codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.dim() == 4 &&
                  codes.size(1) == kvh && codes.size(2) == D / 8 && codes.size(3) == bits,
              "codes must be contiguous uint8 [slots, kv_heads, dim/8, bits]");
  TORCH_CHECK(scales.is_cuda() && scales.is_contiguous() && scales.scalar_type() == at::kHalf && scales.dim() == 3 &&
                  scales.size(0) == codes.size(0) && scales.size(1) == kvh && scales.size(2) == D / kGroup,
              "scales must be contiguous fp16 [slots, kv_heads, dim/32]");
  TORCH_CHECK(x.device() == codes.device() && slots.device() == codes.device() && scales.device() == codes.device(),
              "tensors on different devices");
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const long long warps = n * kvh * (D / kGroup);
  const unsigned blocks = static_cast<unsigned>((warps + kWarps - 1) / kWarps);
  auto* c = codes.data_ptr<uint8_t>();
  auto* s = reinterpret_cast<__half*>(scales.data_ptr<at::Half>());
  const auto* sl = slots.data_ptr<int64_t>();
  const int ni = static_cast<int>(n), hi = static_cast<int>(kvh), di = static_cast<int>(D), bi = static_cast<int>(bits);
  switch (x.scalar_type()) {
    case at::kHalf:
      launch_chained(quantize_write_kernel<__half>, dim3(blocks), dim3(kThreads), 0, stream,
                     reinterpret_cast<const __half*>(x.data_ptr<at::Half>()), sl, c, s, ni, hi, di, bi);
      break;
    case at::kBFloat16:
      launch_chained(quantize_write_kernel<__nv_bfloat16>, dim3(blocks), dim3(kThreads), 0, stream,
                     reinterpret_cast<const __nv_bfloat16*>(x.data_ptr<at::BFloat16>()), sl, c, s, ni, hi, di, bi);
      break;
    case at::kFloat:
      launch_chained(quantize_write_kernel<float>, dim3(blocks), dim3(kThreads), 0, stream, x.data_ptr<float>(), sl,
                     c, s, ni, hi, di, bi);
      break;
    default: TORCH_CHECK(false, "x must be fp16, bf16 or fp32");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

namespace trellis {
void bind_paged_attention(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged (dense or 2-8 bit) KV cache; splits <= 0: chosen from the table width; "
        "sinks: fp32 [heads] learned sink logits in each head's softmax denominator, or None",
        py::arg("q"), py::arg("k_dense"), py::arg("k_codes"), py::arg("k_scales"), py::arg("k_bits"),
        py::arg("v_dense"), py::arg("v_codes"), py::arg("v_scales"), py::arg("v_bits"), py::arg("block_tables"),
        py::arg("lengths"), py::arg("page_size"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0, py::arg("splits") = 0, py::arg("tensor_cores") = true,
        py::arg("sinks") = py::none());
  m.def("quantized_cache_write", &quantized_cache_write,
        "quantize x [n, kv_heads, dim] to 2-8 bit planes and write rows `slots` of codes/scales", py::arg("x"),
        py::arg("slots"), py::arg("codes"), py::arg("scales"), py::arg("bits"));
}
}  // namespace trellis
