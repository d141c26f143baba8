// Chained launches: programmatic dependent launch (PDL, sm_90+) for the kernels of a decode step.
//
// Why: a decode step is a chain of ~360 dependent kernels. Launched the usual way, each one starts
// only after the previous one has finished and flushed: per kernel that is the launch latency plus
// the ramp of its first loads (for a GEMV, a DRAM round trip for its first weight rows) on an idle
// GPU. With PDL the next kernel is launched as soon as every block of the current one has called
// `chain_release()`; it may do work that depends on no earlier kernel (a GEMV fetches its first
// weight rows), then `chain_wait()` blocks until the previous kernel has completed and its memory
// is visible.
//
// The contract every kernel launched with `launch_chained` keeps (the whole chain relies on it):
//  - before `chain_wait()` it reads only memory no kernel of the step writes (weights) or that only
//    kernels at least two launches earlier write (they have completed when this one starts, see
//    below: the step's inputs, such as the attention's lengths and page tables, converted before
//    the first chained kernel), and writes nothing;
//  - it calls `chain_wait()` in every thread before it touches anything else, which makes the
//    chain transitive: when kernel N passes its wait, N-1 has completed, so N-1 passed its own
//    wait and N-2 had completed, and so on;
//  - it calls `chain_release()` after its wait (never before), so at most one launched-but-waiting
//    kernel follows a running one.
// A kernel launched the usual way (torch's) still waits for the full completion of the one before,
// and one launched with PDL after it starts when it has completed (it never releases early).
//
// The switch is process-wide and off by default: engine/kernels/loader.py turns it on around a
// loaded model's decode step (`chained_launches()`), whose weights no kernel writes. Without it, or before
// sm_90, `launch_chained` is a plain launch and the two device calls do nothing.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <atomic>
#include <utility>

namespace trellis {

// The process-wide switch (one instance across the extension's translation units).
inline std::atomic<bool>& chained_launch_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}
inline bool chained_launch_enabled() { return chained_launch_flag().load(std::memory_order_relaxed); }

#ifdef __CUDACC__
// Blocks until the previous kernel of the stream has completed and its writes are visible.
__device__ __forceinline__ void chain_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the next kernel of the stream launch (it still waits for this one in its chain_wait).
__device__ __forceinline__ void chain_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization while
// chained launches are on. The kernel must keep the contract above.
template <typename... Params, typename... Args>
void launch_chained(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                    Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = chained_launch_enabled() ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}
#endif

}  // namespace trellis
