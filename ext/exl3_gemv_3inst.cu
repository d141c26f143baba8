// Instantiations of the workspace split-K EXL3 GEMV for one codebook (one file per codebook so ninja
// builds them in parallel).
#include "exl3_gemv.cuh"

namespace trellis {

void gemv_dispatch_3inst(int K, const GemvArgs& a, cudaStream_t stream, int* blocks_per_sm) {
  gemv_dispatch<CB_3INST>(K, a, stream, blocks_per_sm);
}

void gemv_multi_dispatch_3inst(const GemvMultiArgs& a, int blocks, cudaStream_t stream, int* blocks_per_sm) {
  gemv_multi_run<CB_3INST>(a, blocks, stream, blocks_per_sm);
}

}  // namespace trellis
