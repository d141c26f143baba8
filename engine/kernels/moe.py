"""A mixture-of-experts layer on the GPU for a few tokens: the router in one launch
(``ext/moe_route.cu``) and the routed experts with the router's choice read on the device
(``ext/exl3_expert_gemv.cu``): no host sync and fixed launch shapes, so a decode step of a
mixture-of-experts model can be replayed from a CUDA graph.

A layer without a shared expert is five launches:

1. :func:`route` (``moe_route``): the dense router's logits, the scores, the choice and the mixing
   weights, computing what ``engine.modules.moe.SparseMoE.route``'s torch path computes, written as
   the expert kernels read them (weights float32, chosen int64, ``[tokens, top_k]``);
2. :func:`expert_mlp`, which computes what ``SparseMoE._dispatch`` computes (its torch reference
   and CPU path), ``sum over slots of weight * expert(x)``, from experts stacked by
   ``engine.modules.stacked_experts``: (2) the gate and up GEMVs of every (token, slot) pair, read
   from ``x`` in its own dtype (the padded input features read as zeros: no upcast or padded copy
   of ``x``); (3) the activation with the experts' biases; (4) the down GEMVs; (5) the weighted
   sum, in float32 or straight in the activations' dtype (``out_dtype``). Each pair's GEMV blocks
   read their expert's index from ``chosen`` and run the workspace split-K GEMV's block
   (``ext/exl3_gemv.cuh``) on that expert's slice of the stacks.

Each returns its result, or None where it does not apply (CPU tensors, no extension, more than
:data:`MAX_TOKENS` rows, a router or an activation the kernels do not take): the caller then runs
the torch path. Routers and stacked experts are passed in, not imported.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from engine.kernels import loader
from engine.kernels.loader import CODEBOOK_IDS, KERNEL_DTYPES

# The experts' activations the kernel applies (ext/activations.cuh), by the names configs use.
ACT_IDS = {
    "silu": 0,
    "swish": 0,
    "gelu_pytorch_tanh": 1,
    "gelu_new": 1,
    "gelu_tanh": 1,
    "gelu": 2,
    "relu": 3,
    "relu2": 4,
    "quick_gelu": 5,
}
# The router kernel's bounds (ext/moe_route.cu): experts a warp holds in registers (16 a lane), the
# choice's slots, and groups (one a lane).
ROUTE_MAX_EXPERTS = 512
ROUTE_MAX_TOP_K = 8
ROUTE_MAX_GROUPS = 32
SCORINGS = ("softmax", "sigmoid")
# The extension's dtype codes (ext/exl3_common.cuh DType), for the mix's output.
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}

# Rows the device-routed path takes: a decode step of up to 8 sequences, and a speculative verify
# step (up to 64 rows), whose graph must not meet the torch path's host sync either. Each (row,
# slot) pair reads its expert on its own, so large prefill chunks take the torch path, which
# reads each chosen expert once.
MAX_TOKENS = 64

_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_route_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_splits: dict[tuple, int] = {}


def clear_workspaces() -> None:
    """Drop the expert GEMV's and the router's buffers (a reset of the extension)."""
    _workspaces.clear()
    _route_workspaces.clear()
    _splits.clear()


def workspaces() -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """The expert GEMV's and the router's current buffers: a CUDA graph bakes their addresses in,
    so it keeps them alive (a later, larger launch gets new ones)."""
    return (*_workspaces.values(), *_route_workspaces.values())


def _workspace(device: torch.device, floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partial sums and tickets (zero between launches: the kernel resets them), grown to
    the largest launch seen."""
    ws = _workspaces.get(device)
    if ws is None or ws[0].numel() < floats or ws[1].numel() < counters:
        old_f, old_c = (ws[0].numel(), ws[1].numel()) if ws else (0, 0)
        ws = (
            torch.empty(max(floats, old_f, 1), dtype=torch.float32, device=device),
            torch.zeros(max(counters, old_c, 1), dtype=torch.int32, device=device),
        )
        _workspaces[device] = ws
    return ws


