// Greedy decoding's argmax over float32 logit rows, one block per row.
//
// Why: torch.argmax over a 128K vocabulary took 28 us per decode step on the H200 (profile-step,
// session 16), ~3% of a 1B model's step, for 0.5 MB of reading. One block per row took 16.6 us
// (one multiprocessor's reading), so a row is split over up to kMaxChunks blocks; each writes its
// chunk's first maximum, and the last of a row's blocks (counted on a ticket it resets to zero)
// takes the first maximum of those in chunk order.
// The answer is torch.argmax's: the first maximum, and a NaN counts as larger than any number
// (the first NaN wins).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <climits>
#include <cmath>
#include <algorithm>
#include <cstdint>

#include "trellis_ext.h"

namespace trellis {
namespace {

constexpr int kArgmaxThreads = 1024;
constexpr int kChunkElems = 8192;  // per block (at least): 2 float4 loads per thread
constexpr int kMaxChunks = 64;

// (v, i) becomes (v2, i2) when that one comes first in torch.argmax's order.
__device__ __forceinline__ void take_if_first(float& v, int& i, float v2, int i2) {
  const bool nan1 = v != v, nan2 = v2 != v2;
  const bool first = nan2 ? (!nan1 || i2 < i) : (!nan1 && (v2 > v || (v2 == v && i2 < i)));
  if (first) v = v2, i = i2;
}

__device__ __forceinline__ void warp_first(float& v, int& i) {
  for (int o = 16; o > 0; o >>= 1)
    take_if_first(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
}

// The first maximum of x[begin, end) as (value, index), in thread 0 (the others: garbage).
__device__ __forceinline__ void block_first(const float* __restrict__ row, int begin, int end, bool vec4, float& best,
                                            int& at) {
  __shared__ float vs[kArgmaxThreads / 32];
  __shared__ int is[kArgmaxThreads / 32];
  best = -INFINITY;
  at = INT_MAX;
  if (vec4) {  // begin and end are multiples of 4 here
    const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll 2
    for (int j = begin / 4 + threadIdx.x; j < end / 4; j += kArgmaxThreads) {
      const float4 v = r4[j];
      take_if_first(best, at, v.x, 4 * j);
      take_if_first(best, at, v.y, 4 * j + 1);
      take_if_first(best, at, v.z, 4 * j + 2);
      take_if_first(best, at, v.w, 4 * j + 3);
    }
  } else {
    for (int j = begin + threadIdx.x; j < end; j += kArgmaxThreads) take_if_first(best, at, row[j], j);
  }
  warp_first(best, at);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) vs[warp] = best, is[warp] = at;
  __syncthreads();
  if (warp == 0) {
    best = vs[lane], at = is[lane];
    warp_first(best, at);
  }
}

// grid (chunks, rows). chunks == 1: the block writes its row's answer; else see the file comment.
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_rows_kernel(const float* __restrict__ x, int n, int span, int64_t stride, bool vec4,
                       int64_t* __restrict__ out, float* __restrict__ part_v, int* __restrict__ part_i,
                       int* __restrict__ tickets) {
  const int chunks = gridDim.x, c = blockIdx.x, r = blockIdx.y;
  const float* row = x + r * stride;
  float best;
  int at;
  block_first(row, c * span, min(n, c * span + span), vec4, best, at);  // span: a multiple of 4
  if (chunks == 1) {
    if (threadIdx.x == 0) out[r] = at;
    return;
  }
  __shared__ bool s_last;
  if (threadIdx.x == 0) {
    part_v[r * chunks + c] = best;
    part_i[r * chunks + c] = at;
    __threadfence();  // the partial is visible device-wide before the ticket counts it
    const bool last = atomicAdd(tickets + r, 1) == chunks - 1;
    if (last) tickets[r] = 0;  // every chunk has counted: ready for the next launch
    s_last = last;
  }
  __syncthreads();
  if (!s_last || threadIdx.x >= 32) return;
  __threadfence();
  best = -INFINITY;
  at = INT_MAX;
  for (int j = threadIdx.x; j < chunks; j += 32) take_if_first(best, at, __ldcg(part_v + r * chunks + j),
                                                               __ldcg(part_i + r * chunks + j));
  warp_first(best, at);
  if (threadIdx.x == 0) out[r] = at;
}

at::Tensor argmax_rows(const at::Tensor& x, const c10::optional<at::Tensor>& tickets) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "argmax_rows: a [rows, n] float32 CUDA tensor with contiguous rows");
  TORCH_CHECK(x.size(0) >= 1 && x.size(1) >= 1 && x.size(1) <= INT_MAX - kChunkElems && x.size(0) <= 65535,
              "argmax_rows: empty or too long rows, or too many");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const int n = static_cast<int>(x.size(1));
  const bool vec4 = n % 4 == 0 && x.stride(0) % 4 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  // Several blocks per row only with tickets (zeroed, one per row) to count them.
  int chunks = 1;
  if (tickets.has_value() && tickets->defined()) {
    TORCH_CHECK(tickets->is_cuda() && tickets->scalar_type() == at::kInt && tickets->is_contiguous() &&
                    tickets->numel() >= rows && tickets->device() == x.device(),
                "argmax_rows: tickets must be zeroed int32, one per row, on x's device");
    chunks = std::min(kMaxChunks, (n + kChunkElems - 1) / kChunkElems);
  }
  const int span = ((n + chunks - 1) / chunks + 3) / 4 * 4;  // elements per block
  float* part_v = nullptr;
  int* part_i = nullptr;
  at::Tensor part;
  if (chunks > 1) {
    part = at::empty({2, rows, chunks}, x.options());
    part_v = part.data_ptr<float>();
    part_i = reinterpret_cast<int*>(part_v + rows * chunks);
  }
  argmax_rows_kernel<<<dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(rows)), kArgmaxThreads, 0,
                       c10::cuda::getCurrentCUDAStream().stream()>>>(
      x.data_ptr<float>(), n, span, x.stride(0), vec4, out.data_ptr<int64_t>(), part_v, part_i,
      chunks > 1 ? tickets->data_ptr<int>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

void bind_argmax(pybind11::module_& m) {
  m.def("argmax_rows", &argmax_rows,
        "torch.argmax(x, dim=1) of a float32 [rows, n] tensor (several blocks per row given zeroed tickets)",
        py::arg("x"), py::arg("tickets") = py::none());
}

}  // namespace trellis
