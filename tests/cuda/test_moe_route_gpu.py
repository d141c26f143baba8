"""The router kernel (ext/moe_route.cu, engine.kernels.moe.route) against SparseMoE.route's torch
path: softmax and sigmoid scoring, with and without a selection bias, groups, normalisation, a
scale and per-expert scales, 8-512 experts, top-k 1-8, 1-64 tokens, fp16, bf16 and fp32; the
launches a MoE layer's decode step makes; a graph-replayed MoE block against eager calls.

The reference is the torch path with the router's logits computed in float64 and rounded once to
the activations' dtype (what the kernel's fp32 accumulation rounds to, up to a rare last-place
difference): the kernel then must give the same choice wherever no decision is near a tie, and
the same weights up to a few roundings of a logit. Rows whose decisions are that near a tie are
drawn again (the kernel takes equal values lower index first; torch.topk leaves their order
open)."""

from __future__ import annotations

import math

import pytest
import torch
from cuda_helpers import capture, needs_kernels
from torch import nn

from engine.kernels import moe as moe_kernels
from engine.modules.linear import DenseLinear
from engine.modules.moe import SparseMoE
from engine.modules.scaled_router import ScaledRouter

pytestmark = pytest.mark.cuda

# Logits may differ from the exactly rounded ones by this many units in the last place (the
# kernel's fp32 sum lands on the other side of a rounding boundary); decisions must be clear of it.
ULPS = 2


_route_kernel = needs_kernels("moe_route")


class _ExactRouter(nn.Module):
    """The dense router's logits summed in float64 and rounded once to x's dtype; not a
    DenseLinear, so a SparseMoE over it routes by the torch path."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.double() @ self.weight.double().T
        if self.bias is not None:
            y = y + self.bias.double()
        return y.to(x.dtype)


def _blocks(
    experts: int, hidden: int, top_k: int, dtype: torch.dtype, seed: int, **routing
) -> tuple[SparseMoE, SparseMoE]:
    """(a block over a DenseLinear router, the kernel's; its twin over the exact router, the
    reference), alike in everything else. ``routing``: SparseMoE's keyword arguments, with
    ``router_bias`` and ``selection_bias``/``expert_scale`` as booleans."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    # Logits of about 2 standard deviations: the scores spread, softmax's top ones well above 1/n.
    weight = (2 * torch.randn(experts, hidden, device="cuda", generator=g) / hidden**0.5).to(dtype)
    bias = (
        (0.5 * torch.randn(experts, device="cuda", generator=g)).to(dtype)
        if routing.pop("router_bias")
        else None
    )
    kwargs = dict(routing)
    if kwargs.pop("selection_bias"):
        kwargs["selection_bias"] = 0.1 * torch.randn(experts, device="cuda", generator=g)
    if kwargs.pop("expert_scale"):
        kwargs["expert_scale"] = (0.5 + torch.rand(experts, device="cuda", generator=g)).to(dtype)
    normalize = kwargs.pop("normalize")
    dummies = [nn.Identity() for _ in range(experts)]
    kernel = SparseMoE(DenseLinear(weight, bias), dummies, top_k, normalize, **kwargs)
    reference = SparseMoE(_ExactRouter(weight, bias), dummies, top_k, normalize, **kwargs)
    return kernel, reference


def _ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of each value of ``v`` in ``dtype``."""
    eps = torch.finfo(dtype).eps
    tiny = torch.finfo(dtype).tiny
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(tiny)))) * eps


def _scores(block: SparseMoE, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(biased scores, how far each can move when every logit moves by ``ULPS`` units in the last
    place), float64, from the logits as the reference rounds them."""
    lg = logits.double()
    if block.scoring == "softmax":
        s = lg.softmax(-1)
        own = s  # d s_e / d l_e (at most)
    else:
        s = lg.sigmoid()
        own = s * (1 - s)
    d = ULPS * _ulp(logits.float(), dtype).double()
    # Its own logit's change, and (softmax) the normaliser's.
    common = (s * d).sum(-1, keepdim=True) if block.scoring == "softmax" else torch.zeros_like(s[:, :1])
    move = own * d + s * common + 1e-6
    biased = s + (block.selection_bias.double() if block.selection_bias is not None else 0)
    return biased, move


