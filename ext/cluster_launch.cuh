// The launch configuration of a kernel that runs one thread-block cluster per row (sm_90): rows x
// `cluster` blocks, cluster r on row r. For cudaLaunchKernelEx and cudaOccupancyMaxActiveClusters
// (the probe whether such a cluster can be placed); used by the cluster sampler (sampling.cu) and
// the cluster argmax (argmax.cu). Also the memo of such a probe: once per device.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>
#include <unordered_map>

namespace trellis {

struct ClusterLaunch {
  cudaLaunchAttribute cluster_dim;
  cudaLaunchConfig_t config;
  ClusterLaunch(int cluster, int rows, int threads, size_t smem_bytes, cudaStream_t stream)
      : cluster_dim{}, config{} {
    cluster_dim.id = cudaLaunchAttributeClusterDimension;
    cluster_dim.val.clusterDim.x = cluster;
    cluster_dim.val.clusterDim.y = 1;
    cluster_dim.val.clusterDim.z = 1;
    config.gridDim = dim3(static_cast<unsigned>(rows * cluster));
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem_bytes;
    config.stream = stream;
    config.attrs = &cluster_dim;
    config.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;  // config points at cluster_dim
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// Whether the GPU can place one cluster of `launch`'s shape for `kernel` (the probe before a
// cluster kernel's first launch). Where it cannot, the error the query leaves is cleared: the
// caller runs its single-block kernel instead.
template <typename Kernel>
bool cluster_fits(Kernel kernel, const ClusterLaunch& launch) {
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch.config) == cudaSuccess && clusters > 0) return true;
  (void)cudaGetLastError();
  return false;
}

// probe(device) for the current device, run once per device and remembered (under a lock: several
// threads may launch). Each call site's lambda is its own type, so each site has its own memo.
template <typename Value, typename Probe>
Value once_per_device(Probe probe) {
  static std::mutex mutex;
  static std::unordered_map<int, Value> values;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = values.find(device);
  if (it != values.end()) return it->second;
  const Value value = probe(device);
  values.emplace(device, value);
  return value;
}

}  // namespace trellis
