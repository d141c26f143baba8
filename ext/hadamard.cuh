// Small Sylvester Walsh-Hadamard transforms on registers, shared by the kernels that rotate
// blocks of numbers (whole-weight kernel, quantized KV cache: attention and the cache read).
// Unnormalised: the caller scales. For a pair (i, i + h) inside a block of 2h the lower element
// becomes x_i + x_{i+h}, the upper x_i - x_{i+h} (H_2n = [[H, H], [H, -H]]).
#pragma once

namespace trellis {

// 8 numbers held by one thread.
__device__ __forceinline__ void hadamard8(float (&v)[8]) {
#pragma unroll
  for (int h = 1; h < 8; h <<= 1) {
#pragma unroll
    for (int a = 0; a < 8; ++a) {
      if (a & h) continue;
      const float x = v[a], y = v[a + h];
      v[a] = x + y;
      v[a + h] = x - y;
    }
  }
}

// A 32-number group spread over 4 consecutive lanes, 8 numbers each: number k of the group is
// x[k % 8] of the lane with (lane & 3) == k / 8. Every lane of the warp must call it (the
// shuffles use the full mask).
__device__ __forceinline__ void hadamard32_lanes(float (&x)[8], int lane) {
  hadamard8(x);
#pragma unroll
  for (int m = 1; m < 4; m <<= 1) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float o = __shfl_xor_sync(0xffffffffu, x[i], m);
      x[i] = (lane & m) ? o - x[i] : x[i] + o;
    }
  }
}

}  // namespace trellis
