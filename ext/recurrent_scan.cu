// Prefill scans of the recurrent mixers: the gated delta rule and Mamba-2's state update over all
// the tokens of one sequence, one launch per layer, the state kept in registers from the first
// token to the last.
//
// Why a sequential scan and not the chunked form: in torch the chunked form is hundreds of small
// batched products and triangular solves per layer. Both recurrences are independent along one
// axis of their state: column v of the delta net's S [dk, dv] and row p of Mamba-2's S [P, N] each
// evolve on their own, reading only the token's shared vectors (k and q; B and C). So each thread
// owns a quarter of one column (row), four neighbouring lanes reduce their dot products with two
// shuffles, and a token costs a few hundred register operations. The tokens' vectors come in tiles
// of kTile tokens, copied to shared memory asynchronously (cp.async) while the tile before is
// computed: a global load's latency (~1 us) is paid once per tile, not once per token.
//
// Inputs are float32 and contiguous (engine/kernels/recurrent.py makes them so); the state in and
// out are [heads, rows, cols] float32 (they may be the same tensor).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_pipeline.h>
#include <torch/extension.h>

#include "trellis_ext.h"

namespace trellis {
namespace {

constexpr int kParts = 4;      // threads per state column (row)
constexpr int kCols = 32;      // state columns (rows) per block
constexpr int kThreads = kParts * kCols;

// A shared vector of n = kParts * E floats, stored with one pad after each part's E values so that
// the four parts of a column, reading their r-th values at once, hit four different banks.
template <int E>
__device__ __forceinline__ int padded(int i) { return i + i / E; }

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// The block's per-token inputs: two vectors of D values (padded), kCols per-column values and two
// scalars; token t's are at vec0 + t * stride0 and so on. In shared memory a token takes BUF floats:
// vec0 [kParts * (E + 1)], vec1 [same], the columns' values [kCols], s0, s1.
struct TokenLayout {
  const float* vec0;
  const float* vec1;
  const float* col;
  const float* s0;
  const float* s1;
  long long stride0, stride1, stride_col, stride_s;
  int D;
};

constexpr int kTile = 16;  // tokens per shared-memory tile

template <int E>
__host__ __device__ constexpr int token_floats() { return 2 * kParts * (E + 1) + kCols + 2; }

// Start the asynchronous copy of tokens [first, first + kTile) (those before T) into `tile`.
template <int E>
__device__ __forceinline__ void fetch_tile(const TokenLayout& L, int first, int T, float* tile) {
  constexpr int V = kParts * (E + 1), BUF = token_floats<E>();
  const int per_token = 2 * L.D + kCols + 2, count = min(kTile, T - first) * per_token;
  for (int i = threadIdx.x; i < count; i += kThreads) {
    const int j = i / per_token, e = i - j * per_token;
    const long long t = first + j;
    const float* src;
    int at;
    if (e < L.D) src = L.vec0 + t * L.stride0 + e, at = padded<E>(e);
    else if (e < 2 * L.D) src = L.vec1 + t * L.stride1 + (e - L.D), at = V + padded<E>(e - L.D);
    else if (e < 2 * L.D + kCols) src = L.col + t * L.stride_col + (e - 2 * L.D), at = 2 * V + e - 2 * L.D;
    else src = (e == 2 * L.D + kCols ? L.s0 : L.s1) + t * L.stride_s, at = 2 * V + e - 2 * L.D;
    __pipeline_memcpy_async(tile + j * BUF + at, src, sizeof(float));
  }
  __pipeline_commit();
}

// Runs `token(t, buffer)` for t = 0..T-1 with each token's inputs in shared memory: tile i + 1 is
// in flight while tile i is computed.
template <int E, typename F>
__device__ __forceinline__ void for_each_token(const TokenLayout& L, int T, float* tiles, F&& token) {
  constexpr int BUF = token_floats<E>();
  const int n = (T + kTile - 1) / kTile;
  if (n > 0) fetch_tile<E>(L, 0, T, tiles);
  for (int i = 0; i < n; ++i) {
    float* tile = tiles + (i & 1) * kTile * BUF;
    if (i + 1 < n) {
      fetch_tile<E>(L, (i + 1) * kTile, T, tiles + ((i + 1) & 1) * kTile * BUF);
      __pipeline_wait_prior(1);  // all but the newest copy: tile i's
    } else {
      __pipeline_wait_prior(0);
    }
    __syncthreads();  // every thread's copies of tile i have landed
    const int first = i * kTile, count = min(kTile, T - first);
    for (int j = 0; j < count; ++j) token(first + j, tile + j * BUF);
    __syncthreads();  // tile i is read before tile i + 2's copy reuses its buffer
  }
}

// ---- gated delta rule -------------------------------------------------------------------------
// Block (value head h, columns [c0, c0 + kCols)); per token t, with vectors k_t and q_t (d_k = 4E,
// normalised, q scaled), the column's value v_t[c], g_t (log decay) and beta_t:
//   S <- S * exp(g);  u = S^T k;  S <- S + k (beta (v - u))^T;  o = S^T q.
template <int E>
__global__ void __launch_bounds__(kThreads) gated_delta_scan_kernel(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const float* __restrict__ beta, const float* __restrict__ state_in,
    float* __restrict__ state_out, float* __restrict__ out, int T, int heads, int dv) {
  constexpr int V = kParts * (E + 1);
  __shared__ __align__(16) float tiles[2 * kTile * token_floats<E>()];
  const int h = blockIdx.x, c0 = blockIdx.y * kCols;
  const int c = threadIdx.x / kParts, part = threadIdx.x % kParts, col = c0 + c;
  const int dk = kParts * E;
  const TokenLayout L{k + (long long)h * dk, q + (long long)h * dk, v + (long long)h * dv + c0, g + h, beta + h,
                      (long long)heads * dk, (long long)heads * dk, (long long)heads * dv, heads, dk};
  float s[E];
  const float* S = state_in + ((long long)h * dk + part * E) * dv + col;
#pragma unroll
  for (int r = 0; r < E; ++r) s[r] = S[(long long)r * dv];
  for_each_token<E>(L, T, tiles, [&](int t, const float* ks) {
    const float* qs = ks + V;
    const float decay = expf(ks[2 * V + kCols]), b = ks[2 * V + kCols + 1];
    float u = 0.f;
#pragma unroll
    for (int r = 0; r < E; ++r) {
      s[r] *= decay;
      u += s[r] * ks[part * (E + 1) + r];
    }
    const float delta = (ks[2 * V + c] - quad_sum(u)) * b;
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < E; ++r) {
      s[r] += ks[part * (E + 1) + r] * delta;
      o += s[r] * qs[part * (E + 1) + r];
    }
    o = quad_sum(o);
    if (part == 0) out[((long long)t * heads + h) * dv + col] = o;
  });
  float* So = state_out + ((long long)h * dk + part * E) * dv + col;
#pragma unroll
  for (int r = 0; r < E; ++r) So[(long long)r * dv] = s[r];
}

// ---- Mamba-2 state update ---------------------------------------------------------------------
// Block (head h, rows [p0, p0 + kCols)); per token t, with the head's group's B_t and C_t (N = 4E),
// the row's input x_t[p], dt_t (after softplus and clamp) and A = -exp(A_log):
//   S[p] <- S[p] * exp(dt A) + dt x[p] B;  y[p] = S[p] . C      (no D skip)
template <int E>
__global__ void __launch_bounds__(kThreads) ssd_scan_kernel(
    const float* __restrict__ x, const float* __restrict__ dt, const float* __restrict__ A,
    const float* __restrict__ Bm, const float* __restrict__ Cm, const float* __restrict__ state_in,
    float* __restrict__ state_out, float* __restrict__ y, int T, int heads, int P, int groups) {
  constexpr int V = kParts * (E + 1);
  __shared__ __align__(16) float tiles[2 * kTile * token_floats<E>()];
  const int h = blockIdx.x, p0 = blockIdx.y * kCols;
  const int c = threadIdx.x / kParts, part = threadIdx.x % kParts, p = p0 + c;
  const int N = kParts * E, grp = h / (heads / groups);
  // The second scalar slot repeats dt: the layout has two, the scan needs one.
  const TokenLayout L{Bm + (long long)grp * N, Cm + (long long)grp * N, x + (long long)h * P + p0, dt + h, dt + h,
                      (long long)groups * N, (long long)groups * N, (long long)heads * P, heads, N};
  const float a = A[h];
  float s[E];
  const float* S = state_in + ((long long)h * P + p) * N + part * E;
#pragma unroll
  for (int r = 0; r < E; ++r) s[r] = S[r];
  for_each_token<E>(L, T, tiles, [&](int t, const float* bs) {
    const float* cs = bs + V;
    const float step = bs[2 * V + kCols];
    const float decay = expf(step * a), w = step * bs[2 * V + c];
    float acc = 0.f;
#pragma unroll
    for (int r = 0; r < E; ++r) {
      s[r] = s[r] * decay + w * bs[part * (E + 1) + r];
      acc += s[r] * cs[part * (E + 1) + r];
    }
    acc = quad_sum(acc);
    if (part == 0) y[((long long)t * heads + h) * P + p] = acc;
  });
  float* So = state_out + ((long long)h * P + p) * N + part * E;
#pragma unroll
  for (int r = 0; r < E; ++r) So[r] = s[r];
}

// ---- host side --------------------------------------------------------------------------------

void check_f32(const torch::Tensor& t, const char* name, const torch::Tensor& like) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), name, " must be on the GPU of the input");
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == at::kFloat, name, " must be contiguous float32");
}

