// Small fused kernels for the decode step: RMSNorm, rotary embedding of q and k, gated activation.
//
// Why: in a decode step each of these is a chain of 3-8 elementwise torch kernels (upcast, square,
// mean, rsqrt, multiply, round...). Replayed in a CUDA graph every kernel still costs its launch
// slot (docs/PERFORMANCE.md: the graph floor), and a step has a few per layer. One launch each
// keeps the same arithmetic: fp32 math with the roundings the torch modules do (noted per kernel),
// so results match the torch path to within one rounding of the output dtype.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <initializer_list>
#include <type_traits>

#include "activations.cuh"
#include "chained_launch.cuh"
#include "float_types.cuh"
#include "trellis_ext.h"

namespace trellis {
namespace {

// Round through T and back: the value torch holds after storing an fp32 result in a T tensor.
template <typename T>
__device__ __forceinline__ float rnd(float v) { return to_f<T>(from_f<T>(v)); }

// V consecutive elements moved as one vector (16 bytes when V = 16 / sizeof(T)): at prefill sizes
// (thousands of rows) the scalar 2-byte accesses, not DRAM, were what bounded these kernels.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p) { return *reinterpret_cast<const Pack<T, V>*>(p); }

template <typename T, int V>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, V>& x) { *reinterpret_cast<Pack<T, V>*>(p) = x; }

// True when every pointer is 16-byte aligned and every stride / width is a multiple of a 16-byte
// vector of T, i.e. the vector kernels may run.
template <typename T>
bool vector_ok(std::initializer_list<const void*> ptrs, std::initializer_list<long long> counts) {
  constexpr long long kV = 16 / sizeof(T);
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  for (long long c : counts)
    if (c % kV != 0) return false;
  return true;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
__device__ float block_sum(float v) {
  __shared__ float partial[32];
  __shared__ float total;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x >> 5) ? partial[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

// One output of RMSNorm from the normalised value v = x / rms(x) and the stored weight wi.
// Llama convention (offset 0): v is rounded to T, then multiplied by the T weight (rounded again).
// Gemma (offset != 0): the product with (offset + wi) is taken in fp32 and rounded once.
template <typename T>
__device__ __forceinline__ T norm_out(float v, float wi, float offset) {
  return offset != 0.f ? from_f<T>(v * (offset + wi)) : from_f<T>(wi * rnd<T>(v));
}

// Second pass of both norm kernels: y = norm_out(x * r, w) over the block's row.
template <typename T, int V>
__device__ __forceinline__ void write_normed(const T* x, const T* __restrict__ w, T* __restrict__ y, int n, float r,
                                             float offset) {
  for (int i = threadIdx.x * V; i < n; i += blockDim.x * V) {
    const Pack<T, V> p = load_pack<T, V>(x + i), wv = load_pack<T, V>(w + i);
    Pack<T, V> o;
#pragma unroll
    for (int e = 0; e < V; ++e) o.v[e] = norm_out<T>(to_f<T>(p.v[e]) * r, to_f<T>(wv.v[e]), offset);
    store_pack<T, V>(y + i, o);
  }
}

// Packs a thread keeps in registers when the row fits them: norm_threads gives a row one pack
// per thread up to the thread limit, so a wider row has up to 4 per thread (with 768 threads of
// 16-byte bf16 vectors, the limit below: up to 24K elements, all decoder widths; wider rows take
// the two-pass loops).
constexpr int kRegPacks = 4;

// Both norm kernels when the row fits in registers (n <= kRegPacks * V * blockDim.x): one pass.
// `row(i)` gives the pack at element i (and may store it). The weight's packs are loaded first
// (a weight is no kernel's output, so this may run before chain_wait), so their DRAM latency
// overlaps the row's and the reduction instead of following it (and the row is not read back).
// Same sums in the same order as the loops: the same result bit for bit.
template <typename T, int V, typename Row>
__device__ __forceinline__ void norm_in_registers(Row row, const T* __restrict__ w, T* __restrict__ y, int n,
                                                  float eps, float offset) {
  Pack<T, V> x[kRegPacks], wv[kRegPacks];
#pragma unroll
  for (int j = 0; j < kRegPacks; ++j) {
    const int i = (threadIdx.x + j * blockDim.x) * V;
    if (i < n) wv[j] = load_pack<T, V>(w + i);
  }
  chain_wait();
  chain_release();
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kRegPacks; ++j) {
    const int i = (threadIdx.x + j * blockDim.x) * V;
    if (i < n) {
      x[j] = row(i);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float v = to_f<T>(x[j].v[e]);
        ss += v * v;
      }
    }
  }
  const float r = rsqrtf(block_sum(ss) / static_cast<float>(n) + eps);
#pragma unroll
  for (int j = 0; j < kRegPacks; ++j) {
    const int i = (threadIdx.x + j * blockDim.x) * V;
    if (i < n) {
      Pack<T, V> o;
#pragma unroll
      for (int e = 0; e < V; ++e) o.v[e] = norm_out<T>(to_f<T>(x[j].v[e]) * r, to_f<T>(wv[j].v[e]), offset);
      store_pack<T, V>(y + i, o);
    }
  }
}

// y = x / rms(x) * scale (rounded as norm_out says), one block per row, V elements per access.
// Same as engine/modules/norms.py.
template <typename T, int V>
__global__ void rms_norm_kernel(const T* __restrict__ x, long long x_stride, const T* __restrict__ w,
                                T* __restrict__ y, int n, float eps, float offset) {
  const T* xr = x + static_cast<long long>(blockIdx.x) * x_stride;
  T* yr = y + static_cast<long long>(blockIdx.x) * n;
  if (n <= kRegPacks * V * static_cast<int>(blockDim.x)) {  // the decode step's rows
    norm_in_registers<T, V>([&](int i) { return load_pack<T, V>(xr + i); }, w, yr, n, eps, offset);
    return;
  }
  chain_wait();
  chain_release();
  float ss = 0.f;
  for (int i = threadIdx.x * V; i < n; i += blockDim.x * V) {
    const Pack<T, V> p = load_pack<T, V>(xr + i);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float v = to_f<T>(p.v[e]);
      ss += v * v;
    }
  }
  write_normed<T, V>(xr, w, yr, n, rsqrtf(block_sum(ss) / static_cast<float>(n) + eps), offset);
}

