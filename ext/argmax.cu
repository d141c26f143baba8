// Greedy decoding's argmax over float32 logit rows, one block per row.
//
// Why: torch.argmax over a 128K vocabulary took 28 us per decode step on the H200 (profile-step,
// session 16), ~3% of a 1B model's step, for 0.5 MB of reading. One 1024-thread block with 16-byte
// loads took 16.6 us (one multiprocessor's reading); several blocks per row, combined by the last
// one, measured no faster in the whole step (ext/NOTES.md, sixteenth session).
// The answer is torch.argmax's: the first maximum, and a NaN counts as larger than any number
// (the first NaN wins).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "trellis_ext.h"

namespace trellis {
namespace {

constexpr int kArgmaxThreads = 1024;

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

__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_rows_kernel(const float* __restrict__ x, int n, int64_t stride, bool vec4, int64_t* __restrict__ out) {
  __shared__ float vs[kArgmaxThreads / 32];
  __shared__ int is[kArgmaxThreads / 32];
  const float* row = x + blockIdx.x * stride;
  float best = -INFINITY;
  int at = INT_MAX;
  if (vec4) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll 4
    for (int j = threadIdx.x; j < n / 4; j += kArgmaxThreads) {
      const float4 v = r4[j];
      take_if_first(best, at, v.x, 4 * j);
      take_if_first(best, at, v.y, 4 * j + 1);
      take_if_first(best, at, v.z, 4 * j + 2);
      take_if_first(best, at, v.w, 4 * j + 3);
    }
  } else {
    for (int j = threadIdx.x; j < n; j += kArgmaxThreads) take_if_first(best, at, row[j], j);
  }
  warp_first(best, at);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) vs[warp] = best, is[warp] = at;
  __syncthreads();
  if (warp == 0) {
    best = vs[lane], at = is[lane];
    warp_first(best, at);
    if (lane == 0) out[blockIdx.x] = at;
  }
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "argmax_rows: a [rows, n] float32 CUDA tensor with contiguous rows");
  TORCH_CHECK(x.size(0) >= 1 && x.size(1) >= 1 && x.size(1) <= INT_MAX, "argmax_rows: empty or too long rows");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const int n = static_cast<int>(x.size(1));
  const bool vec4 = n % 4 == 0 && x.stride(0) % 4 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  argmax_rows_kernel<<<static_cast<unsigned>(x.size(0)), kArgmaxThreads, 0,
                       c10::cuda::getCurrentCUDAStream().stream()>>>(x.data_ptr<float>(), n, x.stride(0), vec4,
                                                                     out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

void bind_argmax(pybind11::module_& m) {
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=1) of a float32 [rows, n] tensor, one block per row",
        py::arg("x"));
}

}  // namespace trellis
