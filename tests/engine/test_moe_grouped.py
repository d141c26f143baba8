"""The grouped-GEMM expert mix (engine.modules.grouped_experts) against SparseMoE._dispatch on the
CPU, from the experts' dense weights: softmax and sigmoid routers, gated (SiLU; gpt-oss's clamped
SwiGLU with biases) and plain (squared ReLU) experts, padded widths, uneven loads with experts
nobody chose, and a byte budget that splits the experts into several groups."""

from __future__ import annotations

import pytest
import torch

from engine.modules.feed_forward import FeedForward
from engine.modules.grouped_experts import ExpertWeights, grouped_mix, grouped_mm_op, grouped_prefill
from engine.modules.linear import DenseLinear, ProjectionGroup
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE
from engine.modules.stacked_experts import ExpertActivation

HIDDEN, WIDTH = 24, 40  # padded to 32 and 48 below: the padding is cut, its garbage never read
PAD_IN, PAD_HIDDEN, PAD_OUT = 32, 48, 32

# name -> (activation, gated, limit, limit_after_act, up_offset, biases)
KINDS = {
    "silu": ("silu", True, None, True, 0.0, False),  # Qwen3-MoE, Mixtral
    "gpt_oss": ("quick_gelu", True, 7.0, False, 1.0, True),  # clamped SwiGLU, (up + 1), biases
    "relu2": ("relu2", False, None, True, 0.0, False),  # NemotronH: up and down only
}

pytestmark = pytest.mark.skipif(grouped_mm_op() is None, reason="this torch has no grouped GEMM")


def _linear(gen: torch.Generator, n_in: int, n_out: int, bias: bool) -> DenseLinear:
    b = torch.randn(n_out, generator=gen) if bias else None
    return DenseLinear(torch.randn(n_out, n_in, generator=gen) / n_in**0.5, b)


def _expert(gen: torch.Generator, kind: str) -> torch.nn.Module:
    name, gated, limit, after, offset, bias = KINDS[kind]
    up, down = _linear(gen, HIDDEN, WIDTH, bias), _linear(gen, WIDTH, HIDDEN, bias)
    if not gated:
        return FeedForward(up, down, name)
    group = ProjectionGroup([(_linear(gen, HIDDEN, WIDTH, bias), [WIDTH]), (up, [WIDTH])])
    return GatedMLP(group, down, name, limit, after, offset)


def _block(kind: str, scoring: str, experts: int = 12, top_k: int = 3, seed: int = 0) -> SparseMoE:
    gen = torch.Generator().manual_seed(seed)
    # Uneven loads: a spread of router biases; the last two experts are never chosen.
    bias = torch.linspace(-1.0, 1.5, experts)
    bias[-2:] = -1e4
    router = DenseLinear(torch.randn(experts, HIDDEN, generator=gen), bias)
    extra = {}
    if scoring == "sigmoid":
        extra = dict(selection_bias=torch.randn(experts, generator=gen) * 0.1)
    return SparseMoE(
        router, [_expert(gen, kind) for _ in range(experts)], top_k, True, scoring=scoring, **extra
    )


class DenseWeights:
    """The experts' dense weights as grouped-GEMM operands, padded with garbage (the inputs there
    are zeros, the outputs there are cut); records the expert ranges asked for."""

    def __init__(self, block: SparseMoE, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(7)
        self.ranges: list[tuple[str, int, int]] = []
        experts = list(block.experts)
        self.gated = isinstance(experts[0], GatedMLP)
        kinds = [e.gate_up.linears for e in experts] if self.gated else [[e.fc1] for e in experts]
        downs = [e.down if self.gated else e.fc2 for e in experts]

        def padded(lin: DenseLinear, rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen) * 100  # garbage where the padding is
            w[: lin.in_features, : lin.out_features] = lin.weight.T
            return w

        self.gate_up_w = torch.stack(
            [torch.cat([padded(lin, PAD_IN, PAD_HIDDEN) for lin in lins], dim=1) for lins in kinds]
        ).to(dtype)
        self.down_w = torch.stack([padded(d, PAD_HIDDEN, PAD_OUT) for d in downs]).to(dtype)
        biases = [
            None if lins[0].bias is None else torch.stack([lin.bias for lin in lins]).float()
            for lins in zip(*kinds)
        ]
        self.gate_bias, self.up_bias = (None, biases[0]) if not self.gated else biases
        self.down_bias = None if downs[0].bias is None else torch.stack([d.bias for d in downs]).float()

    def gate_up(self, first: int, last: int, dtype: torch.dtype) -> torch.Tensor:
        self.ranges.append(("gate_up", first, last))
        return self.gate_up_w[first:last].to(dtype)

    def down(self, first: int, last: int, dtype: torch.dtype) -> torch.Tensor:
        self.ranges.append(("down", first, last))
        return self.down_w[first:last].to(dtype)

    def weights(self, block: SparseMoE) -> ExpertWeights:
        e0 = block.experts[0]
        if self.gated:
            act = ExpertActivation(e0.activation, True, e0.limit, e0.limit_after_act, float(e0.up_offset))
        else:
            act = ExpertActivation("relu2", False)
        return ExpertWeights(
            num_experts=len(block.experts),
            in_features=HIDDEN,
            padded_in=PAD_IN,
            hidden=WIDTH,
            padded_hidden=PAD_HIDDEN,
            padded_out=PAD_OUT,
            activation=act,
            gate_up=self.gate_up,
            down=self.down,
            gate_bias=self.gate_bias,
            up_bias=self.up_bias,
            down_bias=self.down_bias,
        )


def _x(tokens: int, seed: int = 1) -> torch.Tensor:
    # Scaled so that the clamped activations' limits (7) are reached.
    return 4 * torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_grouped_mix_matches_dispatch(kind, scoring):
    block = _block(kind, scoring)
    x = _x(150)
    weights, chosen = block.route(x)
    counts = torch.bincount(chosen.flatten(), minlength=12).tolist()
    assert counts[-2:] == [0, 0] and len(set(counts[:-2])) > 3  # uneven, and two experts idle
    dense = DenseWeights(block, torch.float32)
    got = grouped_mix(x, weights, chosen, dense.weights(block))
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, block._dispatch(x, weights, chosen), rtol=1e-4, atol=1e-4)
    # Within the budget: every expert's weights in one group, one grouped GEMM per kind.
    assert dense.ranges == [("gate_up", 0, 12), ("down", 0, 12)]


