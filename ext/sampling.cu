// Sampling on the GPU: penalties, temperature, top-k, min-p, top-p and the draw in one launch.
//
// Why: without it every sampled token copies a [vocab] fp32 row to the host (1 MB for a 262k
// vocabulary) and runs the host sampler there. Here the GPU takes the same decision as the host
// sampler (engine/generation/sampling.py) and the torch reference
// (sample_reference in engine/generation/sampling.py, the test oracle) and writes one token id; the row never
// leaves the device. Two kernels take it, bit for bit alike: on sm_90+ a cluster of 8 blocks per
// row (the second half of this file: the row's x computed once and kept in shared memory), and
// elsewhere one block per row (the first half). Every input is a device tensor (the per-row
// settings, the penalty lists, the uniform u), so a CUDA graph can capture the launch and replay
// it with new values.
//
// The decision, in order (the host sampler's):
//   1. penalties on the raw logits w: repetition (CTRL-style: w > 0 ? w / r : w * r) over the
//      context's distinct ids, then presence + frequency * count over the generated ids; an
//      optional pending token per row (the last one generated, still on the device, not yet in
//      the lists: a pipelined decode step) counts as if appended: one more distinct context id
//      unless listed, one more occurrence (count + 1, or a new entry of count 1);
//   2. greedy (temperature <= 0 or top_k == 1): the argmax of w, the first maximum;
//   3. x = w / temperature, m = max x;
//   4. top-k: keep x >= the k-th largest x (counted with multiplicity);
//   5. probability weights q = floor(exp(x - m) * 2^44) as 64-bit integers over what top-k kept;
//      Z = their sum;
//   6. min-p: keep x >= m + log(min_p)  (p_i >= min_p * p_max);
//   7. top-p: keep a token when the weight of the tokens ranked strictly before it is below
//      top_p * Z (Z: over what top-k kept, min-p's cut included, as on the host);
//   8. the draw: the first kept token in ascending id order whose cumulative weight exceeds
//      floor(u * total), total = the kept tokens' weight.
//
// Tie rule (equal logits at a boundary): tokens of equal x are kept or dropped together. Top-k
// keeps every token equal to the k-th largest (possibly more than k tokens); for top-p "ranked
// strictly before" means "of strictly greater x", so a tie group's members all see the same mass
// before them. -0.0 and +0.0 count as equal (they are compared as floats). Greedy: the first
// (lowest id) maximum.
//
// Why integer weights: sums of integers do not depend on the order of additions, so the block's
// atomics and scans give the same result every run (a replay takes the same decision as the eager
// call) and the torch reference reproduces them exactly with int64 cumsums. 2^44 keeps the largest
// weight (1 for the best token) exact and 2^18 such weights (a 262k vocabulary) below 2^63; a token
// with exp(x - m) < 2^-44 weighs 0 and is never drawn (on the host it would be, with probability
// below 6e-14).
//
// Thresholds are found by radix search over the tokens' keys (the float bits made monotonic:
// a larger float, a larger uint32), 8 bits per pass, with a 256-bin histogram of the row each pass
// (counts for top-k, weights for top-p): four passes over the row instead of a sort.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <cooperative_groups.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>

#include "cluster_launch.cuh"
#include "float_types.cuh"
#include "trellis_ext.h"

namespace trellis {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kSettings = 7;  // temperature, top_k, top_p, min_p, repetition, presence, frequency
constexpr float kWeightScale = 17592186044416.0f;  // 2^44

// Monotonic key of a float: a < b (as floats) <=> key(a) < key(b); -0.0 maps to +0.0's key.
__device__ __forceinline__ uint32_t key_of(float x) {
  uint32_t b = x == 0.0f ? 0u : __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <typename W>
__device__ __forceinline__ W warp_sum(W v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide reductions; every thread gets the result. `scratch` holds kWarps values.
__device__ float block_max(float v, float* scratch) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[lane];
  return warp_max(v);
}

__device__ unsigned long long block_sum(unsigned long long v, unsigned long long* scratch) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_sum(scratch[lane]);
}

// (value, index) with the larger value, the lower index among equals.
__device__ __forceinline__ void better(float& v, int& i, float v2, int i2) {
  if (v2 > v || (v2 == v && i2 < i)) v = v2, i = i2;
}

__device__ int block_argmax(float v, int i, float* fscratch, int* iscratch) {
  for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) fscratch[warp] = v, iscratch[warp] = i;
  __syncthreads();
  v = fscratch[lane], i = iscratch[lane];
  for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
  return i;
}

// ================================================================================================
// The single-block kernel (sm_80-89, and the fallback): one 1024-thread block per row.
// ================================================================================================

// Sum of w over the lanes in `peers` (every one of them calls with the same mask; sm_80+).
__device__ __forceinline__ uint32_t group_sum(unsigned peers, uint32_t w) { return __reduce_add_sync(peers, w); }
__device__ __forceinline__ unsigned long long group_sum(unsigned peers, unsigned long long w) {
  // Weights are below 2^45: 22-bit halves, each summed over at most 32 lanes in 32 bits.
  const unsigned lo = __reduce_add_sync(peers, static_cast<unsigned>(w & 0x3fffffu));
  const unsigned hi = __reduce_add_sync(peers, static_cast<unsigned>(w >> 22));
  return (static_cast<unsigned long long>(hi) << 22) + lo;
}

// Shared state of the threshold search.
template <typename W>
struct Search {
  W hist[256];
  W above;  // weight of the keys above the chosen digit (within the prefix)
  int digit;  // -1: the total weight is below the target
};