// Residual add and the next RMSNorm in one launch: h_out = h + delta, y = rms_norm(h_out), one
// block per row. The sum is rounded to T before it is squared and normalised, exactly the value
// torch's `h + delta` stores, and the loops and reduction are rms_norm_kernel's, so with the same
// V and block size y equals rms_norm_kernel(h_out) bit for bit. h_out is re-read by the thread
// that wrote it (no __restrict__ on it); it must not alias h or delta of another row.
template <typename T, int V>
__global__ void add_rms_norm_kernel(const T* __restrict__ h, long long h_stride, const T* __restrict__ delta,
                                    long long d_stride, const T* __restrict__ w, T* h_out, T* __restrict__ y,
                                    int n, float eps, float offset) {
  const T* hr = h + static_cast<long long>(blockIdx.x) * h_stride;
  const T* dr = delta + static_cast<long long>(blockIdx.x) * d_stride;
  T* sr = h_out + static_cast<long long>(blockIdx.x) * n;
  T* yr = y + static_cast<long long>(blockIdx.x) * n;
  if (n <= kRegPacks * V * static_cast<int>(blockDim.x)) {  // the decode step's rows
    auto row = [&](int i) {
      const Pack<T, V> a = load_pack<T, V>(hr + i), b = load_pack<T, V>(dr + i);
      Pack<T, V> sum;
#pragma unroll
      for (int e = 0; e < V; ++e) sum.v[e] = from_f<T>(to_f<T>(a.v[e]) + to_f<T>(b.v[e]));
      store_pack<T, V>(sr + i, sum);
      return sum;
    };
    norm_in_registers<T, V>(row, w, yr, n, eps, offset);
    return;
  }
  chain_wait();
  chain_release();
  float ss = 0.f;
  for (int i = threadIdx.x * V; i < n; i += blockDim.x * V) {
    const Pack<T, V> a = load_pack<T, V>(hr + i), b = load_pack<T, V>(dr + i);
    Pack<T, V> sum;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      sum.v[e] = from_f<T>(to_f<T>(a.v[e]) + to_f<T>(b.v[e]));
      const float v = to_f<T>(sum.v[e]);
      ss += v * v;
    }
    store_pack<T, V>(sr + i, sum);
  }
  write_normed<T, V>(sr, w, yr, n, rsqrtf(block_sum(ss) / static_cast<float>(n) + eps), offset);
}

