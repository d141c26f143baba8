// The routed experts of a mixture-of-experts layer for a few tokens, with the router's choice read
// on the device: no host sync, fixed launch shapes, so a CUDA graph can replay the layer.
//
// Every expert of a layer has the same shapes and bits per weight, so each projection kind (gate,
// up, down) is one stacked tensor [experts, in/16, out/16, 16K] with a fixed per-expert stride
// (engine/modules/stacked_experts.py). A (token, slot) pair is one row of work: its expert is
// chosen[pair], read on the device by the blocks of that pair, which then run exactly the work of
// one block of the workspace split-K GEMV (exl3_gemv.cuh gemv_block, one input row) on that
// expert's trellis and sign vectors. Only the chosen experts' weights are read.
//
// A layer is four launches (after the router's one, moe_route.cu, which writes `chosen` int64 and
// the weights fp32 as these kernels read them):
//   1. exl3_expert_gemv: gate and up of every pair (one launch, both matrices), fp32 outputs, read
//      from x in its own dtype with the padded input features (in_features up to the next multiple
//      of 128) read as zeros, so no upcast or padded copy of x runs before it;
//   2. exl3_expert_act: the activation with the experts' biases (gated SiLU, gpt-oss's clamped
//      SwiGLU, squared ReLU, ...), fp32, zero in the padded columns the down projection reads;
//   3. exl3_expert_gemv: down of every pair into a per-pair fp32 row;
//   4. exl3_expert_mix: each token's sum over its slots of weight * (row + down bias), in slot order,
//      written in fp32 or straight in the activations' dtype where nothing is added to it after.
// The weighted sum is a per-pair buffer and a fixed-order reduction rather than fp32 atomics in
// the down GEMV's epilogue: it adds no run-to-run variation of its own (the GEMV blocks' sums vary
// only as the workspace GEMV's do, in the order of a block's shared-memory atomics), it needs no
// zeroed output (a memset node per layer), and the buffer is small (pairs x hidden fp32: 512 KB at
// 64 pairs of 2048) next to the expert weights a step reads (~19 MB for Qwen3-30B-A3B's 8 experts
// at 4 bpw).
//
// A pair reads its expert alone (one input row per GEMV block, the MMA's other 7 columns idle):
// the GEMV is bound by weight bytes, and at batch 1 no two pairs share an expert. Several tokens
// that chose the same expert read its weights once each (mostly from L2).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <climits>
#include <vector>

#include "activations.cuh"
#include "exl3_gemv.cuh"
#include "float_types.cuh"
#include "trellis_ext.h"