// The largest key v with weight(keys >= v) >= target, over the items weight_of(i, key) gives
// (weight 0: not a candidate). Returns false (every thread) when the total weight is below target.
// Warp 0 picks each digit: lane l owns bins 255-8l .. 248-8l; a scan from the top bins down finds
// the lane whose bins cross the target, and that lane walks its eight bins.
template <typename W, typename F>
__device__ bool threshold_search(int n, W target, Search<W>& s, F weight_of, uint32_t* result) {
  uint32_t prefix = 0, mask = 0;
  W above = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) s.hist[b] = 0;
    __syncthreads();
    // Most tokens share the first digits (the exponent bits of similar logits): lanes adding to
    // the same bin sum their weights first and one of them adds, else the atomics serialize.
    const int lane = threadIdx.x & 31;
    for (int base = 0; base < n; base += blockDim.x) {  // warp-uniform trip count
      const int i = base + threadIdx.x;
      uint32_t key = 0;
      const W w = i < n ? weight_of(i, key) : W(0);
      const bool counts = w != 0 && (key & mask) == prefix;
      const int bin = counts ? static_cast<int>((key >> shift) & 255u) : 256 + lane;
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (counts) {
        const W sum = group_sum(peers, w);
        if (lane == __ffs(peers) - 1) atomicAdd(&s.hist[bin], sum);
      }
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      const int hi = 255 - 8 * lane;
      W mine = 0;
      for (int b = hi; b > hi - 8; --b) mine += s.hist[b];
      W incl = mine;  // inclusive scan from lane 0 (the top bins) upwards
      for (int o = 1; o < 32; o <<= 1) {
        const W t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
      }
      const unsigned crossed = __ballot_sync(0xffffffffu, above + incl >= target);
      if (crossed == 0) {
        if (lane == 0) s.digit = -1;
      } else if (lane == __ffs(crossed) - 1) {
        W acc = above + incl - mine;
        int b = hi;
        for (; b > hi - 7; --b) {  // the last bin crosses if no other does
          if (acc + s.hist[b] >= target) break;
          acc += s.hist[b];
        }
        s.digit = b;
        s.above = acc;
      }
    }
    __syncthreads();
    const int digit = s.digit;
    above = s.above;
    if (digit < 0) return false;
    prefix |= static_cast<uint32_t>(digit) << shift;
    mask |= 255u << shift;
  }
  *result = prefix;
  return true;
}

struct SampleArgs {
  const void* logits;  // [rows, vocab] at row_stride elements
  long long row_stride;
  float* work;  // [rows, vocab] scratch for the penalized logits
  const float* settings;  // [rows, kSettings]
  const float* u;  // [rows]
  const int* rep_ids;  // [rows, rep_cap] distinct ids, rep_len[r] of them valid
  const int* rep_len;
  int rep_cap;
  const int* gen_ids;  // [rows, gen_cap] distinct ids with gen_counts occurrences, gen_len[r] valid
  const int* gen_counts;
  const int* gen_len;
  int gen_cap;
  const int64_t* pending;  // [rows] each row's token not yet in the lists (< 0: none), or null
  void* out;  // [rows] int64 or int32
  bool out64;
  int vocab;
};

