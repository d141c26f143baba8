// EXL3 tile decoding shared by the GEMV and whole-weight kernels.
//
// Format facts used here (docs/EXL3_FORMAT.md sections 5 and 6: the bitstream, the tile layout):
//  - a tile is 16*K int16 words; read as little-endian uint32 words d[0..8K) the bitstream is
//    d[0], d[1], ... each MSB first (the pair swap of the int16 view disappears in this view);
//  - value i's 16-bit state is stream bits [(i+1)K-16, (i+1)K), circular (tail-biting);
//  - lane L of a warp owns storage positions p = 8L..8L+7, and those 8 values are exactly the
//    A fragment of an m16n8k16 MMA for the transposed tile (output features = MMA rows,
//    input features = MMA k). So a lane decodes its 8 values straight into MMA registers.
//
// Why these instruction choices: on Hopper the decode is bound by integer issue, not DRAM
// (about 2-4 integer instructions per weight are available at 4 bpw before the HBM roofline
// is reached). Every shift amount and word index below is a compile-time constant except the
// per-lane bit offset r, which is fixed for the whole kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <utility>

namespace trellis {

enum Codebook : int { CB_3INST = 0, CB_MCG = 1, CB_MUL1 = 2 };

// The 3INST/MCG xor constant lives in constant memory on purpose: with both constants as
// immediates ptxas splits (x & 0x8FFF8FFF) ^ 0x3B603B60 into two LOP3s (one immediate per
// LOP3); with one of them in the constant bank it is a single LOP3 per weight.
static __constant__ uint32_t kInstXor = 0x3B603B60u;

// Bit position (possibly negative: tail-biting) of the first bit lane `lane` needs.
__host__ __device__ constexpr int lane_first_bit(int K, int lane) { return (8 * lane + 1) * K - 16; }

// Raw 32-bit words lane `lane` must load so that its 7K+16 bits are covered.
__host__ __device__ constexpr int lane_raw_words(int K, int lane) {
  return (((lane_first_bit(K, lane) % 32) + 32) % 32 + 7 * K + 16 + 31) / 32;
}

__host__ __device__ constexpr int max_raw_words(int K) {
  int m = 0;
  for (int l = 0; l < 32; ++l) m = lane_raw_words(K, l) > m ? lane_raw_words(K, l) : m;
  return m;
}

template <int K>
struct TileGeom {
  static constexpr int kWords = 8 * K;                      // uint32 words per tile
  static constexpr int kNorm = (7 * K + 16 + 31) / 32;      // normalised words a lane uses
  static constexpr int kRaw = max_raw_words(K);             // raw words a lane loads
};

// Per-lane constants: word offsets inside a tile (wrapped: tail-biting) and the bit offset r.
template <int K>
struct LanePlan {
  int word[TileGeom<K>::kRaw];
  int r;
  __device__ __forceinline__ explicit LanePlan(int lane) {
    const int s0 = lane_first_bit(K, lane);
    const int w0 = s0 >> 5;  // floor division (s0 >= -15)
    r = s0 & 31;
#pragma unroll
    for (int i = 0; i < TileGeom<K>::kRaw; ++i) {
      int w = w0 + i;
      if (w < 0) w += TileGeom<K>::kWords;
      if (w >= TileGeom<K>::kWords) w -= TileGeom<K>::kWords;
      word[i] = w;
    }
  }
};

// Where each of a lane's 8 states is cut from (compile time). The states lie at offsets
// base + jK of a stream held in `words` 32-bit words, MSB first. A "view" at offset v is the
// 32-bit word holding stream bits [v, v+32): free when v is a multiple of 32 (a word itself),
// one funnel shift otherwise. A state at offset o takes ONE instruction from a view at v = o,
// o-8 or o-16 (d = o - v): >> 16, a byte permute of bytes 1-2, or & 0xFFFF, each zero-filling
// the upper half (a shift-and-mask per state would be two). The views are picked greedily:
// free ones first, then the view that serves the most remaining states. K=4 needs 3 funnel
// shifts for its 8 states instead of 8.
struct StatePlan {
  int view[8];  // stream offset of the view state j is cut from
  int d[8];     // 0, 8 or 16: the state's offset inside that view
};

__host__ __device__ constexpr bool plan_d_ok(int e) { return e == 0 || e == 8 || e == 16; }

__host__ __device__ constexpr StatePlan plan_states(int K, int base, int words) {
  StatePlan p{};
  bool done[8] = {false, false, false, false, false, false, false, false};
  for (int j = 0; j < 8; ++j) {  // free views first
    for (int d = 0; d <= 16 && !done[j]; d += 8) {
      const int v = base + j * K - d;
      if (v >= 0 && v % 32 == 0 && v / 32 < words) {
        p.view[j] = v; p.d[j] = d; done[j] = true;
      }
    }
  }
  for (int round = 0; round < 8; ++round) {  // then the shifted view serving most states
    int best_v = -1, best_count = 0;
    for (int j = 0; j < 8; ++j) {
      if (done[j]) continue;
      for (int d = 0; d <= 16; d += 8) {
        const int v = base + j * K - d;
        if (v < 0 || (v % 32 == 0 && v / 32 >= words)) continue;
        int count = 0;
        for (int i = 0; i < 8; ++i) count += (!done[i] && plan_d_ok(base + i * K - v)) ? 1 : 0;
        if (count > best_count) { best_count = count; best_v = v; }
      }
    }
    if (best_v < 0) break;
    for (int i = 0; i < 8; ++i) {
      if (!done[i] && plan_d_ok(base + i * K - best_v)) {
        p.view[i] = best_v; p.d[i] = base + i * K - best_v; done[i] = true;
      }
    }
  }
  return p;
}

// True when every lane's first bit has the same offset inside its first raw word (K = 4, 8):
// the states can then be cut from the raw words with constant shifts, no re-alignment.
__host__ __device__ constexpr bool lane_offset_uniform(int K) {
  for (int l = 1; l < 32; ++l)
    if (((lane_first_bit(K, l) % 32) + 32) % 32 != ((lane_first_bit(K, 0) % 32) + 32) % 32) return false;
  return true;
}

// The view at stream offset V of words w[0..W) (words past the end read as 0: the states cut
// from such a view never reach them).
template <int V, int W>
__device__ __forceinline__ uint32_t stream_view(const uint32_t (&w)[W]) {
  constexpr int q = V >> 5, b = V & 31;
  if constexpr (b == 0) {
    return w[q];
  } else {
    const uint32_t lo = (q + 1 < W) ? w[q + 1] : 0u;
    return __funnelshift_l(lo, w[q], b);
  }
}

template <int K, int BASE, int W, int J>
__device__ __forceinline__ uint32_t cut_state(const uint32_t (&w)[W]) {
  constexpr StatePlan p = plan_states(K, BASE, W);
  const uint32_t v = stream_view<p.view[J], W>(w);
  if constexpr (p.d[J] == 0) return v >> 16;
  else if constexpr (p.d[J] == 8) return __byte_perm(v, 0u, 0x4421);  // bytes 1, 2; zero above
  else return v & 0xFFFFu;
}

template <int K, int BASE, int W, int... J>
__device__ __forceinline__ void cut_states(const uint32_t (&w)[W], uint32_t (&st)[8],
                                           std::integer_sequence<int, J...>) {
  ((st[J] = cut_state<K, BASE, W, J>(w)), ...);
}

// The 8 states of a lane from its raw words: state j is stream bits [r + jK, r + jK + 16).
// Where r differs between lanes, the stream is first re-aligned (n[] with the lane's first
// needed bit as MSB), so that every cut is a constant shift.
template <int K>
__device__ __forceinline__ void lane_states(const uint32_t (&raw)[TileGeom<K>::kRaw], int r, uint32_t (&st)[8]) {
  if constexpr (lane_offset_uniform(K)) {
    constexpr int R = ((lane_first_bit(K, 0) % 32) + 32) % 32;
    cut_states<K, R, TileGeom<K>::kRaw>(raw, st, std::make_integer_sequence<int, 8>{});
  } else {
    constexpr int NN = TileGeom<K>::kNorm;
    uint32_t n[NN];
#pragma unroll
    for (int i = 0; i < NN; ++i) {
      const uint32_t lo = (i + 1 < TileGeom<K>::kRaw) ? raw[i + 1] : 0u;
      n[i] = __funnelshift_l(lo, raw[i], r);
    }
    cut_states<K, 0, NN>(n, st, std::make_integer_sequence<int, 8>{});
  }
}

__device__ __forceinline__ uint32_t h2_as_u32(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 u32_as_h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// Two states -> one half2 register (low half = first state), bit-exact with section 6.2.
template <int CB>
__device__ __forceinline__ uint32_t decode_pair(uint32_t s0, uint32_t s1) {
  if constexpr (CB == CB_MUL1) {
    // x = s * 0x83DCD12D; b = byte sum (dp4a); h = fp16 with bits 0x6400 + b (= 1024 + b);
    // value = fma(h, k_inv, k_bias) in fp16 with ONE rounding (HFMA2 is fused).
    const uint32_t x0 = s0 * 0x83DCD12Du;
    const uint32_t x1 = s1 * 0x83DCD12Du;
    const uint32_t h0 = __dp4a(x0, 0x01010101u, 0x64006400u);  // low: 0x6400+b0, high: 0x6400
    const uint32_t b1 = __dp4a(x1, 0x01010101u, 0u);
    const uint32_t h = h0 + (b1 << 16);
    const __half2 k_inv = __halves2half2(__ushort_as_half(0x1EEE), __ushort_as_half(0x1EEE));
    const __half2 k_bias = __halves2half2(__ushort_as_half(0xC931), __ushort_as_half(0xC931));
    return h2_as_u32(__hfma2(u32_as_h2(h), k_inv, k_bias));
  } else {
    uint32_t x0, x1;
    if constexpr (CB == CB_3INST) {
      x0 = s0 * 89226354u + 64248484u;
      x1 = s1 * 89226354u + 64248484u;
    } else {
      x0 = s0 * 0xCBAC1FEDu;
      x1 = s1 * 0xCBAC1FEDu;
    }
    x0 = (x0 & 0x8FFF8FFFu) ^ kInstXor;
    x1 = (x1 & 0x8FFF8FFFu) ^ kInstXor;
    // (lo0, lo1) + (hi0, hi1): one fp16 RN addition per value, as the reference does.
    const uint32_t lo = __byte_perm(x0, x1, 0x5410);
    const uint32_t hi = __byte_perm(x0, x1, 0x7632);
    return h2_as_u32(__hadd2(u32_as_h2(lo), u32_as_h2(hi)));
  }
}

// A lane's 8 values as the A fragment of m16n8k16 (rows = output features, k = input features):
// reg0 = (j0, j1), reg1 = (j4, j5), reg2 = (j2, j3), reg3 = (j6, j7).
template <int K, int CB>
__device__ __forceinline__ void decode_fragment(const uint32_t (&raw)[TileGeom<K>::kRaw], int r, uint32_t (&a)[4]) {
  uint32_t st[8];
  lane_states<K>(raw, r, st);
  a[0] = decode_pair<CB>(st[0], st[1]);
  a[1] = decode_pair<CB>(st[4], st[5]);
  a[2] = decode_pair<CB>(st[2], st[3]);
  a[3] = decode_pair<CB>(st[6], st[7]);
}

// 3INST/MCG without the final addition: one register = (lo, hi) fp16 halves of ONE weight.
template <int CB>
__device__ __forceinline__ uint32_t inst_halves(uint32_t s) {
  uint32_t x = (CB == CB_3INST) ? s * 89226354u + 64248484u : s * 0xCBAC1FEDu;
  return (x & 0x8FFF8FFFu) ^ kInstXor;
}

// MUL1 without the affine map, one weight per register: (h, 0) with h = 1024 + byte_sum (exact
// fp16). Paired with a B fragment holding each input twice (as inst_halves is), the MMA adds
// h * u + 0 * u: no instruction packs two weights into one register.
__device__ __forceinline__ uint32_t mul1_halves(uint32_t s) {
  return __dp4a(s * 0x83DCD12Du, 0x01010101u, 0x6400u);
}

// MUL1 without the affine map: registers of h = 1024 + byte_sum (exact fp16), fragment order.
template <int K>
__device__ __forceinline__ void decode_fragment_mul1_raw(const uint32_t (&raw)[TileGeom<K>::kRaw], int r,
                                                         uint32_t (&a)[4]) {
  uint32_t st[8];
  lane_states<K>(raw, r, st);
  uint32_t h[4];
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const uint32_t h0 = __dp4a(st[2 * p] * 0x83DCD12Du, 0x01010101u, 0x64006400u);
    const uint32_t b1 = __dp4a(st[2 * p + 1] * 0x83DCD12Du, 0x01010101u, 0u);
    h[p] = h0 + (b1 << 16);
  }
  a[0] = h[0]; a[1] = h[2]; a[2] = h[1]; a[3] = h[3];
}

// D = A * B + D, fp16 inputs, fp32 accumulation.
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- activations of any of the three float dtypes -------------------------------------------

enum DType : int { DT_F16 = 0, DT_BF16 = 1, DT_F32 = 2 };

__device__ __forceinline__ void load4(const void* p, int dtype, size_t idx, float (&v)[4]) {
  if (dtype == DT_F16) {
    const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const __half*>(p) + idx);
    const float2 a = __half22float2(u32_as_h2(u.x));
    const float2 b = __half22float2(u32_as_h2(u.y));
    v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
  } else if (dtype == DT_BF16) {
    const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p) + idx);
    v[0] = __uint_as_float(u.x << 16);
    v[1] = __uint_as_float(u.x & 0xFFFF0000u);
    v[2] = __uint_as_float(u.y << 16);
    v[3] = __uint_as_float(u.y & 0xFFFF0000u);
  } else {
    const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + idx);
    v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
  }
}

