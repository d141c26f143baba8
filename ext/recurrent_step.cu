// One-token steps of the recurrent mixers (gated delta net, Mamba-2, short convolution): the decode
// step of a hybrid model, with each sequence's state read, advanced and written back in place.
//
// Why kernels: in torch each step is a chain of 15-30 small kernels per layer (conv window shift,
// normalisations, gates, the state update as broadcast products and sums), each a launch slot in
// the decode graph. Here a layer's recurrence is two launches: the causal convolution over all
// channels, then the state update of every head (with the delta net's gated RMSNorm fused).
//
// State layout (engine/cache/recurrent.py): every state tensor is [slots + 1, ...]; row `slots[b]`
// belongs to row b of the step (the last row is the scratch slot of padding rows). A row whose
// position is 0 starts its sequence: its state is read as zeros (a slot keeps whatever its last
// sequence left there). All arithmetic is fp32; states are fp32 (the convolution window may be in
// the activations' dtype).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <algorithm>
#include <type_traits>

#include "float_types.cuh"
#include "trellis_ext.h"

namespace trellis {
namespace {

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }
__device__ __forceinline__ float softplus(float v) { return v > 20.f ? v : log1pf(__expf(v)); }
template <typename T>
__device__ __forceinline__ float rnd(float v) { return to_f<T>(from_f<T>(v)); }

// Sum over the block (blockDim.x a multiple of 32); every thread gets the total.
__device__ float block_total(float v, float* scratch /* [32] shared */) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < warps; ++w) t += scratch[w];
  return t;
}

__device__ __forceinline__ bool starts(const int64_t* positions, int b) {
  return positions != nullptr && positions[b] == 0;
}

// ---- causal depthwise convolution, one new token ----------------------------------------------
// y[b, c] = act(bias[c] + sum_j w[c, j] * window[c, j] + w[c, K-1] * x[b, c]); the window (the
// K-1 previous inputs, oldest first) then shifts by one and takes x. One thread per channel.
template <typename T, typename W>
__global__ void conv_step_kernel(const T* __restrict__ x, W* __restrict__ window, const T* __restrict__ weight,
                                 const T* __restrict__ bias, const int* __restrict__ slots,
                                 const int64_t* __restrict__ positions, T* __restrict__ y, int channels, int K,
                                 int apply_silu) {
  const int b = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const bool fresh = starts(positions, b);
  W* win = window + ((long long)slots[b] * channels + c) * (K - 1);
  const T* w = weight + (long long)c * K;
  const float xc = to_f<T>(x[(long long)b * channels + c]);
  float acc = bias != nullptr ? to_f<T>(bias[c]) : 0.f;
  for (int j = 0; j < K - 1; ++j) {
    const float wj = fresh ? 0.f : to_f<W>(win[j]);
    acc += to_f<T>(w[j]) * wj;
    if (j > 0) win[j - 1] = from_f<W>(wj);  // shift left; win[j] is read before it is overwritten
  }
  if (K > 1) win[K - 2] = from_f<W>(xc);
  acc += to_f<T>(w[K - 1]) * xc;
  y[(long long)b * channels + c] = from_f<T>(apply_silu ? silu(acc) : acc);
}