namespace trellis {
namespace {

constexpr int kExpertMaxMats = 2;  // gate and up share a launch; down has its own

// One projection kind of all the experts, as a launch reads it.
struct ExpertMat {
  const uint32_t* trellis;   // [experts, in/16, out/16, 16K] int16, read as uint32 words
  long long trellis_stride;  // uint32 words per expert
  const __half* suh;         // [experts, in]
  const __half* svh;         // [experts, out]
  float* y;                  // [pairs, out] fp32
  float* partial;            // pair p's split-K region: partial + p * pair_floats
  int* counters;             // pair p's tickets: counters + p * pair_counters
  int K, out, groups;
};

struct ExpertGemvArgs {
  ExpertMat mat[kExpertMaxMats];
  int count;
  const void* x;         // [rows, x_cols]: features x_cols..in read as zeros
  int x_dtype, x_bytes;  // DType code and element size
  int in, x_cols, splits;
  const int64_t* chosen;  // [pairs], token-major: pair p is token p / top_k's slot p % top_k
  int x_div;              // pair p reads x row p / x_div (top_k: its token's row; 1: its own)
  int num_experts;
  int blocks_per_pair;  // sum over the matrices of groups * splits
  long long pair_floats;
  int pair_counters;
};

// Grid: pairs * blocks_per_pair blocks. Block b works for pair b / blocks_per_pair, on matrix 0's
// (group, split) blocks first, then matrix 1's; its expert's K is the matrix's (one K per
// projection kind), so the switch is block-uniform.
template <int CB>
__global__ void __launch_bounds__(kGemvThreads, 3) exl3_expert_gemv_kernel(const ExpertGemvArgs args) {
  __shared__ GemvSmem sm;
  const int pair = blockIdx.x / args.blocks_per_pair;
  int local = blockIdx.x - pair * args.blocks_per_pair;
  const int first = args.mat[0].groups * args.splits;
  const int i = (args.count > 1 && local >= first) ? 1 : 0;
  if (i) local -= first;
  const ExpertMat& mat = args.mat[i];
  const long long e = args.chosen[pair];
  // Routing never gives such an index; a wrong one must not read outside the stack. Every block
  // of the pair leaves (tickets untouched) and the mix skips the pair.
  if (e < 0 || e >= args.num_experts) return;
  GemvArgs a;
  a.x = static_cast<const char*>(args.x) + (size_t)(pair / args.x_div) * args.x_cols * args.x_bytes;
  a.trellis = mat.trellis + e * mat.trellis_stride;
  a.suh = mat.suh + e * args.in;
  a.svh = mat.svh + e * mat.out;
  a.y = mat.y + (size_t)pair * mat.out;
  a.partial = mat.partial ? mat.partial + pair * args.pair_floats : nullptr;
  a.counters = mat.counters ? mat.counters + (size_t)pair * args.pair_counters : nullptr;
  a.m = 1;
  a.in = args.in;
  a.out = mat.out;
  a.splits = args.splits;
  a.x_dtype = args.x_dtype;
  const int g = local % mat.groups, s = local / mat.groups;
  switch (mat.K) {
#define TRELLIS_EXPERT_CASE(k) \
  case k: gemv_block<k, CB, 1, true>(a, g, s, sm, args.x_cols); break;
    TRELLIS_EXPERT_CASE(1) TRELLIS_EXPERT_CASE(2) TRELLIS_EXPERT_CASE(3) TRELLIS_EXPERT_CASE(4)
    TRELLIS_EXPERT_CASE(5) TRELLIS_EXPERT_CASE(6) TRELLIS_EXPERT_CASE(7) TRELLIS_EXPERT_CASE(8)
#undef TRELLIS_EXPERT_CASE
    default: break;
  }
}

// Launch over `blocks` blocks, or (blocks_per_sm set) report how many fit on an SM at the largest
// stage ring any K uses.
template <int CB>
void expert_gemv_run(const ExpertGemvArgs& a, int blocks, cudaStream_t stream, int* blocks_per_sm) {
  static bool ready = false;
  static int bps = 1;
  if (!ready) {
    cudaFuncSetAttribute(exl3_expert_gemv_kernel<CB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         gemv_max_smem_bytes());
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, exl3_expert_gemv_kernel<CB>, kGemvThreads,
                                                  gemv_max_smem_bytes());
    bps = n > 0 ? n : 1;
    ready = true;
  }
  if (blocks_per_sm) {
    *blocks_per_sm = bps;
    return;
  }
  int smem = 0;
  for (int i = 0; i < a.count; ++i) smem = std::max(smem, gemv_smem_bytes(a.mat[i].K));
  exl3_expert_gemv_kernel<CB><<<blocks, kGemvThreads, smem, stream>>>(a);
}

int expert_dispatch(int codebook, const ExpertGemvArgs& a, int blocks, cudaStream_t stream, bool query) {
  int bps = 0;
  int* q = query ? &bps : nullptr;
  if (codebook == CB_3INST) expert_gemv_run<CB_3INST>(a, blocks, stream, q);
  else if (codebook == CB_MCG) expert_gemv_run<CB_MCG>(a, blocks, stream, q);
  else expert_gemv_run<CB_MUL1>(a, blocks, stream, q);
  return bps;
}

// h[p, j] for j < features: act(gate + gate bias) * up' (gated; up' the up row plus its bias, and
// clamped + offset where `limit` >= 0), or act(up + up bias) (plain). Zero for j >= features: the
// padded input columns of the down projection. One block row per pair, fp32 throughout.
__global__ void expert_act_kernel(const float* __restrict__ gate, const float* __restrict__ up,
                                  const int64_t* __restrict__ chosen, const float* __restrict__ gate_bias,
                                  const float* __restrict__ up_bias, float* __restrict__ h, int width, int features,
                                  int num_experts, int act, float limit, int limit_after_act, float up_offset) {
  const long long p = blockIdx.y;
  const long long e = chosen[p];
  const bool valid = e >= 0 && e < num_experts;
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < width; j += gridDim.x * blockDim.x) {
    float v = 0.f;
    if (valid && j < features) {
      float u = up[p * width + j] + (up_bias ? up_bias[e * features + j] : 0.f);
      if (gate) {
        const float g = gate[p * width + j] + (gate_bias ? gate_bias[e * features + j] : 0.f);
        if (limit >= 0.f) {  // engine/modules/mlp.py GatedMLP._clamped
          u = fminf(fmaxf(u, -limit), limit) + up_offset;
          v = (limit_after_act ? fminf(activate_by(act, g), limit) : activate_by(act, fminf(g, limit))) * u;
        } else {
          v = activate_by(act, g) * u;
        }
      } else {
        v = activate_by(act, u);
      }
    }
    h[p * width + j] = v;
  }
}