// The row's pending token if it is a valid id, else -1 (out-of-range ids are ignored, as in the
// lists).
__device__ __forceinline__ int pending_of(const SampleArgs& a, int row) {
  if (a.pending == nullptr) return -1;
  const int64_t p = a.pending[row];
  return p >= 0 && p < a.vocab ? static_cast<int>(p) : -1;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) sample_kernel(SampleArgs a) {
  __shared__ float fscratch[kWarps];
  __shared__ int iscratch[kWarps];
  __shared__ unsigned long long uscratch[kWarps];
  __shared__ Search<uint32_t> count_search;
  __shared__ Search<unsigned long long> mass_search;

  const int row = blockIdx.x, tid = threadIdx.x, n = a.vocab;
  const T* logits = static_cast<const T*>(a.logits) + row * a.row_stride;
  float* work = a.work + static_cast<long long>(row) * n;
  const float* st = a.settings + row * kSettings;
  const float temperature = st[0], top_p = st[2], min_p = st[3], rep = st[4], presence = st[5], frequency = st[6];
  const int top_k = static_cast<int>(st[1]);

  // 1. Penalties, into the work row (read straight from the logits when there are none). The
  // pending token: while scanning a list, any thread that meets it notes it; after the barrier,
  // thread 0 penalises it if no list entry did (once: the ids are distinct).
  __shared__ int pending_listed[2];  // [0]: in rep_ids, [1]: in gen_ids
  const bool rep_on = rep != 1.0f, gen_on = presence != 0.0f || frequency != 0.0f;
  const int pending = pending_of(a, row);
  const int n_rep = rep_on ? a.rep_len[row] : 0;
  const int n_gen = gen_on ? a.gen_len[row] : 0;
  const bool use_work = n_rep > 0 || n_gen > 0 || (pending >= 0 && (rep_on || gen_on));
  if (use_work) {
    if (tid == 0) pending_listed[0] = pending_listed[1] = 0;
    for (int i = tid; i < n; i += blockDim.x) work[i] = to_f<T>(logits[i]);
    __syncthreads();
    for (int j = tid; j < n_rep; j += blockDim.x) {
      const int id = a.rep_ids[row * a.rep_cap + j];
      if (id < 0 || id >= n) continue;  // cannot raise here: ignore an out-of-range id
      if (id == pending) pending_listed[0] = 1;
      const float v = work[id];
      work[id] = v > 0.0f ? __fdiv_rn(v, rep) : __fmul_rn(v, rep);
    }
    __syncthreads();
    if (tid == 0 && pending >= 0 && rep_on && !pending_listed[0]) {
      const float v = work[pending];
      work[pending] = v > 0.0f ? __fdiv_rn(v, rep) : __fmul_rn(v, rep);
    }
    __syncthreads();
    for (int j = tid; j < n_gen; j += blockDim.x) {
      const int id = a.gen_ids[row * a.gen_cap + j];
      if (id < 0 || id >= n) continue;
      int occurrences = a.gen_counts[row * a.gen_cap + j];
      if (id == pending) pending_listed[1] = 1, ++occurrences;
      const float count = static_cast<float>(occurrences);
      // No fused multiply-add: the reference rounds the product, then the sum.
      work[id] = __fsub_rn(work[id], __fadd_rn(presence, __fmul_rn(frequency, count)));
    }
    __syncthreads();
    if (tid == 0 && pending >= 0 && gen_on && !pending_listed[1])
      work[pending] = __fsub_rn(work[pending], __fadd_rn(presence, __fmul_rn(frequency, 1.0f)));
    __syncthreads();
  }
  auto raw = [&](int i) -> float { return use_work ? work[i] : to_f<T>(logits[i]); };

  auto write = [&](int token) {
    if (tid == 0) {
      if (a.out64) static_cast<long long*>(a.out)[row] = token;
      else static_cast<int*>(a.out)[row] = token;
    }
  };

  // 2. Greedy.
  if (temperature <= 0.0f || top_k == 1) {
    float best = -INFINITY;
    int at = INT_MAX;
    for (int i = tid; i < n; i += blockDim.x) better(best, at, raw(i), i);
    const int token = block_argmax(best, at, fscratch, iscratch);
    write(token == INT_MAX ? 0 : token);
    return;
  }

  // 3. Temperature and the maximum.
  auto x_of = [&](int i) -> float { return __fdiv_rn(raw(i), temperature); };
  float m = -INFINITY;
  for (int i = tid; i < n; i += blockDim.x) m = fmaxf(m, x_of(i));
  m = block_max(m, fscratch);
  if (m == -INFINITY) {  // every token masked out: no distribution to draw from
    write(0);
    return;
  }

  // 4. Top-k: the key of the k-th largest x.
  uint32_t k_key = 0;
  if (top_k > 0 && top_k < n) {
    threshold_search<uint32_t>(
        n, static_cast<uint32_t>(top_k), count_search,
        [&](int i, uint32_t& key) -> uint32_t {
          key = key_of(x_of(i));
          return 1u;
        },
        &k_key);
  }

  // 5. Weights over what top-k kept (floor_key: the smallest key that counts).
  auto weight_of = [&](int i, uint32_t& key, uint32_t floor_key) -> unsigned long long {
    const float x = x_of(i);
    key = key_of(x);
    if (key < floor_key) return 0ull;
    return __float2ull_rz(__fmul_rn(expf(__fsub_rn(x, m)), kWeightScale));
  };
  unsigned long long z = 0;
  for (int i = tid; i < n; i += blockDim.x) {
    uint32_t key;
    z += weight_of(i, key, k_key);
  }
  z = block_sum(z, uscratch);

  // 6. Min-p: x >= m + log(min_p).
  uint32_t t_key = k_key;
  if (min_p > 0.0f) t_key = max(t_key, key_of(__fadd_rn(m, logf(min_p))));

  // 7. Top-p: the largest key v whose weight(keys >= v) reaches top_p * Z; the mass before v is
  // below it, the mass before anything smaller is not. G < top_p * Z <=> G < ceil(top_p * Z).
  if (top_p < 1.0f) {
    const auto target = static_cast<unsigned long long>(ceil(static_cast<double>(top_p) * static_cast<double>(z)));
    uint32_t p_key;
    const bool found = threshold_search<unsigned long long>(
        n, target, mass_search, [&](int i, uint32_t& key) { return weight_of(i, key, k_key); }, &p_key);
    if (found) t_key = max(t_key, p_key);
  }

  // 8. The draw, in ascending id order. The row is cut into kThreads segments of whole 32-id
  // groups; each warp sums its segments (coalesced reads), a block-wide scan of the segment sums
  // finds the one segment where the cumulative weight passes the target, and one warp scans it.
  __shared__ unsigned long long segment_sum[kThreads];
  __shared__ int draw_segment;
  __shared__ unsigned long long draw_carry, draw_target;
  const int lane = tid & 31, warp = tid >> 5;
  const int seg_len = ((n + kThreads - 1) / kThreads + 31) / 32 * 32;
  auto kept_weight = [&](int i, int end) -> unsigned long long {
    uint32_t key;
    return i < end ? weight_of(i, key, t_key) : 0ull;
  };
  for (int sgm = warp; sgm < kThreads; sgm += kWarps) {
    const int b = sgm * seg_len, e = min(n, b + seg_len);
    unsigned long long acc = 0;
    for (int i = b + lane; i < b + seg_len && b < n; i += 32) acc += kept_weight(i, e);
    acc = warp_sum(acc);
    if (lane == 0) segment_sum[sgm] = acc;
  }
  __syncthreads();
  // Exclusive scan of segment_sum over the block: within warps, then over the warp totals.
  const unsigned long long own = segment_sum[tid];
  unsigned long long incl = own;
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  __syncthreads();  // uscratch was read by block_sum
  if (lane == 31) uscratch[warp] = incl;
  __syncthreads();
  unsigned long long before = 0, total = 0;
  for (int w = 0; w < kWarps; ++w) {  // 32 shared reads, the same for every thread of a warp
    const unsigned long long t = uscratch[w];
    if (w < warp) before += t;
    total += t;
  }
  before += incl - own;
  // u in [0, 1) gives a target below the total; clamp anyway (u = 1 picks the last kept token).
  unsigned long long target = static_cast<unsigned long long>(floor(static_cast<double>(a.u[row]) * static_cast<double>(total)));
  if (total > 0 && target >= total) target = total - 1;
  if (tid == 0) draw_segment = -1;
  __syncthreads();
  if (before <= target && target < before + own) {  // exactly one segment (own > 0 there)
    draw_segment = tid;
    draw_carry = before;
    draw_target = target;
  }
  __syncthreads();
  if (draw_segment < 0) {
    write(0);  // total weight 0: cannot happen (the best token weighs 2^44)
  } else if (warp == 0) {
    const int b = draw_segment * seg_len, e = min(n, b + seg_len);
    unsigned long long carry = draw_carry;
    const unsigned long long goal = draw_target;
    for (int i0 = b; i0 < e; i0 += 32) {
      const unsigned long long mine = kept_weight(i0 + lane, e);
      unsigned long long cum = mine;
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long t = __shfl_up_sync(0xffffffffu, cum, o);
        if (lane >= o) cum += t;
      }
      const unsigned crossed = __ballot_sync(0xffffffffu, carry + cum > goal);
      if (crossed) {
        write(i0 + __ffs(crossed) - 1);  // lane 0 is thread 0: it writes
        break;
      }
      carry += __shfl_sync(0xffffffffu, cum, 31);
    }
  }
}