def _decisive(block: SparseMoE, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per row: whether every decision of the torch path's routing (the top_k-th against the next
    expert, the last kept group against the next) holds under a change of each logit by ``ULPS``
    units in the last place."""
    biased, move = _scores(block, logits, dtype)
    rows, n = biased.shape
    ok = torch.ones(rows, dtype=torch.bool, device=biased.device)
    eligible = torch.ones_like(biased, dtype=torch.bool)
    if block.num_groups > 1:
        size = n // block.num_groups
        grouped = biased.reshape(rows, block.num_groups, size)
        worth = grouped.topk(min(2, size), dim=-1).values.sum(-1)
        worth_move = 2 * move.reshape(rows, block.num_groups, size).max(-1).values
        order = worth.argsort(-1, descending=True)
        if block.groups_per_token < block.num_groups:
            a, b = (
                order[:, block.groups_per_token - 1 : block.groups_per_token],
                order[:, block.groups_per_token :],
            )
            gap = worth.gather(-1, a) - worth.gather(-1, b)
            ok &= (gap > worth_move.gather(-1, a) + worth_move.gather(-1, b)).all(-1)
        keep = torch.zeros_like(worth, dtype=torch.bool).scatter_(
            -1, order[:, : block.groups_per_token], True
        )
        eligible = keep.repeat_interleave(size, dim=-1)
    masked = biased.masked_fill(~eligible, -math.inf)
    order = masked.argsort(-1, descending=True)
    k = block.top_k
    if k < int(eligible.sum(-1).min()):
        a, b = order[:, k - 1 : k], order[:, k : int(eligible.sum(-1).min())]
        gap = masked.gather(-1, a) - masked.gather(-1, b)
        ok &= (gap > move.gather(-1, a) + move.gather(-1, b)).all(-1)
    return ok


def _decisive_x(
    block: SparseMoE, reference: SparseMoE, tokens: int, hidden: int, dtype, seed: int
) -> torch.Tensor:
    """``tokens`` rows of x, each drawn until the reference's routing of it is decisive."""
    g = torch.Generator(device="cuda").manual_seed(1000 + seed)
    rows: list[torch.Tensor] = []
    for _ in range(50):
        x = torch.randn(8 * tokens, hidden, device="cuda", generator=g).to(dtype)
        with torch.no_grad():
            logits = reference.router(x).float()
        rows.extend(x[_decisive(block, logits, dtype)])
        if len(rows) >= tokens:
            return torch.stack(rows[:tokens]).contiguous()
    pytest.fail(f"only {len(rows)} of {tokens} rows with decisive routings")