// ---- gated delta rule, one new token, with the gated RMSNorm of its output --------------------
// Block (v-head h, row b); thread (part p, column v) keeps rows [p*ROWS, (p+1)*ROWS) of column v
// of the head's state S [dk, dv] in registers (columns contiguous: coalesced rows).
//   S <- S * exp(g);  u = S^T k;  delta = (v - u) * beta;  S <- S + k delta^T;  o = S^T q
// with q, k L2-normalised (q also scaled), g = -exp(A_log) * softplus(a + dt_bias),
// beta = beta_scale * sigmoid(b); then out = w * rms_norm(o) * silu(z) (torch's roundings: o and
// the normalised value are rounded to T, the product with the T weight too).
template <typename T, int ROWS>
__global__ void gated_delta_step_kernel(const T* __restrict__ qkv, const T* __restrict__ a_in,
                                        const T* __restrict__ b_in, const T* __restrict__ z,
                                        const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                                        const T* __restrict__ norm_w, float* __restrict__ state,
                                        const int* __restrict__ slots, const int64_t* __restrict__ positions,
                                        T* __restrict__ out, int hk, int hv, int dk, int dv, float q_scale,
                                        float beta_scale, float norm_eps, float l2_eps) {
  extern __shared__ float smem[];
  float* qs = smem;            // [dk]
  float* ks = qs + dk;         // [dk]
  float* vs = ks + dk;         // [dv]
  float* red = vs + dv;        // [parts, dv]
  __shared__ float scratch[32];
  const int h = blockIdx.x, b = blockIdx.y, parts = blockDim.x / dv;
  const int col = threadIdx.x % dv, part = threadIdx.x / dv;
  const int kh = h / (hv / hk);
  const long long row_len = 2LL * hk * dk + (long long)hv * dv;
  const T* row = qkv + b * row_len;
  float qq = 0.f, kk = 0.f;
  for (int i = threadIdx.x; i < dk; i += blockDim.x) {
    const float qi = to_f<T>(row[(long long)kh * dk + i]), ki = to_f<T>(row[(long long)hk * dk + kh * dk + i]);
    qs[i] = qi;
    ks[i] = ki;
    qq += qi * qi;
    kk += ki * ki;
  }
  for (int i = threadIdx.x; i < dv; i += blockDim.x) vs[i] = to_f<T>(row[2LL * hk * dk + (long long)h * dv + i]);
  const float q_norm = rsqrtf(block_total(qq, scratch) + l2_eps) * q_scale;
  const float k_norm = rsqrtf(block_total(kk, scratch) + l2_eps);
  const float g = -__expf(a_log[h]) * softplus(to_f<T>(a_in[(long long)b * hv + h]) + dt_bias[h]);
  const float beta = beta_scale / (1.f + __expf(-to_f<T>(b_in[(long long)b * hv + h])));
  const float decay = __expf(g);
  const bool fresh = starts(positions, b);
  float* S = state + (((long long)slots[b] * hv + h) * dk + (long long)part * ROWS) * dv + col;
  float s[ROWS];
  float u = 0.f;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    s[r] = fresh ? 0.f : S[(long long)r * dv] * decay;
    u += s[r] * ks[part * ROWS + r] * k_norm;
  }
  red[part * dv + col] = u;
  __syncthreads();
  u = 0.f;
  for (int p = 0; p < parts; ++p) u += red[p * dv + col];
  const float delta = (vs[col] - u) * beta;
  float o = 0.f;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    s[r] += ks[part * ROWS + r] * k_norm * delta;
    o += s[r] * qs[part * ROWS + r] * q_norm;
    S[(long long)r * dv] = s[r];
  }
  __syncthreads();  // every thread has read red[] above
  red[part * dv + col] = o;
  __syncthreads();
  o = 0.f;
  for (int p = 0; p < parts; ++p) o += red[p * dv + col];
  const float ot = rnd<T>(o);
  const float ss = block_total(part == 0 ? ot * ot : 0.f, scratch);
  if (part == 0) {
    const float r = rsqrtf(ss / static_cast<float>(dv) + norm_eps);
    const float normed = rnd<T>(to_f<T>(norm_w[col]) * rnd<T>(ot * r));
    const long long at = ((long long)b * hv + h) * dv + col;
    out[at] = from_f<T>(normed * silu(to_f<T>(z[at])));
  }
}

