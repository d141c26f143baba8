// The feed-forward activations of the kernels that finish a gated or plain MLP's middle (the fused
// gated activation, the experts' activation), in fp32. Numbered as engine/kernels (fused.ACT_IDS,
// moe.ACT_IDS) number them.
#pragma once

namespace trellis {

enum Act { kSilu = 0, kGeluTanh = 1, kGeluErf = 2, kRelu = 3, kRelu2 = 4, kQuickGelu = 5 };

template <int ACT>
__device__ __forceinline__ float activate(float g) {
  if (ACT == kSilu) return g / (1.f + __expf(-g));
  if (ACT == kGeluTanh) return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
  if (ACT == kGeluErf) return 0.5f * g * (1.f + erff(g * 0.7071067811865476f));
  if (ACT == kRelu2) {  // squared ReLU (Primer; NemotronH's experts)
    const float r = fmaxf(g, 0.f);
    return r * r;
  }
  if (ACT == kQuickGelu) return g / (1.f + __expf(-1.702f * g));  // g * sigmoid(1.702 g) (gpt-oss)
  return fmaxf(g, 0.f);
}

// activate<act>(g) for an activation chosen at run time (a kernel whose cost is its memory traffic,
// where one switch per element costs nothing measurable).
__device__ __forceinline__ float activate_by(int act, float g) {
  switch (act) {
    case kSilu: return activate<kSilu>(g);
    case kGeluTanh: return activate<kGeluTanh>(g);
    case kGeluErf: return activate<kGeluErf>(g);
    case kRelu2: return activate<kRelu2>(g);
    case kQuickGelu: return activate<kQuickGelu>(g);
    default: return activate<kRelu>(g);
  }
}

}  // namespace trellis