// ================================================================================================
// The cluster kernel (sm_90+): one row per thread-block cluster.
//
// Which kernel runs where: on sm_90 and newer, with a slice of the row that fits a block's shared
// memory (vocabularies up to ~350k tokens on an H100/H200), this one; on sm_80-89, a build
// without sm_90 code, a larger vocabulary, or the binding's cluster=false (tests, A/B), the
// single-block kernel above. Both take the same decision, bit for bit.
//
// Why: one 1024-thread block per row uses one of the GPU's SMs and re-derived x, its key and its
// weight (a correctly rounded division, expf, a float->u64 conversion) from the logits in every
// pass. Here kCluster blocks share a row, each owning a contiguous slice of it (rank r: ids
// [r * slice, (r + 1) * slice)), and each keeps its slice of x = w / temperature in shared memory:
// the logits are read once, divided once, and every later pass is a shared-memory read plus a few
// instructions. Block results (maxima, sums, histograms) meet through distributed shared memory:
// every block publishes its value in its own shared memory, the cluster barrier makes them
// visible, and every block reads all kCluster of them in rank order and derives the same
// cluster-wide value (integer sums and float maxima do not depend on the order anyway), so no
// block ever has to wait for a broadcast.
// ================================================================================================
constexpr int kCluster = 8;  // blocks per row: the portable cluster size
constexpr int kCountCopies = 32;  // lane-private copies of a count histogram
constexpr int kMassCopies = 16;  // copies of a mass histogram: lanes l and l + 16 share one
constexpr int kCandidatesPerWarp = 64;  // top-p candidate list: room per warp segment
static_assert(kThreads == 1024, "the histogram fold gives each of the 256 bins four threads");

// Shared memory of a block besides its slice of x (the dynamic part).
struct ClusterShared {
  // Radix histogram of this block's elements, copy = lane % copies: counts as
  // uint32[256][kCountCopies]; weights as two uint32[256][kMassCopies], the low and the high
  // words of 64-bit sums (a 64-bit shared atomicAdd is a compare-and-swap loop on sm_90, which
  // retries when warps hit one word; two 32-bit adds with an explicit carry are native and exact).
  // A digit is usually shared by many lanes of a warp (similar logits share their exponent bits):
  // with one copy per lane (per two for weights) the adds of a warp do not serialize. Zero between
  // passes (the fold that reads them clears them).
  uint32_t copies[256 * kCountCopies];
  unsigned long long slot[2][256];  // published to the cluster; alternate exchanges use alternate slots
  unsigned long long hist[256];  // the cluster's histogram of the current pass
  unsigned long long segment[kWarps];  // the draw: weight of each warp's segment
  float cand_x[kCandidatesPerWarp * kWarps];  // top-p candidates (x, id), warp segment by segment
  int cand_id[kCandidatesPerWarp * kWarps];
  float fscratch[kWarps];
  int iscratch[kWarps];
  unsigned long long uscratch[kWarps];
  unsigned long long above;  // threshold search: the pass's result, from warp 0 to the block
  int digit;  // -1: the total weight is below the target
  int pending_listed[2];  // penalties: the pending token is in rep_ids ([0]) / gen_ids ([1])
};
static_assert(2 * kMassCopies <= kCountCopies, "the mass histogram's two words fit the copies");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
namespace cg = cooperative_groups;

// The cluster and the exchange slot to use next. Exchange k writes slot k % 2 before the cluster
// barrier and reads the others' after it; exchange k + 2 writes the same slot only after exchange
// k + 1's barrier, which every block reaches after its reads of exchange k: one barrier per
// exchange suffices.
struct ClusterCtx {
  cg::cluster_group cluster;
  int rank;
  int parity;
  ClusterShared* sh;
  __device__ unsigned long long* next_slot() {
    unsigned long long* s = sh->slot[parity];
    parity ^= 1;
    return s;
  }
};

// Every block publishes one value (thread 0's `mine`); after the barrier, lane r (< kCluster) of
// every warp holds block r's value and the other lanes `pad`.
__device__ unsigned long long cluster_gather(ClusterCtx& c, unsigned long long mine, unsigned long long pad) {
  unsigned long long* s = c.next_slot();
  if (threadIdx.x == 0) s[0] = mine;
  c.cluster.sync();
  const int lane = threadIdx.x & 31;
  return lane < kCluster ? *c.cluster.map_shared_rank(s, lane) : pad;
}

__device__ float cluster_max(ClusterCtx& c, float v) {
  v = block_max(v, c.sh->fscratch);
  const unsigned long long g = cluster_gather(c, __float_as_uint(v), __float_as_uint(-INFINITY));
  return warp_max(__uint_as_float(static_cast<uint32_t>(g)));
}

__device__ unsigned long long cluster_sum(ClusterCtx& c, unsigned long long v) {
  v = block_sum(v, c.sh->uscratch);
  return warp_sum(cluster_gather(c, v, 0ull));
}

