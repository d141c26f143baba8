// Python bindings of the Trellis CUDA extension. Argument checks live here so the kernels can
// assume contiguous tensors of the right dtypes on one device.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <torch/extension.h>

#include <algorithm>

#include "trellis_ext.h"

namespace {

constexpr int kMaxRows = 8;
constexpr int kMaxChunks = 16;

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

int dispatch(int codebook, int K, bool fast, const trellis::GemvArgs& a, cudaStream_t stream, bool query) {
  int bps = 0;
  int* q = query ? &bps : nullptr;
  if (codebook == 0) trellis::gemv_dispatch_3inst(K, fast, a, stream, q);
  else if (codebook == 1) trellis::gemv_dispatch_mcg(K, fast, a, stream, q);
  else trellis::gemv_dispatch_mul1(K, fast, a, stream, q);
  return bps;
}

// Split-K count: one full wave of blocks, at least enough splits for the shared-memory bound,
// and few enough that the last block's sum over splits * m partial rows stays short.
int choose_splits(int in, int out, int m, int blocks_per_sm, int sms) {
  const int n_chunks = in / 128;
  const int groups = out / 128;
  const int min_splits = (n_chunks + kMaxChunks - 1) / kMaxChunks;
  int splits = std::max(1, (blocks_per_sm * sms) / std::max(groups, 1));
  splits = std::min({splits, n_chunks, std::max(1, std::min(16, 64 / m))});
  return std::max(splits, min_splits);
}

// y = had(had(x * suh) @ Q) * svh for m <= 8 rows. Returns the number of splits used.
int64_t exl3_gemv(const at::Tensor& x, const at::Tensor& trellis, const at::Tensor& suh, const at::Tensor& svh,
                  at::Tensor& y, at::Tensor& partial, at::Tensor& counters, int64_t codebook, int64_t splits,
                  bool fast) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-D CUDA tensor");
  const int K = bits_of(trellis);
  const int in = static_cast<int>(trellis.size(0) * 16), out = static_cast<int>(trellis.size(1) * 16);
  const int m = static_cast<int>(x.size(0));
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "exl3_gemv takes 1..8 rows, got ", m);
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
  const int min_splits = (n_chunks + kMaxChunks - 1) / kMaxChunks;
  if (splits <= 0) {
    const int bps = dispatch(static_cast<int>(codebook), K, fast, a, stream, true);
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
  dispatch(static_cast<int>(codebook), K, fast, a, stream, false);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return splits;
}

at::Tensor exl3_reconstruct(const at::Tensor& trellis, int64_t codebook) {
  TORCH_CHECK(trellis.is_cuda(), "trellis must be a CUDA tensor");
  const int K = bits_of(trellis);
  TORCH_CHECK(codebook >= 0 && codebook <= 2, "codebook must be 0 (3inst), 1 (mcg) or 2 (mul1)");
  const int in = static_cast<int>(trellis.size(0) * 16), out = static_cast<int>(trellis.size(1) * 16);
  const c10::cuda::CUDAGuard guard(trellis.device());
  at::Tensor q = at::empty({in, out}, trellis.options().dtype(at::kHalf));
  trellis::launch_reconstruct(reinterpret_cast<const uint32_t*>(trellis.data_ptr()), q.data_ptr(), in, out, K,
                              static_cast<int>(codebook), c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return q;
}

at::Tensor hadamard128(const at::Tensor& x, const c10::optional<at::Tensor>& pre,
                       const c10::optional<at::Tensor>& post, at::ScalarType out_dtype) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() >= 1, "x must be a contiguous CUDA tensor");
  const int64_t n = x.size(-1);
  TORCH_CHECK(n % 128 == 0, "last dim must be a multiple of 128, got ", n);
  if (pre) check_vec(*pre, n, "pre");
  if (post) check_vec(*post, n, "post");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_dtype));
  trellis::launch_hadamard(x.data_ptr(), dtype_code(x), y.data_ptr(), dtype_code(y),
                           pre ? pre->data_ptr() : nullptr, post ? post->data_ptr() : nullptr, x.numel() / n,
                           static_cast<int>(n), c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Trellis Chat CUDA kernels: EXL3 GEMV/reconstruct, blockwise Hadamard";
  m.def("exl3_gemv", &exl3_gemv, "EXL3 GEMV (1..8 rows) with fused Hadamards; returns the split count",
        py::arg("x"), py::arg("trellis"), py::arg("suh"), py::arg("svh"), py::arg("y"), py::arg("partial"),
        py::arg("counters"), py::arg("codebook"), py::arg("splits") = 0, py::arg("fast") = false);
  m.def("exl3_reconstruct", &exl3_reconstruct, "decode Q (in, out) fp16 from a trellis", py::arg("trellis"),
        py::arg("codebook"));
  m.def("hadamard128", &hadamard128, "y = had128(x * pre) * post, blockwise along the last dim", py::arg("x"),
        py::arg("pre") = py::none(), py::arg("post") = py::none(), py::arg("out_dtype"));
  // Each further kernel family registers its own bindings (one file each, see trellis_ext.h).
  trellis::bind_paged_attention(m);
  trellis::bind_viterbi(m);
  trellis::bind_fused_ops(m);
  m.attr("ABI_VERSION") = 2;
}