// out[t, c] = sum over slots s of weights[t, s] * (y[t * top_k + s, c] + bias[e, c]), slot by slot
// in order, summed in fp32 and stored as O (rounded once, as torch's conversion of the fp32 sum
// would); pairs with an out-of-range expert add nothing.
template <typename O>
__global__ void expert_mix_kernel(const float* __restrict__ y, const int64_t* __restrict__ chosen,
                                  const float* __restrict__ weights, const float* __restrict__ bias,
                                  O* __restrict__ out, int top_k, int width, int features, int num_experts) {
  const long long t = blockIdx.y;
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < features; c += gridDim.x * blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < top_k; ++s) {
      const long long p = t * top_k + s;
      const long long e = chosen[p];
      if (e < 0 || e >= num_experts) continue;
      const float v = y[p * width + c] + (bias ? bias[e * features + c] : 0.f);
      acc = fmaf(weights[p], v, acc);
    }
    out[t * features + c] = from_f<O>(acc);
  }
}

// ---- bindings -------------------------------------------------------------------------------

int dtype_code_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return DT_F16;
    case at::kBFloat16: return DT_BF16;
    case at::kFloat: return DT_F32;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type(), " (fp16, bf16 or fp32)");
  }
  return -1;
}

void check_on(const at::Tensor& t, const at::Tensor& x, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == x.device() && t.is_contiguous(), name,
              " must be a contiguous CUDA tensor on x's device");
}

// The chosen experts as the kernels read them: int64 [tokens, top_k], contiguous.
void check_chosen(const at::Tensor& chosen, const at::Tensor& like) {
  check_on(chosen, like, "chosen");
  TORCH_CHECK(chosen.scalar_type() == at::kLong && chosen.dim() == 2 && chosen.numel() >= 1,
              "chosen must be a non-empty int64 [tokens, top_k] tensor");
}

// Checks a per-expert vector stack [experts, n] of `dtype` (a bias or sign vector).
void check_stack(const at::Tensor& t, const at::Tensor& x, int64_t experts, int64_t n, at::ScalarType dtype,
                 const char* name) {
  check_on(t, x, name);
  TORCH_CHECK(t.scalar_type() == dtype && t.dim() == 2 && t.size(0) == experts && t.size(1) == n, name,
              " must be [", experts, ", ", n, "] of ", dtype);
}