// Where the rotated keys go. Plain: k_out [tokens, hk, d]. CACHE: the KV write fused in (one
// launch fewer per layer): the rotated keys and the values v [tokens, hk, d] (rows strided by
// v_stride) go straight into the dense paged caches k_out / v_cache [slots, hk, d] at row
// slots[token]; a slot outside the cache writes nothing (as kv_cache_write).
struct RopeCacheArgs {
  const void* v = nullptr;
  long long v_stride = 0;
  const int64_t* slots = nullptr;
  void* v_cache = nullptr;
  long long num_slots = 0;
};

// Rotary embedding (rotate-half convention) of q [tokens, hq, d] and k [tokens, hk, d] in one
// launch; the first `rot` dims of each head rotate, the rest are copied. One block per token; a
// work item is V dims i of the first half together with dims i + rot/2 (the pair rotate_half
// mixes), or V pass-through dims (CACHE: then V dims of a value row). torch computes
// x * cos + rotate_half(x) * sin with each product and the sum rounded to T.
template <typename T, int V, bool CACHE>
__global__ void rope_kernel(const T* __restrict__ q, long long q_stride, T* __restrict__ q_out, int hq,
                            const T* __restrict__ k, long long k_stride, T* __restrict__ k_out, int hk,
                            const T* __restrict__ cos, const T* __restrict__ sin, int d, int rot,
                            const RopeCacheArgs cache) {
  chain_wait();
  chain_release();
  const long long token = blockIdx.x;
  const int half = rot / 2;
  const int rot_items = half / V, per_head = rot_items + (d - rot) / V;
  const T* c = cos + token * rot;
  const T* s = sin + token * rot;
  long long k_row = token;  // row of k_out
  bool k_live = true;
  if constexpr (CACHE) {
    k_row = cache.slots[token];
    k_live = k_row >= 0 && k_row < cache.num_slots;
  }
  const int qk_items = (hq + hk) * per_head;
  const int v_items = CACHE ? hk * (d / V) : 0;
  for (int item = threadIdx.x; item < qk_items + v_items; item += blockDim.x) {
    if (CACHE && item >= qk_items) {  // a value row's V dims, copied as they are
      if (!k_live) continue;
      const int j = item - qk_items, h = j / (d / V), i = (j - h * (d / V)) * V;
      const T* src = static_cast<const T*>(cache.v) + token * cache.v_stride + static_cast<long long>(h) * d;
      T* dst = static_cast<T*>(cache.v_cache) + (k_row * hk + h) * d;
      store_pack<T, V>(dst + i, load_pack<T, V>(src + i));
      continue;
    }
    const int head = item / per_head, j = item - head * per_head;
    const bool is_q = head < hq;
    if (!is_q && !k_live) continue;
    const int h = is_q ? head : head - hq;
    const T* src = (is_q ? q + token * q_stride : k + token * k_stride) + static_cast<long long>(h) * d;
    T* dst = is_q ? q_out + (token * hq + h) * d : k_out + (k_row * hk + h) * d;
    if (j < rot_items) {
      const int i = j * V;
      const Pack<T, V> a = load_pack<T, V>(src + i), b = load_pack<T, V>(src + i + half);
      const Pack<T, V> ca = load_pack<T, V>(c + i), sa = load_pack<T, V>(s + i);
      const Pack<T, V> cb = load_pack<T, V>(c + i + half), sb = load_pack<T, V>(s + i + half);
      Pack<T, V> oa, ob;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float xa = to_f<T>(a.v[e]), xb = to_f<T>(b.v[e]);
        oa.v[e] = from_f<T>(rnd<T>(xa * to_f<T>(ca.v[e])) + rnd<T>(-xb * to_f<T>(sa.v[e])));
        ob.v[e] = from_f<T>(rnd<T>(xb * to_f<T>(cb.v[e])) + rnd<T>(xa * to_f<T>(sb.v[e])));
      }
      store_pack<T, V>(dst + i, oa);
      store_pack<T, V>(dst + i + half, ob);
    } else {
      const int i = rot + (j - rot_items) * V;
      store_pack<T, V>(dst + i, load_pack<T, V>(src + i));
    }
  }
}