// The first (lowest id) maximum of the row: (value, id) pairs meet as one 64-bit word.
__device__ int cluster_argmax(ClusterCtx& c, float v, int i) {
  for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) c.sh->fscratch[warp] = v, c.sh->iscratch[warp] = i;
  __syncthreads();
  v = c.sh->fscratch[lane], i = c.sh->iscratch[lane];
  for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
  const auto pack = [](float fv, int fi) {
    return (static_cast<unsigned long long>(__float_as_uint(fv)) << 32) | static_cast<uint32_t>(fi);
  };
  const unsigned long long g = cluster_gather(c, pack(v, i), pack(-INFINITY, INT_MAX));
  v = __uint_as_float(static_cast<uint32_t>(g >> 32)), i = static_cast<int>(static_cast<uint32_t>(g));
  for (int o = 16; o > 0; o >>= 1) better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
  return i;
}

// threshold_search over the cluster's row: the largest key v with weight(keys >= v) >= target,
// weight_of(x, key) giving each element of the block's slice `xs` its weight (0: not a candidate).
// Per 8-bit digit: the block's histogram in lane-private copies, folded into 256 sums and
// published; the cluster barrier; every block adds the kCluster histograms (rank order) and picks
// the digit (every block the same one: the same integers, the same scan).
template <typename W, typename F>
__device__ bool cluster_threshold_search(ClusterCtx& c, const float* xs, int len, unsigned long long target,
                                         F weight_of, uint32_t* result) {
  constexpr bool kCounts = sizeof(W) == 4;  // else 64-bit weights
  constexpr int kCopies = kCounts ? kCountCopies : kMassCopies;
  constexpr int kPerThread = kCopies / 4;  // copies each of a bin's four threads folds
  uint32_t* low = c.sh->copies;  // counts, or the low words of the weights
  uint32_t* high = c.sh->copies + 256 * kMassCopies;  // the high words of the weights
  unsigned long long* hist = c.sh->hist;
  const int tid = threadIdx.x, lane = tid & 31;
  uint32_t prefix = 0, mask = 0;
  unsigned long long above = 0;  // weight of the keys above the chosen prefix
  for (int shift = 24; shift >= 0; shift -= 8) {
    const int copy = lane % kCopies;
    for (int j = tid; j < len; j += kThreads) {
      const float x = xs[j];
      const uint32_t key = key_of(x);
      if ((key & mask) != prefix) continue;  // decided by an earlier digit: no weight to compute
      const W w = weight_of(x, key);
      if (w == 0) continue;
      const int at = static_cast<int>((key >> shift) & 255u) * kCopies + copy;
      if constexpr (kCounts) {
        atomicAdd(low + at, w);
      } else {
        // The add that wraps the low word sees it in the old value and carries one (the adds of
        // one word are serialized); the high words sum to at most 2^64 / 2^32.
        const uint32_t w_low = static_cast<uint32_t>(w), old = atomicAdd(low + at, w_low);
        atomicAdd(high + at, static_cast<uint32_t>(w >> 32) + (old + w_low < old ? 1u : 0u));
      }
    }
    __syncthreads();
    // Fold: thread t sums a quarter of bin t / 4's copies and clears them for the next pass. The
    // start is rotated so that a warp's eight bins read distinct banks (32 copies: bank = copy;
    // 16: bins 2b and 2b + 1 share a row of banks).
    unsigned long long* out = c.next_slot();
    {
      const int bin = tid >> 2, part = tid & 3;
      const int row = bin * kCopies + part * kPerThread, rotation = bin * kCopies / 32;
      unsigned long long sum = 0;
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int at = row + (i + rotation) % kPerThread;
        sum += low[at];
        low[at] = 0;
        if constexpr (!kCounts) {
          sum += static_cast<unsigned long long>(high[at]) << 32;
          high[at] = 0;
        }
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (part == 0) out[bin] = sum;
    }
    c.cluster.sync();
    if (tid < 256) {
      unsigned long long h = 0;
#pragma unroll
      for (int r = 0; r < kCluster; ++r) h += c.cluster.map_shared_rank(out, r)[tid];
      hist[tid] = h;
    }
    __syncthreads();
    // Warp 0 picks the digit: lane l owns bins 255-8l .. 248-8l (read from a start rotated by
    // l / 2, so the warp's 64-bit reads take two wavefronts, the least); a scan from the top bins
    // down finds the lane whose bins cross the target, and that lane walks its eight bins.
    if (tid < 32) {
      const int hi = 255 - 8 * lane;
      unsigned long long own = 0;
#pragma unroll
      for (int b = 0; b < 8; ++b) own += hist[hi - (b + (lane >> 1)) % 8];
      unsigned long long incl = own;
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
      }
      const unsigned crossed = __ballot_sync(0xffffffffu, above + incl >= target);
      if (crossed == 0) {
        if (lane == 0) c.sh->digit = -1;
      } else if (lane == __ffs(crossed) - 1) {
        unsigned long long acc = above + incl - own;
        int b = hi;
        for (; b > hi - 7; --b) {  // the last bin crosses if no other does
          if (acc + hist[b] >= target) break;
          acc += hist[b];
        }
        c.sh->digit = b;
        c.sh->above = acc;
      }
    }
    __syncthreads();
    const int digit = c.sh->digit;
    if (digit < 0) return false;  // the same in every thread of the cluster
    above = c.sh->above;
    prefix |= static_cast<uint32_t>(digit) << shift;
    mask |= 255u << shift;
  }
  *result = prefix;
  return true;
}
#endif  // __CUDA_ARCH__ >= 900

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) cluster_sample_kernel(SampleArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Dynamic shared memory: the ClusterShared state, then this block's slice of the row (the
  // penalized w, then x = w / T).
  extern __shared__ __align__(16) unsigned char smem[];
  ClusterShared& sh = *reinterpret_cast<ClusterShared*>(smem);
  float* xs = reinterpret_cast<float*>(smem + sizeof(ClusterShared));
  ClusterCtx c{cg::this_cluster(), 0, 0, &sh};
  c.rank = static_cast<int>(c.cluster.block_rank());

  const int row = blockIdx.x / kCluster, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, n = a.vocab;
  const int slice = (n + kCluster - 1) / kCluster;
  const int lo = min(n, c.rank * slice), len = min(n, lo + slice) - lo;
  const T* logits = static_cast<const T*>(a.logits) + row * a.row_stride + lo;
  const float* st = a.settings + row * kSettings;
  const float temperature = st[0], top_p = st[2], min_p = st[3], rep = st[4], presence = st[5], frequency = st[6];
  const int top_k = static_cast<int>(st[1]);

  for (int i = tid; i < 256 * kCountCopies; i += kThreads) sh.copies[i] = 0;

  // 1. The slice's logits and their penalties (each block applies those of its ids; the ids of a
  // list are distinct, so no two threads touch one element). The pending token: the block whose
  // slice holds it notes whether a list entry is it (every block scans the whole lists) and,
  // after the barrier, penalises it if none was.
  for (int j = tid; j < len; j += kThreads) xs[j] = to_f<T>(logits[j]);
  const bool rep_on = rep != 1.0f, gen_on = presence != 0.0f || frequency != 0.0f;
  const int pending = pending_of(a, row);
  const int own_pending = pending >= lo && pending < lo + len ? pending - lo : -1;  // in this slice
  const int n_rep = rep_on ? a.rep_len[row] : 0;
  const int n_gen = gen_on ? a.gen_len[row] : 0;
  if (n_rep > 0 || n_gen > 0 || (pending >= 0 && (rep_on || gen_on))) {
    if (tid == 0) sh.pending_listed[0] = sh.pending_listed[1] = 0;
    __syncthreads();
    for (int j = tid; j < n_rep; j += kThreads) {
      const int id = a.rep_ids[row * a.rep_cap + j] - lo;
      if (id < 0 || id >= len) continue;  // another block's id, or out of range
      if (id == own_pending) sh.pending_listed[0] = 1;
      const float v = xs[id];
      xs[id] = v > 0.0f ? __fdiv_rn(v, rep) : __fmul_rn(v, rep);
    }
    __syncthreads();
    if (tid == 0 && own_pending >= 0 && rep_on && !sh.pending_listed[0]) {
      const float v = xs[own_pending];
      xs[own_pending] = v > 0.0f ? __fdiv_rn(v, rep) : __fmul_rn(v, rep);
    }
    __syncthreads();
    for (int j = tid; j < n_gen; j += kThreads) {
      const int id = a.gen_ids[row * a.gen_cap + j] - lo;
      if (id < 0 || id >= len) continue;
      int occurrences = a.gen_counts[row * a.gen_cap + j];
      if (id == own_pending) sh.pending_listed[1] = 1, ++occurrences;
      const float count = static_cast<float>(occurrences);
      xs[id] = __fsub_rn(xs[id], __fadd_rn(presence, __fmul_rn(frequency, count)));
    }
    __syncthreads();
    if (tid == 0 && own_pending >= 0 && gen_on && !sh.pending_listed[1])
      xs[own_pending] = __fsub_rn(xs[own_pending], __fadd_rn(presence, __fmul_rn(frequency, 1.0f)));
  }
  __syncthreads();

  auto store = [&](int token) {
    if (a.out64) static_cast<long long*>(a.out)[row] = token;
    else static_cast<int*>(a.out)[row] = token;
  };
  // Every exit: one thread of the cluster has stored the token; no block may exit while another
  // can still read its shared memory, hence the barrier.
  auto finish = [&](bool writer, int token) {
    if (writer) store(token);
    c.cluster.sync();
  };

  // 2. Greedy.
  if (temperature <= 0.0f || top_k == 1) {
    float best = -INFINITY;
    int at = INT_MAX;
    for (int j = tid; j < len; j += kThreads) better(best, at, xs[j], lo + j);
    const int token = cluster_argmax(c, best, at);
    finish(c.rank == 0 && tid == 0, token == INT_MAX ? 0 : token);
    return;
  }

  // 3. Temperature (once per element) and the maximum.
  float m = -INFINITY;
  for (int j = tid; j < len; j += kThreads) {
    const float x = __fdiv_rn(xs[j], temperature);
    xs[j] = x;
    m = fmaxf(m, x);
  }
  m = cluster_max(c, m);  // its block_max synchronizes the block: xs holds x from here on
  if (m == -INFINITY) {
    finish(c.rank == 0 && tid == 0, 0);
    return;
  }
  auto weight = [m](float x) -> unsigned long long {
    return __float2ull_rz(__fmul_rn(expf(__fsub_rn(x, m)), kWeightScale));
  };

  // 4. Top-k: the key of the k-th largest x.
  uint32_t k_key = 0;
  if (top_k > 0 && top_k < n) {
    cluster_threshold_search<uint32_t>(
        c, xs, len, static_cast<unsigned long long>(top_k), [](float, uint32_t) { return 1u; }, &k_key);
  }

  // 5./6. Min-p: x >= m + log(min_p). floor_key: the smallest key top-k and min-p keep.
  uint32_t floor_key = k_key;
  if (min_p > 0.0f) floor_key = max(floor_key, key_of(__fadd_rn(m, logf(min_p))));
  uint32_t t_key = floor_key;

  // 7. Top-p, with Z over what top-k kept. The search only looks at keys >= floor_key: where the
  // single-block kernel's threshold p (over everything top-k kept) is >= floor_key, the weight of
  // the keys >= v is the same for every v >= floor_key, so this search finds p too; where p is
  // below floor_key, the weight of the keys >= floor_key is below the target, this search finds
  // nothing and the threshold stays floor_key = max(floor_key, p).
  //
  // Those candidates are usually few (min-p 0.05 keeps x >= m - 3; top-k keeps k): while summing
  // Z, each warp copies its segment's candidates, in id order, into its part of the candidate list
  // (-inf pads the rest: weight 0, never counted, never drawn). If every warp's fit, the four
  // search passes and the draw scan the list instead of the slice. The choice is the block's own:
  // either way its histograms and sums are the same.
  const float* dx = xs;  // what the top-p search and the draw scan: the slice or the list
  int dlen = len, seg_len = (len + kWarps - 1) / kWarps;
  bool listed = false;
  const int seg_b0 = min(len, warp * seg_len), seg_e0 = min(len, seg_b0 + seg_len);
  if (top_p < 1.0f) {
    const bool try_list = floor_key != 0;  // else every token is a candidate
    float* list_x = sh.cand_x + warp * kCandidatesPerWarp;
    int* list_id = sh.cand_id + warp * kCandidatesPerWarp;
    int count = 0;  // this warp's candidates so far
    unsigned long long z = 0;
    for (int j0 = seg_b0; j0 < seg_e0; j0 += 32) {  // warp-uniform trip count
      const int j = j0 + lane;
      const float x = j < seg_e0 ? xs[j] : -INFINITY;  // weighs 0
      const uint32_t key = key_of(x);
      if (key >= k_key) z += weight(x);
      if (try_list) {
        const bool candidate = j < seg_e0 && key >= floor_key;
        const unsigned ballot = __ballot_sync(0xffffffffu, candidate);
        const int at = count + __popc(ballot & ((1u << lane) - 1u));
        if (candidate && at < kCandidatesPerWarp) list_x[at] = x, list_id[at] = lo + j;
        count += __popc(ballot);
      }
    }
    if (try_list)
      for (int k = count + lane; k < kCandidatesPerWarp; k += 32) list_x[k] = -INFINITY, list_id[k] = lo;
    listed = try_list && __syncthreads_or(count > kCandidatesPerWarp) == 0;  // also publishes the list
    if (listed) dx = sh.cand_x, dlen = kCandidatesPerWarp * kWarps, seg_len = kCandidatesPerWarp;
    z = cluster_sum(c, z);
    const auto target = static_cast<unsigned long long>(ceil(static_cast<double>(top_p) * static_cast<double>(z)));
    uint32_t p_key;
    const bool found = cluster_threshold_search<unsigned long long>(
        c, dx, dlen, target,
        [&](float x, uint32_t key) { return key >= floor_key ? weight(x) : 0ull; }, &p_key);
    if (found) t_key = max(t_key, p_key);
  }

  // 8. The draw, in ascending id order: the blocks' slices are in rank order, each slice (or the
  // candidate list) is cut into kWarps segments in id order. Each warp sums its segment; the
  // blocks' totals meet in the cluster; the block holding the target finds the segment, and that
  // segment's warp scans it 32 elements a step.
  auto kept = [&](int j, int end) -> unsigned long long {
    if (j >= end) return 0ull;
    const float x = dx[j];
    return key_of(x) >= t_key ? weight(x) : 0ull;
  };
  const int seg_b = min(dlen, warp * seg_len), seg_e = min(dlen, seg_b + seg_len);
  {
    unsigned long long acc = 0;
    for (int j = seg_b + lane; j < seg_e; j += 32) acc += kept(j, seg_e);
    acc = warp_sum(acc);
    if (lane == 0) sh.segment[warp] = acc;
  }
  __syncthreads();
  const unsigned long long own = sh.segment[lane];
  unsigned long long incl = own;  // every warp scans the segment sums: lane l, segments 0..l
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  const unsigned long long block_total = __shfl_sync(0xffffffffu, incl, 31);
  const unsigned long long g = cluster_gather(c, block_total, 0ull);
  unsigned long long before = 0, total = 0;  // weight of the lower ranks' slices; of the row
#pragma unroll
  for (int r = 0; r < kCluster; ++r) {
    const unsigned long long t = __shfl_sync(0xffffffffu, g, r);
    if (r < c.rank) before += t;
    total += t;
  }
  // u in [0, 1) gives a target below the total; clamp anyway (u = 1 picks the last kept token).
  unsigned long long target = static_cast<unsigned long long>(floor(static_cast<double>(a.u[row]) * static_cast<double>(total)));
  if (total > 0 && target >= total) target = total - 1;
  if (total > 0 && before <= target && target < before + block_total) {
    // This block's slice holds the token; the first segment whose running sum passes the target.
    const unsigned crossed = __ballot_sync(0xffffffffu, before + incl > target);
    const int seg = __ffs(crossed) - 1;
    if (warp == seg) {
      // The weight before segment seg: lane seg's exclusive prefix (incl and own are per lane).
      unsigned long long carry = before + __shfl_sync(0xffffffffu, incl - own, seg);
      for (int j0 = seg_b; j0 < seg_e; j0 += 32) {
        const unsigned long long w = kept(j0 + lane, seg_e);
        unsigned long long cum = w;
        for (int o = 1; o < 32; o <<= 1) {
          const unsigned long long t = __shfl_up_sync(0xffffffffu, cum, o);
          if (lane >= o) cum += t;
        }
        const unsigned hit = __ballot_sync(0xffffffffu, carry + cum > target);
        if (hit) {
          const int j = j0 + __ffs(hit) - 1;
          if (lane == 0) store(listed ? sh.cand_id[j] : lo + j);
          break;
        }
        carry += __shfl_sync(0xffffffffu, cum, 31);
      }
    }
  }
  finish(total == 0 && c.rank == 0 && tid == 0, 0);  // total 0 cannot happen: the best token weighs 2^44
#endif  // __CUDA_ARCH__ >= 900
}

