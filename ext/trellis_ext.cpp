// Python bindings of the Trellis CUDA extension. Argument checks live here so the kernels can
// assume contiguous tensors of the right dtypes on one device.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <torch/extension.h>

#include <algorithm>
#include <climits>
#include <vector>

#include "trellis_ext.h"

namespace {

constexpr int kMaxRows = 16;

// Input chunks per block of the workspace GEMV (exl3_gemv.cuh gemv_max_chunks): 16 up to 8 rows,
// 8 above (the two-group instances' u_s holds twice the rows in the same static shared memory).
int max_chunks(int m) { return m > 8 ? 8 : 16; }

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return 0;
    case at::kBFloat16: return 1;
    case at::kFloat: return 2;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type(), " (fp16, bf16 or fp32)");
  }
  return -1;
}

int bits_of(const at::Tensor& trellis) {
  TORCH_CHECK(trellis.dim() == 3, "trellis must be 3-D (in/16, out/16, 16K)");
  TORCH_CHECK(trellis.scalar_type() == at::kShort, "trellis must be int16");
  TORCH_CHECK(trellis.is_contiguous(), "trellis must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(trellis.data_ptr()) % 16 == 0, "trellis must be 16-byte aligned");
  const int64_t words = trellis.size(2);
  TORCH_CHECK(words % 16 == 0 && words / 16 >= 1 && words / 16 <= 8, "trellis last dim must be 16*K, K in 1..8");
  TORCH_CHECK(trellis.size(1) % 8 == 0, "out must be a multiple of 128");
  TORCH_CHECK(trellis.size(0) % 8 == 0, "in must be a multiple of 128");
  return static_cast<int>(words / 16);
}

void check_vec(const at::Tensor& v, int64_t n, const char* name) {
  TORCH_CHECK(v.is_cuda() && v.scalar_type() == at::kHalf && v.is_contiguous() && v.dim() == 1 && v.size(0) == n,
              name, " must be a contiguous fp16 CUDA vector of length ", n);
}

int dispatch(int codebook, int K, const trellis::GemvArgs& a, cudaStream_t stream, bool query) {
  int bps = 0;
  int* q = query ? &bps : nullptr;
  if (codebook == 0) trellis::gemv_dispatch_3inst(K, a, stream, q);
  else if (codebook == 1) trellis::gemv_dispatch_mcg(K, a, stream, q);
  else trellis::gemv_dispatch_mul1(K, a, stream, q);
  return bps;
}

// Split-K count: one full wave of blocks, at least enough splits for the shared-memory bound,
// and few enough that the last block's sum over splits * m partial rows stays short.
int choose_splits(int in, int out, int m, int blocks_per_sm, int sms) {
  const int n_chunks = in / 128;
  const int groups = out / 128;
  const int min_splits = (n_chunks + max_chunks(m) - 1) / max_chunks(m);
  int splits = std::max(1, (blocks_per_sm * sms) / std::max(groups, 1));
  splits = std::min({splits, n_chunks, std::max(1, std::min(16, 64 / m))});
  return std::max(splits, min_splits);
}

// y = had(had(x * suh) @ Q) * svh for m <= 16 rows (the workspace split-K GEMV). Returns the
// number of splits used.
int64_t exl3_gemv(const at::Tensor& x, const at::Tensor& trellis, const at::Tensor& suh, const at::Tensor& svh,
                  at::Tensor& y, at::Tensor& partial, at::Tensor& counters, int64_t codebook, int64_t splits) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-D CUDA tensor");
  const int K = bits_of(trellis);
  const int in = static_cast<int>(trellis.size(0) * 16), out = static_cast<int>(trellis.size(1) * 16);
  const int m = static_cast<int>(x.size(0));
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "exl3_gemv takes 1..", kMaxRows, " rows, got ", m);
  TORCH_CHECK(x.size(1) == in, "x has ", x.size(1), " features, trellis expects ", in);
  TORCH_CHECK(codebook >= 0 && codebook <= 2, "codebook must be 0 (3inst), 1 (mcg) or 2 (mul1)");
  check_vec(suh, in, "suh");
  check_vec(svh, out, "svh");
  TORCH_CHECK(y.is_cuda() && y.is_contiguous() && y.scalar_type() == x.scalar_type() && y.dim() == 2 &&
                  y.size(0) == m && y.size(1) == out,
              "y must be a contiguous (m, out) tensor of x's dtype");
  TORCH_CHECK(trellis.device() == x.device() && y.device() == x.device(), "tensors on different devices");
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  trellis::GemvArgs a{};
  a.x = x.data_ptr();
  a.trellis = reinterpret_cast<const uint32_t*>(trellis.data_ptr());
  a.suh = suh.data_ptr();
  a.svh = svh.data_ptr();
  a.y = y.data_ptr();
  a.m = m;
  a.in = in;
  a.out = out;
  a.x_dtype = dtype_code(x);
  const int n_chunks = in / 128;
  const int min_splits = (n_chunks + max_chunks(m) - 1) / max_chunks(m);
  if (splits <= 0) {
    const int bps = dispatch(static_cast<int>(codebook), K, a, stream, true);
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.get_device()));
    splits = choose_splits(in, out, m, bps, sms);
  }
  TORCH_CHECK(splits >= min_splits && splits <= n_chunks, "splits must be in [", min_splits, ", ", n_chunks, "]");
  a.splits = static_cast<int>(splits);
  if (splits > 1) {
    TORCH_CHECK(partial.is_cuda() && partial.scalar_type() == at::kFloat && partial.is_contiguous() &&
                    partial.numel() >= splits * m * out,
                "workspace too small: need ", splits * m * out, " floats");
    TORCH_CHECK(counters.is_cuda() && counters.scalar_type() == at::kInt && counters.numel() >= out / 128,
                "counter buffer too small");
    a.partial = partial.data_ptr<float>();
    a.counters = counters.data_ptr<int>();
  }
  dispatch(static_cast<int>(codebook), K, a, stream, false);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return splits;
}