// ---- Mamba-2 (SSD) step -----------------------------------------------------------------------
// Block (head h, row b); each warp takes rows p of the head's state S [P, N] (N contiguous):
//   dt = clamp(softplus(dt_raw + dt_bias)); S <- S * exp(dt * A) + dt * x[p] * B;  y[p] = S C + D x[p]
// with A = -exp(A_log), B and C those of the head's group. y is fp32 (the gated norm follows).
template <typename T>
__global__ void ssd_step_kernel(const T* __restrict__ x, const T* __restrict__ Bm, const T* __restrict__ Cm,
                                const T* __restrict__ dt_raw, const float* __restrict__ dt_bias,
                                const float* __restrict__ a_log, const float* __restrict__ D,
                                float* __restrict__ state, const int* __restrict__ slots,
                                const int64_t* __restrict__ positions, float* __restrict__ y, int heads, int P, int N,
                                int groups, float dt_min, float dt_max) {
  const int h = blockIdx.x, b = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = h / (heads / groups);
  float dt = softplus(to_f<T>(dt_raw[(long long)b * heads + h]) + dt_bias[h]);
  dt = fminf(fmaxf(dt, dt_min), dt_max);
  const float dA = __expf(dt * -__expf(a_log[h]));
  const bool fresh = starts(positions, b);
  const T* Bg = Bm + ((long long)b * groups + g) * N;
  const T* Cg = Cm + ((long long)b * groups + g) * N;
  float* S = state + ((long long)slots[b] * heads + h) * P * N;
  for (int p = warp; p < P; p += warps) {
    const float xp = to_f<T>(x[((long long)b * heads + h) * P + p]);
    float acc = 0.f;
    for (int n = lane; n < N; n += 32) {
      const float prev = fresh ? 0.f : S[(long long)p * N + n];
      const float sn = prev * dA + dt * xp * to_f<T>(Bg[n]);
      S[(long long)p * N + n] = sn;
      acc += sn * to_f<T>(Cg[n]);
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) y[((long long)b * heads + h) * P + p] = acc + D[h] * xp;
  }
}

// ---- host side --------------------------------------------------------------------------------

void check_rows(const torch::Tensor& t, const char* name, const torch::Tensor& like) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), name, " must be on the GPU of the input");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_slots(const torch::Tensor& slots, const c10::optional<torch::Tensor>& positions, int64_t rows,
                 const torch::Tensor& like) {
  check_rows(slots, "slots", like);
  TORCH_CHECK(slots.scalar_type() == at::kInt && slots.numel() == rows, "slots must be int32 [rows]");
  if (positions) {
    check_rows(*positions, "positions", like);
    TORCH_CHECK(positions->scalar_type() == at::kLong && positions->numel() == rows, "positions must be int64 [rows]");
  }
}

