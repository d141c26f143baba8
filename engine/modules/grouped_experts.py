"""A mixture's routed experts over a long prefill chunk as grouped GEMMs: one GEMM per projection
kind for every expert at once, instead of about ten launches per chosen expert
(``SparseMoE._dispatch``). Computes what ``_dispatch`` computes, summed in float32.

1. The (token, slot) pairs are sorted by expert on the device; each expert's rows end at the
   cumulative sum of the per-expert counts (int32 offsets, on the device), and the rows are
   gathered once.
2. The experts' whole weights come from :class:`ExpertWeights` (EXL3 stacks decoded by
   ``engine.kernels.moe_grouped``; the tests' dense weights), in groups of experts whose
   decoded weights stay under :data:`GROUP_WEIGHT_BYTES` (the model is already on the GPU: the
   temporary must be small). With one group nothing is read on the host; with several the
   groups' row ranges are (one sync).
3. Gate and up side by side in one grouped GEMM, the experts' biases per row, the activation as
   :class:`~engine.modules.mlp.GatedMLP` computes it and scaled by the row's mixing weight (down
   is linear, so its output comes out already weighted; its bias is scaled alike), down.
4. Each output row goes back to its (token, slot) place (a permutation: a copy, no atomics),
   and a token's ``top_k`` rows are summed in float32 by one reduction. So the ``tokens x
   top_k`` output rows are never copied to float32, multiplied or added with atomics; only the
   narrower activations are scaled.

:func:`grouped_prefill` is ``SparseMoE._routed``'s entry: stacked EXL3 experts, bf16 activations,
more rows than ``engine.kernels.moe.MAX_TOKENS``, outside CUDA-graph capture. It returns None
elsewhere, and the caller runs ``_dispatch``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import kernels
from engine.modules.mlp import ACTIVATIONS, gated_product
from engine.modules.stacked_experts import ExpertActivation, StackedExperts

# The most bytes of decoded weights (gate, up and down together) one group of experts holds.
GROUP_WEIGHT_BYTES = 512 << 20

# Experts' weights of a range: (first, last, dtype) -> [last - first, rows, columns], or None
# where they cannot be had (no extension).
Decode = Callable[[int, int, torch.dtype], torch.Tensor | None]


@dataclass
class ExpertWeights:
    """A layer's routed experts as whole weights, a range of experts at a time.

    ``gate_up`` gives ``[n, padded_in, columns]``: the gate's ``padded_hidden`` columns then the
    up's (gated experts), or the up's alone; ``down`` gives ``[n, padded_hidden, padded_out]``.
    Columns and rows beyond the true features are padding (the inputs there are zeros, the
    outputs there are cut). Biases are float32 ``[experts, features]``, None without."""

    num_experts: int
    in_features: int
    padded_in: int
    hidden: int
    padded_hidden: int
    padded_out: int
    activation: ExpertActivation
    gate_up: Decode
    down: Decode
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    def bytes_per_expert(self, dtype: torch.dtype) -> int:
        """One expert's decoded weights, all projection kinds."""
        kinds = 2 if self.activation.gated else 1
        return (kinds * self.padded_in + self.padded_out) * self.padded_hidden * dtype.itemsize