__device__ __forceinline__ void store4(void* p, int dtype, size_t idx, const float (&v)[4]) {
  if (dtype == DT_F16) {
    uint2 u;
    u.x = h2_as_u32(__floats2half2_rn(v[0], v[1]));
    u.y = h2_as_u32(__floats2half2_rn(v[2], v[3]));
    *reinterpret_cast<uint2*>(static_cast<__half*>(p) + idx) = u;
  } else if (dtype == DT_BF16) {
    __nv_bfloat162 a = __floats2bfloat162_rn(v[0], v[1]);
    __nv_bfloat162 b = __floats2bfloat162_rn(v[2], v[3]);
    uint2 u;
    u.x = *reinterpret_cast<uint32_t*>(&a);
    u.y = *reinterpret_cast<uint32_t*>(&b);
    *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p) + idx) = u;
  } else {
    *reinterpret_cast<float4*>(static_cast<float*>(p) + idx) = make_float4(v[0], v[1], v[2], v[3]);
  }
}

// 128-point Sylvester Hadamard across one warp, lane holding elements 4*lane .. 4*lane+3.
// Unnormalised (the caller multiplies by 1/sqrt(128)). For a pair (i, i+h) inside a block of
// 2h: the lower element becomes x_i + x_{i+h}, the upper x_i - x_{i+h} (H_2n = [[H, H], [H, -H]]).
__device__ __forceinline__ void warp_hadamard128(float (&v)[4], int lane) {
  float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
  v[0] = a0 + a2; v[2] = a0 - a2; v[1] = a1 + a3; v[3] = a1 - a3;
#pragma unroll
  for (int mask = 1; mask < 32; mask <<= 1) {
    const bool upper = lane & mask;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float p = __shfl_xor_sync(0xFFFFFFFFu, v[i], mask);
      v[i] = upper ? p - v[i] : v[i] + p;
    }
  }
}

constexpr float kRsqrt128 = 0.08838834764831845f;

}  // namespace trellis
