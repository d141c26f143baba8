// Greedy decoding's argmax over float32 logit rows: one block per row, or on sm_90 a cluster of
// blocks per row.
//
// Why: greedy decoding needs one id per row, and a 128K-vocabulary row is 0.5 MB: torch.argmax
// spends a noticeable share of a small model's decode step on it. One 1024-thread block with
// 16-byte loads is bound by latency: a multiprocessor keeps ~64 KB of loads in flight, so the
// row's 0.5 MB is about eight round trips in series. Several blocks per row combined by the last
// one through a global ticket gain nothing (the ticket adds a pass). A thread-block cluster reads
// the row on kArgmaxCluster multiprocessors at once and combines the blocks' answers through
// distributed shared memory, without global atomics or a second launch. Measured figures:
// docs/KERNELS.md, section 7.
// The answer is torch.argmax's: the first maximum, and a NaN counts as larger than any number
// (the first NaN wins). take_if_first orders (value, index) pairs totally, so the blocks' answers
// combine in any order to the same one.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>
#include <torch/extension.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "cluster_launch.cuh"
#include "trellis_ext.h"

namespace trellis {
namespace {

constexpr int kArgmaxThreads = 1024;
constexpr int kArgmaxCluster = 8;            // blocks per row (a portable cluster size)
constexpr int kArgmaxClusterMinWidth = 8192;  // narrower rows: one block reads them in one round trip

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

// The first maximum of row[lo, hi) (elements, or float4 vectors where vec4) as this block's
// threads find it; thread 0 gets the block's answer.
__device__ __forceinline__ void block_first(const float* __restrict__ row, int lo, int hi, bool vec4, float& best,
                                            int& at) {
  __shared__ float vs[kArgmaxThreads / 32];
  __shared__ int is[kArgmaxThreads / 32];
  best = -INFINITY;
  at = INT_MAX;
  if (vec4) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll 4
    for (int j = lo + threadIdx.x; j < hi; j += kArgmaxThreads) {
      const float4 v = r4[j];
      take_if_first(best, at, v.x, 4 * j);
      take_if_first(best, at, v.y, 4 * j + 1);
      take_if_first(best, at, v.z, 4 * j + 2);
      take_if_first(best, at, v.w, 4 * j + 3);
    }
  } else {
    for (int j = lo + threadIdx.x; j < hi; j += kArgmaxThreads) take_if_first(best, at, row[j], j);
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

__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_rows_kernel(const float* __restrict__ x, int n, int64_t stride, bool vec4, int64_t* __restrict__ out) {
  float best;
  int at;
  block_first(x + blockIdx.x * stride, 0, vec4 ? n / 4 : n, vec4, best, at);
  if (threadIdx.x == 0) out[blockIdx.x] = at;
}

// kArgmaxCluster blocks per row (cluster r on row r), block b reading the b-th slice; block 0
// takes the first of the blocks' answers from their shared memory.
__global__ void __launch_bounds__(kArgmaxThreads) argmax_rows_cluster_kernel(const float* __restrict__ x, int n,
                                                                             int64_t stride, bool vec4,
                                                                             int64_t* __restrict__ out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  __shared__ float block_best;
  __shared__ int block_at;
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int r = blockIdx.x / kArgmaxCluster;
  const int items = vec4 ? n / 4 : n, per = (items + kArgmaxCluster - 1) / kArgmaxCluster;
  const int lo = min(items, rank * per), hi = min(items, lo + per);
  float best;
  int at;
  block_first(x + r * stride, lo, hi, vec4, best, at);
  if (threadIdx.x == 0) block_best = best, block_at = at;
  cluster.sync();  // every block's answer is in its shared memory
  if (rank == 0 && threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float v = -INFINITY;
    int i = INT_MAX;
    if (lane < kArgmaxCluster) v = *cluster.map_shared_rank(&block_best, lane), i = *cluster.map_shared_rank(&block_at, lane);
    warp_first(v, i);
    if (lane == 0) out[r] = i;
  }
  cluster.sync();  // a block's shared memory must outlive block 0's reads of it
#endif
}

// Whether the cluster kernel can run on the current device: sm_90 code for it in this build and
// a cluster of kArgmaxCluster such blocks that the GPU can place. Probed once per device.
bool cluster_argmax_runs() {
  return once_per_device<bool>([](int device) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    cudaFuncAttributes attr;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, argmax_rows_cluster_kernel));
    if (major < 9 || attr.binaryVersion < 90) return false;
    return cluster_fits(argmax_rows_cluster_kernel, ClusterLaunch(kArgmaxCluster, 1, kArgmaxThreads, 0, nullptr));
  });
}

// cluster: may use the cluster kernel (wide rows on sm_90); false: one block per row (A/B runs).
at::Tensor argmax_rows(const at::Tensor& x, bool cluster) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "argmax_rows: a [rows, n] float32 CUDA tensor with contiguous rows");
  TORCH_CHECK(x.size(0) >= 1 && x.size(1) >= 1 && x.size(1) <= INT_MAX, "argmax_rows: empty or too long rows");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const int n = static_cast<int>(x.size(1));
  const bool vec4 = n % 4 == 0 && x.stride(0) % 4 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  if (cluster && n >= kArgmaxClusterMinWidth && cluster_argmax_runs()) {
    const ClusterLaunch launch(kArgmaxCluster, static_cast<int>(x.size(0)), kArgmaxThreads, 0, stream);
    C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, argmax_rows_cluster_kernel, x.data_ptr<float>(), n,
                                      x.stride(0), vec4, out.data_ptr<int64_t>()));
  } else {
    argmax_rows_kernel<<<static_cast<unsigned>(x.size(0)), kArgmaxThreads, 0, stream>>>(
        x.data_ptr<float>(), n, x.stride(0), vec4, out.data_ptr<int64_t>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

void bind_argmax(pybind11::module_& m) {
  m.def("argmax_rows", &argmax_rows,
        "torch.argmax(x, dim=1) of a float32 [rows, n] tensor: one block per row, or a cluster of blocks per wide "
        "row on sm_90 where cluster",
        py::arg("x"), py::arg("cluster") = true);
}

}  // namespace trellis
