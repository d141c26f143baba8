// Instantiations of the EXL3 GEMV for one codebook (one file per codebook so ninja builds them in parallel).
#include "exl3_gemv.cuh"

namespace trellis {

template <bool FAST, bool ILP = false>
static void dispatch_k(int K, const GemvArgs& a, cudaStream_t stream, int* blocks_per_sm) {
  switch (K) {
#define TRELLIS_CASE(k)                                                          \
  case k:                                                                        \
    if (blocks_per_sm) *blocks_per_sm = gemv_blocks_per_sm<k, CB_3INST, FAST, ILP>(); \
    else launch_gemv<k, CB_3INST, FAST, ILP>(a, stream);                              \
    break;
    TRELLIS_CASE(1) TRELLIS_CASE(2) TRELLIS_CASE(3) TRELLIS_CASE(4)
    TRELLIS_CASE(5) TRELLIS_CASE(6) TRELLIS_CASE(7) TRELLIS_CASE(8)
#undef TRELLIS_CASE
    default: break;
  }
}

void gemv_dispatch_3inst(int K, bool fast, const GemvArgs& a, cudaStream_t stream, int* blocks_per_sm) {
  if (fast && gemv_ilp()) dispatch_k<true, true>(K, a, stream, blocks_per_sm);  // TRELLIS_GEMV_ILP=1
  else if (fast) dispatch_k<true>(K, a, stream, blocks_per_sm);
  else dispatch_k<false>(K, a, stream, blocks_per_sm);
}

void gemv_multi_dispatch_3inst(bool fast, const GemvMultiArgs& a, int blocks, cudaStream_t stream,
                              int* blocks_per_sm) {
  gemv_multi_dispatch<CB_3INST>(fast, a, blocks, stream, blocks_per_sm);
}

}  // namespace trellis
