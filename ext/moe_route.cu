// The router of a mixture-of-experts layer for a few tokens in one launch: the logits of a plain
// dense router (x @ W^T + b), the scores, the choice and the mixing weights, written as the expert
// kernels (exl3_expert_gemv.cu) read them: weights fp32 [tokens, top_k], chosen int64 [tokens,
// top_k]. It computes what engine/modules/moe.py SparseMoE.route computes with torch ops:
//
//   logits = x @ W^T + b, accumulated in fp32 and rounded once to x's dtype (the torch path's
//            linear returns them so), then read as fp32;
//   scores = softmax(logits) over the experts, or sigmoid(logits) per expert;
//   biased = scores + selection_bias (where there is one);
//   groups (num_groups > 1): a group is worth the sum of its two best biased scores; only the
//            best groups_per_token groups' experts compete;
//   chosen = the top_k experts by biased score, in descending order (torch.topk's sorted order);
//   weights = scores at the chosen, / their sum where normalize, * scale, * expert_scale[chosen].
// Equal values are taken lower index first, in the group choice and the expert choice alike (a
// total order: the result does not depend on the order of the reduction; torch.topk leaves the
// order of ties unspecified, so the two paths agree wherever there is no tie at a boundary).
//
// Why one launch: at batch 1 a decode step is a chain of dependent launches, and the torch path is
// six to ten of them per layer (the router's GEMV, the upcast, softmax or sigmoid, topk, the sum and
// the division, the scale, the expert-scale gather), each a few microseconds of launch latency for
// almost no work.
//
// Launch shape: grid (ceil(experts / kRouteExperts), ceil(tokens / kRouteTokens)). Block (bx, by)
// computes the logits of experts [bx * kRouteExperts, ...) for tokens [by * kRouteTokens, ...)
// into a global fp32 workspace: its threads stride over the hidden dimension in 16-byte vectors
// (the router's rows are read once, by one block each; a single block would read a 0.5 MB router
// at one multiprocessor's bandwidth), then a fixed-order block reduction. The last block of a token
// tile to finish (atomic ticket, reset by that block, so the workspace needs no clearing and a
// CUDA graph can replay the launch) chooses for the tile's tokens, one warp per token, lane l
// holding experts l, l + 32, ... in registers. No floating-point atomics: a replay gives the eager
// call's bits.
//
// Chained launches (chained_launch.cuh): the first router rows are loaded before chain_wait (a
// weight is no kernel's output), so their DRAM latency overlaps the previous kernel's tail.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "chained_launch.cuh"
#include "exl3_common.cuh"
#include "float_types.cuh"
#include "trellis_ext.h"

namespace trellis {
namespace {

constexpr int kRouteThreads = 128;
constexpr int kRouteWarps = kRouteThreads / 32;
constexpr int kRouteTokens = kRouteWarps;  // tokens per block: one warp each chooses
constexpr int kRouteExperts = 2;           // experts per block: 2 x 16-byte loads in flight per thread
constexpr int kRouteMaxExperts = 512;
constexpr int kRoutePerLane = kRouteMaxExperts / 32;
constexpr int kRouteMaxTopK = 8;
constexpr int kRouteMaxGroups = 32;  // one group per lane in the group choice

struct RouteArgs {
  const void* x;               // [tokens, hidden], T
  const void* weight;          // [experts, hidden], T
  const void* bias;            // [experts], T, or null
  const void* selection_bias;  // [experts], sel_dtype, or null
  const void* expert_scale;    // [experts], scale_dtype, or null
  float* logits;               // workspace [tokens, experts]
  int* tickets;                // [token tiles], zero on entry and on exit
  float* weights;              // [tokens, top_k]
  int64_t* chosen;             // [tokens, top_k]
  int tokens, hidden, experts, top_k;
  int sigmoid, normalize, num_groups, groups_per_token;
  int sel_dtype, scale_dtype;
  float scale;
};

__device__ __forceinline__ float load_f(const void* p, int dtype, int i) {
  if (dtype == DT_F16) return __half2float(static_cast<const __half*>(p)[i]);
  if (dtype == DT_BF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

// sum over a 16-byte vector of x * w, in element order.
template <typename T>
__device__ __forceinline__ float dot16(const uint4& x, const uint4& w, float acc) {
  const uint32_t xs[4] = {x.x, x.y, x.z, x.w}, ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      acc = fmaf(__uint_as_float(xs[j]), __uint_as_float(ws[j]), acc);
    } else if constexpr (std::is_same_v<T, __half>) {
      const float2 a = __half22float2(u32_as_h2(xs[j])), b = __half22float2(u32_as_h2(ws[j]));
      acc = fmaf(a.y, b.y, fmaf(a.x, b.x, acc));
    } else {  // bf16: the high half of a float
      acc = fmaf(__uint_as_float(xs[j] << 16), __uint_as_float(ws[j] << 16), acc);
      acc = fmaf(__uint_as_float(xs[j] & 0xFFFF0000u), __uint_as_float(ws[j] & 0xFFFF0000u), acc);
    }
  }
  return acc;
}

// (v, i, s) becomes (v2, i2, s2) where v2 is larger, or equal with a lower index.
__device__ __forceinline__ void take_if_better(float& v, int& i, float& s, float v2, int i2, float s2) {
  if (v2 > v || (v2 == v && i2 < i)) v = v2, i = i2, s = s2;
}

__device__ __forceinline__ void warp_best(float& v, int& i, float& s) {
  for (int o = 16; o > 0; o >>= 1)
    take_if_better(v, i, s, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o),
                   __shfl_xor_sync(0xffffffffu, s, o));
}

// Token t's choice and weights from its logits row (one warp; `biased_s` this warp's scratch).
__device__ void choose(const RouteArgs& a, const int t, float* biased_s) {
  const int lane = threadIdx.x & 31;
  const int E = a.experts;
  const float* row = a.logits + (size_t)t * E;
  float s[kRoutePerLane], b[kRoutePerLane];
  uint32_t open = 0;  // bit i: expert lane + 32 i may still be chosen
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kRoutePerLane; ++i) {
    const int e = lane + 32 * i;
    // Written by other blocks of this launch: read past L1.
    s[i] = e < E ? __ldcg(row + e) : -INFINITY;
    if (e < E) open |= 1u << i;
    m = fmaxf(m, s[i]);
  }
  if (a.sigmoid) {
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i) s[i] = 1.f / (1.f + expf(-s[i]));
  } else {
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i) {
      s[i] = (open >> i & 1) ? expf(s[i] - m) : 0.f;
      sum += s[i];
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i) s[i] = s[i] / sum;
  }