// Dynamic shared memory the cluster kernel may use on the current device (ClusterShared and a
// row's slice of x), 0 where it cannot run there: below sm_90, a build without sm_90 code for it,
// or a cluster of kCluster such blocks that the GPU cannot place. Probed once per device and
// logits dtype (the first call; a CUDA graph capture happens after a warm-up call), raising the
// kernel's dynamic shared memory limit to the device's maximum on the way.
template <typename T>
size_t cluster_smem_limit() {
  return once_per_device<size_t>([](int device) -> size_t {
    int major = 0, optin = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    cudaFuncAttributes attr;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, cluster_sample_kernel<T>));
    if (major < 9 || attr.binaryVersion < 90 || static_cast<size_t>(optin) <= attr.sharedSizeBytes) return 0;
    const size_t dynamic = static_cast<size_t>(optin) - attr.sharedSizeBytes;
    C10_CUDA_CHECK(cudaFuncSetAttribute(cluster_sample_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(dynamic)));
    const ClusterLaunch one_row(kCluster, 1, kThreads, dynamic, nullptr);
    return cluster_fits(cluster_sample_kernel<T>, one_row) ? dynamic : 0;
  });
}

// The cluster kernel where it can run (see its section) and `cluster` allows, else the
// single-block kernel.
template <typename T>
void launch_sampling(const SampleArgs& a, int rows, cudaStream_t stream, bool cluster) {
  const size_t smem_bytes =
      sizeof(ClusterShared) + static_cast<size_t>((a.vocab + kCluster - 1) / kCluster) * sizeof(float);
  if (cluster && smem_bytes <= cluster_smem_limit<T>()) {
    const ClusterLaunch launch(kCluster, rows, kThreads, smem_bytes, stream);
    C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, cluster_sample_kernel<T>, a));
  } else {
    sample_kernel<T><<<rows, kThreads, 0, stream>>>(a);
  }
}