torch::Tensor conv_step(torch::Tensor x, torch::Tensor window, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                        torch::Tensor slots, c10::optional<torch::Tensor> positions, bool apply_silu) {
  const at::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(x.dim() == 2, "x must be [rows, channels]");
  check_rows(x, "x", x);
  check_rows(window, "window", x);
  check_rows(weight, "weight", x);
  const int64_t rows = x.size(0), channels = x.size(1), K = weight.size(-1);
  TORCH_CHECK(weight.numel() == channels * K && weight.scalar_type() == x.scalar_type(), "weight must be [channels, K]");
  TORCH_CHECK(window.dim() == 3 && window.size(1) == channels && window.size(2) == K - 1, "window must be [slots, channels, K-1]");
  TORCH_CHECK(window.scalar_type() == x.scalar_type() || window.scalar_type() == at::kFloat,
              "window must be float32 or the input's dtype");
  if (bias) {
    check_rows(*bias, "bias", x);
    TORCH_CHECK(bias->numel() == channels && bias->scalar_type() == x.scalar_type(), "bias must be [channels]");
  }
  check_slots(slots, positions, rows, x);
  auto y = torch::empty_like(x);
  if (rows == 0) return y;
  const dim3 block(128), grid((channels + 127) / 128, rows);
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t* pos = positions ? positions->data_ptr<int64_t>() : nullptr;
  by_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* bp = bias ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr;
    auto launch = [&](auto* win) {
      using W = std::remove_pointer_t<decltype(win)>;
      conv_step_kernel<T, W><<<grid, block, 0, stream>>>(
          reinterpret_cast<const T*>(x.data_ptr()), win, reinterpret_cast<const T*>(weight.data_ptr()), bp,
          slots.data_ptr<int>(), pos, reinterpret_cast<T*>(y.data_ptr()), channels, K, apply_silu ? 1 : 0);
    };
    if (window.scalar_type() == at::kFloat)
      launch(window.data_ptr<float>());
    else
      launch(reinterpret_cast<T*>(window.data_ptr()));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

torch::Tensor gated_delta_step(torch::Tensor qkv, torch::Tensor a, torch::Tensor b, torch::Tensor z,
                               torch::Tensor a_log, torch::Tensor dt_bias, torch::Tensor norm_w, torch::Tensor state,
                               torch::Tensor slots, c10::optional<torch::Tensor> positions, int64_t hk, int64_t dk,
                               double q_scale, double beta_scale, double norm_eps, double l2_eps) {
  const at::cuda::CUDAGuard guard(qkv.device());
  for (const auto* t : {&qkv, &a, &b, &z, &a_log, &dt_bias, &norm_w, &state}) check_rows(*t, "every input", qkv);
  TORCH_CHECK(state.dim() == 4 && state.scalar_type() == at::kFloat, "state must be float32 [slots, hv, dk, dv]");
  const int64_t rows = qkv.size(0), hv = state.size(1), dv = state.size(3);
  TORCH_CHECK(state.size(2) == dk && hv % hk == 0, "state must be [slots, hv, dk, dv] with hv a multiple of hk");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == 2 * hk * dk + hv * dv, "qkv must be [rows, 2*hk*dk + hv*dv]");
  TORCH_CHECK(a.numel() == rows * hv && b.numel() == rows * hv && z.numel() == rows * hv * dv, "a, b, z sizes");
  TORCH_CHECK(a_log.scalar_type() == at::kFloat && dt_bias.scalar_type() == at::kFloat && a_log.numel() == hv &&
                  dt_bias.numel() == hv, "A_log and dt_bias must be float32 [hv]");
  TORCH_CHECK(norm_w.numel() == dv && norm_w.scalar_type() == qkv.scalar_type(), "norm weight must be [dv]");
  for (const auto* t : {&a, &b, &z}) TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "a, b, z in qkv's dtype");
  check_slots(slots, positions, rows, qkv);
  // As engine/kernels/recurrent.py delta_heads_fit: 32 key rows a thread where the block fits, else 16.
  const int rows_per = dk % 32 == 0 && dk / 32 * dv <= 1024 ? 32 : 16;
  const int parts = dk / rows_per;
  TORCH_CHECK(dk % rows_per == 0 && dv % 32 == 0 && parts * dv <= 1024, "head sizes dk ", dk, ", dv ", dv,
              " are not supported by the kernel");
  auto out = torch::empty_like(z).view({rows, hv * dv});
  if (rows == 0) return out;
  const size_t smem = sizeof(float) * (2 * dk + dv + parts * dv);
  const dim3 grid(hv, rows), block(parts * dv);
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t* pos = positions ? positions->data_ptr<int64_t>() : nullptr;
  by_dtype(qkv.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    auto kernel = rows_per == 32 ? gated_delta_step_kernel<T, 32> : gated_delta_step_kernel<T, 16>;
    kernel<<<grid, block, smem, stream>>>(
        reinterpret_cast<const T*>(qkv.data_ptr()), reinterpret_cast<const T*>(a.data_ptr()),
        reinterpret_cast<const T*>(b.data_ptr()), reinterpret_cast<const T*>(z.data_ptr()), a_log.data_ptr<float>(),
        dt_bias.data_ptr<float>(), reinterpret_cast<const T*>(norm_w.data_ptr()), state.data_ptr<float>(),
        slots.data_ptr<int>(), pos, reinterpret_cast<T*>(out.data_ptr()), hk, hv, dk, dv,
        static_cast<float>(q_scale), static_cast<float>(beta_scale), static_cast<float>(norm_eps),
        static_cast<float>(l2_eps));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

torch::Tensor ssd_step(torch::Tensor x, torch::Tensor B, torch::Tensor C, torch::Tensor dt, torch::Tensor dt_bias,
                       torch::Tensor a_log, torch::Tensor D, torch::Tensor state, torch::Tensor slots,
                       c10::optional<torch::Tensor> positions, int64_t groups, double dt_min, double dt_max) {
  const at::cuda::CUDAGuard guard(x.device());
  for (const auto* t : {&x, &B, &C, &dt, &dt_bias, &a_log, &D, &state}) check_rows(*t, "every input", x);
  TORCH_CHECK(state.dim() == 4 && state.scalar_type() == at::kFloat, "state must be float32 [slots, heads, P, N]");
  const int64_t rows = x.size(0), heads = state.size(1), P = state.size(2), N = state.size(3);
  TORCH_CHECK(x.numel() == rows * heads * P && dt.numel() == rows * heads, "x must be [rows, heads*P], dt [rows, heads]");
  TORCH_CHECK(heads % groups == 0 && B.numel() == rows * groups * N && C.numel() == rows * groups * N,
              "B and C must be [rows, groups*N] with heads a multiple of groups");
  for (const auto* t : {&dt_bias, &a_log, &D})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == heads, "dt_bias, A_log, D must be float32 [heads]");
  for (const auto* t : {&B, &C, &dt}) TORCH_CHECK(t->scalar_type() == x.scalar_type(), "B, C, dt in x's dtype");
  check_slots(slots, positions, rows, x);
  auto y = torch::empty({rows, heads * P}, x.options().dtype(at::kFloat));
  if (rows == 0) return y;
  const dim3 grid(heads, rows), block(std::min<int64_t>(256, 32 * P));
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t* pos = positions ? positions->data_ptr<int64_t>() : nullptr;
  by_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ssd_step_kernel<T><<<grid, block, 0, stream>>>(
        reinterpret_cast<const T*>(x.data_ptr()), reinterpret_cast<const T*>(B.data_ptr()),
        reinterpret_cast<const T*>(C.data_ptr()), reinterpret_cast<const T*>(dt.data_ptr()),
        dt_bias.data_ptr<float>(), a_log.data_ptr<float>(), D.data_ptr<float>(), state.data_ptr<float>(),
        slots.data_ptr<int>(), pos, y.data_ptr<float>(), heads, P, N, groups, static_cast<float>(dt_min),
        static_cast<float>(dt_max));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

}  // namespace

