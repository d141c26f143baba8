"""The grouped-GEMM prefill of stacked EXL3 experts (engine.modules.grouped_experts,
engine.kernels.moe_grouped) against SparseMoE._dispatch on a 200-row bf16 chunk: gated (SiLU;
gpt-oss's clamped SwiGLU with biases) and plain (squared ReLU) experts, one group of experts and
several; taken only for bf16 chunks of more rows than the device-routed kernels take."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import needs_kernels
from random_exl3 import random_streaming_linear

from engine import kernels
from engine.exl3 import EXL3Linear
from engine.modules import grouped_experts
from engine.modules.feed_forward import FeedForward
from engine.modules.linear import DenseLinear, ProjectionGroup
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE

pytestmark = pytest.mark.cuda

HIDDEN, WIDTH, EXPERTS, TOP_K, ROWS = 256, 200, 16, 4, 200  # WIDTH pads to 256
# name -> (activation, gated, limit, limit_after_act, up_offset, biases)
KINDS = {
    "silu": ("silu", True, None, True, 0.0, False),
    "gpt_oss": ("quick_gelu", True, 7.0, False, 1.0, True),
    "relu2": ("relu2", False, None, True, 0.0, False),
}
# Both paths multiply the same decoded bf16 weights by the same bf16 rows; the grouped path
# weights the activations before down (one more bf16 rounding) and sums in another order: a few
# bf16 roundings of a row. A wrong expert, bias or weight is O(1).
TOL = 2e-2


_weight_kernel = needs_kernels("exl3_weight_into")


def _linear(g: torch.Generator, n_in: int, n_out: int, bias: bool) -> EXL3Linear:
    return random_streaming_linear(g, n_in, n_out, bias=bias, dtype=torch.bfloat16)


def _block(kind: str, seed: int = 0) -> SparseMoE:
    name, gated, limit, after, offset, bias = KINDS[kind]
    g = torch.Generator(device="cuda").manual_seed(seed)
    experts = []
    for _ in range(EXPERTS):
        up, down = _linear(g, HIDDEN, WIDTH, bias), _linear(g, WIDTH, HIDDEN, bias)
        if gated:
            group = ProjectionGroup([(_linear(g, HIDDEN, WIDTH, bias), [WIDTH]), (up, [WIDTH])])
            experts.append(GatedMLP(group, down, name, limit, after, offset))
        else:
            experts.append(FeedForward(up, down, name))
    router_bias = torch.linspace(-1.0, 1.0, EXPERTS, device="cuda")
    router_bias[-1] = -1e4  # an expert nobody chooses
    weight = torch.randn(EXPERTS, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5
    router = DenseLinear(weight.bfloat16(), router_bias.bfloat16())
    block = SparseMoE(router, experts, TOP_K, True)
    assert block.stacked is not None
    return block


def _x(dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(1)
    return (4 * torch.randn(ROWS, HIDDEN, device="cuda", generator=g)).to(dtype)


def _rows_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(((a - b).norm(dim=1) / b.norm(dim=1)).max())


def _count(monkeypatch, owner, name: str) -> list[int]:
    calls: list[int] = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("groups", [1, 3])
def test_grouped_prefill_matches_dispatch(kind, groups, monkeypatch):
    block = _block(kind)
    x = _x()
    with torch.inference_mode():
        weights, chosen = block.route(x)
        want = block._dispatch(x, weights, chosen)
        if groups > 1:
            per_expert = grouped_experts.from_stacked(block.stacked).bytes_per_expert(torch.bfloat16)
            monkeypatch.setattr(grouped_experts, "GROUP_WEIGHT_BYTES", per_expert * -(-EXPERTS // groups))
        mixes = _count(monkeypatch, grouped_experts, "grouped_mix")
        dispatches = _count(monkeypatch, SparseMoE, "_dispatch")
        got = block._routed(x, weights, chosen)
    assert mixes == [1] and dispatches == []
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert _rows_rel(got, want) < TOL


def test_fp16_chunks_take_dispatch(monkeypatch):
    block = _block("silu").half()
    x = _x(torch.float16)
    mixes = _count(monkeypatch, grouped_experts, "grouped_mix")
    dispatches = _count(monkeypatch, SparseMoE, "_dispatch")
    with torch.inference_mode():
        block(x)
    assert mixes == [] and dispatches == [1]


def test_a_few_rows_stay_on_the_device_routed_kernels(monkeypatch):
    block = _block("silu")
    x = _x()[: kernels.moe.MAX_TOKENS]
    mixes = _count(monkeypatch, grouped_experts, "grouped_mix")
    with torch.inference_mode():
        block(x)
    assert mixes == []


def test_a_stack_decodes_in_one_launch_as_each_expert_alone(cuda_extension):
    """``exl3_weight_stack_into`` over experts 3..11 of a stack, into the second half of each
    matrix's columns, writes exactly what one ``exl3_weight_into`` per expert writes."""
    stack = _block("gpt_oss", seed=5).stacked.up
    first, last, col = 3, 11, stack.padded_out
    w = torch.zeros(last - first, stack.padded_in, 2 * stack.padded_out, dtype=torch.bfloat16, device="cuda")
    cuda_extension.exl3_weight_stack_into(
        stack.trellis[first:last], stack.suh[first:last], stack.svh[first:last], 2, w, col
    )
    for i, e in enumerate(range(first, last)):
        alone = torch.zeros(stack.padded_in, 2 * stack.padded_out, dtype=torch.bfloat16, device="cuda")
        cuda_extension.exl3_weight_into(stack.trellis[e], stack.suh[e], stack.svh[e], 2, alone, col)
        assert torch.equal(w[i], alone), f"expert {e}"
    assert not w[:, :, :col].any()  # columns before col0 untouched
