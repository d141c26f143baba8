// The cluster split-K GEMV (exl3_gemv_cluster.cuh): instantiations, the split (= cluster size)
// choice and the binding. One entry point for one to three matrices of one input; engine/kernels/
// gemv.py runs it wherever the GPU has clusters (sm_90+), the workspace GEMV elsewhere.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "exl3_gemv_cluster.cuh"
#include "trellis_ext.h"

namespace trellis {
namespace {

// rg: the kernel's column groups (gemv_row_groups of the launch's rows).
int cluster_call(int codebook, bool int8, int rg, int mode, const GemvMultiArgs* a, int blocks, int splits, int smem,
                 cudaStream_t stream, bool pdl = false) {
  if (codebook == CB_3INST)
    return gemv_cluster_dispatch<CB_3INST>(int8, rg, mode, a, blocks, splits, smem, stream, pdl);
  if (codebook == CB_MCG) return gemv_cluster_dispatch<CB_MCG>(int8, rg, mode, a, blocks, splits, smem, stream, pdl);
  return gemv_cluster_dispatch<CB_MUL1>(int8, rg, mode, a, blocks, splits, smem, stream, pdl);
}

// The q/k/v epilogue's arguments (see GemvRopeEpilogue), checked; false when none was asked for.
bool set_epilogue(GemvMultiArgs& a, const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& caches,
                  const std::vector<bool>& rope, const c10::optional<at::Tensor>& cos,
                  const c10::optional<at::Tensor>& sin, const c10::optional<at::Tensor>& slots, int64_t head_dim) {
  bool any = false;
  for (bool r : rope) any = any || r;
  for (const auto& c : caches) any = any || c.has_value();
  if (!any) return false;
  const int count = a.count, m = a.mat[0].m;
  TORCH_CHECK(static_cast<int>(caches.size()) == count && static_cast<int>(rope.size()) == count,
              "caches and rope need one entry per matrix");
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, "the epilogue takes fp16 or bf16");
  GemvRopeEpilogue& e = a.epi;
  for (int i = 0; i < count; ++i) {
    e.rope[i] = rope[i] ? 1 : 0;
    if (!caches[i].has_value()) continue;
    const at::Tensor& c = *caches[i];
    TORCH_CHECK(c.is_cuda() && c.is_contiguous() && c.scalar_type() == x.scalar_type() && c.device() == x.device() &&
                    c.dim() == 3 && c.size(1) * c.size(2) == a.mat[i].out,
                "cache ", i, " must be a contiguous [slots, heads, head_dim] tensor of x's dtype, ", a.mat[i].out,
                " numbers a row");
    e.cache[i] = c.data_ptr();
    e.num_slots = c.size(0);
  }
  for (int i = 0; i < count; ++i) {
    TORCH_CHECK(!caches[i].has_value() || caches[i]->size(0) == e.num_slots, "the caches must have one row count");
  }
  if (e.num_slots > 0) {
    TORCH_CHECK(slots.has_value() && slots->is_cuda() && slots->scalar_type() == at::kLong && slots->is_contiguous() &&
                    slots->numel() == m && slots->device() == x.device(),
                "slots must be a contiguous int64 CUDA vector, one per row");
    e.slots = slots->data_ptr<int64_t>();
  }
  bool rotates = false;
  for (int i = 0; i < count; ++i) rotates = rotates || e.rope[i];
  if (rotates) {
    TORCH_CHECK(head_dim == 64 || head_dim == 128, "the RoPE epilogue takes head_dim 64 or 128, got ", head_dim);
    for (const c10::optional<at::Tensor>* t : {&cos, &sin}) {
      TORCH_CHECK(t->has_value() && (*t)->is_cuda() && (*t)->is_contiguous() && (*t)->scalar_type() == x.scalar_type() &&
                      (*t)->numel() == m * head_dim && (*t)->device() == x.device(),
                  "cos and sin must be contiguous [rows, head_dim] tensors of x's dtype");
    }
    e.cos = cos->data_ptr();
    e.sin = sin->data_ptr();
    e.head_dim = static_cast<int>(head_dim);
  }
  e.on = 1;
  return true;
}

// Occupancy answers depend only on (kernel, smem, cluster size): cached (host-side queries).
int cluster_query(int codebook, bool int8, int rg, int mode, int splits, int smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int, int, int, int>, int> cache;
  const auto key = std::make_tuple(codebook, int8 ? 1 : 0, rg, mode, splits, smem);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const int v = cluster_call(codebook, int8, rg, mode, nullptr, 0, splits, smem, nullptr);
  cache[key] = v;
  return v;
}

// ring: the largest cp.async ring among the launch's matrices (not monotonic in K: K=6 > K=7).
int cluster_smem(int ring, int m, int n_chunks, int splits) {
  return cluster_u_bytes(n_chunks, splits, m) + std::max(ring, cluster_red_bytes(m));
}

bool cluster_size_ok(int codebook, bool int8, int rg, int splits, int smem) {
  return splits <= 8 || cluster_query(codebook, int8, rg, 2, splits, smem) > 0;
}

// Splits = cluster size. As the workspace GEMV's multi launch: minimise (waves) x (input chunks per block + ~2
// chunks of fixed cost), over the cluster sizes this kernel can launch. A wave is as many
// clusters as the GPU holds at once (a cluster lives in one GPC, so blocks per SM x SMs / S can
// overestimate it); where that query answers nothing, the slot count for S <= 8.
int cluster_choose_splits(int codebook, bool int8, int ring, int m, int n_chunks, int total_groups, int sms) {
  const int min_s = (n_chunks + kGemvMaxChunks - 1) / kGemvMaxChunks;
  const int max_s = std::min(n_chunks, kClusterMaxSize);
  const int rg = gemv_row_groups(m);
  int best = -1;
  long long best_cost = LLONG_MAX;
  for (int sp = min_s; sp <= max_s; ++sp) {
    const int smem = cluster_smem(ring, m, n_chunks, sp);
    long long clusters = cluster_query(codebook, int8, rg, 2, sp, smem);  // co-resident clusters of sp blocks
    if (clusters <= 0) {
      if (sp > 8) continue;  // not launchable here
      clusters = std::max(1LL, std::max(1, cluster_query(codebook, int8, rg, 1, sp, smem)) * (long long)sms / sp);
    }
    const long long waves = (total_groups + clusters - 1) / clusters;
    const long long cost = waves * ((n_chunks + sp - 1) / sp + 2);
    if (cost < best_cost) best_cost = cost, best = sp;
  }
  return best;
}

int bits_of(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == at::kShort && t.is_contiguous(),
              "trellis must be a contiguous 3-D int16 tensor (in/16, out/16, 16K)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "trellis must be 16-byte aligned");
  const int64_t words = t.size(2);
  TORCH_CHECK(words % 16 == 0 && words / 16 >= 1 && words / 16 <= 8, "trellis last dim must be 16*K, K in 1..8");
  TORCH_CHECK(t.size(1) % 8 == 0 && t.size(0) % 8 == 0, "in and out must be multiples of 128");
  return static_cast<int>(words / 16);
}

int dtype_code(const at::Tensor& t) {
  if (t.scalar_type() == at::kHalf) return DT_F16;
  if (t.scalar_type() == at::kBFloat16) return DT_BF16;
  TORCH_CHECK(t.scalar_type() == at::kFloat, "unsupported dtype ", t.scalar_type(), " (fp16, bf16 or fp32)");
  return DT_F32;
}

// y[i] = had(had(x * suh[i]) @ Q[i]) * svh[i], 1..3 matrices of the same in features and
// codebook, 1..16 rows, one launch. splits <= 0: the launch's choice. A chained launch while
// chained launches are on (chained_launch.cuh). int8: the integer-MMA variant (MUL1,
// <= kClusterInt8MaxRows rows). Returns the split count.
int64_t exl3_gemv_cluster(const at::Tensor& x, const std::vector<at::Tensor>& trellis,
                          const std::vector<at::Tensor>& suh, const std::vector<at::Tensor>& svh,
                          const std::vector<at::Tensor>& y, int64_t codebook, int64_t splits, bool int8,
                          const std::vector<c10::optional<at::Tensor>>& caches, const std::vector<bool>& rope,
                          const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
                          const c10::optional<at::Tensor>& slots, int64_t head_dim) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-D CUDA tensor");
  const int count = static_cast<int>(trellis.size());
  TORCH_CHECK(count >= 1 && count <= kGemvMaxMats, "exl3_gemv_cluster takes 1..", kGemvMaxMats, " matrices");
  TORCH_CHECK(suh.size() == trellis.size() && svh.size() == trellis.size() && y.size() == trellis.size(),
              "trellis, suh, svh and y lists must have the same length");
  TORCH_CHECK(codebook >= 0 && codebook <= 2, "codebook must be 0 (3inst), 1 (mcg) or 2 (mul1)");
  const int m = static_cast<int>(x.size(0));
  TORCH_CHECK(m >= 1 && m <= kGemvWideRows, "exl3_gemv_cluster takes 1..", kGemvWideRows, " rows, got ", m);
  TORCH_CHECK(!int8 || (codebook == CB_MUL1 && m <= kClusterInt8MaxRows),
              "the int8 GEMV takes the MUL1 codebook and 1..", kClusterInt8MaxRows, " rows");
  const int in = static_cast<int>(x.size(1));
  TORCH_CHECK(in % 128 == 0 && in > 0, "in features must be a positive multiple of 128");
  const c10::cuda::CUDAGuard guard(x.device());
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, x.get_device()));
  TORCH_CHECK(major >= 9, "exl3_gemv_cluster needs sm_90 or newer (thread-block clusters)");
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  GemvMultiArgs a{};
  a.count = count;
  int total_groups = 0, ring = 0;
  for (int i = 0; i < count; ++i) {
    a.K[i] = bits_of(trellis[i]);
    ring = std::max(ring, gemv_smem_bytes(a.K[i]));
    TORCH_CHECK(trellis[i].size(0) * 16 == in, "matrix ", i, " has ", trellis[i].size(0) * 16,
                " in features, x has ", in);
    const int out = static_cast<int>(trellis[i].size(1) * 16);
    for (const at::Tensor* v : {&suh[i], &svh[i]}) {
      const int64_t n = v == &suh[i] ? in : out;
      TORCH_CHECK(v->is_cuda() && v->scalar_type() == at::kHalf && v->is_contiguous() && v->dim() == 1 &&
                      v->size(0) == n && v->device() == x.device(),
                  "suh/svh must be contiguous fp16 vectors of length in/out on x's device");
    }
    const bool to_cache = i < static_cast<int>(caches.size()) && caches[i].has_value();  // then y[i] is unused
    TORCH_CHECK(to_cache || (y[i].is_cuda() && y[i].is_contiguous() && y[i].scalar_type() == x.scalar_type() &&
                             y[i].dim() == 2 && y[i].size(0) == m && y[i].size(1) == out && y[i].device() == x.device()),
                "y[", i, "] must be a contiguous (m, out) tensor of x's dtype");
    TORCH_CHECK(trellis[i].device() == x.device(), "tensors on different devices");
    GemvArgs& g = a.mat[i];
    g.x = x.data_ptr();
    g.trellis = reinterpret_cast<const uint32_t*>(trellis[i].data_ptr());
    g.suh = suh[i].data_ptr();
    g.svh = svh[i].data_ptr();
    g.y = to_cache ? nullptr : y[i].data_ptr();
    g.m = m;
    g.in = in;
    g.out = out;
    g.x_dtype = dtype_code(x);
    total_groups += out / 128;
  }
  const int n_chunks = in / 128;
  const int cb = static_cast<int>(codebook);
  const int min_s = (n_chunks + kGemvMaxChunks - 1) / kGemvMaxChunks;
  if (splits <= 0) {
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.get_device()));
    splits = cluster_choose_splits(cb, int8, ring, m, n_chunks, total_groups, sms);
    TORCH_CHECK(splits > 0, "exl3_gemv_cluster: no launchable cluster size for ", n_chunks, " input chunks");
  }
  TORCH_CHECK(splits >= min_s && splits <= std::min(n_chunks, kClusterMaxSize), "splits must be in [", min_s, ", ",
              std::min(n_chunks, kClusterMaxSize), "]");
  const int sp = static_cast<int>(splits);
  const int smem = cluster_smem(ring, m, n_chunks, sp);
  const int rg = gemv_row_groups(m);
  TORCH_CHECK(cluster_size_ok(cb, int8, rg, sp, smem), "clusters of ", sp, " blocks cannot be launched here");
  int blocks = 0;
  for (int i = 0; i < kGemvMaxMats; ++i) a.begin[i] = INT_MAX;
  for (int i = 0; i < count; ++i) {
    a.mat[i].splits = sp;
    a.begin[i] = blocks;
    blocks += (a.mat[i].out / 128) * sp;
  }
  const bool epi = set_epilogue(a, x, caches, rope, cos, sin, slots, head_dim);
  TORCH_CHECK(!epi || int8, "the q/k/v epilogue runs with the int8 GEMV only");
  const cudaError_t err =
      static_cast<cudaError_t>(cluster_call(cb, int8, rg, 0, &a, blocks, sp, smem, stream, chained_launch_enabled()));
  TORCH_CHECK(err == cudaSuccess, "exl3_gemv_cluster launch (", blocks, " blocks, clusters of ", sp, ", ", smem,
              " B shared): ", cudaGetErrorString(err));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return splits;
}

}  // namespace