def _route_workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's logits (float32, room for :data:`MAX_TOKENS` rows of
    :data:`ROUTE_MAX_EXPERTS`) and tickets (zero between launches: the kernel resets them), one
    fixed size per device, so a captured graph's buffer is never replaced."""
    ws = _route_workspaces.get(device)
    if ws is None:
        ws = (
            torch.empty(MAX_TOKENS * ROUTE_MAX_EXPERTS, dtype=torch.float32, device=device),
            torch.zeros(MAX_TOKENS, dtype=torch.int32, device=device),  # >= one per 4-token tile
        )
        _route_workspaces[device] = ws
    return ws


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    *,
    scoring: str,
    normalize: bool,
    scale: float = 1.0,
    selection_bias: torch.Tensor | None = None,
    num_groups: int = 1,
    groups_per_token: int = 1,
    expert_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(weights, chosen)`` of a dense router ``x @ weight.T + bias`` for ``x`` ``[tokens <=
    MAX_TOKENS, hidden]``, in one launch: float32 weights and int64 experts, both ``[tokens,
    top_k]``, the choice in descending order of biased score, as ``SparseMoE.route``'s torch path
    gives them (its docstring has the steps; equal scores are taken lower index first). The logits
    are accumulated in float32 and rounded to ``x``'s dtype, as the torch path's linear returns
    them. None where the kernel does not apply: CPU tensors, no extension, too many rows, a
    ``weight`` not of ``x``'s dtype, more than :data:`ROUTE_MAX_EXPERTS` experts,
    :data:`ROUTE_MAX_TOP_K` slots or :data:`ROUTE_MAX_GROUPS` groups, rows that are not whole
    16-byte vectors."""
    if not x.is_cuda or x.ndim != 2 or not 1 <= x.shape[0] <= MAX_TOKENS or x.dtype not in KERNEL_DTYPES:
        return None
    if weight.ndim != 2 or weight.dtype != x.dtype:
        return None
    experts, hidden = weight.shape
    # Checked here, not left to the extension (docs/KERNELS.md, "Pitfalls").
    if hidden != x.shape[1]:
        raise ValueError(f"route: the router takes {hidden} features, x has {x.shape[1]}")
    if scoring not in SCORINGS:
        raise ValueError(f"route: unknown scoring '{scoring}' (one of {', '.join(SCORINGS)})")
    if not 1 <= top_k <= experts or experts % num_groups or not 1 <= groups_per_token <= num_groups:
        raise ValueError(
            f"route: top {top_k} of {experts} experts in {num_groups} groups, {groups_per_token} kept"
        )
    if top_k > groups_per_token * (experts // num_groups):
        raise ValueError(f"route: top_k {top_k} exceeds the experts of {groups_per_token} groups")
    for name, t in (("bias", bias), ("selection_bias", selection_bias), ("expert_scale", expert_scale)):
        if t is not None and (t.shape != (experts,) or t.device != x.device):
            raise ValueError(
                f"route: {name} must be [{experts}] on x's device, got {list(t.shape)} on {t.device}"
            )
    if weight.device != x.device:
        raise ValueError(f"route: the router's weight is on {weight.device}, x on {x.device}")
    if experts > ROUTE_MAX_EXPERTS or top_k > ROUTE_MAX_TOP_K or num_groups > ROUTE_MAX_GROUPS:
        return None
    if bias is not None and bias.dtype != x.dtype:
        return None
    per_expert = [t for t in (bias, selection_bias, expert_scale) if t is not None]
    if any(t.dtype not in KERNEL_DTYPES for t in per_expert):
        return None
    # 16-byte vector loads of whole rows; a copy to get them would cost the launch this saves.
    if not (x.is_contiguous() and weight.is_contiguous() and all(t.is_contiguous() for t in per_expert)):
        return None
    if (hidden * x.element_size()) % 16 or x.data_ptr() % 16 or weight.data_ptr() % 16:
        return None
    ext = loader.kernel_ready(x, weight, *per_expert)
    if ext is None or not hasattr(ext, "moe_route"):
        return None
    logits, tickets = _route_workspace(x.device)
    weights, chosen = ext.moe_route(
        x,
        weight,
        bias,
        selection_bias,
        expert_scale,
        logits,
        tickets,
        top_k,
        scoring == "sigmoid",
        normalize,
        float(scale),
        num_groups,
        groups_per_token,
    )
    return weights, chosen


def _ready() -> ModuleType | None:
    ext = loader.extension()
    return ext if ext is not None and hasattr(ext, "exl3_expert_gemv") else None


def supports(stack: Any) -> bool:
    """Whether :func:`expert_mlp` runs for these stacked experts (``StackedExperts``, or None): on
    a GPU with the extension, an activation the kernel applies, gate and up of one codebook, and
    stacks the experts still hold. Then a decode step of their layer has fixed shapes."""
    if stack is None or stack.device.type != "cuda" or stack.activation.name not in ACT_IDS:
        return False
    if stack.gate is not None and stack.gate.codebook != stack.up.codebook:
        return False
    return stack.current() and _ready() is not None


def _launch_splits(
    ext: ModuleType, device: torch.device, in_features: int, groups: int, codebook: str
) -> int:
    """The split count the launch would choose (asked once per shape: it sizes the workspace)."""
    key = (device, in_features, groups, codebook)
    if key not in _splits:
        index = device.index if device.index is not None else torch.cuda.current_device()
        _splits[key] = int(ext.exl3_expert_splits(in_features, groups, CODEBOOK_IDS[codebook], index))
    return _splits[key]


def expert_mlp(
    x: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    stack: Any,
    splits: tuple[int, int] = (0, 0),
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor | None:
    """``out[t] = sum_s weights[t, s] * expert_{chosen[t, s]}(x[t])`` ``[tokens, out]`` for ``x``
    ``[tokens <= MAX_TOKENS, in]``, ``weights``/``chosen`` ``[tokens, top_k]``; None where the
    kernels do not apply. Summed in float32 and stored as ``out_dtype`` (rounded once, as a
    conversion of the float32 sum would be). ``weights`` float32 and ``chosen`` int64, contiguous
    (as :func:`route` writes them), are read as they are; other dtypes are converted first.
    ``splits``: the split-K counts of the gate/up and the down launch (0: the launch's choice), for
    tests."""
    if not x.is_cuda or x.ndim != 2 or not 1 <= x.shape[0] <= MAX_TOKENS or x.dtype not in KERNEL_DTYPES:
        return None
    if not supports(stack):
        return None
    ext = loader.kernel_ready(x, weights, chosen, stack.up.trellis)
    if ext is None:
        return None
    gate, up, down = stack.gate, stack.up, stack.down
    tokens = x.shape[0]
    # Checked here, not left to the extension (docs/KERNELS.md, "Pitfalls").
    if chosen.ndim != 2 or chosen.shape[0] != tokens or weights.shape != chosen.shape:
        raise ValueError(
            f"expert_mlp: chosen and weights must be [{tokens}, top_k], got {list(chosen.shape)} "
            f"and {list(weights.shape)}"
        )
    if x.shape[1] != up.in_features:
        raise ValueError(f"expert_mlp: the experts take {up.in_features} features, x has {x.shape[1]}")
    if out_dtype not in DTYPE_CODES:
        raise ValueError(f"expert_mlp: out_dtype must be one of {list(DTYPE_CODES)}, got {out_dtype}")
    top_k = chosen.shape[1]
    pairs = tokens * top_k
    experts = stack.num_experts
    # No-ops (no launch) for the router kernel's outputs.
    chosen = chosen.to(torch.int64).contiguous()
    weights = weights.float().contiguous()
    # The GEMV reads x in its dtype and zero-fills the padded features itself, 4 at a time from
    # 16-byte aligned rows; other widths take a padded float32 copy.
    xin = x.contiguous()
    if xin.shape[1] % 4 or xin.data_ptr() % 16:
        xin = F.pad(x.float(), (0, up.padded_in - x.shape[1])).contiguous()

    ins = [gate, up] if gate is not None else [up]
    in_groups = pairs * sum(m.padded_out // 128 for m in ins)
    down_groups = pairs * (down.padded_out // 128)
    s_in = splits[0] or _launch_splits(ext, x.device, up.padded_in, in_groups, up.codebook)
    s_down = splits[1] or _launch_splits(ext, x.device, down.padded_in, down_groups, down.codebook)
    # One workspace for both launches (they run one after the other on the stream), sized first so
    # that no buffer a launch was given is replaced before a graph could keep it.
    floats = pairs * max(s_in * sum(m.padded_out for m in ins), s_down * down.padded_out)
    partial, counters = _workspace(x.device, floats, max(in_groups, down_groups))

    ys = [torch.empty(pairs, m.padded_out, dtype=torch.float32, device=x.device) for m in ins]
    ext.exl3_expert_gemv(
        xin,
        chosen,
        [m.trellis for m in ins],
        [m.suh for m in ins],
        [m.svh for m in ins],
        ys,
        partial,
        counters,
        CODEBOOK_IDS[up.codebook],
        top_k,
        s_in,
    )
    act = stack.activation
    h = ext.exl3_expert_act(
        ys[0] if gate is not None else None,
        ys[-1],
        chosen,
        gate.bias if gate is not None else None,
        up.bias,
        ACT_IDS[act.name],
        act.limit if act.limit is not None else -1.0,
        act.limit_after_act,
        act.up_offset,
        up.out_features,
        experts,
    )
    y_down = torch.empty(pairs, down.padded_out, dtype=torch.float32, device=x.device)
    ext.exl3_expert_gemv(
        h,
        chosen,
        [down.trellis],
        [down.suh],
        [down.svh],
        [y_down],
        partial,
        counters,
        CODEBOOK_IDS[down.codebook],
        1,
        s_down,
    )
    return ext.exl3_expert_mix(
        y_down, chosen, weights, down.bias, down.out_features, experts, DTYPE_CODES[out_dtype]
    )
