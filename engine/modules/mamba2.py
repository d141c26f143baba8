"""The Mamba-2 mixer (Dao & Gu, 2024: "Transformers are SSMs"), as NemotronH uses it.

Per token, one input projection gives a gate ``z``, the convolution's input ``xBC`` and a time
step ``dt`` per head. ``xBC`` goes through a short causal convolution and SiLU, then splits into
the heads' inputs ``x`` (``heads x head_dim``) and the state-space projections ``B`` and ``C``
(``groups x d_state``, each group shared by ``heads / groups`` heads). Each head keeps a state
``S`` (``head_dim x d_state``) that decays by ``exp(dt * A)`` per token:

    dt  = clamp(softplus(dt + dt_bias), *time_step_limit),   A = -exp(A_log)
    S_t = exp(dt_t * A) * S_{t-1} + dt_t * x_t B_t^T
    y_t = S_t C_t + D * x_t

The output is normalised with the gate, ``rms_norm_per_group(y * silu(z)) * weight`` (one RMS
per group of ``intermediate / groups`` channels), and projected back by ``out_proj``.

A sequence's recurrent state is its convolution window (:mod:`engine.modules.causal_conv`) and
``S`` for every head, kept in float32. The scan has two forms computing the same function:
:func:`ssd_chunked` for a sequence's many tokens at once (prefill: quadratic within chunks of
``chunk_size`` tokens, the state carried from chunk to chunk) and :func:`ssd_step` for one token
of each of a batch of sequences (decode).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import recurrent
from engine.modules.batch import BatchLayout, decode_states_before
from engine.modules.causal_conv import CausalConv1d
from engine.modules.linear import LinearSite


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """``out[h, t, s] = a[s + 1, h] + ... + a[t, h]`` for ``t >= s`` (0 on the diagonal) and
    ``-inf`` above it, from ``a`` ``[length, heads]``. Summed directly rather than as a
    difference of prefix sums, which would lose precision once those grow large."""
    n = a.shape[0]
    later = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), diagonal=-1)
    terms = a.t()[:, :, None].expand(-1, n, n).masked_fill(~later, 0.0)  # [h, i, s]: a[i] for i > s
    sums = terms.cumsum(dim=1)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~causal, -math.inf)


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., groups, d_state]`` -> ``[..., heads, d_state]``: each group serves consecutive heads."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over one sequence, ``chunk_size`` tokens at a time (float32 throughout).

    ``x`` ``[length, heads, head_dim]``, ``dt`` ``[length, heads]`` (after softplus and clamp),
    ``A`` ``[heads]``, ``B`` and ``C`` ``[length, groups, d_state]``, ``state`` ``[heads,
    head_dim, d_state]`` the state before the first token. Returns ``y`` ``[length, heads,
    head_dim]`` (without the ``D`` skip) and the state after the last token.

    Within a chunk, token ``t`` reads token ``s <= t`` through ``(C_t . B_s) * exp(a_{s+1} + ...
    + a_t) * dt_s x_s`` with ``a = dt * A`` (an attention-like product), and the state carried
    in from the chunk before through ``exp(a_0 + ... + a_t) * S C_t``.
    """
    heads = x.shape[1]
    B, C = _per_head(B, heads), _per_head(C, heads)
    log_decay = dt * A  # [length, heads], <= 0
    inputs = x * dt[..., None]  # dt_s x_s
    ys = []
    for start in range(0, x.shape[0], chunk_size):
        chunk = slice(start, start + chunk_size)
        a, b, c, u = log_decay[chunk], B[chunk], C[chunk], inputs[chunk]
        between = _segment_sums(a)  # [heads, t, s]: decay from after s to t
        scores = torch.einsum("thn,shn->hts", c, b) * torch.exp(between)
        y = torch.einsum("hts,shp->thp", scores, u)
        since_start = torch.exp(a.cumsum(dim=0))  # [t, heads]: decay of the carried-in state
        y = y + torch.einsum("thn,hpn->thp", c, state) * since_start[..., None]
        to_end = torch.exp(between[:, -1, :]).t()  # [s, heads]: decay from after s to the end
        entering = torch.einsum("shn,shp->hpn", b * to_end[..., None], u)
        state = state * since_start[-1][:, None, None] + entering
        ys.append(y)
    return torch.cat(ys), state


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of a batch of sequences (float32): ``x`` ``[batch, heads, head_dim]``,
    ``dt`` ``[batch, heads]``, ``B`` and ``C`` ``[batch, groups, d_state]``, ``state`` ``[batch,
    heads, head_dim, d_state]``. Returns ``y`` (without the ``D`` skip) and the states after."""
    heads = x.shape[1]
    B, C = _per_head(B, heads), _per_head(C, heads)
    decay = torch.exp(dt * A)[..., None, None]
    state = state * decay + (x * dt[..., None])[..., None] * B[:, :, None, :]
    return torch.einsum("bhpn,bhn->bhp", state, C), state


class GatedGroupRMSNorm(nn.Module):
    """``rms_norm(y * silu(z)) * weight``, the RMS taken over each group of ``group_size``
    channels alone (the gate is applied before the norm), in float32."""

    def __init__(self, weight: torch.Tensor, eps: float, group_size: int, key: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps, self.group_size = eps, group_size
        self.key = key  # the checkpoint key it was read from

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = y.float() * F.silu(z.float())
        groups = gated.view(*gated.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return groups.view(gated.shape) * self.weight.float()


class Mamba2(nn.Module):
    """The mixer: ``in_proj`` -> (``z``, ``xBC``, ``dt``); ``conv`` over ``xBC``; the scan;
    ``norm`` gated by ``z``; ``out_proj``. ``A_log``, ``D`` and ``dt_bias`` are ``[heads]``;
    ``dt_limit`` clamps the time step after softplus (None: no clamp)."""

    def __init__(
        self,
        in_proj: nn.Module,
        conv: CausalConv1d,
        A_log: torch.Tensor,
        D: torch.Tensor,
        dt_bias: torch.Tensor,
        norm: GatedGroupRMSNorm,
        out_proj: nn.Module,
        head_dim: int,
        groups: int,
        state_size: int,
        chunk_size: int,
        dt_limit: tuple[float, float] | None = None,
    ) -> None:
        super().__init__()
        # Registered in the order they run: the converter writes the tensors in this order.
        self.in_proj, self.conv = in_proj, conv
        self.A_log = nn.Parameter(A_log, requires_grad=False)
        self.D = nn.Parameter(D, requires_grad=False)
        self.dt_bias = nn.Parameter(dt_bias, requires_grad=False)
        self.norm, self.out_proj = norm, out_proj
        self.heads, self.head_dim, self.groups, self.state_size = A_log.shape[0], head_dim, groups, state_size
        self.chunk_size, self.dt_limit = chunk_size, dt_limit
        self.intermediate = self.heads * head_dim
        if self.heads % groups:
            raise ValueError(f"{self.heads} Mamba-2 heads cannot share {groups} groups evenly")
        conv_channels = self.intermediate + 2 * groups * state_size  # x, B and C
        if conv.channels != conv_channels:
            raise ValueError(f"the convolution has {conv.channels} channels, x, B and C {conv_channels}")

    def quantizable_linears(self) -> list[LinearSite]:
        return [LinearSite("in", self, "in_proj"), LinearSite("out", self, "out_proj")]

    def forward(self, x: torch.Tensor, batch: BatchLayout, cache) -> torch.Tensor:
        """``cache["conv"]`` and ``cache["ssm"]`` are the layer's windows ``[slots + 1, channels,
        K - 1]`` and states ``[slots + 1, heads, head_dim, d_state]``."""
        i, bc = self.intermediate, self.groups * self.state_size
        z, xbc, dt = self.in_proj(x).split([i, i + 2 * bc, self.heads], dim=-1)
        if batch.decode is not None and (y := self._decode_kernels(xbc, dt, batch, cache)) is not None:
            return self.out_proj(self.norm(y, z).to(x.dtype))
        xbc = self.conv(xbc, batch, cache["conv"])
        u, B, C = xbc.float().split([i, bc, bc], dim=-1)
        u = u.view(-1, self.heads, self.head_dim)
        B, C = B.view(-1, self.groups, self.state_size), C.view(-1, self.groups, self.state_size)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if self.dt_limit is not None:
            dt = dt.clamp(*self.dt_limit)
        A = -torch.exp(self.A_log.float())
        y = self._scan(u, dt, A, B, C, batch, cache["ssm"])
        y = y + u * self.D.float()[:, None]
        return self.out_proj(self.norm(y.view(-1, i), z).to(x.dtype))

    def _decode_kernels(
        self, xbc: torch.Tensor, dt: torch.Tensor, batch: BatchLayout, cache
    ) -> torch.Tensor | None:
        """A fixed-shape decode step's convolution and state update in two launches
        (``engine.kernels.recurrent``): ``y`` ``[rows, heads * head_dim]`` float32 with the ``D``
        skip, or None where the kernels do not apply (checked before either runs)."""
        if batch.positions.dtype != torch.int64 or dt.dtype != xbc.dtype:
            return None
        mixed = self.conv.decode_kernel(xbc, batch, cache["conv"])
        if mixed is None:
            return None
        i, bc = self.intermediate, self.groups * self.state_size
        u, B, C = (t.contiguous() for t in mixed.split([i, bc, bc], dim=-1))
        y = recurrent.ssd_step(
            u, B, C, dt.contiguous(), self.dt_bias, self.A_log, self.D, cache["ssm"],
            batch.decode.state_slots, batch.positions, groups=self.groups,
            dt_limit=self.dt_limit or (0.0, float("inf")),
        )  # fmt: skip
        if y is None:
            raise RuntimeError("the CUDA extension has conv_step but no ssd_step")
        return y

    def _scan(
        self,
        u: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        batch: BatchLayout,
        states: torch.Tensor,
    ) -> torch.Tensor:
        """Every row's scan output, each sequence's state read from its slot (zeros at position
        0) and written back after its last row."""
        if batch.decode is not None:  # one token per row: fixed shapes, slots on the device
            slots, before = decode_states_before(states, batch)
            y, states[slots] = ssd_step(u, dt, A, B, C, before)
            return y
        y = torch.empty_like(u)
        for seq in batch.sequences:
            rows = seq.rows
            before = seq.state_before(states).float()
            args = (u[rows], dt[rows], A, B[rows], C[rows], before)
            scanned = recurrent.ssd_scan(*args)  # the GPU's one-launch scan, else the chunked form
            y[rows], states[seq.state_slot] = (
                scanned if scanned is not None else ssd_chunked(*args, self.chunk_size)
            )
        return y