def _by_expert(weights: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (weights, chosen) sorted by expert index: the slots' order within the choice is
    left to the ordering test."""
    chosen_sorted, order = chosen.sort(-1)
    return weights.gather(-1, order), chosen_sorted


def _rtol(dtype: torch.dtype) -> float:
    # A logit a few units in the last place off moves a weight by about that much, relatively.
    return 4 * ULPS * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5


def _check(block: SparseMoE, reference: SparseMoE, tokens: int, dtype: torch.dtype, seed: int) -> None:
    hidden = block.router.in_features
    x = _decisive_x(block, reference, tokens, hidden, dtype, seed)
    routed = block._route_in_one_launch(x)
    assert routed is not None, "the router kernel declined"
    weights, chosen = routed
    assert weights.dtype == torch.float32 and chosen.dtype == torch.int64
    assert weights.shape == chosen.shape == (tokens, block.top_k)
    assert weights.is_contiguous() and chosen.is_contiguous()
    ref_w, ref_c = reference.route(x)
    w, c = _by_expert(weights, chosen)
    rw, rc = _by_expert(ref_w, ref_c)
    assert torch.equal(c, rc), (c, rc)
    torch.testing.assert_close(w, rw, rtol=_rtol(dtype), atol=1e-6)
    # The slots in descending order of biased score (torch.topk's sorted order), up to the scores'
    # own uncertainty.
    biased, move = _scores(block, reference.router(x).float(), dtype)
    ordered, slack = biased.gather(-1, chosen), 2 * move.gather(-1, chosen)
    assert (ordered[:, :-1] >= ordered[:, 1:] - slack[:, :-1] - slack[:, 1:]).all()
    # SparseMoE.route takes the kernel: the same tensors' values.
    again_w, again_c = block.route(x)
    assert torch.equal(again_c, chosen) and torch.equal(again_w, weights)


_ROUTING = {
    "softmax": dict(scoring="softmax", normalize=False),
    "softmax_normalized": dict(scoring="softmax", normalize=True),  # Mixtral, Qwen3-MoE
    "softmax_biased": dict(scoring="softmax", normalize=True, selection_bias=True),  # Ernie 4.5
    "sigmoid": dict(scoring="sigmoid", normalize=False),
    "sigmoid_biased_scaled": dict(
        scoring="sigmoid", normalize=True, selection_bias=True, scale=2.5
    ),  # LFM2, GLM
    "sigmoid_groups": dict(
        scoring="sigmoid", normalize=True, selection_bias=True, scale=2.5, num_groups=8, groups_per_token=4
    ),  # DeepSeek-V3
    "softmax_groups": dict(scoring="softmax", normalize=False, num_groups=4, groups_per_token=2),
    "expert_scale": dict(scoring="softmax", normalize=True, expert_scale=True),
    "everything": dict(
        scoring="sigmoid",
        normalize=True,
        selection_bias=True,
        scale=1.5,
        num_groups=4,
        groups_per_token=3,
        expert_scale=True,
        router_bias=True,
    ),
}


def _routing(name: str, **over) -> dict:
    base = {"router_bias": False, "selection_bias": False, "expert_scale": False}
    return {**base, **_ROUTING[name], **over}


@pytest.mark.parametrize("name", list(_ROUTING))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_routings_equal_the_torch_path(name, dtype) -> None:
    for i, (experts, top_k) in enumerate([(8, 1), (8, 8), (32, 4), (64, 6), (128, 8), (256, 8)]):
        routing = _routing(name)
        groups = routing.get("num_groups", 1)
        if experts % groups or top_k > routing.get("groups_per_token", 1) * (experts // groups):
            continue
        block, reference = _blocks(experts, 256, top_k, dtype, seed=i, **routing)
        for tokens in (1, 3, 8, 64):
            _check(block, reference, tokens, dtype, seed=100 * i + tokens)


@pytest.mark.parametrize("top_k", range(1, 9))
def test_every_top_k(top_k) -> None:
    block, reference = _blocks(
        16, 128, top_k, torch.bfloat16, seed=top_k, **_routing("sigmoid_biased_scaled")
    )
    for tokens in (1, 5, 17):
        _check(block, reference, tokens, torch.bfloat16, seed=top_k + tokens)


def test_fp32_activations_and_the_most_experts() -> None:
    block, reference = _blocks(512, 64, 8, torch.float32, seed=3, **_routing("softmax_normalized"))
    _check(block, reference, 4, torch.float32, seed=3)
    block, reference = _blocks(512, 64, 8, torch.bfloat16, seed=4, **_routing("everything", num_groups=32))
    _check(block, reference, 9, torch.bfloat16, seed=4)


# gpt-oss-20b (2880 wide, top 4 of 32, a router bias), Qwen3-30B-A3B (2048, top 8 of 128),
# DeepSeek-V3 (7168, top 8 of 256 in 8 groups of which 4, sigmoid, bias, scale 2.5).
MODEL_ROUTERS = {
    "gpt_oss_20b": (2880, 32, 4, _routing("softmax_normalized", router_bias=True)),
    "qwen3_30b": (2048, 128, 8, _routing("softmax_normalized")),
    "deepseek_v3": (7168, 256, 8, _routing("sigmoid_groups")),
}


@pytest.mark.parametrize("model", list(MODEL_ROUTERS))
def test_model_routers(model) -> None:
    hidden, experts, top_k, routing = MODEL_ROUTERS[model]
    block, reference = _blocks(experts, hidden, top_k, torch.bfloat16, seed=7, **routing)
    for tokens in (1, 4, 64):
        _check(block, reference, tokens, torch.bfloat16, seed=tokens)


def test_replays_are_the_eager_calls_bit_for_bit() -> None:
    """No floating-point atomics and tickets the last block resets: a captured launch replays to
    the eager call's bits, for new inputs each time."""
    block, _ = _blocks(64, 512, 6, torch.float16, seed=5, **_routing("everything"))
    x = torch.randn(5, 512, device="cuda", dtype=torch.float16)
    graph, (weights, chosen) = capture(lambda: block.route(x))
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3):
        x.copy_(torch.randn(5, 512, device="cuda", generator=g))
        graph.replay()
        eager_w, eager_c = block.route(x)
        torch.cuda.synchronize()
        assert torch.equal(chosen, eager_c) and torch.equal(weights, eager_w)
    assert all(int(ws[1].abs().sum()) == 0 for ws in moe_kernels.workspaces())


