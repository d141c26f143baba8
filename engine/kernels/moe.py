"""A mixture's routed experts on the GPU for a few tokens, the router's choice read on the device
(``ext/exl3_expert_gemv.cu``): no host sync and fixed launch shapes, so a decode step of a
mixture-of-experts model can be replayed from a CUDA graph.

:func:`expert_mlp` computes what ``engine.modules.moe.SparseMoE._dispatch`` computes (its torch
reference and CPU path), ``sum over slots of weight * expert(x)`` in float32, from experts stacked
by ``engine.modules.stacked_experts``, in four launches: the gate and up GEMVs of every (token,
slot) pair, the activation with the experts' biases, the down GEMVs, and the weighted sum. Each
pair's GEMV blocks read their expert's index from ``chosen`` and run the workspace split-K GEMV's
block (``ext/exl3_gemv.cuh``) on that expert's slice of the stacks.

Returns its result, or None where it does not apply (CPU tensors, no extension, more than
:data:`MAX_TOKENS` rows, an activation the kernel does not apply): the caller then runs the torch
path. Stacked experts are passed in, not imported.
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
# Rows the device-routed path takes: a decode step of up to 8 sequences, and a speculative verify
# step (up to 64 rows), whose graph must not meet the torch path's host sync either. Each (row,
# slot) pair reads its expert on its own, so large prefill chunks take the torch path, which
# reads each chosen expert once.
MAX_TOKENS = 64

_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_splits: dict[tuple, int] = {}


def clear_workspaces() -> None:
    """Drop the expert GEMV's buffers (a reset of the extension)."""
    _workspaces.clear()
    _splits.clear()


def workspaces() -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """The expert GEMV's current buffers: a CUDA graph bakes their addresses in, so it keeps them
    alive (a later, larger launch gets new ones)."""
    return tuple(_workspaces.values())


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
) -> torch.Tensor | None:
    """``out[t] = sum_s weights[t, s] * expert_{chosen[t, s]}(x[t])`` float32 ``[tokens, out]`` for
    ``x`` ``[tokens <= MAX_TOKENS, in]``, ``weights``/``chosen`` ``[tokens, top_k]``; None where the
    kernels do not apply. ``splits``: the split-K counts of the gate/up and the down launch (0: the
    launch's choice), for tests."""
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
    top_k = chosen.shape[1]
    pairs = tokens * top_k
    experts = stack.num_experts
    chosen = chosen.to(torch.int64).contiguous()
    weights = weights.float().contiguous()
    xin = x.float()
    if xin.shape[1] < up.padded_in:
        xin = F.pad(xin, (0, up.padded_in - xin.shape[1]))
    xin = xin.contiguous()

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
    return ext.exl3_expert_mix(y_down, chosen, weights, down.bias, down.out_features, experts)