#pragma unroll
  for (int i = 0; i < kRoutePerLane; ++i) {
    const int e = lane + 32 * i;
    b[i] = s[i];
    if (a.selection_bias && (open >> i & 1)) b[i] += load_f(a.selection_bias, a.sel_dtype, e);
  }

  if (a.num_groups > 1) {
    const int size = E / a.num_groups;
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i)
      if (open >> i & 1) biased_s[lane + 32 * i] = b[i];
    __syncwarp();
    float worth = -INFINITY;  // lane g: group g's two best biased scores
    if (lane < a.num_groups) {
      float b1 = -INFINITY, b2 = -INFINITY;
      for (int j = lane * size; j < (lane + 1) * size; ++j) {
        const float v = biased_s[j];
        if (v > b1) b2 = b1, b1 = v;
        else if (v > b2) b2 = v;
      }
      worth = size >= 2 ? b1 + b2 : b1;
    }
    uint32_t keep = 0;  // bit g: group g competes
    for (int k = 0; k < a.groups_per_token; ++k) {
      const bool free = lane < a.num_groups && !(keep >> lane & 1);
      float v = free ? worth : -INFINITY, unused = 0.f;
      int g = free ? lane : INT_MAX;
      warp_best(v, g, unused);
      if (g < a.num_groups) keep |= 1u << g;
    }
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i)
      if ((open >> i & 1) && !(keep >> ((lane + 32 * i) / size) & 1)) open &= ~(1u << i);
  }

  float w[kRouteMaxTopK];
  int c[kRouteMaxTopK];
#pragma unroll
  for (int k = 0; k < kRouteMaxTopK; ++k) {
    w[k] = 0.f, c[k] = -1;
    if (k >= a.top_k) continue;
    float v = -INFINITY, sc = 0.f;
    int e = INT_MAX;
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i)
      if (open >> i & 1) take_if_better(v, e, sc, b[i], lane + 32 * i, s[i]);
    warp_best(v, e, sc);
    w[k] = sc, c[k] = e;
    if (e < E && (e & 31) == lane) open &= ~(1u << (e >> 5));
  }
  if (a.normalize) {
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < kRouteMaxTopK; ++k)
      if (k < a.top_k) sum += w[k];