// out = act(gate) * up over rows of width n, V consecutive elements per thread; gate/up rows may
// be strided (slices of a fused gate_up output). torch rounds act(gate) to T before the product.
template <typename T, int ACT, int V>
__global__ void act_mul_kernel(const T* __restrict__ gate, long long g_stride, const T* __restrict__ up,
                               long long u_stride, T* __restrict__ out, int n) {
  chain_wait();
  chain_release();
  const long long row = blockIdx.y;
  const T* g = gate + row * g_stride;
  const T* u = up + row * u_stride;
  T* o = out + row * n;
  for (int i = (blockIdx.x * blockDim.x + threadIdx.x) * V; i < n; i += gridDim.x * blockDim.x * V) {
    const Pack<T, V> gv = load_pack<T, V>(g + i), uv = load_pack<T, V>(u + i);
    Pack<T, V> ov;
#pragma unroll
    for (int e = 0; e < V; ++e) ov.v[e] = from_f<T>(rnd<T>(activate<ACT>(to_f<T>(gv.v[e]))) * to_f<T>(uv.v[e]));
    store_pack<T, V>(o + i, ov);
  }
}

// Keys and values of one step into the dense paged cache in one launch, instead of one
// index_copy_ per side: grid (tokens, 2), block y 0 writes k's row, 1 writes v's row to row
// slots[token] of its cache. A plain copy of bits (same dtype on both sides), in words of
// sizeof(W) bytes; rows may be strided (k/v slices of a fused qkv output). Slots outside the
// cache are skipped (index_copy_ would assert on the device).
template <typename W>
__global__ void kv_cache_write_kernel(const W* __restrict__ k, long long k_stride, const W* __restrict__ v,
                                      long long v_stride, const int64_t* __restrict__ slots,
                                      W* __restrict__ k_cache, W* __restrict__ v_cache, int k_width, int v_width,
                                      long long num_slots) {
  chain_wait();
  chain_release();
  const long long token = blockIdx.x;
  const long long slot = static_cast<long long>(slots[token]);
  if (slot < 0 || slot >= num_slots) return;
  const bool is_v = blockIdx.y != 0;
  const int width = is_v ? v_width : k_width;
  const W* src = is_v ? v + token * v_stride : k + token * k_stride;
  W* dst = (is_v ? v_cache : k_cache) + slot * width;
  for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}

// RoPE's cos and sin tables for absolute positions, [tokens, rot] each, in one launch. torch's
// formula (engine/modules/rope.py) is nine launches per step: float(pos), the product with
// inv_freq, cat, cos, sin and a scaling and a cast of each; this does the same fp32 operations
// in the same order (cosf and sinf are what torch's CUDA cos and sin call), so the tables equal
// torch's bit for bit.
template <typename T>
__global__ void rope_tables_kernel(const int64_t* __restrict__ positions, const float* __restrict__ inv_freq,
                                   int half, float factor, T* __restrict__ cos, T* __restrict__ sin) {
  chain_wait();  // positions may be a previous kernel's output
  chain_release();
  const long long token = blockIdx.x;
  const float p = static_cast<float>(positions[token]);
  const int rot = 2 * half;
  for (int j = threadIdx.x; j < rot; j += blockDim.x) {
    const float f = p * inv_freq[j < half ? j : j - half];
    cos[token * rot + j] = from_f<T>(cosf(f) * factor);
    sin[token * rot + j] = from_f<T>(sinf(f) * factor);
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 2 && t.stride(1) == 1, name, " must be a 2-D CUDA tensor with unit inner stride");
}

// Block size of the norm kernels for width n and V elements per access: one access per thread
// up to the thread limit. (Several accesses per thread leave each thread a serial chain of loads,
// sums and stores on the decode step's critical path, where the block's threads could work in
// parallel; docs/KERNELS.md, section 6.) rms_norm and add_rms_norm launch the same
// way for the same width and vector size, so their sums of squares add in the same order.
int norm_threads(int n, int v) { return std::min(1024, std::max(32, ((n / v + 31) / 32) * 32)); }