@pytest.mark.parametrize("kind", ["silu", "gpt_oss"])
def test_a_small_budget_splits_the_experts_into_groups(kind):
    block = _block(kind, "softmax")
    x = _x(120, seed=3)
    weights, chosen = block.route(x)
    dense = DenseWeights(block, torch.float32)
    experts = dense.weights(block)
    got = grouped_mix(x, weights, chosen, experts, budget=3 * experts.bytes_per_expert(torch.float32))
    torch.testing.assert_close(got, block._dispatch(x, weights, chosen), rtol=1e-4, atol=1e-4)
    # Groups of three; the last (experts 9..11) has rows from expert 9 alone, so it still runs,
    # each group's gate/up then its down.
    assert dense.ranges == [(k, first, first + 3) for first in (0, 3, 6, 9) for k in ("gate_up", "down")]


def test_a_group_nobody_chose_is_skipped():
    block = _block("silu", "softmax", experts=12, top_k=2)
    x = _x(100, seed=5)
    weights, chosen = block.route(x)
    chosen = chosen.clamp(max=7)  # experts 8..11 idle (a real router's choices are distinct; ours
    weights = weights.clone()  # need not be: duplicates just add twice, in both paths)
    dense = DenseWeights(block, torch.float32)
    experts = dense.weights(block)
    got = grouped_mix(x, weights, chosen, experts, budget=4 * experts.bytes_per_expert(torch.float32))
    torch.testing.assert_close(got, block._dispatch(x, weights, chosen), rtol=1e-4, atol=1e-4)
    assert [r for r in dense.ranges if r[0] == "gate_up"] == [("gate_up", 0, 4), ("gate_up", 4, 8)]


def test_grouped_mix_in_bf16_is_close_to_dispatch():
    block = _block("silu", "sigmoid").to(torch.bfloat16)
    x = _x(130).to(torch.bfloat16)
    weights, chosen = block.route(x)
    dense = DenseWeights(block, torch.bfloat16)
    got = grouped_mix(x, weights, chosen, dense.weights(block))
    want = block._dispatch(x, weights, chosen)
    exact = block.float()._dispatch(x.float(), weights.float(), chosen)

    def error(a: torch.Tensor) -> torch.Tensor:
        return (a - exact).norm(dim=1) / exact.norm(dim=1)

    # The same bf16 products, but the activations are weighted before down (one more bf16
    # rounding of each) and the sums run in another order: about as far from the float32 mix as
    # _dispatch is, and far below the O(1) of a wrong expert, bias or weight.
    assert float(error(got).median()) < 1.25 * float(error(want).median())
    assert float(error(got).max()) < 2 * float(error(want).max()) < 2e-2


def test_bad_shapes_are_refused():
    block = _block("silu", "softmax")
    x = _x(80)
    weights, chosen = block.route(x)
    experts = DenseWeights(block, torch.float32).weights(block)
    with pytest.raises(ValueError, match="tokens"):
        grouped_mix(x[:, :10], weights, chosen, experts)
    with pytest.raises(ValueError, match="top_k"):
        grouped_mix(x, weights[:, :2], chosen, experts)


def test_grouped_prefill_declines_off_the_gpu():
    block = _block("silu", "softmax")
    x = _x(100)
    weights, chosen = block.route(x)
    assert grouped_prefill(x, weights, chosen, block.stacked) is None  # CPU, no stacks


def test_padding_is_zero_filled_and_cut():
    """The padded input features are zeros (other garbage weights there change nothing) and the
    padded output features are cut (NaN there never reaches the mix)."""
    block = _block("relu2", "softmax")
    x = _x(90)
    weights, chosen = block.route(x)
    dense = DenseWeights(block, torch.float32)
    experts = dense.weights(block)
    a = grouped_mix(x, weights, chosen, experts)
    dense.gate_up_w[:, HIDDEN:] = -3.0  # rows the zero padding of x meets
    dense.down_w[:, WIDTH:] = 5.0  # rows the zero padding of the activation meets
    dense.gate_up_w[:, :, WIDTH:] = float("nan")  # the up's padded outputs
    dense.down_w[:, :, HIDDEN:] = float("nan")  # the down's padded outputs
    b = grouped_mix(x, weights, chosen, experts)
    assert torch.isfinite(b).all()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