int multi_dispatch(int codebook, const trellis::GemvMultiArgs& a, int blocks, cudaStream_t stream, bool query) {
  int bps = 0;
  int* q = query ? &bps : nullptr;
  if (codebook == 0) trellis::gemv_multi_dispatch_3inst(a, blocks, stream, q);
  else if (codebook == 1) trellis::gemv_multi_dispatch_mcg(a, blocks, stream, q);
  else trellis::gemv_multi_dispatch_mul1(a, blocks, stream, q);
  return bps;
}

// One split count for all matrices of a multi launch. Separate launches each fill a wave; one
// launch of several matrices should fill whole waves together, so pick the count that minimises
// (waves of blocks) x (input chunks per block + a fixed per-block cost of ~2 chunks: input
// rotation, split sum, output rotation). The fixed cost is an estimate, not a measurement.
int choose_multi_splits(int in, int total_groups, int m, int blocks_per_sm, int sms) {
  const int n_chunks = in / 128;
  const int min_splits = (n_chunks + max_chunks(m) - 1) / max_chunks(m);
  const int max_splits = std::max(min_splits, std::min({n_chunks, 16, std::max(1, 64 / m)}));
  const long long slots = std::max(1, blocks_per_sm * sms);
  int best = min_splits;
  long long best_cost = LLONG_MAX;
  for (int sp = min_splits; sp <= max_splits; ++sp) {
    const long long waves = ((long long)total_groups * sp + slots - 1) / slots;
    const long long cost = waves * ((n_chunks + sp - 1) / sp + 2);
    if (cost < best_cost) best_cost = cost, best = sp;
  }
  return best;
}

