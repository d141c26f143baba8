// The launch configuration of a kernel that runs one thread-block cluster per row (sm_90): rows x
// `cluster` blocks, cluster r on row r. For cudaLaunchKernelEx and cudaOccupancyMaxActiveClusters
// (the probe whether such a cluster can be placed); used by the cluster sampler (sampling.cu) and
// the cluster argmax (argmax.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

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

}  // namespace trellis