at::Tensor sample_tokens(const at::Tensor& logits, const at::Tensor& settings, const at::Tensor& u,
                         const at::Tensor& rep_ids, const at::Tensor& rep_len, const at::Tensor& gen_ids,
                         const at::Tensor& gen_counts, const at::Tensor& gen_len, at::Tensor& work, at::Tensor& out,
                         const c10::optional<at::Tensor>& pending, bool cluster) {
  // engine/kernels/sampling.py checks the arguments and names the problem; these only guard the kernel.
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.stride(1) == 1, "logits: 2-D CUDA, last dim contiguous");
  const int rows = static_cast<int>(logits.size(0)), vocab = static_cast<int>(logits.size(1));
  TORCH_CHECK(rows >= 1 && vocab >= 1, "logits must not be empty");
  TORCH_CHECK(settings.scalar_type() == at::kFloat && settings.is_contiguous() && settings.size(0) == rows &&
                  settings.size(1) == kSettings, "settings: [rows, 7] float32");
  TORCH_CHECK(u.scalar_type() == at::kFloat && u.is_contiguous() && u.numel() == rows, "u: [rows] float32");
  for (const at::Tensor* t : {&rep_ids, &rep_len, &gen_ids, &gen_counts, &gen_len})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->size(0) == rows, "penalty lists: int32");
  TORCH_CHECK(work.scalar_type() == at::kFloat && work.is_contiguous() && work.numel() >= (int64_t)rows * vocab,
              "work: [rows, vocab] float32");
  TORCH_CHECK((out.scalar_type() == at::kLong || out.scalar_type() == at::kInt) && out.is_contiguous() &&
                  out.numel() == rows, "out: [rows] int64 or int32");
  if (pending.has_value())
    TORCH_CHECK(pending->scalar_type() == at::kLong && pending->is_contiguous() && pending->numel() == rows &&
                    pending->device() == logits.device(), "pending: [rows] int64 on the logits' device");
  const c10::cuda::CUDAGuard guard(logits.device());
  SampleArgs a;
  a.logits = logits.data_ptr();
  a.row_stride = logits.stride(0);
  a.work = work.data_ptr<float>();
  a.settings = settings.data_ptr<float>();
  a.u = u.data_ptr<float>();
  a.rep_ids = rep_ids.data_ptr<int>();
  a.rep_len = rep_len.data_ptr<int>();
  a.rep_cap = rep_ids.dim() == 2 ? static_cast<int>(rep_ids.size(1)) : 0;
  a.gen_ids = gen_ids.data_ptr<int>();
  a.gen_counts = gen_counts.data_ptr<int>();
  a.gen_len = gen_len.data_ptr<int>();
  a.gen_cap = gen_ids.dim() == 2 ? static_cast<int>(gen_ids.size(1)) : 0;
  a.pending = pending.has_value() ? pending->data_ptr<int64_t>() : nullptr;
  a.out = out.data_ptr();
  a.out64 = out.scalar_type() == at::kLong;
  a.vocab = vocab;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  switch (logits.scalar_type()) {
    case at::kFloat: launch_sampling<float>(a, rows, stream, cluster); break;
    case at::kHalf: launch_sampling<__half>(a, rows, stream, cluster); break;
    case at::kBFloat16: launch_sampling<__nv_bfloat16>(a, rows, stream, cluster); break;
    default: TORCH_CHECK(false, "logits must be fp32, fp16 or bf16");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

void bind_sampling(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("sample_tokens", &sample_tokens,
        "one token per row: penalties, temperature, top-k, min-p, top-p, inverse-CDF draw (writes out)",
        py::arg("logits"), py::arg("settings"), py::arg("u"), py::arg("rep_ids"), py::arg("rep_len"),
        py::arg("gen_ids"), py::arg("gen_counts"), py::arg("gen_len"), py::arg("work"), py::arg("out"),
        py::arg("pending") = py::none(), py::arg("cluster") = true);
}

}  // namespace trellis