void bind_recurrent_step(pybind11::module_& m) {
  m.def("conv_step", &conv_step,
        "causal depthwise convolution of one new token per row, window [slots, C, K-1] shifted in place",
        py::arg("x"), py::arg("window"), py::arg("weight"), py::arg("bias"), py::arg("slots"), py::arg("positions"),
        py::arg("silu"));
  m.def("gated_delta_step", &gated_delta_step,
        "gated delta rule of one token per row (state [slots, hv, dk, dv] in place) + gated RMSNorm",
        py::arg("qkv"), py::arg("a"), py::arg("b"), py::arg("z"), py::arg("a_log"), py::arg("dt_bias"),
        py::arg("norm_weight"), py::arg("state"), py::arg("slots"), py::arg("positions"), py::arg("hk"), py::arg("dk"),
        py::arg("q_scale"), py::arg("beta_scale"), py::arg("norm_eps"), py::arg("l2_eps"));
  m.def("ssd_step", &ssd_step, "Mamba-2 state update of one token per row (state [slots, heads, P, N] in place)",
        py::arg("x"), py::arg("B"), py::arg("C"), py::arg("dt"), py::arg("dt_bias"), py::arg("a_log"), py::arg("D"),
        py::arg("state"), py::arg("slots"), py::arg("positions"), py::arg("groups"), py::arg("dt_min"),
        py::arg("dt_max"));
}

}  // namespace trellis
