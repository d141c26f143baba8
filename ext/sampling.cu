// Sampling on the GPU: penalties, temperature, top-k, min-p, top-p and the draw in one launch.
//
// Why: without it every sampled token copies a [vocab] fp32 row to the host (1 MB for a 262k
// vocabulary) and runs the host sampler there. Here one block per batch row takes the same
// decision as the host sampler (engine/generation/sampling.py) and the torch reference
// (engine/generation/device_sampling.py, the test oracle) and writes one token id; the row never
// leaves the device. Every input is a device tensor (the per-row settings, the penalty lists, the
// uniform u), so a CUDA graph can capture the launch and replay it with new values.
//
// The decision, in order (the host sampler's):
//   1. penalties on the raw logits w: repetition (CTRL-style: w > 0 ? w / r : w * r) over the
//      context's distinct ids, then presence + frequency * count over the generated ids;
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
// a larger float, a larger uint32), 8 bits per pass, with a block-wide 256-bin histogram each pass
// (counts for top-k, weights for top-p): four passes over the row instead of a sort.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <climits>
#include <cstdint>
#include <initializer_list>

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
  void* out;  // [rows] int64 or int32
  bool out64;
  int vocab;
};

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

  // 1. Penalties, into the work row (read straight from the logits when there are none).
  const int n_rep = rep != 1.0f ? a.rep_len[row] : 0;
  const int n_gen = (presence != 0.0f || frequency != 0.0f) ? a.gen_len[row] : 0;
  const bool use_work = n_rep > 0 || n_gen > 0;
  if (use_work) {
    for (int i = tid; i < n; i += blockDim.x) work[i] = to_f<T>(logits[i]);
    __syncthreads();
    for (int j = tid; j < n_rep; j += blockDim.x) {
      const int id = a.rep_ids[row * a.rep_cap + j];
      if (id < 0 || id >= n) continue;  // cannot raise here: ignore an out-of-range id
      const float v = work[id];
      work[id] = v > 0.0f ? __fdiv_rn(v, rep) : __fmul_rn(v, rep);
    }
    __syncthreads();
    for (int j = tid; j < n_gen; j += blockDim.x) {
      const int id = a.gen_ids[row * a.gen_cap + j];
      if (id < 0 || id >= n) continue;
      const float count = static_cast<float>(a.gen_counts[row * a.gen_cap + j]);
      // No fused multiply-add: the reference rounds the product, then the sum.
      work[id] = __fsub_rn(work[id], __fadd_rn(presence, __fmul_rn(frequency, count)));
    }
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

at::Tensor sample_tokens(const at::Tensor& logits, const at::Tensor& settings, const at::Tensor& u,
                         const at::Tensor& rep_ids, const at::Tensor& rep_len, const at::Tensor& gen_ids,
                         const at::Tensor& gen_counts, const at::Tensor& gen_len, at::Tensor& work, at::Tensor& out) {
  // engine/ops.py checks the arguments and names the problem; these only guard the kernel.
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
  a.out = out.data_ptr();
  a.out64 = out.scalar_type() == at::kLong;
  a.vocab = vocab;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  switch (logits.scalar_type()) {
    case at::kFloat: sample_kernel<float><<<rows, kThreads, 0, stream>>>(a); break;
    case at::kHalf: sample_kernel<__half><<<rows, kThreads, 0, stream>>>(a); break;
    case at::kBFloat16: sample_kernel<__nv_bfloat16><<<rows, kThreads, 0, stream>>>(a); break;
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
        py::arg("gen_ids"), py::arg("gen_counts"), py::arg("gen_len"), py::arg("work"), py::arg("out"));
}

}  // namespace trellis