// The most threads both norm kernels of <T, V> can launch with: registers x threads must fit the
// multiprocessor's register file, and with their register-resident rows the kernels take up to
// ~83 registers (bf16 vectors: 768 threads, not 1024). One limit for both, so that they still
// use the same block size and add their sums of squares in the same order. Queried once.
template <typename T, int V>
int norm_thread_limit() {
  static const int limit = [] {
    int lim = 1024;
    for (const void* k : {reinterpret_cast<const void*>(rms_norm_kernel<T, V>),
                          reinterpret_cast<const void*>(add_rms_norm_kernel<T, V>)}) {
      cudaFuncAttributes attr{};
      C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, k));
      lim = std::min(lim, (attr.maxThreadsPerBlock / 32) * 32);
    }
    return lim;
  }();
  return limit;
}

// Launches norm kernel K<T, V> with 16-byte vectors when every pointer and width allows it.
template <typename T, typename Launch>
void launch_norm(bool vec, int n, Launch&& launch) {
  constexpr int kV = 16 / sizeof(T);
  if (vec) launch(std::integral_constant<int, kV>{}, std::min(norm_threads(n, kV), norm_thread_limit<T, kV>()));
  else launch(std::integral_constant<int, 1>{}, std::min(norm_threads(n, 1), norm_thread_limit<T, 1>()));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  check_rows(x, "x");
  const int n = static_cast<int>(x.size(1));
  TORCH_CHECK(weight.is_cuda() && weight.is_contiguous() && weight.numel() == n && weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous CUDA vector of x's dtype and width");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({x.size(0), n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.size(0) == 0) return y;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  by_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const bool vec = vector_ok<T>({x.data_ptr(), weight.data_ptr(), y.data_ptr()}, {x.stride(0), n});
    launch_norm<T>(vec, n, [&](auto v, int threads) {
      launch_chained(rms_norm_kernel<T, decltype(v)::value>, dim3(static_cast<unsigned>(x.size(0))), dim3(threads), 0,
                     stream, reinterpret_cast<const T*>(x.data_ptr()), x.stride(0),
                     reinterpret_cast<const T*>(weight.data_ptr()), reinterpret_cast<T*>(y.data_ptr()), n,
                     static_cast<float>(eps), static_cast<float>(offset));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

std::vector<at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& delta, const at::Tensor& weight,
                                     double eps, double offset) {
  check_rows(h, "h");
  check_rows(delta, "delta");
  TORCH_CHECK(delta.sizes() == h.sizes() && delta.scalar_type() == h.scalar_type(), "delta must match h");
  const int n = static_cast<int>(h.size(1));
  TORCH_CHECK(weight.is_cuda() && weight.is_contiguous() && weight.numel() == n && weight.scalar_type() == h.scalar_type(),
              "weight must be a contiguous CUDA vector of h's dtype and width");
  const c10::cuda::CUDAGuard guard(h.device());
  const auto opts = h.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor h_out = at::empty({h.size(0), n}, opts);
  at::Tensor y = at::empty({h.size(0), n}, opts);
  if (h.size(0) == 0 || n == 0) return {h_out, y};
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  by_dtype(h.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const bool vec = vector_ok<T>({h.data_ptr(), delta.data_ptr(), weight.data_ptr(), h_out.data_ptr(), y.data_ptr()},
                                  {h.stride(0), delta.stride(0), n});
    launch_norm<T>(vec, n, [&](auto v, int threads) {
      launch_chained(add_rms_norm_kernel<T, decltype(v)::value>, dim3(static_cast<unsigned>(h.size(0))), dim3(threads),
                     0, stream, reinterpret_cast<const T*>(h.data_ptr()), h.stride(0),
                     reinterpret_cast<const T*>(delta.data_ptr()), delta.stride(0),
                     reinterpret_cast<const T*>(weight.data_ptr()), reinterpret_cast<T*>(h_out.data_ptr()),
                     reinterpret_cast<T*>(y.data_ptr()), n, static_cast<float>(eps), static_cast<float>(offset));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {h_out, y};
}

// k and v [tokens, heads, head_dim] (heads contiguous within a row; rows may be strided) into the
// contiguous caches [slots, heads, head_dim] of the same dtype at rows `slots` (int64).
void kv_cache_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots, at::Tensor& k_cache,
                    at::Tensor& v_cache) {
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->is_cuda() && t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "k and v must be CUDA tensors [tokens, heads, head_dim] with contiguous heads");
  }
  TORCH_CHECK(k_cache.is_cuda() && v_cache.is_cuda() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "the caches must be contiguous CUDA tensors");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3 && k_cache.size(0) == v_cache.size(0), "caches must be [slots, heads, head_dim]");
  TORCH_CHECK(k.sizes().slice(1) == k_cache.sizes().slice(1) && v.sizes().slice(1) == v_cache.sizes().slice(1),
              "k/v rows must match the cache rows");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type() &&
                  k.scalar_type() == v.scalar_type(),
              "k, v and the caches must share one dtype");
  TORCH_CHECK(slots.is_cuda() && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1 &&
                  slots.size(0) == k.size(0) && v.size(0) == k.size(0),
              "slots must be a contiguous int64 CUDA vector, one per token");
  const long long tokens = k.size(0);
  if (tokens == 0) return;
  const c10::cuda::CUDAGuard guard(k.device());
  const long long es = static_cast<long long>(k.element_size());
  const long long k_width = k.size(1) * k.size(2) * es, v_width = v.size(1) * v.size(2) * es;  // bytes
  // The widest word that every address, row stride and row length is a multiple of.
  const long long values[] = {reinterpret_cast<long long>(k.data_ptr()), reinterpret_cast<long long>(v.data_ptr()),
                              reinterpret_cast<long long>(k_cache.data_ptr()),
                              reinterpret_cast<long long>(v_cache.data_ptr()), k.stride(0) * es, v.stride(0) * es,
                              k_width, v_width};
  int word = 16;
  for (long long x : values) {
    while (x % word != 0) word /= 2;
  }
  const int widest = static_cast<int>(std::max(k_width, v_width) / word);
  const int threads = std::min(256, std::max(32, ((widest + 31) / 32) * 32));
  const dim3 grid(static_cast<unsigned>(tokens), 2);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  auto launch = [&](auto tag) {
    using W = decltype(tag);
    launch_chained(kv_cache_write_kernel<W>, grid, dim3(threads), 0, stream, reinterpret_cast<const W*>(k.data_ptr()),
                   k.stride(0) * es / word, reinterpret_cast<const W*>(v.data_ptr()), v.stride(0) * es / word,
                   slots.data_ptr<int64_t>(), reinterpret_cast<W*>(k_cache.data_ptr()),
                   reinterpret_cast<W*>(v_cache.data_ptr()), static_cast<int>(k_width / word),
                   static_cast<int>(v_width / word), k_cache.size(0));
  };
  switch (word) {
    case 16: launch(uint4{}); break;
    case 8: launch(uint2{}); break;
    case 4: launch(uint32_t{}); break;
    case 2: launch(uint16_t{}); break;
    default: launch(uint8_t{}); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              " must be a CUDA tensor [tokens, heads, head_dim] with contiguous heads");
}

// Checks shared by rope and rope_kv_write; returns the rotary dim.
int check_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  check_heads(q, "q");
  check_heads(k, "k");
  const long long tokens = q.size(0);
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == q.size(2) && k.scalar_type() == q.scalar_type(), "k does not match q");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type() && cos.numel() == sin.numel() && cos.numel() % tokens == 0,
              "cos/sin must be contiguous [tokens, 1, rotary_dim] tables of q's dtype");
  const int rot = static_cast<int>(tokens ? cos.numel() / tokens : 0);
  TORCH_CHECK(rot % 2 == 0 && rot <= q.size(2), "rotary dim must be even and at most head_dim");
  return rot;
}