// y[i] = had(had(x * suh[i]) @ Q[i]) * svh[i] for up to 3 matrices of the same in features and
// codebook, in one launch. Workspace: matrix i uses partial[off_i : off_i + splits*m*out_i] and
// counters[c_i : c_i + out_i/128] (prefix sums). Returns the (common) split count.
int64_t exl3_gemv_multi(const at::Tensor& x, const std::vector<at::Tensor>& trellis,
                        const std::vector<at::Tensor>& suh, const std::vector<at::Tensor>& svh,
                        const std::vector<at::Tensor>& y, at::Tensor& partial, at::Tensor& counters,
                        int64_t codebook, int64_t splits) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-D CUDA tensor");
  const int count = static_cast<int>(trellis.size());
  TORCH_CHECK(count >= 1 && count <= trellis::kGemvMaxMats, "exl3_gemv_multi takes 1..", trellis::kGemvMaxMats,
              " matrices, got ", count);
  TORCH_CHECK(suh.size() == trellis.size() && svh.size() == trellis.size() && y.size() == trellis.size(),
              "trellis, suh, svh and y lists must have the same length");
  TORCH_CHECK(codebook >= 0 && codebook <= 2, "codebook must be 0 (3inst), 1 (mcg) or 2 (mul1)");
  const int m = static_cast<int>(x.size(0));
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "exl3_gemv_multi takes 1..", kMaxRows, " rows, got ", m);
  const int in = static_cast<int>(x.size(1));
  TORCH_CHECK(in % 128 == 0, "in features must be a multiple of 128");
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  trellis::GemvMultiArgs a{};
  a.count = count;
  int total_groups = 0;
  for (int i = 0; i < count; ++i) {
    a.K[i] = bits_of(trellis[i]);
    TORCH_CHECK(trellis[i].size(0) * 16 == in, "matrix ", i, " has ", trellis[i].size(0) * 16,
                " in features, x has ", in);
    const int out = static_cast<int>(trellis[i].size(1) * 16);
    check_vec(suh[i], in, "suh");
    check_vec(svh[i], out, "svh");
    TORCH_CHECK(y[i].is_cuda() && y[i].is_contiguous() && y[i].scalar_type() == x.scalar_type() &&
                    y[i].dim() == 2 && y[i].size(0) == m && y[i].size(1) == out,
                "y[", i, "] must be a contiguous (m, out) tensor of x's dtype");
    TORCH_CHECK(trellis[i].device() == x.device() && y[i].device() == x.device() &&
                    suh[i].device() == x.device() && svh[i].device() == x.device(),
                "tensors on different devices");
    trellis::GemvArgs& g = a.mat[i];
    g.x = x.data_ptr();
    g.trellis = reinterpret_cast<const uint32_t*>(trellis[i].data_ptr());
    g.suh = suh[i].data_ptr();
    g.svh = svh[i].data_ptr();
    g.y = y[i].data_ptr();
    g.m = m;
    g.in = in;
    g.out = out;
    g.x_dtype = dtype_code(x);
    total_groups += out / 128;
  }
  const int n_chunks = in / 128;
  const int min_splits = (n_chunks + max_chunks(m) - 1) / max_chunks(m);
  if (splits <= 0) {
    const int bps = multi_dispatch(static_cast<int>(codebook), a, 0, stream, true);
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.get_device()));
    splits = choose_multi_splits(in, total_groups, m, bps, sms);
  }
  TORCH_CHECK(splits >= min_splits && splits <= n_chunks, "splits must be in [", min_splits, ", ", n_chunks, "]");
  const int sp = static_cast<int>(splits);
  // Matrix i's workspace regions start at the prefix sums of the others' sizes.
  long long floats = 0, float_off[trellis::kGemvMaxMats] = {0, 0, 0};
  int ctr = 0, ctr_off[trellis::kGemvMaxMats] = {0, 0, 0};
  int blocks = 0;
  for (int i = 0; i < trellis::kGemvMaxMats; ++i) a.begin[i] = INT_MAX;
  for (int i = 0; i < count; ++i) {
    const int out = a.mat[i].out;
    a.mat[i].splits = sp;
    a.begin[i] = blocks;
    blocks += (out / 128) * sp;
    float_off[i] = floats;
    ctr_off[i] = ctr;
    floats += (long long)sp * m * out;
    ctr += out / 128;
  }
  if (sp > 1) {
    TORCH_CHECK(partial.is_cuda() && partial.scalar_type() == at::kFloat && partial.is_contiguous() &&
                    partial.numel() >= floats && partial.device() == x.device(),
                "workspace too small: need ", floats, " floats");
    TORCH_CHECK(counters.is_cuda() && counters.scalar_type() == at::kInt && counters.is_contiguous() &&
                    counters.numel() >= ctr && counters.device() == x.device(),
                "counter buffer too small: need ", ctr);
    for (int i = 0; i < count; ++i) {
      a.mat[i].partial = partial.data_ptr<float>() + float_off[i];
      a.mat[i].counters = counters.data_ptr<int>() + ctr_off[i];
    }
  }
  multi_dispatch(static_cast<int>(codebook), a, blocks, stream, false);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return splits;
}

}  // namespace

int trellis::gemv_multi_splits(int in, int total_groups, int m, int blocks_per_sm, int sms) {
  return choose_multi_splits(in, total_groups, m, blocks_per_sm, sms);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Trellis Chat CUDA kernels: EXL3 GEMVs and whole weights, paged attention, fused ops, sampling";
  m.def("exl3_gemv", &exl3_gemv,
        "EXL3 GEMV (1..16 rows, workspace split-K) with fused Hadamards; returns the split count", py::arg("x"),
        py::arg("trellis"), py::arg("suh"), py::arg("svh"), py::arg("y"), py::arg("partial"), py::arg("counters"),
        py::arg("codebook"), py::arg("splits") = 0);
  m.def("exl3_gemv_multi", &exl3_gemv_multi,
        "up to 3 EXL3 GEMVs of one input (same in features and codebook) in one launch; returns the split count",
        py::arg("x"), py::arg("trellis"), py::arg("suh"), py::arg("svh"), py::arg("y"), py::arg("partial"),
        py::arg("counters"), py::arg("codebook"), py::arg("splits") = 0);
  // Each further kernel family registers its own bindings (one file each, see trellis_ext.h).
  trellis::bind_paged_attention(m);
  trellis::bind_viterbi(m);
  trellis::bind_fused_ops(m);
  trellis::bind_recurrent_step(m);
  trellis::bind_recurrent_scan(m);
  trellis::bind_gemv_cluster(m);
  trellis::bind_quantized_cache_read(m);
  trellis::bind_exl3_weight(m);
  trellis::bind_sampling(m);
  trellis::bind_argmax(m);
  trellis::bind_expert_gemv(m);
  trellis::bind_moe_route(m);
  m.attr("ABI_VERSION") = 3;
}
