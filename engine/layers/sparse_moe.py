"""The sparse mixture of experts as a feed-forward kind: its spec (every family's routing as data),
where checkpoints keep its router and experts, and how they become a
:class:`~engine.modules.moe.SparseMoE`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.gated_mlp import GatedMLPNames
from engine.layers.kind import FeedForwardKind
from engine.layers.spec import FeedForwardSpec
from engine.modules.feed_forward import FeedForward
from engine.modules.linear import DenseLinear, ProjectionGroup
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE

if TYPE_CHECKING:
    from engine.loading.builder import LayerReader


@dataclass(frozen=True)
class SparseMoESpec(FeedForwardSpec):
    """A mixture of experts (the config fields of the families in parentheses).

    Experts:
      ``num_experts`` (num_experts, num_local_experts, n_routed_experts); ``experts_per_token``
      (num_experts_per_tok); ``intermediate_size``: each routed expert's width
      (moe_intermediate_size); ``gated``: an expert is ``down(act(gate(x)) * up(x))`` (SwiGLU),
      else ``down(act(up(x)))`` with only up and down projections (NemotronH);
      ``activation`` (hidden_act; NemotronH's mlp_hidden_act "relu2"); ``latent_size``: the
      routed experts work in this width, between a projection in and one out (NemotronH's
      moe_latent_size; 0: none).
    Router:
      ``scoring``: "softmax" over the experts (Mixtral, Qwen-MoE, Ernie 4.5) or "sigmoid" per
      expert (DeepSeek-V3, GLM-4.5, dots.llm1, MiniMax-M2, LFM2-MoE, NemotronH);
      ``selection_bias``: a learned per-expert bias added to the scores to choose the experts,
      not to weigh them, after either scoring (LFM2-MoE's ``expert_bias`` with use_expert_bias,
      ``e_score_correction_bias`` elsewhere); ``normalize``: the chosen
      experts' weights renormalised to sum to one (norm_topk_prob); ``routed_scale``: the
      weights' final factor (routed_scaling_factor); ``num_groups`` / ``groups_per_token``:
      each token chooses among the experts of its best groups only (n_group / topk_group).
    Shared expert:
      ``shared_expert_size``: the width of an expert every token goes through, gated or not as
      the routed ones are (shared_expert_intermediate_size, moe_shared_expert_intermediate_size,
      or n_shared_experts * moe_intermediate_size; 0: none); ``shared_expert_gate``: its output
      is scaled by ``sigmoid(linear(x))`` (Qwen2-MoE's shared_expert_gate);
      ``shared_expert_bias``: its projections have biases (Ernie 4.5's use_bias).
    Clamped SwiGLU (GatedMLP's ``limit``): ``limit`` bounds the routed experts' activations,
    ``shared_expert_limit`` the shared expert's (Step 3.5's per-layer swiglu_limits and
    swiglu_limits_shared; None: unclamped); ``limit_after_act`` False: the gate is clamped
    before its activation, and ``up_offset`` is added to the clipped up (gpt-oss's clamped
    SwiGLU: activation quick_gelu, swiglu_limit, offset 1).
    Biases: ``expert_bias``: each routed expert's projections have one; ``router_bias``: the
    router's linear has one (gpt-oss, both).
    """

    kind: ClassVar[str] = "sparse_moe"

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    normalize: bool = False
    activation: str = "silu"
    shared_expert_size: int = 0
    shared_expert_gate: bool = True
    shared_expert_bias: bool = False
    gated: bool = True
    scoring: str = "softmax"
    selection_bias: bool = False
    routed_scale: float = 1.0
    num_groups: int = 1
    groups_per_token: int = 1
    latent_size: int = 0
    limit: float | None = None
    shared_expert_limit: float | None = None
    limit_after_act: bool = True
    up_offset: float = 0.0
    expert_bias: bool = False
    router_bias: bool = False


@dataclass(frozen=True)
class SparseMoENames:
    """The router, each expert's projections as the Hub checkpoints store them (``{e}`` = expert
    index), and the fused 3-D tensors that transformers 5 keeps in memory, under
    ``experts_fused``: ``gate_up_proj`` [experts, 2 * f, hidden] and ``down_proj`` [experts,
    hidden, f] of gated experts, ``up_proj`` [experts, f, hidden] and ``down_proj`` of others.
    ``selection_bias_row``: the selection bias is stored as one row, [1, experts] (Ernie 4.5).
    ``experts_stacked``: where each projection of all the experts is one 3-D tensor,
    ``{experts_stacked}.gate_proj.weight`` [experts, f, hidden], ``up_proj`` alike and
    ``down_proj`` [experts, hidden, f] (Step 3.5's ``moe``); None: no such layout.
    ``experts_fused_in_out``: the fused tensors are [experts, in, out] whatever their shapes, with
    their biases beside them (``gate_up_proj_bias`` [experts, 2 * f], ``down_proj_bias``), and
    ``gate_up_interleaved``: gate and up rows alternate in them (gpt-oss, both)."""

    kind: ClassVar[str] = "sparse_moe"

    router: str = "mlp.gate"
    selection_bias: str = "mlp.gate.e_score_correction_bias"
    expert_gate: str = "mlp.experts.{e}.gate_proj"
    expert_up: str = "mlp.experts.{e}.up_proj"
    expert_down: str = "mlp.experts.{e}.down_proj"
    experts_fused: str = "mlp.experts"
    shared_expert: str = "mlp.shared_expert"  # gate_proj (if gated), up_proj, down_proj
    shared_expert_gate: str = "mlp.shared_expert_gate"
    latent_in: str = "mlp.fc1_latent_proj"
    latent_out: str = "mlp.fc2_latent_proj"
    selection_bias_row: bool = False
    experts_stacked: str | None = None
    experts_fused_in_out: bool = False
    gate_up_interleaved: bool = False

    def expert(self, e: int) -> GatedMLPNames:
        return GatedMLPNames(
            self.expert_gate.format(e=e), self.expert_up.format(e=e), None, self.expert_down.format(e=e)
        )


def build_sparse_moe(reader: LayerReader, spec: SparseMoESpec, names: SparseMoENames) -> SparseMoE:
    h = reader.hidden_size
    d = spec.latent_size or h  # the width the routed experts read and write
    latent_in = latent_out = None
    if spec.latent_size:
        latent_in = reader.linear(names.latent_in, h, d)
        latent_out = reader.linear(names.latent_out, d, h)
    shared = shared_gate = None
    if spec.shared_expert_size:
        k = names.shared_expert
        shared_names = GatedMLPNames(f"{k}.gate_proj", f"{k}.up_proj", None, f"{k}.down_proj")
        shared = _expert(
            reader,
            spec,
            shared_names,
            spec.shared_expert_size,
            h,
            spec.shared_expert_bias,
            spec.shared_expert_limit,
        )
        if spec.shared_expert_gate:
            shared_gate = reader.linear(names.shared_expert_gate, h, 1)
    # Float32 whatever the model's dtype (transformers keeps DeepSeek's and NemotronH's so): the
    # bias only decides which experts win, and rounded to bf16 it can reorder close scores.
    bias = None
    if spec.selection_bias:
        n = spec.num_experts
        shape = [1, n] if names.selection_bias_row else [n]
        bias = reader.tensor(names.selection_bias, shape, torch.float32).reshape(n)
    router = reader.linear(names.router, h, spec.num_experts, spec.router_bias)
    with reader.routed_experts():  # in host memory with --experts-on cpu (engine.modules.host_experts)
        experts = _routed_experts(reader, spec, names, d)
    return SparseMoE(
        router,
        experts,
        spec.experts_per_token,
        spec.normalize,
        shared,
        shared_gate,
        scoring=spec.scoring,
        selection_bias=bias,
        scale=spec.routed_scale,
        num_groups=spec.num_groups,
        groups_per_token=spec.groups_per_token,
        latent_in=latent_in,
        latent_out=latent_out,
    )


def _routed_experts(
    reader: LayerReader, spec: SparseMoESpec, names: SparseMoENames, d: int
) -> list[nn.Module]:
    """Experts stored one linear each (the Hub's layout, and every EXL3 conversion's) are read as
    such; otherwise the 3-D tensors that hold every expert's projections (transformers 5's fused
    ones, or a family's stacked ones) are sliced per expert (views: no copy), each slice keyed as
    the expert's own linear would be."""
    f, count, fused = spec.intermediate_size, spec.num_experts, names.experts_fused
    first = names.expert(0)
    if reader.has_linear(first.gate if spec.gated else first.up):
        return [
            _expert(reader, spec, names.expert(e), f, d, spec.expert_bias, spec.limit) for e in range(count)
        ]
    each = names.experts_stacked
    if each is not None and reader.has(f"{each}.up_proj.weight"):
        ups = reader.packed_tensor(f"{each}.up_proj.weight", [count, f, d])
        gates = reader.packed_tensor(f"{each}.gate_proj.weight", [count, f, d]) if spec.gated else None
        down = reader.packed_tensor(f"{each}.down_proj.weight", [count, d, f])
        return [
            _sliced_expert(reader, spec, names.expert(e), gates[e] if spec.gated else None, ups[e], down[e])
            for e in range(count)
        ]
    stacked = f"{fused}.gate_up_proj" if spec.gated else f"{fused}.up_proj"
    if not reader.has(stacked):
        return [
            _expert(reader, spec, names.expert(e), f, d, spec.expert_bias, spec.limit) for e in range(count)
        ]
    in_out = names.experts_fused_in_out
    ins = _fused(reader, stacked, [count, 2 * f if spec.gated else f, d], in_out)
    down = _fused(reader, f"{fused}.down_proj", [count, d, f], in_out)
    split = names.gate_up_interleaved
    if not spec.expert_bias:
        return [
            _sliced_expert(reader, spec, names.expert(e), *_gate_and_up(spec, ins[e], split), down[e])
            for e in range(count)
        ]
    # transformers' names for the fused experts' biases
    in_bias = reader.packed_tensor(f"{stacked}_bias", [count, ins.shape[1]])
    down_bias = reader.packed_tensor(f"{fused}.down_proj_bias", [count, d])
    return [
        _sliced_expert(
            reader,
            spec,
            names.expert(e),
            *_gate_and_up(spec, ins[e], split),
            down[e],
            (*_gate_and_up(spec, in_bias[e], split), down_bias[e]),
        )
        for e in range(count)
    ]


def _gate_and_up(
    spec: SparseMoESpec, ins: torch.Tensor, interleaved: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One expert's slice of ``gate_up_proj`` (gate rows, then up rows; or alternating, where
    ``interleaved``) as its gate and up weights (or biases); an ungated expert's ``up_proj``
    slice is its up weight alone."""
    if not spec.gated:
        return None, ins
    if interleaved:  # copies: every other row's view would slow each matmul
        return ins[0::2].contiguous(), ins[1::2].contiguous()
    f = ins.shape[0] // 2
    return ins[:f], ins[f:]


def _fused(reader: LayerReader, name: str, shape: list[int], in_out: bool = False) -> torch.Tensor:
    """A fused 3-D expert tensor as ``shape`` [experts, out, in]. Qwen3-VL-MoE's own checkpoints
    store theirs the other way round, [experts, in, out] (transformers 5 transposes them on
    loading): such a tensor is transposed here. A square one looks the same either way, and is
    taken as transformers 5 saves it, unless ``in_out`` says the family stores [experts, in, out]."""
    if in_out:
        return reader.packed_tensor(name, [shape[0], shape[2], shape[1]]).transpose(1, 2).contiguous()
    stored = reader.packed_tensor(name, None)
    if list(stored.shape) == shape:
        return stored
    if list(stored.shape) == [shape[0], shape[2], shape[1]]:
        # Contiguous, as every other layout's weights are: a strided one would slow each matmul.
        return stored.transpose(1, 2).contiguous()
    raise ModelLoadError(
        f"tensor '{reader.key(name)}' has shape {list(stored.shape)}, expected {shape} "
        f"or {[shape[0], shape[2], shape[1]]}"
    )


def _expert(
    reader: LayerReader,
    spec: SparseMoESpec,
    names: GatedMLPNames,
    f: int,
    d: int,
    bias: bool = False,
    limit: float | None = None,
) -> nn.Module:
    """One expert of width ``f`` over ``d`` features: a gated MLP (clamped at ``limit``), or up
    and down only; with ``bias``, each projection has one."""
    if spec.gated:
        gate_up = reader.projections([names.gate, names.up], d, [f, f], bias)
        down = reader.linear(names.down, f, d, bias)
        return GatedMLP(gate_up, down, spec.activation, limit, spec.limit_after_act, spec.up_offset)
    return FeedForward(
        reader.linear(names.up, d, f, bias), reader.linear(names.down, f, d, bias), spec.activation
    )


def _sliced_expert(
    reader: LayerReader,
    spec: SparseMoESpec,
    names: GatedMLPNames,
    gate: torch.Tensor | None,
    up: torch.Tensor,
    down: torch.Tensor,
    biases: tuple[torch.Tensor | None, ...] = (None, None, None),
) -> nn.Module:
    """One expert from its slices of the 3-D tensors (``gate`` None: an ungated expert), with
    ``biases`` of gate, up and down where it has them."""
    f = down.shape[1]
    gate_bias, up_bias, down_bias = biases
    down_linear = DenseLinear(down, down_bias, key=reader.key(names.down))
    up_linear = DenseLinear(up, up_bias, key=reader.key(names.up))
    if not spec.gated:
        return FeedForward(up_linear, down_linear, spec.activation)
    gate_linear = DenseLinear(gate, gate_bias, key=reader.key(names.gate))
    gate_up = ProjectionGroup([(gate_linear, [f]), (up_linear, [f])])
    return GatedMLP(gate_up, down_linear, spec.activation, spec.limit, spec.limit_after_act, spec.up_offset)


SPARSE_MOE = FeedForwardKind(SparseMoENames(), build_sparse_moe)