def _softmax_route(x: torch.Tensor, weight: torch.Tensor, top_k: int = 2, **kwargs):
    return moe_kernels.route(x, weight, None, top_k, scoring="softmax", normalize=False, **kwargs)


def test_routers_the_kernel_does_not_read_take_the_torch_path() -> None:
    block, _ = _blocks(16, 128, 2, torch.float16, seed=6, **_routing("softmax"))
    x = torch.randn(2, 128, device="cuda", dtype=torch.float16)
    # Gemma 4's scaled router: not a plain linear
    scaled = ScaledRouter(nn.Identity(), torch.ones(128, device="cuda", dtype=torch.float16), block.router)
    gemma = SparseMoE(scaled, list(block.experts), 2, False)
    assert gemma._route_in_one_launch(x) is None
    weights, chosen = gemma.route(x)
    assert chosen.shape == (2, 2) and weights.dtype == torch.float32
    # more experts, slots or groups than the kernel holds, more rows than a decode step
    w = block.router.weight
    wide = torch.randn(64, 128, device="cuda").half()
    assert _softmax_route(x, torch.randn(513, 128, device="cuda").half()) is None
    assert _softmax_route(x, wide, top_k=9) is None
    assert _softmax_route(x, wide, num_groups=64, groups_per_token=2) is None
    assert _softmax_route(torch.randn(moe_kernels.MAX_TOKENS + 1, 128, device="cuda").half(), w) is None
    # a router of another dtype than x (the torch path's linear would refuse it too), CPU tensors
    assert _softmax_route(x, w.float()) is None
    assert _softmax_route(x.cpu(), w.cpu()) is None
    # rows that are not whole 16-byte vectors (12 fp16 features)
    assert _softmax_route(x[:, :12].contiguous(), w[:, :12].contiguous()) is None


def test_bad_arguments_are_refused() -> None:
    x = torch.randn(2, 128, device="cuda", dtype=torch.float16)
    w = torch.randn(16, 128, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="features"):
        moe_kernels.route(x, w[:, :64].contiguous(), None, 2, scoring="softmax", normalize=False)
    with pytest.raises(ValueError, match="scoring"):
        moe_kernels.route(x, w, None, 2, scoring="tanh", normalize=False)
    with pytest.raises(ValueError, match="top"):
        moe_kernels.route(x, w, None, 17, scoring="softmax", normalize=False)
    with pytest.raises(ValueError, match="groups"):
        moe_kernels.route(x, w, None, 8, scoring="softmax", normalize=False, num_groups=4, groups_per_token=1)
    with pytest.raises(ValueError, match="selection_bias"):
        moe_kernels.route(
            x, w, None, 2, scoring="sigmoid", normalize=False, selection_bias=torch.zeros(8, device="cuda")
        )
