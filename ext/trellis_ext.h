// Host-side entry points of the CUDA kernels (no CUDA syntax: included by the C++ bindings).
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

namespace trellis {

struct GemvArgs {
  const void* x;            // (m, in) contiguous, dtype x_dtype
  const uint32_t* trellis;  // (in/16, out/16, 16K) int16, read as uint32 words
  const void* suh;          // (in,) fp16
  const void* svh;          // (out,) fp16
  void* y;                  // (m, out) contiguous, dtype x_dtype
  float* partial;           // (splits, m, out) workspace
  int* counters;            // (out/128,) zero on entry, zero on exit
  int m, in, out, splits, x_dtype;
};

// Up to kGemvMaxMats GEMVs of the same x (same m, in, dtype; codebook per launch) in one launch.
// Matrix i owns grid blocks [begin[i], begin[i+1]) = (out_i/128) * splits_i blocks; begin[] of
// absent matrices is INT_MAX. mat[i].partial/counters are disjoint regions of one workspace.
constexpr int kGemvMaxMats = 3;

// The decode step's q/k/v launch can finish what the RoPE + KV-write launch would do next
// (exl3_gemv_cluster.cuh, a branch of its int8 kernel): matrix i's outputs are rotated by rotate-half
// RoPE where rope[i] (q and k), and stored into the dense KV cache row slots[n] where cache[i]
// (k and v) instead of into y. Every other launch leaves it off (on = 0).
struct GemvRopeEpilogue {
  const void* cos = nullptr;  // [m, head_dim] in x's dtype (the step's RoPE tables)
  const void* sin = nullptr;
  const int64_t* slots = nullptr;  // [m] cache rows; outside [0, num_slots): nothing written
  long long num_slots = 0;
  void* cache[kGemvMaxMats] = {nullptr, nullptr, nullptr};  // [num_slots, out_i] in x's dtype
  int rope[kGemvMaxMats] = {0, 0, 0};
  int head_dim = 0;           // 64 or 128: a 128-output group holds whole heads
  int on = 0;                 // the int8 kernel runs the epilogue (the binding checks the variant)
};

struct GemvMultiArgs {
  GemvArgs mat[kGemvMaxMats];
  int K[kGemvMaxMats];
  int begin[kGemvMaxMats];
  int count;
  GemvRopeEpilogue epi;
};

// The workspace split-K GEMV (exl3_gemv.cuh): launch (blocks_per_sm == nullptr) or query occupancy
// (*blocks_per_sm set, nothing launched).
void gemv_dispatch_3inst(int K, const GemvArgs& a, cudaStream_t stream, int* blocks_per_sm);
void gemv_dispatch_mcg(int K, const GemvArgs& a, cudaStream_t stream, int* blocks_per_sm);
void gemv_dispatch_mul1(int K, const GemvArgs& a, cudaStream_t stream, int* blocks_per_sm);
void gemv_multi_dispatch_3inst(const GemvMultiArgs& a, int blocks, cudaStream_t stream, int* blocks_per_sm);
void gemv_multi_dispatch_mcg(const GemvMultiArgs& a, int blocks, cudaStream_t stream, int* blocks_per_sm);
void gemv_multi_dispatch_mul1(const GemvMultiArgs& a, int blocks, cudaStream_t stream, int* blocks_per_sm);

// The workspace GEMV's split count for one launch of `total_groups` 128-column groups (of all its
// matrices) over `in` features and m rows (trellis_ext.cpp; the expert GEMV launch uses it too).
int gemv_multi_splits(int in, int total_groups, int m, int blocks_per_sm, int sms);

}  // namespace trellis

// Kernel families that bind their own entry points (their .cu files include torch/extension.h).
#include <pybind11/pybind11.h>
namespace trellis {
void bind_paged_attention(pybind11::module_& m);  // ext/paged_attention.cu
void bind_viterbi(pybind11::module_& m);          // ext/viterbi.cu
void bind_fused_ops(pybind11::module_& m);        // ext/fused_ops.cu
void bind_recurrent_step(pybind11::module_& m);   // ext/recurrent_step.cu
void bind_recurrent_scan(pybind11::module_& m);   // ext/recurrent_scan.cu
void bind_gemv_cluster(pybind11::module_& m);     // ext/exl3_gemv_cluster.cu
void bind_quantized_cache_read(pybind11::module_& m);  // ext/quantized_cache_read.cu
void bind_exl3_weight(pybind11::module_& m);          // ext/exl3_weight.cu
void bind_sampling(pybind11::module_& m);             // ext/sampling.cu
void bind_argmax(pybind11::module_& m);               // ext/argmax.cu
void bind_expert_gemv(pybind11::module_& m);          // ext/exl3_expert_gemv.cu
void bind_moe_route(pybind11::module_& m);            // ext/moe_route.cu
}  // namespace trellis
