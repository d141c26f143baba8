"""The mixture of experts' routing variants, as data (``SparseMoESpec``): softmax or sigmoid
scores, a selection-only bias, renormalised and scaled weights, group-limited choice, gated or
squared-ReLU experts, a shared expert with or without its gate, a latent width.

Each variant is checked against a token-by-token reference written here from the definitions,
and the families' own blocks (transformers' DeepSeek-V3, NemotronH, LFM2-MoE) are read from their
state dicts through the kind's build function and must compute what transformers computes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine.architectures.base import TensorNames
from engine.layers.sparse_moe import SparseMoENames, SparseMoESpec, build_sparse_moe
from engine.layers.spec import LayerSpec, ModelSpec
from engine.loading.builder import LayerReader, ModelBuilder
from engine.loading.safetensors_store import WeightStore
from engine.modules.feed_forward import FeedForward
from engine.modules.linear import DenseLinear, ProjectionGroup
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE

HIDDEN, WIDTH, TOKENS = 16, 12, 48


def _w(gen: torch.Generator, out: int, inp: int) -> torch.Tensor:
    return torch.randn(out, inp, generator=gen) / inp**0.5


def _expert(gen: torch.Generator, gated: bool, d: int = HIDDEN, f: int = WIDTH):
    if gated:
        gate_up = ProjectionGroup([(DenseLinear(_w(gen, f, d)), [f]), (DenseLinear(_w(gen, f, d)), [f])])
        return GatedMLP(gate_up, DenseLinear(_w(gen, d, f)), "silu")
    return FeedForward(DenseLinear(_w(gen, f, d)), DenseLinear(_w(gen, d, f)), "relu2")


def _block(
    experts: int = 8,
    top_k: int = 2,
    *,
    scoring: str = "softmax",
    normalize: bool = False,
    bias: bool = False,
    scale: float = 1.0,
    groups: tuple[int, int] = (1, 1),
    gated: bool = True,
    shared: str | None = None,  # None, "gated" (with a sigmoid gate) or "plain"
    latent: int = 0,
    seed: int = 0,
) -> SparseMoE:
    gen = torch.Generator().manual_seed(seed)
    d = latent or HIDDEN
    extra = {}
    if latent:
        extra = dict(latent_in=DenseLinear(_w(gen, d, HIDDEN)), latent_out=DenseLinear(_w(gen, HIDDEN, d)))
    return SparseMoE(
        DenseLinear(torch.randn(experts, HIDDEN, generator=gen)),
        [_expert(gen, gated, d) for _ in range(experts)],
        top_k,
        normalize,
        _expert(gen, gated) if shared else None,
        DenseLinear(_w(gen, 1, HIDDEN)) if shared == "gated" else None,
        scoring=scoring,
        # Of the size of the scores' spread, so that it changes some choices.
        selection_bias=torch.randn(experts, generator=gen) * 0.3 if bias else None,
        scale=scale,
        num_groups=groups[0],
        groups_per_token=groups[1],
        **extra,
    )


def _reference_choice(block: SparseMoE, row: torch.Tensor) -> tuple[list[int], list[float]]:
    """One token's experts and weights, straight from the definitions."""
    logits = block.router(row[None])[0].double()
    scores = logits.softmax(-1) if block.scoring == "softmax" else logits.sigmoid()
    biased = scores + (block.selection_bias.double() if block.selection_bias is not None else 0.0)
    n = len(scores)
    allowed = list(range(n))
    if block.num_groups > 1:
        size = n // block.num_groups
        groups = [list(range(g * size, (g + 1) * size)) for g in range(block.num_groups)]

        def worth(group: list[int]) -> float:
            return sum(sorted((float(biased[e]) for e in group), reverse=True)[:2])

        best = sorted(groups, key=worth, reverse=True)[: block.groups_per_token]
        allowed = [e for g in best for e in g]
    chosen = sorted(allowed, key=lambda e: -float(biased[e]))[: block.top_k]
    weights = [float(scores[e]) for e in chosen]
    if block.normalize:
        weights = [w / sum(weights) for w in weights]
    return chosen, [w * block.scale for w in weights]