#pragma unroll
    for (int k = 0; k < kRouteMaxTopK; ++k) w[k] = w[k] / sum;
  }
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < kRouteMaxTopK; ++k) {
      if (k >= a.top_k) break;
      float v = w[k] * a.scale;
      if (a.expert_scale && c[k] >= 0 && c[k] < E) v *= load_f(a.expert_scale, a.scale_dtype, c[k]);
      a.weights[(size_t)t * a.top_k + k] = v;
      a.chosen[(size_t)t * a.top_k + k] = c[k];
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kRouteThreads) moe_route_kernel(const RouteArgs a) {
  __shared__ float red_s[kRouteWarps][kRouteTokens * kRouteExperts];
  __shared__ float biased_s[kRouteWarps][kRouteMaxExperts];
  __shared__ int last_s;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int e0 = blockIdx.x * kRouteExperts, t0 = blockIdx.y * kRouteTokens;
  const int nt = min(kRouteTokens, a.tokens - t0);
  const int chunks = a.hidden * static_cast<int>(sizeof(T)) / 16;  // 16-byte vectors per row
  const uint4* w = static_cast<const uint4*>(a.weight);
  const uint4* x = static_cast<const uint4*>(a.x);

  // The router's rows (a weight): the first vectors before the wait, each next one a step ahead.
  uint4 wv[kRouteExperts];
  auto load_w = [&](int c) {
#pragma unroll
    for (int j = 0; j < kRouteExperts; ++j)
      wv[j] = (c < chunks && e0 + j < a.experts) ? __ldg(w + (size_t)(e0 + j) * chunks + c) : make_uint4(0, 0, 0, 0);
  };
  load_w(threadIdx.x);
  chain_wait();
  chain_release();

  float acc[kRouteTokens][kRouteExperts];
#pragma unroll
  for (int t = 0; t < kRouteTokens; ++t)
#pragma unroll
    for (int j = 0; j < kRouteExperts; ++j) acc[t][j] = 0.f;
  for (int c = threadIdx.x; c < chunks; c += kRouteThreads) {
    uint4 cur[kRouteExperts];
#pragma unroll
    for (int j = 0; j < kRouteExperts; ++j) cur[j] = wv[j];
    load_w(c + kRouteThreads);
#pragma unroll
    for (int t = 0; t < kRouteTokens; ++t) {
      if (t >= nt) break;
      const uint4 xv = x[(size_t)(t0 + t) * chunks + c];
#pragma unroll
      for (int j = 0; j < kRouteExperts; ++j) acc[t][j] = dot16<T>(xv, cur[j], acc[t][j]);
    }
  }
#pragma unroll
  for (int t = 0; t < kRouteTokens; ++t)
#pragma unroll
    for (int j = 0; j < kRouteExperts; ++j) {
      float v = acc[t][j];
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) red_s[warp][t * kRouteExperts + j] = v;
    }
  __syncthreads();
  if (threadIdx.x < kRouteTokens * kRouteExperts) {
    const int t = threadIdx.x / kRouteExperts, e = e0 + threadIdx.x % kRouteExperts;
    if (t < nt && e < a.experts) {
      float v = 0.f;
#pragma unroll
      for (int q = 0; q < kRouteWarps; ++q) v += red_s[q][threadIdx.x];
      if (a.bias) v += to_f<T>(static_cast<const T*>(a.bias)[e]);
      // Rounded to x's dtype as the torch path's linear returns its logits.
      a.logits[(size_t)(t0 + t) * a.experts + e] = to_f<T>(from_f<T>(v));
    }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last_s = atomicAdd(&a.tickets[blockIdx.y], 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!last_s) return;
  __threadfence();
  if (threadIdx.x == 0) a.tickets[blockIdx.y] = 0;
  if (warp < nt) choose(a, t0 + warp, biased_s[warp]);
}

// ---- bindings -------------------------------------------------------------------------------

int float_code(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kHalf: return DT_F16;
    case at::kBFloat16: return DT_BF16;
    case at::kFloat: return DT_F32;
    default: TORCH_CHECK(false, name, " must be fp16, bf16 or fp32, got ", t.scalar_type());
  }
  return -1;
}

