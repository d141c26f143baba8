// The gated MLP's activations, shared by the act_mul kernel (fused_ops.cu) and the GEMV that
// applies act(gate) * up while it loads its input (exl3_gemv_v5.cuh): one definition, so the two
// paths give the same bits.
#pragma once

namespace trellis {

enum Act { kSilu = 0, kGeluTanh = 1, kGeluErf = 2, kRelu = 3 };  // engine/ops.py ACT_IDS

template <int ACT>
__device__ __forceinline__ float activate(float g) {
  if (ACT == kSilu) return g / (1.f + __expf(-g));
  if (ACT == kGeluTanh) return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
  if (ACT == kGeluErf) return 0.5f * g * (1.f + erff(g * 0.7071067811865476f));
  return fmaxf(g, 0.f);
}

// activate<act> with the activation chosen at run time (uniform across a block).
__device__ __forceinline__ float activate(int act, float g) {
  switch (act) {
    case kSilu: return activate<kSilu>(g);
    case kGeluTanh: return activate<kGeluTanh>(g);
    case kGeluErf: return activate<kGeluErf>(g);
    default: return activate<kRelu>(g);
  }
}

}  // namespace trellis