// y[i][p] = had(had(x[p / x_div] * suh[i][e]) @ Q[i][e]) * svh[i][e] with e = chosen[p], for the
// 1..2 stacked matrices of one input; x (any activation dtype) may hold fewer features than the
// matrices take (the rest read as zeros), y is fp32. Workspace: pair p, matrix i use partial[p * pair_floats +
// off_i, + splits * out_i) and counters[p * pair_counters + c_i, + out_i / 128). Returns the split
// count (splits <= 0: the launch's choice).
int64_t exl3_expert_gemv(const at::Tensor& x, const at::Tensor& chosen, const std::vector<at::Tensor>& trellis,
                         const std::vector<at::Tensor>& suh, const std::vector<at::Tensor>& svh,
                         const std::vector<at::Tensor>& y, at::Tensor& partial, at::Tensor& counters,
                         int64_t codebook, int64_t x_div, int64_t splits) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-D CUDA tensor");
  check_chosen(chosen, x);
  const int count = static_cast<int>(trellis.size());
  TORCH_CHECK(count >= 1 && count <= kExpertMaxMats, "exl3_expert_gemv takes 1..", kExpertMaxMats,
              " stacked matrices, got ", count);
  TORCH_CHECK(suh.size() == trellis.size() && svh.size() == trellis.size() && y.size() == trellis.size(),
              "trellis, suh, svh and y lists must have the same length");
  TORCH_CHECK(codebook >= 0 && codebook <= 2, "codebook must be 0 (3inst), 1 (mcg) or 2 (mul1)");
  const int64_t pairs = chosen.numel();
  TORCH_CHECK(x_div >= 1 && x.size(0) * x_div == pairs, "x has ", x.size(0), " rows; ", pairs,
              " pairs need pairs / x_div of them (x_div ", x_div, ")");
  TORCH_CHECK(!trellis.empty() && trellis[0].dim() == 4, "trellis must be int16 [experts, in/16, out/16, 16K]");
  const int in = static_cast<int>(trellis[0].size(1) * 16);
  TORCH_CHECK(in % 128 == 0 && in >= 128, "in features must be a positive multiple of 128");
  const int x_cols = static_cast<int>(x.size(1));
  // load4 reads 4 features at once (8 or 16 bytes): whole groups, aligned.
  TORCH_CHECK(x_cols >= 4 && x_cols <= in && x_cols % 4 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "x has ", x_cols, " features: it must be 16-byte aligned with a multiple of 4 features, at most the ",
              in, " the matrices take");
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  ExpertGemvArgs a{};
  a.count = count;
  a.x = x.data_ptr();
  a.x_dtype = dtype_code_of(x);
  a.x_bytes = static_cast<int>(x.element_size());
  a.in = in;
  a.x_cols = x_cols;
  a.chosen = chosen.data_ptr<int64_t>();
  a.x_div = static_cast<int>(x_div);
  const int64_t experts = trellis[0].dim() == 4 ? trellis[0].size(0) : 0;
  a.num_experts = static_cast<int>(experts);
  int total_groups = 0;
  for (int i = 0; i < count; ++i) {
    const at::Tensor& t = trellis[i];
    check_on(t, x, "trellis");
    TORCH_CHECK(t.dim() == 4 && t.scalar_type() == at::kShort && t.size(0) == experts && experts >= 1,
                "trellis must be int16 [experts, in/16, out/16, 16K], the same experts for every matrix");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "trellis must be 16-byte aligned");
    TORCH_CHECK(t.size(1) * 16 == in, "matrix ", i, " has ", t.size(1) * 16, " in features, matrix 0 ", in);
    TORCH_CHECK(t.size(2) % 8 == 0 && t.size(2) >= 8, "out features must be a positive multiple of 128");
    const int64_t words = t.size(3);
    TORCH_CHECK(words % 16 == 0 && words / 16 >= 1 && words / 16 <= 8, "trellis last dim must be 16*K, K in 1..8");
    const int out = static_cast<int>(t.size(2) * 16);
    check_stack(suh[i], x, experts, in, at::kHalf, "suh");
    check_stack(svh[i], x, experts, out, at::kHalf, "svh");
    check_on(y[i], x, "y");
    TORCH_CHECK(y[i].scalar_type() == at::kFloat && y[i].dim() == 2 && y[i].size(0) == pairs && y[i].size(1) == out,
                "y[", i, "] must be a [pairs, out] fp32 tensor");
    ExpertMat& m = a.mat[i];
    m.trellis = reinterpret_cast<const uint32_t*>(t.data_ptr());
    m.trellis_stride = t[0].numel() / 2;  // int16 -> uint32 words (in * out * K / 16 int16: even)
    m.suh = reinterpret_cast<const __half*>(suh[i].data_ptr());
    m.svh = reinterpret_cast<const __half*>(svh[i].data_ptr());
    m.y = y[i].data_ptr<float>();
    m.K = static_cast<int>(words / 16);
    m.out = out;
    m.groups = out / 128;
    total_groups += m.groups;
  }
  const int n_chunks = in / 128;
  const int min_splits = (n_chunks + kGemvMaxChunks - 1) / kGemvMaxChunks;
  if (splits <= 0) {
    const int bps = expert_dispatch(static_cast<int>(codebook), a, 0, stream, true);
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.get_device()));
    const long long groups = (long long)total_groups * pairs;
    splits = gemv_multi_splits(in, static_cast<int>(std::min<long long>(groups, INT_MAX)), 1, bps, sms);
  }
  TORCH_CHECK(splits >= min_splits && splits <= n_chunks, "splits must be in [", min_splits, ", ", n_chunks, "]");
  a.splits = static_cast<int>(splits);
  long long pair_floats = 0;
  int pair_counters = 0;
  long long float_off[kExpertMaxMats] = {0, 0};
  int ctr_off[kExpertMaxMats] = {0, 0};
  for (int i = 0; i < count; ++i) {
    float_off[i] = pair_floats;
    ctr_off[i] = pair_counters;
    pair_floats += (long long)a.splits * a.mat[i].out;
    pair_counters += a.mat[i].groups;
  }
  a.pair_floats = pair_floats;
  a.pair_counters = pair_counters;
  a.blocks_per_pair = total_groups * a.splits;
  if (a.splits > 1) {
    check_on(partial, x, "partial");
    check_on(counters, x, "counters");
    TORCH_CHECK(partial.scalar_type() == at::kFloat && partial.numel() >= pairs * pair_floats,
                "workspace too small: need ", pairs * pair_floats, " floats");
    TORCH_CHECK(counters.scalar_type() == at::kInt && counters.numel() >= pairs * pair_counters,
                "counter buffer too small: need ", pairs * pair_counters);
    for (int i = 0; i < count; ++i) {
      a.mat[i].partial = partial.data_ptr<float>() + float_off[i];
      a.mat[i].counters = counters.data_ptr<int>() + ctr_off[i];
    }
  }
  const long long blocks = pairs * a.blocks_per_pair;
  TORCH_CHECK(blocks <= INT_MAX, "too many pairs for one launch");
  expert_dispatch(static_cast<int>(codebook), a, static_cast<int>(blocks), stream, false);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return splits;
}

