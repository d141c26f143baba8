"""The device-routed expert kernels (ext/exl3_expert_gemv.cu, engine.kernels.moe) against a float64
reference built from the experts' dequantized weights, for random routings: batch 1-8, 8-256
experts, top-k 1-8, every expert activation, several bit widths and codebooks; half inputs read
as they are against the padded float32 copy the GEMV took before; the mix written in the
activations' dtype; graph replays with new routings written into the captured inputs; and
SparseMoE taking the kernels (with the router kernel: five launches a layer)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cuda_helpers import capture, needs_kernels
from random_exl3 import random_streaming_linear

from engine.exl3 import EXL3Linear
from engine.kernels import moe as moe_kernels
from engine.kernels.loader import CODEBOOK_IDS
from engine.modules.feed_forward import FeedForward
from engine.modules.linear import DenseLinear, ProjectionGroup
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE
from engine.modules.stacked_experts import stack_experts

pytestmark = pytest.mark.cuda

# Each row's rotated input is rounded to fp16 in the GEMV (twice: x, then the activation), the
# weights are not: ~1e-3 of the output. A wrong expert, slot, weight or bias is an O(1) error.
TOL = 1e-2
# Same kernels, same split counts: only the order of a GEMV block's shared-memory atomics differs.
SAME_TOL = 5e-4

# name -> (activation, gated, limit, limit_after_act, up_offset, biases)
ACTIVATIONS = {
    "silu": ("silu", True, None, True, 0.0, False),  # Qwen3-MoE, Mixtral
    "gpt_oss": ("quick_gelu", True, 7.0, False, 1.0, True),  # clamped SwiGLU, (up + 1), biases
    "step": ("silu", True, 7.0, True, 0.0, False),  # Step 3.5: the activation's output clamped
    "relu2": ("relu2", False, None, True, 0.0, False),  # NemotronH: up and down only
    "gelu_tanh": ("gelu_pytorch_tanh", True, None, True, 0.0, True),
}


_expert_kernel = needs_kernels("exl3_expert_gemv")


def _linear(g: torch.Generator, n_in: int, n_out: int, bits: int, codebook: str, bias: bool) -> EXL3Linear:
    return random_streaming_linear(g, n_in, n_out, bits, codebook, bias)


def _experts(n: int, hidden: int, width: int, act: str, bits=(4, 4, 4), codebook="mul1", seed=0) -> list:
    name, gated, limit, after, offset, bias = ACTIVATIONS[act]
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(n):
        up = _linear(g, hidden, width, bits[1], codebook, bias)
        down = _linear(g, width, hidden, bits[2], codebook, bias)
        if not gated:
            out.append(FeedForward(up, down, name))
            continue
        gate = _linear(g, hidden, width, bits[0], codebook, bias)
        group = ProjectionGroup([(gate, [width]), (up, [width])])
        out.append(GatedMLP(group, down, name, limit, after, offset))
    return out


def _dense_twin(expert) -> torch.nn.Module:
    """The expert with its dequantized weights in float64 (the torch modules' own arithmetic)."""

    def dense(lin: EXL3Linear) -> DenseLinear:
        bias = None if lin.bias is None else lin.bias.double()
        return DenseLinear(lin.reconstruct().double(), bias)

    if isinstance(expert, FeedForward):
        return FeedForward(dense(expert.fc1), dense(expert.fc2), "relu2")
    gate, up = expert.gate_up.linears
    group = ProjectionGroup([(dense(gate), [gate.out_features]), (dense(up), [up.out_features])])
    return GatedMLP(
        group, dense(expert.down), expert.activation, expert.limit, expert.limit_after_act, expert.up_offset
    )


def _reference(experts, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """sum_s weights[t, s] * expert_{chosen[t, s]}(x[t]) in float64; out-of-range experts add nothing."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    x64 = x.double()
    for e in sorted(set(chosen.flatten().tolist())):
        if not 0 <= e < len(experts):
            continue
        twin = _dense_twin(experts[e])  # one at a time: 256 experts' float64 weights would not fit
        t, s = (chosen == e).nonzero(as_tuple=True)
        out.index_add_(0, t, twin(x64[t]) * weights[t, s].double().unsqueeze(1))
    return out


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (as a router chooses) and positive weights."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    chosen = torch.stack([torch.randperm(experts, device="cuda", generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, device="cuda", generator=g) + 0.1
    return weights, chosen


def _x(tokens: int, hidden: int, dtype=torch.float16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed + tokens)
    # Scaled so that the clamped activations' limits (7) are reached.
    return (6 * torch.randn(tokens, hidden, device="cuda", generator=g)).to(dtype)


def _rows_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest relative error of a row (a token) of ``a`` against ``b``."""
    a, b = a.double(), b.double()
    return float(((a - b).norm(dim=1) / b.norm(dim=1)).max())


def _counters_zero() -> bool:
    return all(int(ws[1].abs().sum()) == 0 for ws in moe_kernels.workspaces())


def _stacked(experts):
    stack = stack_experts(experts)
    assert stack is not None and moe_kernels.supports(stack)
    return stack


def _check(experts, stack, tokens, top_k, dtype=torch.float16, seed=0, splits=(0, 0)) -> None:
    # The model width: a gated expert's down projection's outputs, an ungated one's fc2's.
    last = getattr(experts[0], "down", None) or experts[0].fc2
    x = _x(tokens, last.out_features, dtype, seed)
    weights, chosen = _routing(tokens, len(experts), top_k, seed)
    out = moe_kernels.expert_mlp(x, weights, chosen, stack, splits=splits)
    assert out is not None and out.dtype == torch.float32 and out.shape == x.shape
    err = _rows_rel(out, _reference(experts, x, weights, chosen))
    assert err < TOL, (tokens, top_k, err)


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
@pytest.mark.parametrize("bits", [(4, 4, 4), (2, 3, 5), (1, 6, 8)], ids=["4-4-4", "2-3-5", "1-6-8"])
def test_activations_codebooks_and_bits_match_the_reference(act, codebook, bits) -> None:
    # 320 features pad to 384: the activation zeroes the padded columns the down projection reads
    experts = _experts(16, 256, 320, act, bits, codebook)
    stack = _stacked(experts)
    for tokens in range(1, 9):
        _check(experts, stack, tokens, 4, seed=tokens)
    torch.cuda.synchronize()
    assert _counters_zero()


@pytest.mark.parametrize("num_experts,top_k", [(8, 1), (8, 8), (32, 2), (128, 6), (256, 8)])
def test_expert_counts_and_top_k_match_the_reference(num_experts, top_k) -> None:
    experts = _experts(num_experts, 256, 256, "silu", seed=num_experts)
    stack = _stacked(experts)
    for tokens in (1, 2, 5, 8):
        _check(experts, stack, tokens, top_k, seed=100 + tokens)


# Qwen3-30B-A3B's expert (2048 -> 768, top 8 of 128) and gpt-oss-20b's (2880 -> 2880 padded to
# 2944: 23 input chunks, so at least two splits; top 4 of 32, biases, clamped SwiGLU).
REALISTIC = {"qwen3_30b": (2048, 768, 128, 8, "silu"), "gpt_oss_20b": (2880, 2880, 32, 4, "gpt_oss")}


@pytest.mark.parametrize("shape", list(REALISTIC))
def test_model_shapes_at_every_split_count(shape) -> None:
    hidden, width, n, top_k, act = REALISTIC[shape]
    experts = _experts(n, hidden, width, act, (4, 4, 4), "mul1", seed=7)
    stack = _stacked(experts)
    chunks_in, chunks_down = -(-hidden // 128), -(-width // 128)
    for tokens in (1, 3, 8):
        _check(experts, stack, tokens, top_k, torch.bfloat16, seed=tokens)
        for splits in (
            (-(-chunks_in // 16), -(-chunks_down // 16)),
            (min(chunks_in, 16), min(chunks_down, 16)),
        ):
            _check(experts, stack, tokens, top_k, torch.bfloat16, seed=tokens, splits=splits)
    torch.cuda.synchronize()
    assert _counters_zero()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_activation_dtypes(dtype) -> None:
    experts = _experts(16, 256, 384, "gpt_oss", seed=3)
    _check(experts, _stacked(experts), 5, 4, dtype)


def test_tokens_sharing_experts_and_more_rows_than_a_decode_step() -> None:
    experts = _experts(8, 256, 256, "silu", seed=4)
    stack = _stacked(experts)
    x = _x(40, 256)  # a speculative verify step's rows; every token on the same two experts
    chosen = torch.tensor([[3, 5]] * 40, device="cuda")
    weights = torch.rand(40, 2, device="cuda") + 0.1
    out = moe_kernels.expert_mlp(x, weights, chosen, stack)
    assert _rows_rel(out, _reference(experts, x, weights, chosen)) < TOL
    assert moe_kernels.expert_mlp(_x(moe_kernels.MAX_TOKENS + 1, 256), weights[:1], chosen[:1], stack) is None


def test_an_out_of_range_expert_adds_nothing() -> None:
    experts = _experts(8, 256, 256, "gpt_oss", seed=5)
    stack = _stacked(experts)
    x = _x(3, 256)
    weights, chosen = _routing(3, 8, 2, seed=5)
    chosen[0, 1], chosen[2, 0] = -1, 8
    out = moe_kernels.expert_mlp(x, weights, chosen, stack)
    assert _rows_rel(out, _reference(experts, x, weights, chosen)) < TOL
    torch.cuda.synchronize()
    assert _counters_zero()


def test_graph_replays_follow_new_routings() -> None:
    """The routing is read on the device: a graph captured once computes each new choice."""
    experts = _experts(64, 512, 384, "gpt_oss", seed=6)
    stack = _stacked(experts)
    x = _x(4, 512)
    weights, chosen = _routing(4, 64, 4, seed=0)
    moe_kernels.expert_mlp(x, weights, chosen, stack)  # sizes the workspace outside the capture
    graph, out = capture(lambda: moe_kernels.expert_mlp(x, weights, chosen, stack))
    for seed in (1, 2, 3):
        new_w, new_c = _routing(4, 64, 4, seed)
        weights.copy_(new_w)
        chosen.copy_(new_c)
        x.copy_(_x(4, 512, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        eager = moe_kernels.expert_mlp(x, weights, chosen, stack)
        assert _rows_rel(out, eager) < SAME_TOL
        assert _rows_rel(out, _reference(experts, x, weights, chosen)) < TOL
    assert _counters_zero()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("hidden", [256, 200], ids=["whole", "padded"])
def test_half_inputs_equal_the_padded_float_copy(dtype, hidden, cuda_extension) -> None:
    """The gate/up launch reads x in its dtype and zero-fills the padded features: the same sums
    as from the float32 copy padded with zeros (the GEMV rounds its rotated input to fp16 either
    way), up to the order of a block's shared-memory atomics."""
    experts = _experts(8, hidden, 256, "silu", seed=12)
    stack = _stacked(experts)
    up = stack.up
    assert up.in_features == hidden and up.padded_in == 256
    x = _x(5, hidden, dtype)
    _, chosen = _routing(5, 8, 3, seed=12)
    padded = F.pad(x.float(), (0, up.padded_in - hidden)).contiguous()
    pairs, splits, mats = 15, 2, (stack.gate, up)
    outs = []
    for xin in (x, padded):
        ys = [torch.empty(pairs, m.padded_out, device="cuda") for m in mats]
        partial = torch.empty(pairs * splits * sum(m.padded_out for m in mats), device="cuda")
        counters = torch.zeros(
            pairs * sum(m.padded_out // 128 for m in mats), dtype=torch.int32, device="cuda"
        )
        cuda_extension.exl3_expert_gemv(
            xin, chosen, [m.trellis for m in mats], [m.suh for m in mats], [m.svh for m in mats], ys, partial,
            counters, CODEBOOK_IDS[up.codebook], 3, splits,
        )  # fmt: skip
        outs.append(ys)
    for half_y, float_y in zip(*outs):
        assert half_y.dtype == torch.float32
        assert _rows_rel(half_y, float_y) < SAME_TOL
    weights, chosen = _routing(5, 8, 3, seed=12)
    out = moe_kernels.expert_mlp(x, weights, chosen, stack)
    assert _rows_rel(out, moe_kernels.expert_mlp(x.float(), weights, chosen, stack)) < SAME_TOL
    assert _rows_rel(out, _reference(experts, x, weights, chosen)) < TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_the_mix_written_in_the_activations_dtype(dtype) -> None:
    experts = _experts(16, 256, 320, "gpt_oss", seed=13)
    stack = _stacked(experts)
    x = _x(4, 256, dtype)
    weights, chosen = _routing(4, 16, 4, seed=13)
    splits = (1, 2)  # fixed, so the two calls differ only by the atomics' order
    out = moe_kernels.expert_mlp(x, weights, chosen, stack, splits=splits, out_dtype=dtype)
    wide = moe_kernels.expert_mlp(x, weights, chosen, stack, splits=splits)
    assert out.dtype == dtype and wide.dtype == torch.float32
    # One rounding of the float32 sum: within a unit in the last place of dtype, plus the float32
    # noise of the GEMVs' in-block reductions (shared-memory atomics, any order), which scales
    # with the outputs' magnitude (about 1e3 here), not with a value that cancels to near zero.
    noise = 1e-5 * wide.abs().max().item()
    torch.testing.assert_close(out.float(), wide.to(dtype).float(), rtol=torch.finfo(dtype).eps, atol=noise)
    with pytest.raises(ValueError, match="out_dtype"):
        moe_kernels.expert_mlp(x, weights, chosen, stack, out_dtype=torch.int32)


def test_bad_arguments_are_refused() -> None:
    experts = _experts(8, 256, 256, "silu", seed=8)
    stack = _stacked(experts)
    weights, chosen = _routing(2, 8, 2, seed=8)
    with pytest.raises(ValueError, match="chosen and weights"):
        moe_kernels.expert_mlp(_x(3, 256), weights, chosen, stack)
    with pytest.raises(ValueError, match="features"):
        moe_kernels.expert_mlp(_x(2, 128), weights, chosen, stack)


def _moe_block(act: str, n: int = 16, top_k: int = 4, hidden: int = 256, **routing) -> SparseMoE:
    g = torch.Generator(device="cuda").manual_seed(9)
    router = DenseLinear((torch.randn(n, hidden, device="cuda", generator=g) / 16).half())  # x is fp16
    return SparseMoE(router, _experts(n, hidden, 320, act, seed=9), top_k, True, **routing)


class _Counting:
    """Stands in for a kernel entry (``expert_mlp``, ``route``): counts the calls, passes them on,
    keeps the last result."""

    def __init__(self, fn) -> None:
        self.fn, self.calls, self.last = fn, 0, None

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.last = self.fn(*args, **kwargs)
        return self.last


def _no_torch_path(*args):
    pytest.fail("the torch path ran")


@pytest.mark.parametrize("act", ["silu", "gpt_oss", "relu2"])
def test_sparse_moe_takes_the_kernels_for_a_few_rows(act, monkeypatch) -> None:
    block = _moe_block(act)
    assert block.stacked is not None and block.dynamic_decode is None  # graph-capturable
    for tokens in (1, 8):
        x = _x(tokens, 256)
        weights, chosen = block.route(x)
        reference = _reference(block.experts, x, weights, chosen).to(x.dtype)
        counting = _Counting(moe_kernels.expert_mlp)
        with monkeypatch.context() as patched:
            patched.setattr(moe_kernels, "expert_mlp", counting)
            patched.setattr(SparseMoE, "_dispatch", _no_torch_path)
            out = block(x)
        assert counting.calls == 1 and _rows_rel(out, reference) < TOL
        assert _rows_rel(out.float(), block._dispatch(x, weights, chosen)) < TOL
    # a prefill chunk beyond the kernels' rows: the torch path (one sync per layer)
    x = _x(moe_kernels.MAX_TOKENS + 9, 256)
    weights, chosen = block.route(x)
    assert _rows_rel(block(x), _reference(block.experts, x, weights, chosen)) < TOL


@pytest.mark.parametrize("hidden", [256, 200], ids=["whole", "padded"])
def test_sparse_moe_decode_step_captures_in_a_graph(hidden, monkeypatch) -> None:
    """Router kernel and expert kernels replayed: the eager call's routing bit for bit (the router
    has no atomics), the experts' mix up to the GEMV's atomics' order."""
    block = _moe_block(
        "silu", n=32, top_k=8, hidden=hidden, scoring="sigmoid", num_groups=4, groups_per_token=2, scale=2.0
    )
    routes = _Counting(moe_kernels.route)
    monkeypatch.setattr(moe_kernels, "route", routes)
    x = _x(3, hidden)
    graph, out = capture(lambda: block(x))
    assert routes.calls == 2 and routes.last is not None  # the router kernel ran, and was captured
    captured_w, captured_c = routes.last
    for seed in (11, 12):
        x.copy_(_x(3, hidden, seed=seed))  # new tokens: new routes, chosen on the device
        graph.replay()
        eager = block(x)
        torch.cuda.synchronize()
        eager_w, eager_c = routes.last
        assert torch.equal(captured_c, eager_c) and torch.equal(captured_w, eager_w)
        assert out.dtype == x.dtype and _rows_rel(out.float(), eager.float()) < 2e-3


def test_sparse_moe_decode_is_five_launches() -> None:
    """Without a shared expert: the router, gate/up, the activation, down, and the mix in x's dtype;
    no routing op, upcast, padding or conversion between them."""
    block = _moe_block("gpt_oss", hidden=200)  # 200 features: the GEMV zero-fills 56 of them
    x = _x(1, 200)
    block(x)  # first-call buffers and queries
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = block(x)
        torch.cuda.synchronize()
    launches = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(launches) == 5, launches
    assert out.dtype == x.dtype