def grouped_mm_op() -> Callable[..., torch.Tensor] | None:
    """torch's grouped GEMM (``F.grouped_mm``, or the older ``torch._grouped_mm``), None where
    this torch has neither."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def from_stacked(stacked: StackedExperts) -> ExpertWeights:
    """The EXL3 experts of ``stacked`` decoded by the extension (``engine.kernels.moe_grouped``)."""
    up, down = stacked.up, stacked.down
    kinds = [up] if stacked.gate is None else [stacked.gate, up]

    def gate_up(first: int, last: int, dtype: torch.dtype) -> torch.Tensor | None:
        return kernels.moe_grouped.decode_experts(kinds, first, last, dtype)

    def down_weights(first: int, last: int, dtype: torch.dtype) -> torch.Tensor | None:
        return kernels.moe_grouped.decode_experts([down], first, last, dtype)

    return ExpertWeights(
        num_experts=stacked.num_experts,
        in_features=up.in_features,
        padded_in=up.padded_in,
        hidden=up.out_features,
        padded_hidden=up.padded_out,
        padded_out=down.padded_out,
        activation=stacked.activation,
        gate_up=gate_up,
        down=down_weights,
        gate_bias=None if stacked.gate is None else stacked.gate.bias,
        up_bias=up.bias,
        down_bias=down.bias,
    )


def grouped_prefill(
    x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, stacked: StackedExperts | None
) -> torch.Tensor | None:
    """The routed experts' mix (float32 ``[tokens, features]``) by grouped GEMMs where they apply:
    stacked experts still current, a CUDA ``x`` in bf16 (the grouped GEMM's CUDA
    dtype) of more than ``engine.kernels.moe.MAX_TOKENS`` rows, no graph being captured (several
    expert groups read their row ranges on the host), padded widths the GEMM's 16-byte strides
    take. Else None."""
    if stacked is None or not x.is_cuda:
        return None
    if x.dtype != torch.bfloat16 or x.ndim != 2 or x.shape[0] <= kernels.moe.MAX_TOKENS:
        return None
    if torch.cuda.is_current_stream_capturing() or not stacked.current():
        return None
    if stacked.down.padded_in != stacked.up.padded_out or any(
        n % 8 for n in (stacked.up.padded_in, stacked.up.padded_out, stacked.down.padded_out)
    ):
        return None
    return grouped_mix(x, weights, chosen, from_stacked(stacked), budget=GROUP_WEIGHT_BYTES)


def _expert_groups(ends: torch.Tensor, num_experts: int, per_group: int) -> list[tuple[int, int, slice]]:
    """``(first, last, rows)`` of each group of ``per_group`` experts that has rows; one group of
    all experts and all rows without reading ``ends`` on the host."""
    if per_group >= num_experts:
        return [(0, num_experts, slice(None))]
    bounds = [0, *ends.tolist()]  # the one host sync: slicing rows needs the group's range
    groups = []
    for first in range(0, num_experts, per_group):
        last = min(first + per_group, num_experts)
        if bounds[last] > bounds[first]:
            groups.append((first, last, slice(bounds[first], bounds[last])))
    return groups


@torch.no_grad()
def grouped_mix(
    x: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    experts: ExpertWeights,
    budget: int = GROUP_WEIGHT_BYTES,
) -> torch.Tensor | None:
    """``sum over slots of weights[t, s] * expert_{chosen[t, s]}(x[t])`` in float32 for ``x``
    ``[tokens, in_features]``, ``weights``/``chosen`` ``[tokens, top_k]``, computed in ``x``'s
    dtype by one grouped GEMM per projection kind and group of experts (decoded weights of a group
    under ``budget`` bytes; at least one expert a group). None where torch has no grouped GEMM or
    the weights cannot be decoded."""
    mm = grouped_mm_op()
    if mm is None:
        return None
    if x.ndim != 2 or x.shape[1] != experts.in_features:
        raise ValueError(f"grouped_mix: x must be [tokens, {experts.in_features}], got {tuple(x.shape)}")
    if chosen.shape != weights.shape or chosen.shape[0] != x.shape[0]:
        raise ValueError("grouped_mix: weights and chosen must both be [tokens, top_k] of x's tokens")
    n = experts.num_experts
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)
    by_expert = flat[order]
    tokens = order // chosen.shape[1]
    mix = weights.reshape(-1)[order].float().unsqueeze(1)
    ends = torch.bincount(flat, minlength=n)[:n].cumsum(0).to(torch.int32)
    rows = x.index_select(0, tokens)
    if experts.padded_in > experts.in_features:
        rows = F.pad(rows, (0, experts.padded_in - experts.in_features))
    # Every (token, slot) pair's weighted expert output, at row token * top_k + slot.
    pairs = torch.empty(flat.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    per_group = max(1, budget // experts.bytes_per_expert(x.dtype))
    for first, last, part in _expert_groups(ends, n, per_group):
        offsets = ends[first:last] - part.start if part.start else ends[first:last]
        y = _experts_on_rows(mm, rows[part], offsets, by_expert[part], mix[part], first, last, experts)
        if y is None:
            return None
        pairs.index_copy_(0, order[part], y)
    return pairs.view(x.shape[0], chosen.shape[1], x.shape[1]).sum(dim=1, dtype=torch.float32)


def _experts_on_rows(
    mm: Callable[..., torch.Tensor],
    rows: torch.Tensor,
    offsets: torch.Tensor,
    by_expert: torch.Tensor,
    mix: torch.Tensor,
    first: int,
    last: int,
    experts: ExpertWeights,
) -> torch.Tensor | None:
    """Experts ``first..last-1`` on their rows (sorted by expert; expert ``first + i``'s end at
    ``offsets[i]``): ``[rows, in_features]`` in ``rows``' dtype, each row its own expert's output
    with its biases, as the expert module returns it, times the row's mixing weight ``mix``
    (float32 ``[rows, 1]``)."""
    dtype = rows.dtype
    w = experts.gate_up(first, last, dtype)
    if w is None:
        return None
    h = mm(rows, w, offs=offsets)
    del w
    act, hidden, ph = experts.activation, experts.hidden, experts.padded_hidden
    up = h[:, ph : ph + hidden] if act.gated else h[:, :hidden]
    if experts.up_bias is not None:
        up = up + experts.up_bias[by_expert].to(dtype)
    if act.gated:
        gate = h[:, :hidden]
        if experts.gate_bias is not None:
            gate = gate + experts.gate_bias[by_expert].to(dtype)
        a = gated_product(gate, up, act.name, act.limit, act.limit_after_act, act.up_offset)
    else:
        a = ACTIVATIONS[act.name](up)
    del h
    a = a.mul_(mix)  # in place: computed in float32, rounded once to the activations' dtype
    a = F.pad(a, (0, ph - hidden)) if ph > hidden else a.contiguous()
    w = experts.down(first, last, dtype)
    if w is None:
        return None
    y = mm(a, w, offs=offsets)[:, : experts.in_features]
    if experts.down_bias is not None:
        y = y + (experts.down_bias[by_expert] * mix).to(dtype)
    return y