void bind_gemv_cluster(pybind11::module_& m) {
  m.def("exl3_gemv_cluster", &exl3_gemv_cluster,
        "EXL3 GEMV (sm_90+, split-K over a thread-block cluster) of 1..3 matrices of one input, 1..16 rows; "
        "returns the split count",
        py::arg("x"), py::arg("trellis"), py::arg("suh"), py::arg("svh"), py::arg("y"), py::arg("codebook"),
        py::arg("splits") = 0, py::arg("int8") = false,
        // The decode step's q/k/v epilogue (int8 only; trellis_ext.h GemvRopeEpilogue): per matrix
        // a KV cache to store into instead of y, and whether to rotate by RoPE with cos/sin.
        py::arg("caches") = std::vector<c10::optional<at::Tensor>>{}, py::arg("rope") = std::vector<bool>{},
        py::arg("cos") = c10::nullopt, py::arg("sin") = c10::nullopt, py::arg("slots") = c10::nullopt,
        py::arg("head_dim") = 0);
  m.def(
      "set_chained_launches",
      [](bool on) { return chained_launch_flag().exchange(on); },
      "turn chained launches (programmatic dependent launch, sm_90+) of the decode-step kernels on or "
      "off for the process; returns the previous setting",
      py::arg("on"));
}

}  // namespace trellis