// The split count exl3_expert_gemv chooses for `total_groups` 128-column groups (over all pairs
// and matrices) of `in` features, so the caller can size the workspace before the launch.
int64_t exl3_expert_splits(int64_t in, int64_t total_groups, int64_t codebook, int64_t device) {
  TORCH_CHECK(in % 128 == 0 && in >= 128 && total_groups >= 1, "in must be a positive multiple of 128");
  TORCH_CHECK(codebook >= 0 && codebook <= 2, "codebook must be 0 (3inst), 1 (mcg) or 2 (mul1)");
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  ExpertGemvArgs a{};
  const int bps = expert_dispatch(static_cast<int>(codebook), a, 0, nullptr, true);
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, static_cast<int>(device)));
  return gemv_multi_splits(static_cast<int>(in), static_cast<int>(std::min<int64_t>(total_groups, INT_MAX)), 1,
                           bps, sms);
}

constexpr int kElementwiseThreads = 256;

// The activation of every pair's gate/up rows (see expert_act_kernel); limit < 0: unclamped.
at::Tensor exl3_expert_act(const c10::optional<at::Tensor>& gate, const at::Tensor& up, const at::Tensor& chosen,
                           const c10::optional<at::Tensor>& gate_bias, const c10::optional<at::Tensor>& up_bias,
                           int64_t act, double limit, bool limit_after_act, double up_offset, int64_t features,
                           int64_t num_experts) {
  check_on(up, up, "up");
  TORCH_CHECK(up.scalar_type() == at::kFloat && up.dim() == 2, "up must be fp32 [pairs, width]");
  check_chosen(chosen, up);
  const int64_t pairs = up.size(0), width = up.size(1);
  TORCH_CHECK(chosen.numel() == pairs, "chosen has ", chosen.numel(), " pairs, up ", pairs, " rows");
  TORCH_CHECK(features >= 1 && features <= width, "features must be in [1, ", width, "]");
  TORCH_CHECK(act >= kSilu && act <= kQuickGelu, "unknown activation id ", act);
  if (gate) {
    check_on(*gate, up, "gate");
    TORCH_CHECK(gate->scalar_type() == at::kFloat && gate->sizes() == up.sizes(), "gate must match up");
  }
  TORCH_CHECK(num_experts >= 1, "num_experts must be positive");
  if (gate_bias) check_stack(*gate_bias, up, num_experts, features, at::kFloat, "gate_bias");
  if (up_bias) check_stack(*up_bias, up, num_experts, features, at::kFloat, "up_bias");
  TORCH_CHECK(!gate_bias || gate, "a gate bias needs a gate");
  const c10::cuda::CUDAGuard guard(up.device());
  at::Tensor h = at::empty({pairs, width}, up.options());
  const int blocks_x = static_cast<int>(std::min<int64_t>((width + kElementwiseThreads - 1) / kElementwiseThreads, 64));
  expert_act_kernel<<<dim3(blocks_x, static_cast<unsigned>(pairs)), kElementwiseThreads, 0,
                      c10::cuda::getCurrentCUDAStream().stream()>>>(
      gate ? gate->data_ptr<float>() : nullptr, up.data_ptr<float>(), chosen.data_ptr<int64_t>(),
      gate_bias ? gate_bias->data_ptr<float>() : nullptr, up_bias ? up_bias->data_ptr<float>() : nullptr,
      h.data_ptr<float>(), static_cast<int>(width), static_cast<int>(features),
      static_cast<int>(num_experts), static_cast<int>(act), static_cast<float>(limit),
      limit_after_act ? 1 : 0, static_cast<float>(up_offset));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return h;
}