// A per-expert vector [experts] on x's device, contiguous.
void check_per_expert(const at::Tensor& t, const at::Tensor& x, int64_t experts, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == x.device() && t.is_contiguous() && t.dim() == 1 && t.size(0) == experts,
              name, " must be a contiguous CUDA vector of ", experts, " on x's device");
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// (weights fp32 [tokens, top_k], chosen int64 [tokens, top_k]) of a dense router for x [tokens,
// hidden]; `logits` (fp32, tokens * experts) and `tickets` (int32, zero, one per 4 tokens) are the
// caller's workspace.
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& weight,
                                             const c10::optional<at::Tensor>& bias,
                                             const c10::optional<at::Tensor>& selection_bias,
                                             const c10::optional<at::Tensor>& expert_scale, at::Tensor& logits,
                                             at::Tensor& tickets, int64_t top_k, bool sigmoid, bool normalize,
                                             double scale, int64_t num_groups, int64_t groups_per_token) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1,
              "x must be a contiguous non-empty 2-D CUDA tensor");
  float_code(x, "x");
  TORCH_CHECK(weight.is_cuda() && weight.device() == x.device() && weight.is_contiguous() && weight.dim() == 2 &&
                  weight.scalar_type() == x.scalar_type() && weight.size(1) == x.size(1),
              "weight must be a contiguous [experts, ", x.size(1), "] tensor of x's dtype on x's device");
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = weight.size(0);
  TORCH_CHECK(experts >= 1 && experts <= kRouteMaxExperts, "experts must be in [1, ", kRouteMaxExperts, "]");
  TORCH_CHECK((hidden * x.element_size()) % 16 == 0 && aligned16(x) && aligned16(weight),
              "x's and weight's rows must be whole, 16-byte aligned 16-byte vectors");
  TORCH_CHECK(top_k >= 1 && top_k <= std::min<int64_t>(kRouteMaxTopK, experts), "top_k must be in [1, ",
              std::min<int64_t>(kRouteMaxTopK, experts), "]");
  TORCH_CHECK(num_groups >= 1 && num_groups <= kRouteMaxGroups && experts % num_groups == 0,
              "num_groups must divide the experts and be at most ", kRouteMaxGroups);
  TORCH_CHECK(groups_per_token >= 1 && groups_per_token <= num_groups &&
                  top_k <= groups_per_token * (experts / num_groups),
              "groups_per_token must be in [1, num_groups] and its groups hold top_k experts");
  if (bias) {
    check_per_expert(*bias, x, experts, "bias");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "bias must have x's dtype");
  }
  if (selection_bias) check_per_expert(*selection_bias, x, experts, "selection_bias");
  if (expert_scale) check_per_expert(*expert_scale, x, experts, "expert_scale");
  const int64_t tiles = (tokens + kRouteTokens - 1) / kRouteTokens;
  TORCH_CHECK(logits.is_cuda() && logits.device() == x.device() && logits.scalar_type() == at::kFloat &&
                  logits.is_contiguous() && logits.numel() >= tokens * experts,
              "logits workspace too small: need ", tokens * experts, " floats");
  TORCH_CHECK(tickets.is_cuda() && tickets.device() == x.device() && tickets.scalar_type() == at::kInt &&
                  tickets.is_contiguous() && tickets.numel() >= tiles,
              "ticket buffer too small: need ", tiles);
  TORCH_CHECK(tiles <= 65535, "too many tokens for one launch");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor weights = at::empty({tokens, top_k}, x.options().dtype(at::kFloat));
  at::Tensor chosen = at::empty({tokens, top_k}, x.options().dtype(at::kLong));

  RouteArgs a{};
  a.x = x.data_ptr();
  a.weight = weight.data_ptr();
  a.bias = bias ? bias->data_ptr() : nullptr;
  a.selection_bias = selection_bias ? selection_bias->data_ptr() : nullptr;
  a.sel_dtype = selection_bias ? float_code(*selection_bias, "selection_bias") : DT_F32;
  a.expert_scale = expert_scale ? expert_scale->data_ptr() : nullptr;
  a.scale_dtype = expert_scale ? float_code(*expert_scale, "expert_scale") : DT_F32;
  a.logits = logits.data_ptr<float>();
  a.tickets = tickets.data_ptr<int>();
  a.weights = weights.data_ptr<float>();
  a.chosen = chosen.data_ptr<int64_t>();
  a.tokens = static_cast<int>(tokens);
  a.hidden = static_cast<int>(hidden);
  a.experts = static_cast<int>(experts);
  a.top_k = static_cast<int>(top_k);
  a.sigmoid = sigmoid ? 1 : 0;
  a.normalize = normalize ? 1 : 0;
  a.num_groups = static_cast<int>(num_groups);
  a.groups_per_token = static_cast<int>(groups_per_token);
  a.scale = static_cast<float>(scale);
  const dim3 grid(static_cast<unsigned>((experts + kRouteExperts - 1) / kRouteExperts), static_cast<unsigned>(tiles));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  by_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    launch_chained(moe_route_kernel<T>, grid, dim3(kRouteThreads), 0, stream, a);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {weights, chosen};
}

}  // namespace

void bind_moe_route(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("moe_route", &moe_route,
        "a dense router's logits, scores, top-k choice (optionally biased and group-limited) and mixing weights "
        "for a few tokens in one launch; returns (weights fp32, chosen int64), both [tokens, top_k]",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("selection_bias"), py::arg("expert_scale"),
        py::arg("logits"), py::arg("tickets"), py::arg("top_k"), py::arg("sigmoid"), py::arg("normalize"),
        py::arg("scale"), py::arg("num_groups"), py::arg("groups_per_token"));
}

}  // namespace trellis