def _reference(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        row = x[t : t + 1]
        inner = block.latent_in(row) if block.latent_in is not None else row
        routed = sum(w * block.experts[e](inner)[0] for e, w in zip(*_reference_choice(block, x[t])))
        out[t] = block.latent_out(routed[None])[0] if block.latent_out is not None else routed
        if block.shared is not None:
            gate = torch.sigmoid(block.shared_gate(row)[0]) if block.shared_gate is not None else 1.0
            out[t] += gate * block.shared(row)[0]
    return out


VARIANTS = {
    "softmax": dict(),
    "softmax-normalized-shared-gate": dict(normalize=True, shared="gated"),
    "sigmoid": dict(scoring="sigmoid", top_k=3),
    "sigmoid-bias-normalized-scaled": dict(scoring="sigmoid", bias=True, normalize=True, scale=2.5, top_k=4),
    "grouped": dict(scoring="sigmoid", bias=True, normalize=True, scale=1.5, groups=(4, 2), top_k=3),
    "squared-relu-plain-shared": dict(
        scoring="sigmoid", bias=True, normalize=True, gated=False, shared="plain"
    ),
    "latent": dict(scoring="sigmoid", bias=True, normalize=True, gated=False, shared="plain", latent=8),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_routing_variants_match_the_definitions(variant):
    block = _block(**VARIANTS[variant])
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    weights, chosen = block.route(x)
    for t in range(TOKENS):
        ref_chosen, ref_weights = _reference_choice(block, x[t])
        assert sorted(chosen[t].tolist()) == sorted(ref_chosen)
        got = dict(zip(chosen[t].tolist(), weights[t].tolist()))
        assert [got[e] for e in ref_chosen] == pytest.approx(ref_weights, rel=1e-5)
    torch.testing.assert_close(block(x), _reference(block, x), rtol=1e-5, atol=1e-5)


def test_the_selection_bias_steers_the_choice_but_not_the_weights():
    block = _block(scoring="sigmoid", bias=True, top_k=3)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    weights, chosen = block.route(x)
    scores = block.router(x).sigmoid()
    unbiased = scores.topk(3, dim=-1).indices.sort(-1).values
    assert (chosen.sort(-1).values != unbiased).any(dim=-1).sum() >= 3  # some tokens change experts
    torch.testing.assert_close(weights, scores.gather(-1, chosen))  # weighed by the plain scores


def test_group_limited_routing_keeps_to_the_best_groups():
    block = _block(scoring="sigmoid", bias=True, groups=(4, 2), top_k=3)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    _, chosen = block.route(x)
    assert all(len(set((chosen[t] // 2).tolist())) <= 2 for t in range(TOKENS))  # experts of 2 groups
    free = _block(scoring="sigmoid", bias=True, top_k=3)
    _, unlimited = free.route(x)
    assert any(len(set((unlimited[t] // 2).tolist())) == 3 for t in range(TOKENS))  # a real limit


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(scoring="tanh"), "scoring"),
        (dict(groups=(3, 1)), "groups"),
        (dict(groups=(4, 1), top_k=3), "top_k"),
    ],
)
def test_impossible_routings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _block(**kwargs)


def test_squared_relu_experts_list_their_two_linears_for_the_converter():
    block = _block(gated=False, shared="plain", latent=8)
    roles = [(site.role, site.routed) for site in block.quantizable_linears()]
    assert roles[0] == ("latent_in", False) and roles[-3] == ("latent_out", False)
    assert roles[1:-3] == [("up", True), ("down", True)] * 8 and roles[-2:] == [
        ("up", False),
        ("down", False),
    ]


# -- the families' blocks, read through the kind's build function ------------------------------


def _read(state: dict[str, torch.Tensor], prefix: str, spec: SparseMoESpec, names: SparseMoENames, tmp_path):
    """Build ``spec`` from ``state`` (saved under ``model.layers.0.<prefix>``) with the real reader."""
    path = tmp_path / "model.safetensors"
    save_file({f"model.layers.0.{prefix}{k}": v.contiguous() for k, v in state.items()}, str(path))
    model = ModelSpec(320, HIDDEN, 64, (LayerSpec(None, spec),), 1e-6)
    builder = ModelBuilder(model, TensorNames(), WeightStore(tmp_path), torch.float32, "cpu", 64)
    return build_sparse_moe(LayerReader(builder, "model.layers.0.", {}), spec, names)


def _randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Transformers' bare blocks start with zero or uninitialised weights: give every tensor
    random values (the score biases too)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            scale = 0.3 if t.dim() == 1 else t.shape[-1] ** -0.5
            t.copy_(torch.randn(t.shape, generator=gen) * scale)
    return module.eval()


def _check(reference: torch.nn.Module, ours: SparseMoE) -> None:
    x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(x)
    got = ours(x[0])
    assert ((got - expected[0]).norm() / expected.norm()).item() < 1e-5


@pytest.mark.parametrize("latent", [0, 8])
def test_a_nemotron_h_moe_layer_maps_onto_the_spec(latent, tmp_path):
    """NemotronH's "E" layer (``mixer.*``): sigmoid router with ``e_score_correction_bias``,
    grouped top-k, squared-ReLU experts (up and down only, fused 3-D in memory), a plain shared
    expert, optionally Nemotron-3's latent projections."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    if latent and "moe_latent_size" not in NemotronHConfig().to_dict():
        pytest.skip("this transformers' NemotronH has no latent MoE")
    config = NemotronHConfig(
        hidden_size=HIDDEN,
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=WIDTH,
        moe_shared_expert_intermediate_size=20,
        moe_latent_size=latent or None,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        mlp_hidden_act="relu2",
    )
    reference = _randomised(NemotronHMoE(config), seed=5)
    spec = SparseMoESpec(
        num_experts=config.n_routed_experts,
        experts_per_token=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        normalize=config.norm_topk_prob,
        activation=config.mlp_hidden_act,
        shared_expert_size=config.moe_shared_expert_intermediate_size,
        shared_expert_gate=False,
        gated=False,
        scoring="sigmoid",
        selection_bias=True,
        routed_scale=config.routed_scaling_factor,
        num_groups=config.n_group,
        groups_per_token=config.topk_group,
        latent_size=config.moe_latent_size or 0,
    )
    names = SparseMoENames(
        router="mixer.gate",
        selection_bias="mixer.gate.e_score_correction_bias",
        expert_up="mixer.experts.{e}.up_proj",
        expert_down="mixer.experts.{e}.down_proj",
        experts_fused="mixer.experts",
        shared_expert="mixer.shared_experts",
        latent_in="mixer.fc1_latent_proj",
        latent_out="mixer.fc2_latent_proj",
    )
    ours = _read(reference.state_dict(), "mixer.", spec, names, tmp_path)
    assert isinstance(ours.experts[0], FeedForward) and ours.shared_gate is None
    _check(reference, ours)


def test_a_deepseek_v3_moe_layer_maps_onto_the_spec(tmp_path):
    """DeepSeek-V3 (and GLM-4.5's same router): grouped sigmoid routing with a correction bias,
    SwiGLU experts, ``n_shared_experts`` gated-MLP shared experts without a gate."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(
        hidden_size=HIDDEN,
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=WIDTH,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    reference = _randomised(DeepseekV3MoE(config), seed=6)
    spec = SparseMoESpec(
        num_experts=8,
        experts_per_token=3,
        intermediate_size=WIDTH,
        normalize=True,
        shared_expert_size=WIDTH * config.n_shared_experts,
        shared_expert_gate=False,
        scoring="sigmoid",
        selection_bias=True,
        routed_scale=2.5,
        num_groups=4,
        groups_per_token=2,
    )
    names = SparseMoENames(shared_expert="mlp.shared_experts")
    ours = _read(reference.state_dict(), "mlp.", spec, names, tmp_path)
    _check(reference, ours)


def test_an_lfm2_moe_layer_maps_onto_the_spec(tmp_path):
    """LFM2-MoE: sigmoid router whose ``expert_bias`` (beside the router, not in it) steers the
    choice, normalised weights, SwiGLU experts named w1/w3/w2."""
    from transformers import Lfm2MoeConfig
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeSparseMoeBlock

    config = Lfm2MoeConfig(
        hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=WIDTH
    )
    reference = _randomised(Lfm2MoeSparseMoeBlock(config), seed=7)
    spec = SparseMoESpec(8, 3, WIDTH, normalize=True, scoring="sigmoid", selection_bias=True)
    names = SparseMoENames(
        router="feed_forward.gate",
        selection_bias="feed_forward.expert_bias",
        experts_fused="feed_forward.experts",
    )
    ours = _read(reference.state_dict(), "feed_forward.", spec, names, tmp_path)
    _check(reference, ours)


def test_squared_relu_is_relu_then_square():
    x = torch.linspace(-2, 2, 9)
    block = _block(gated=False)
    torch.testing.assert_close(block.experts[0].act(x), F.relu(x) ** 2)