// Each token's weighted sum over its slots of the down rows plus the chosen expert's bias, stored in
// the dtype of code out_dtype (DT_F16, DT_BF16 or DT_F32).
at::Tensor exl3_expert_mix(const at::Tensor& y, const at::Tensor& chosen, const at::Tensor& weights,
                           const c10::optional<at::Tensor>& bias, int64_t features, int64_t num_experts,
                           int64_t out_dtype) {
  check_on(y, y, "y");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2, "y must be fp32 [pairs, width]");
  check_chosen(chosen, y);
  check_on(weights, y, "weights");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == chosen.sizes(),
              "weights must be fp32 of chosen's shape");
  const int64_t tokens = chosen.size(0), top_k = chosen.size(1), width = y.size(1);
  TORCH_CHECK(y.size(0) == tokens * top_k, "y has ", y.size(0), " rows, chosen ", tokens * top_k, " pairs");
  TORCH_CHECK(features >= 1 && features <= width, "features must be in [1, ", width, "]");
  TORCH_CHECK(num_experts >= 1, "num_experts must be positive");
  if (bias) check_stack(*bias, y, num_experts, features, at::kFloat, "bias");
  TORCH_CHECK(out_dtype == DT_F16 || out_dtype == DT_BF16 || out_dtype == DT_F32,
              "out_dtype must be 0 (fp16), 1 (bf16) or 2 (fp32)");
  const at::ScalarType out_type =
      out_dtype == DT_F16 ? at::kHalf : (out_dtype == DT_BF16 ? at::kBFloat16 : at::kFloat);
  const c10::cuda::CUDAGuard guard(y.device());
  at::Tensor out = at::empty({tokens, features}, y.options().dtype(out_type));
  const int blocks_x =
      static_cast<int>(std::min<int64_t>((features + kElementwiseThreads - 1) / kElementwiseThreads, 64));
  by_dtype(out.scalar_type(), [&](auto tag) {
    using O = decltype(tag);
    expert_mix_kernel<O><<<dim3(blocks_x, static_cast<unsigned>(tokens)), kElementwiseThreads, 0,
                           c10::cuda::getCurrentCUDAStream().stream()>>>(
        y.data_ptr<float>(), chosen.data_ptr<int64_t>(), weights.data_ptr<float>(),
        bias ? bias->data_ptr<float>() : nullptr, reinterpret_cast<O*>(out.data_ptr()), static_cast<int>(top_k),
        static_cast<int>(width), static_cast<int>(features), static_cast<int>(num_experts));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

void bind_expert_gemv(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("exl3_expert_gemv", &exl3_expert_gemv,
        "the chosen experts' EXL3 GEMVs of 1..2 stacked matrices for every (token, slot) pair, the expert read "
        "on the device; returns the split count",
        py::arg("x"), py::arg("chosen"), py::arg("trellis"), py::arg("suh"), py::arg("svh"), py::arg("y"),
        py::arg("partial"), py::arg("counters"), py::arg("codebook"), py::arg("x_div"), py::arg("splits") = 0);
  m.def("exl3_expert_splits", &exl3_expert_splits,
        "the split count exl3_expert_gemv chooses for this many 128-column groups of in features",
        py::arg("in_features"), py::arg("total_groups"), py::arg("codebook"), py::arg("device"));
  m.def("exl3_expert_act", &exl3_expert_act,
        "the experts' activation of every pair's gate/up rows with the chosen experts' biases (fp32)",
        py::arg("gate"), py::arg("up"), py::arg("chosen"), py::arg("gate_bias"), py::arg("up_bias"), py::arg("act"),
        py::arg("limit"), py::arg("limit_after_act"), py::arg("up_offset"), py::arg("features"),
        py::arg("num_experts"));
  m.def("exl3_expert_mix", &exl3_expert_mix,
        "each token's routing-weighted sum over its slots of the experts' down rows plus their biases, summed in "
        "fp32 and stored in out_dtype (0 fp16, 1 bf16, 2 fp32)",
        py::arg("y"), py::arg("chosen"), py::arg("weights"), py::arg("bias"), py::arg("features"),
        py::arg("num_experts"), py::arg("out_dtype") = static_cast<int64_t>(DT_F32));
}

}  // namespace trellis