// E (state values a thread keeps) for a vector length D: D = 4E with E in {8, 16, 32}.
int elements_for(int64_t D) {
  if (D % kParts) return 0;
  const int64_t e = D / kParts;
  return e == 8 || e == 16 || e == 32 ? static_cast<int>(e) : 0;
}

void gated_delta_scan(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                      torch::Tensor state_in, torch::Tensor state_out, torch::Tensor out) {
  const at::cuda::CUDAGuard guard(q.device());
  for (const auto* t : {&q, &k, &v, &g, &beta, &state_in, &state_out, &out}) check_f32(*t, "every tensor", q);
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes(), "q and k must be [T, heads, dk]");
  const int64_t T = q.size(0), heads = q.size(1), dk = q.size(2);
  TORCH_CHECK(v.dim() == 3 && v.size(0) == T && v.size(1) == heads, "v must be [T, heads, dv]");
  const int64_t dv = v.size(2);
  TORCH_CHECK(g.numel() == T * heads && beta.numel() == T * heads, "g and beta must be [T, heads]");
  for (const auto* t : {&state_in, &state_out})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == heads && t->size(1) == dk && t->size(2) == dv,
                "states must be [heads, dk, dv]");
  TORCH_CHECK(out.sizes() == v.sizes(), "out must be [T, heads, dv]");
  const int e = elements_for(dk);
  TORCH_CHECK(e != 0 && dv % kCols == 0, "head sizes dk ", dk, ", dv ", dv, " are not supported by the scan");
  const dim3 grid(heads, dv / kCols), block(kThreads);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto kernel = e == 32 ? gated_delta_scan_kernel<32> : e == 16 ? gated_delta_scan_kernel<16> : gated_delta_scan_kernel<8>;
  kernel<<<grid, block, 0, stream>>>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                                     g.data_ptr<float>(), beta.data_ptr<float>(), state_in.data_ptr<float>(),
                                     state_out.data_ptr<float>(), out.data_ptr<float>(), T, heads, dv);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void ssd_scan(torch::Tensor x, torch::Tensor dt, torch::Tensor A, torch::Tensor B, torch::Tensor C,
              torch::Tensor state_in, torch::Tensor state_out, torch::Tensor y) {
  const at::cuda::CUDAGuard guard(x.device());
  for (const auto* t : {&x, &dt, &A, &B, &C, &state_in, &state_out, &y}) check_f32(*t, "every tensor", x);
  TORCH_CHECK(x.dim() == 3, "x must be [T, heads, P]");
  const int64_t T = x.size(0), heads = x.size(1), P = x.size(2);
  TORCH_CHECK(B.dim() == 3 && B.size(0) == T && C.sizes() == B.sizes(), "B and C must be [T, groups, N]");
  const int64_t groups = B.size(1), N = B.size(2);
  TORCH_CHECK(heads % groups == 0, "heads must be a multiple of groups");
  TORCH_CHECK(dt.numel() == T * heads && A.numel() == heads, "dt must be [T, heads], A [heads]");
  for (const auto* t : {&state_in, &state_out})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == heads && t->size(1) == P && t->size(2) == N,
                "states must be [heads, P, N]");
  TORCH_CHECK(y.sizes() == x.sizes(), "y must be [T, heads, P]");
  const int e = elements_for(N);
  TORCH_CHECK(e != 0 && P % kCols == 0, "sizes P ", P, ", N ", N, " are not supported by the scan");
  const dim3 grid(heads, P / kCols), block(kThreads);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto kernel = e == 32 ? ssd_scan_kernel<32> : e == 16 ? ssd_scan_kernel<16> : ssd_scan_kernel<8>;
  kernel<<<grid, block, 0, stream>>>(x.data_ptr<float>(), dt.data_ptr<float>(), A.data_ptr<float>(),
                                     B.data_ptr<float>(), C.data_ptr<float>(), state_in.data_ptr<float>(),
                                     state_out.data_ptr<float>(), y.data_ptr<float>(), T, heads, P, groups);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void bind_recurrent_scan(pybind11::module_& m) {
  m.def("gated_delta_scan", &gated_delta_scan,
        "gated delta rule over one sequence's tokens (float32): out [T, heads, dv], state_out [heads, dk, dv]",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("state_in"),
        py::arg("state_out"), py::arg("out"));
  m.def("ssd_scan", &ssd_scan,
        "Mamba-2 state update over one sequence's tokens (float32): y [T, heads, P] without D, state_out [heads, P, N]",
        py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"), py::arg("C"), py::arg("state_in"),
        py::arg("state_out"), py::arg("y"));
}

}  // namespace trellis
