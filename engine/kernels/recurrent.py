"""The recurrent mixers' CUDA kernels. One-token steps (``ext/recurrent_step.cu``): the causal
convolution with its window, the gated delta rule with its gated RMSNorm, and the Mamba-2 state
update. Prefill scans (``ext/recurrent_scan.cu``): the gated delta rule and the Mamba-2 update over
all the tokens of one sequence, in one launch each.

Each step advances the states of the step's rows in place (row ``b`` owns state row ``slots[b]``; a row
whose position is 0 starts from zeros) and returns the step's output, or None where the kernel
does not apply (CPU tensors, no extension, a shape it does not take): the caller then runs its
torch code, which is the reference these kernels are tested against.
"""

from __future__ import annotations

from types import ModuleType

import torch

from engine.kernels import loader
from engine.kernels.loader import KERNEL_DTYPES


def _ready(*tensors: torch.Tensor) -> ModuleType | None:
    if not all(t.is_contiguous() for t in tensors) or tensors[0].dtype not in KERNEL_DTYPES:
        return None
    ext = loader.kernel_ready(*tensors)
    return ext if ext is not None and hasattr(ext, "conv_step") else None


def conv_step(
    x: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    positions: torch.Tensor | None,
    silu: bool,
) -> torch.Tensor | None:
    """``act(conv(window ++ x))`` per channel for ``x`` [rows, channels]; ``window``
    [slots + 1, channels, K - 1] (oldest first) shifts to take ``x``; ``weight`` [channels, K]."""
    ext = _ready(x, window, weight, slots)
    if ext is None or slots.dtype != torch.int32 or weight.dtype != x.dtype:
        return None
    if window.dtype not in (x.dtype, torch.float32) or (bias is not None and bias.dtype != x.dtype):
        return None
    return ext.conv_step(x, window, weight.reshape(weight.shape[0], -1), bias, slots, positions, silu)


def delta_heads_fit(key_dim: int, value_dim: int) -> bool:
    """Whether the kernel takes these head sizes: a block holds one head's value columns times
    the parts its key rows split into (16 or 32 rows a thread), at most 1,024 threads."""
    if value_dim % 32:
        return False
    return any(key_dim % rows == 0 and key_dim // rows * value_dim <= 1024 for rows in (32, 16))


def gated_delta_step(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    z: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor | None,
    *,
    key_heads: int,
    key_dim: int,
    beta_scale: float = 1.0,
    norm_eps: float = 1e-6,
    l2_eps: float = 1e-6,
) -> torch.Tensor | None:
    """The gated delta rule for one token per row, normalised and gated: ``[rows, hv * dv]``.

    ``qkv`` [rows, 2 * hk * dk + hv * dv] is the convolved [q | k | v]; ``a``, ``b`` [rows, hv];
    ``z`` [rows, hv * dv]; ``a_log``, ``dt_bias`` fp32 [hv]; ``state`` fp32 [slots + 1, hv, dk, dv];
    queries are scaled by ``dk ** -0.5`` after their L2 norm."""
    ext = _ready(qkv, a, b, z, norm_weight, state, slots)
    if ext is None or slots.dtype != torch.int32 or state.dtype != torch.float32:
        return None
    if not a.dtype == b.dtype == z.dtype == norm_weight.dtype == qkv.dtype:
        return None
    if not delta_heads_fit(key_dim, state.shape[-1]):
        return None
    return ext.gated_delta_step(
        qkv,
        a,
        b,
        z,
        a_log.float().contiguous(),
        dt_bias.float().contiguous(),
        norm_weight,
        state,
        slots,
        positions,
        key_heads,
        key_dim,
        key_dim**-0.5,
        beta_scale,
        norm_eps,
        l2_eps,
    )


def ssd_step(
    x: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    a_log: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor | None,
    *,
    groups: int,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor | None:
    """Mamba-2's state update for one token per row: ``y`` fp32 [rows, heads * P] (``D`` skip
    included, before the gated norm). ``x`` [rows, heads * P]; ``B``, ``C`` [rows, groups * N];
    ``dt`` [rows, heads] before softplus; ``state`` fp32 [slots + 1, heads, P, N]."""
    ext = _ready(x, B, C, dt, state, slots)
    if ext is None or slots.dtype != torch.int32 or state.dtype != torch.float32:
        return None
    if not x.dtype == B.dtype == C.dtype == dt.dtype:
        return None
    low, high = dt_limit
    return ext.ssd_step(
        x,
        B,
        C,
        dt,
        dt_bias.float().contiguous(),
        a_log.float().contiguous(),
        D.float().contiguous(),
        state,
        slots,
        positions,
        groups,
        low,
        min(high, 3.0e38),
    )


def scan_fits(vector: int, columns: int) -> bool:
    """Whether the prefill scans (``ext/recurrent_scan.cu``) take these sizes: a thread keeps a
    quarter of a state column of ``vector`` values (8, 16 or 32 of them) and a block 32 columns."""
    return vector % 4 == 0 and vector // 4 in (8, 16, 32) and columns % 32 == 0


def _scan_ext(*tensors: torch.Tensor) -> ModuleType | None:
    ext = loader.kernel_ready(*tensors)
    return ext if ext is not None and hasattr(ext, "gated_delta_scan") else None


def gated_delta_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`engine.modules.gated_delta_net.gated_delta_chunked` in one launch: one sequence's
    ``T`` tokens (``q``, ``k`` ``[T, heads, d_k]`` normalised, ``v`` ``[T, heads, d_v]``, ``g``,
    ``beta`` ``[T, heads]``) from ``state`` ``[heads, d_k, d_v]``; returns the outputs and the state
    after the last token (float32), or None where the kernel does not apply."""
    ext = _scan_ext(q, k, v, g, beta, state)
    if ext is None or not scan_fits(q.shape[-1], v.shape[-1]):
        return None
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    before = state.float().contiguous()
    out, after = torch.empty_like(v), torch.empty_like(before)
    ext.gated_delta_scan(q, k, v, g, beta, before, after, out)
    return out, after


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`engine.modules.mamba2.ssd_chunked` in one launch: one sequence's ``x`` ``[T, heads,
    P]``, ``dt`` ``[T, heads]`` (after softplus and clamp), ``A`` ``[heads]``, ``B``, ``C`` ``[T,
    groups, N]`` from ``state`` ``[heads, P, N]``; returns ``y`` (no ``D`` skip) and the state after
    the last token (float32), or None where the kernel does not apply."""
    ext = _scan_ext(x, dt, A, B, C, state)
    if ext is None or not scan_fits(B.shape[-1], x.shape[-1]):
        return None
    x, dt, A, B, C = (t.float().contiguous() for t in (x, dt, A, B, C))
    before = state.float().contiguous()
    y, after = torch.empty_like(x), torch.empty_like(before)
    ext.ssd_scan(x, dt, A, B, C, before, after, y)
    return y, after