// One block per token over q's and k's heads (and, with a cache, v's): k_dst is k_out [tokens, hk,
// d] or the key cache [slots, hk, d].
void launch_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, int rot,
                 at::Tensor& q_out, at::Tensor& k_dst, const RopeCacheArgs* cache) {
  const long long tokens = q.size(0);
  const int d = static_cast<int>(q.size(2));
  const int hq = static_cast<int>(q.size(1)), hk = static_cast<int>(k.size(1));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  by_dtype(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int kV = 16 / sizeof(T);
    const long long v_stride = cache ? cache->v_stride : 0;
    const bool vec = vector_ok<T>({q.data_ptr(), k.data_ptr(), q_out.data_ptr(), k_dst.data_ptr(), cos.data_ptr(),
                                   sin.data_ptr(), cache ? cache->v : nullptr, cache ? cache->v_cache : nullptr},
                                  {q.stride(0), k.stride(0), d, rot / 2, d - rot, v_stride});
    const int per_head = vec ? (rot / 2 + d - rot) / kV : rot / 2 + d - rot;
    const int items = (hq + hk) * per_head + (cache ? hk * (vec ? d / kV : d) : 0);
    const int threads = std::min(256, std::max(32, ((items + 31) / 32) * 32));
    const RopeCacheArgs none{};
    auto launch = [&](auto kernel) {
      launch_chained(kernel, dim3(static_cast<unsigned>(tokens)), dim3(threads), 0, stream,
                     reinterpret_cast<const T*>(q.data_ptr()), q.stride(0), reinterpret_cast<T*>(q_out.data_ptr()), hq,
                     reinterpret_cast<const T*>(k.data_ptr()), k.stride(0), reinterpret_cast<T*>(k_dst.data_ptr()), hk,
                     reinterpret_cast<const T*>(cos.data_ptr()), reinterpret_cast<const T*>(sin.data_ptr()), d, rot,
                     cache ? *cache : none);
    };
    if (cache) {
      if (vec) launch(rope_kernel<T, kV, true>);
      else launch(rope_kernel<T, 1, true>);
    } else {
      if (vec) launch(rope_kernel<T, kV, false>);
      else launch(rope_kernel<T, 1, false>);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::vector<at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  const int rot = check_rope(q, k, cos, sin);
  const c10::cuda::CUDAGuard guard(q.device());
  const auto opts = q.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor q_out = at::empty({q.size(0), q.size(1), q.size(2)}, opts);
  at::Tensor k_out = at::empty({k.size(0), k.size(1), k.size(2)}, opts);
  if (q.size(0) > 0) launch_rope(q, k, cos, sin, rot, q_out, k_out, nullptr);
  return {q_out, k_out};
}

// rope of q and k, with the rotated keys and the values v written into the dense paged caches at
// rows `slots` (int64) in the same launch (the decode step's RoPE + KV write). Returns q rotated.
at::Tensor rope_kv_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& slots, at::Tensor& k_cache, at::Tensor& v_cache) {
  const int rot = check_rope(q, k, cos, sin);
  check_heads(v, "v");
  TORCH_CHECK(v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type(), "v must match k");
  TORCH_CHECK(k_cache.is_cuda() && v_cache.is_cuda() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.sizes().slice(1) == k.sizes().slice(1) && k_cache.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type(),
              "the caches must be contiguous [slots, kv_heads, head_dim] CUDA tensors of k's shape and dtype");
  TORCH_CHECK(slots.is_cuda() && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1 &&
                  slots.size(0) == q.size(0),
              "slots must be a contiguous int64 CUDA vector, one per token");
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor q_out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (q.size(0) == 0) return q_out;
  RopeCacheArgs cache;
  cache.v = v.data_ptr();
  cache.v_stride = v.stride(0);
  cache.slots = slots.data_ptr<int64_t>();
  cache.v_cache = v_cache.data_ptr();
  cache.num_slots = k_cache.size(0);
  launch_rope(q, k, cos, sin, rot, q_out, k_cache, &cache);
  return q_out;
}

// cos and sin [tokens, 1, rot] in `dtype` for int64 positions [tokens] (see rope_tables_kernel).
std::vector<at::Tensor> rope_tables(const at::Tensor& positions, const at::Tensor& inv_freq, double factor,
                                    at::ScalarType dtype) {
  TORCH_CHECK(positions.is_cuda() && positions.dim() == 1 && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "positions must be a contiguous 1-D int64 CUDA tensor");
  TORCH_CHECK(inv_freq.device() == positions.device() && inv_freq.dim() == 1 &&
                  inv_freq.scalar_type() == at::kFloat && inv_freq.is_contiguous() && inv_freq.size(0) >= 1,
              "inv_freq must be a contiguous 1-D float32 tensor on the positions' device");
  const c10::cuda::CUDAGuard guard(positions.device());
  const int64_t tokens = positions.size(0), half = inv_freq.size(0);
  const auto options = positions.options().dtype(dtype);
  at::Tensor cos = at::empty({tokens, 1, 2 * half}, options), sin = at::empty({tokens, 1, 2 * half}, options);
  if (tokens == 0) return {cos, sin};
  const int threads = static_cast<int>(std::min<int64_t>(1024, ((2 * half + 31) / 32) * 32));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  by_dtype(cos.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    launch_chained(rope_tables_kernel<T>, dim3(static_cast<unsigned>(tokens)), dim3(threads), 0, stream,
                   positions.data_ptr<int64_t>(), inv_freq.data_ptr<float>(), static_cast<int>(half),
                   static_cast<float>(factor), reinterpret_cast<T*>(cos.data_ptr()), reinterpret_cast<T*>(sin.data_ptr()));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {cos, sin};
}

at::Tensor act_mul(const at::Tensor& gate, const at::Tensor& up, int64_t act) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(), "gate and up must match");
  TORCH_CHECK(act >= 0 && act <= 3, "act must be 0 (silu), 1 (gelu tanh), 2 (gelu erf) or 3 (relu)");
  const c10::cuda::CUDAGuard guard(gate.device());
  const int n = static_cast<int>(gate.size(1));
  at::Tensor out = at::empty({gate.size(0), n}, gate.options().memory_format(at::MemoryFormat::Contiguous));
  if (gate.size(0) == 0 || n == 0) return out;
  const int threads = 256;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  by_dtype(gate.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int kV = 16 / sizeof(T);
    const bool vec = vector_ok<T>({gate.data_ptr(), up.data_ptr(), out.data_ptr()}, {gate.stride(0), up.stride(0), n});
    const int per_block = threads * (vec ? kV : 1);
    const dim3 grid(static_cast<unsigned>(std::min((n + per_block - 1) / per_block, 64)),
                    static_cast<unsigned>(gate.size(0)));
    const T* g = reinterpret_cast<const T*>(gate.data_ptr());
    const T* u = reinterpret_cast<const T*>(up.data_ptr());
    T* o = reinterpret_cast<T*>(out.data_ptr());
    auto launch = [&](auto kernel) {
      launch_chained(kernel, grid, dim3(threads), 0, stream, g, gate.stride(0), u, up.stride(0), o, n);
    };
    auto by_width = [&](auto act_tag) {
      constexpr int A = decltype(act_tag)::value;
      if (vec) launch(act_mul_kernel<T, A, kV>);
      else launch(act_mul_kernel<T, A, 1>);
    };
    switch (act) {
      case kSilu: by_width(std::integral_constant<int, kSilu>{}); break;
      case kGeluTanh: by_width(std::integral_constant<int, kGeluTanh>{}); break;
      case kGeluErf: by_width(std::integral_constant<int, kGeluErf>{}); break;
      default: by_width(std::integral_constant<int, kRelu>{}); break;
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

void bind_fused_ops(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("rms_norm", &rms_norm, "RMSNorm of rows (Llama: offset 0; Gemma: offset 1)", py::arg("x"), py::arg("weight"),
        py::arg("eps"), py::arg("offset"));
  m.def("add_rms_norm", &add_rms_norm, "h + delta and RMSNorm of it in one launch; returns [h_out, y]",
        py::arg("h"), py::arg("delta"), py::arg("weight"), py::arg("eps"), py::arg("offset"));
  m.def("kv_cache_write", &kv_cache_write, "k and v rows into the dense paged caches at slots, one launch",
        py::arg("k"), py::arg("v"), py::arg("slots"), py::arg("k_cache"), py::arg("v_cache"));
  m.def("rope_kv_write", &rope_kv_write,
        "rope of q and k with the rotated keys and the values written into the dense paged caches at slots, one "
        "launch; returns q rotated",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cos"), py::arg("sin"), py::arg("slots"), py::arg("k_cache"),
        py::arg("v_cache"));
  m.def("rope", &rope, "rotate-half rotary embedding of q and k in one launch; returns new tensors", py::arg("q"),
        py::arg("k"), py::arg("cos"), py::arg("sin"));
  m.def("rope_tables", &rope_tables, "RoPE's cos and sin [tokens, 1, rot] for int64 positions, one launch; "
        "returns [cos, sin]", py::arg("positions"), py::arg("inv_freq"), py::arg("factor"), py::arg("dtype"));
  m.def("act_mul", &act_mul, "act(gate) * up (0 silu, 1 gelu tanh, 2 gelu erf, 3 relu)", py::arg("gate"),
        py::arg("up"), py::arg("act"));
}

}  // namespace trellis
