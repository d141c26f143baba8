"""The gated delta net (Yang, Kautz & Hatamizadeh, 2024: "Gated Delta Networks"), the linear
attention of Qwen3-Next, Qwen3.5 and OLMo-Hybrid.

Per token, projections of the input give queries and keys (``k_heads x d_k``), values and an
output gate ``z`` (``v_heads x d_v``), and per value head a write strength ``b`` and a decay
input ``a``. Queries, keys and values go through a short causal convolution and SiLU
(:mod:`engine.modules.causal_conv`); queries and keys are then L2-normalised, queries scaled by
``d_k ** -0.5``, and each query/key head serves ``v_heads / k_heads`` consecutive value heads.
Each value head keeps a state ``S`` (``d_k x d_v``) updated by the delta rule with a decay:

    g_t    = -exp(A_log) * softplus(a_t + dt_bias)       (log of the decay, <= 0)
    beta_t = beta_scale * sigmoid(b_t)
    S_t    = exp(g_t) * S_{t-1}
    S_t    = S_t + beta_t * k_t (v_t - S_t^T k_t)^T       (move S's answer to k_t towards v_t)
    o_t    = S_t^T q_t

``beta_scale`` is 1, or 2 where OLMo-Hybrid allows the update ``I - beta k k^T`` negative
eigenvalues. The output of each value head is normalised and gated, ``rms_norm(o) * silu(z)``,
and projected back by ``out_proj``.

A sequence's recurrent state is its convolution window and every value head's ``S``, in float32.
The recurrence has two forms that compute the same function: :func:`gated_delta_chunked` for a
sequence's many tokens at once (prefill: matrix products within chunks of 64 tokens, the state
carried from chunk to chunk) and :func:`gated_delta_step` for one token of each of a batch of
sequences (decode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import recurrent
from engine.modules.batch import BatchLayout, decode_states_before
from engine.modules.causal_conv import CausalConv1d
from engine.modules.linear import DenseLinear, LinearSite, ProjectionGroup

CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dimension (eps inside the root, as FLA's kernels)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over one sequence's ``T`` tokens, chunk by chunk.

    ``q``, ``k`` ``[T, heads, d_k]`` (normalised, ``q`` scaled), ``v`` ``[T, heads, d_v]``, ``g``,
    ``beta`` ``[T, heads]``, all float32; ``state`` ``[heads, d_k, d_v]`` float32 is ``S`` before the
    first token. Returns the outputs ``[T, heads, d_v]`` and ``S`` after the last token.

    Within a chunk, with ``G_t = g_1 + ... + g_t`` the decay since the chunk began and ``S_0`` the
    state it began from, every ``S_t`` is ``exp(G_t) S_0`` plus decayed writes
    ``exp(G_t - G_s) k_s u_s^T`` of the chunk's tokens ``s <= t``. The written values ``u`` solve
    a unit lower-triangular system (each write corrects what the earlier ones left):

        (I + A) u = beta v - (beta k exp(G)) S_0,   A[t, s] = beta_t exp(G_t - G_s) k_t.k_s (s < t)

    and then ``o_t = exp(G_t) S_0^T q_t + sum_{s <= t} exp(G_t - G_s) (q_t.k_s) u_s``. Only the
    carry of ``S`` from chunk to chunk is sequential.
    """
    length, heads, _ = k.shape
    n = -(-length // chunk_size)
    pad = n * chunk_size - length

    def chunked(t: torch.Tensor) -> torch.Tensor:
        """``[T, heads, ...]`` -> ``[heads, chunks, chunk_size, ...]``, zero-padded at the end."""
        t = t.movedim(0, 1)
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(heads, n, chunk_size, *t.shape[2:])

    # Padding tokens have zero keys, values and log-decay: they write nothing and decay nothing,
    # so the state after the last chunk is the state after the last real token.
    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))
    G = g.cumsum(-1)  # [heads, chunks, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(G_t - G_s) for s <= t, 0 above the diagonal (masked before exp: it would overflow).
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    A = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is ignored: the solve takes it as 1
    u_from_v = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False, unitriangular=True)
    u_from_state = torch.linalg.solve_triangular(
        A, k_beta * G.exp()[..., None], upper=False, unitriangular=True
    )
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]  # each write decayed to the chunk's end
    chunk_decay = G[..., -1].exp()[..., None, None]  # [heads, chunks, 1, 1]

    out = torch.empty_like(v)
    for i in range(n):
        u = u_from_v[:, i] - u_from_state[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + scores[:, i] @ u
        state = state * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ u
    return out.reshape(heads, n * chunk_size, -1)[:, :length].movedim(1, 0), state


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token each of ``B`` sequences: ``q``, ``k`` ``[B, heads, d_k]``, ``v`` ``[B, heads, d_v]``,
    ``g``, ``beta`` ``[B, heads]``, ``state`` ``[B, heads, d_k, d_v]``, all float32. Returns the
    outputs ``[B, heads, d_v]`` and the states after the token."""
    state = state * g.exp()[..., None, None]
    predicted = (k[..., None, :] @ state)[..., 0, :]  # S^T k
    state = state + k[..., :, None] * (beta[..., None] * (v - predicted))[..., None, :]
    return (q[..., None, :] @ state)[..., 0, :], state


class GatedRMSNorm(nn.Module):
    """``rms_norm(x) * weight * silu(z)`` over each head's ``d_v`` values (the weight as stored:
    no ``1 +`` offset, whatever the model's other norms do). In 16-bit models the normalised
    values are rounded before the scale, and the gate is applied in float32."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * normed * F.silu(z.float())).to(dtype)


class HeadGroupedProjections(nn.Module):
    """Qwen3-Next's input projections: ``in_proj_qkvz`` and ``in_proj_ba``, each fused and
    grouped by key head. Key head ``h``'s group holds its query and key, then the values and
    gates of its ``r = v_heads / k_heads`` value heads (``d_k, d_k, r d_v, r d_v``), and ``r``
    ``b`` then ``r`` ``a``. Returns what :class:`SplitProjections` returns."""

    def __init__(
        self, qkvz: nn.Module, ba: nn.Module, k_heads: int, v_heads: int, d_k: int, d_v: int
    ) -> None:
        super().__init__()
        self.qkvz, self.ba = qkvz, ba
        self.k_heads, self.d_k, self.d_v, self.ratio = k_heads, d_k, d_v, v_heads // k_heads

    def quantizable_linears(self) -> list[LinearSite]:
        # in_proj_ba stays 16-bit, as ExLlamaV3 keeps it: two numbers per head, each a gate.
        return [LinearSite("q+k+v+z", self, "qkvz")]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows, r, dk, dv = x.shape[0], self.ratio, self.d_k, self.d_v
        grouped = self.qkvz(x).view(rows, self.k_heads, -1)
        q, k, v, z = grouped.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.ba(x).view(rows, self.k_heads, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(rows, -1), k.reshape(rows, -1), v.reshape(rows, -1)], dim=-1)
        return qkv, z.reshape(rows, -1, dv), b.reshape(rows, -1), a.reshape(rows, -1)


class SplitProjections(nn.Module):
    """Input projections stored apart (Qwen3.5, OLMo-Hybrid): ``qkv`` (one fused ``in_proj_qkv``
    or q, k and v linears, as a :class:`ProjectionGroup`), ``z``, ``b`` and ``a``. Returns
    ``qkv`` ``[rows, 2 k_heads d_k + v_heads d_v]`` (queries, keys, values: the convolution's
    channels), ``z`` ``[rows, v_heads, d_v]``, ``b`` and ``a`` ``[rows, v_heads]``.

    ``z`` reads the same input as q, k and v, so it joins their group (Qwen3.5's in_proj_qkv and
    in_proj_z are one GEMV launch on the GPU); 16-bit ``b`` and ``a`` become one matrix, so that a
    decode step runs one small matrix product for both instead of two."""

    def __init__(self, qkv: ProjectionGroup, z: nn.Module, b: nn.Module, a: nn.Module, d_v: int) -> None:
        super().__init__()
        self.qkvz = ProjectionGroup([*zip(qkv.linears, qkv.splits), (z, [z.out_features])])
        self.heads = b.out_features
        dense = [isinstance(m, DenseLinear) and m.bias is None for m in (b, a)]
        self.ba: nn.Module | None = None
        if all(dense):
            self.ba = DenseLinear(torch.cat([b.weight, a.weight]))
            # What the checkpoint stores (and a conversion writes back): b and a apart.
            self.ba.source_keys = [key for key in (b.key, a.key) if key]
        self.b, self.a = (None, None) if self.ba is not None else (b, a)
        self.d_v = d_v

    def quantizable_linears(self) -> list[LinearSite]:
        # b and a stay 16-bit, as ExLlamaV3 keeps them.
        return self.qkvz.sites(("q", "k", "v", "z"))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        *qkv, z = self.qkvz.each(x)
        qkv = qkv[0] if len(qkv) == 1 else torch.cat(qkv, dim=-1)
        if self.ba is not None:
            b, a = self.ba(x).split(self.heads, dim=-1)
        else:
            b, a = self.b(x), self.a(x)
        return qkv, z.view(x.shape[0], -1, self.d_v), b, a


class GatedDeltaNet(nn.Module):
    """The mixer: ``projections`` -> (``qkv``, ``z``, ``b``, ``a``); ``conv`` over ``qkv``; the
    recurrence per value head; ``norm`` gated by ``z``; ``out_proj``. ``A_log`` and ``dt_bias``
    are ``[v_heads]``."""

    def __init__(
        self,
        projections: nn.Module,
        conv: CausalConv1d,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        norm: GatedRMSNorm,
        out_proj: nn.Module,
        k_heads: int,
        d_k: int,
        d_v: int,
        beta_scale: float = 1.0,
        chunk_size: int = CHUNK_SIZE,
    ) -> None:
        super().__init__()
        # Registered in the order they run: the converter writes the tensors in this order.
        self.projections, self.conv = projections, conv
        self.A_log = nn.Parameter(A_log, requires_grad=False)
        self.dt_bias = nn.Parameter(dt_bias, requires_grad=False)
        self.norm, self.out_proj = norm, out_proj
        self.k_heads, self.v_heads, self.d_k, self.d_v = k_heads, A_log.shape[0], d_k, d_v
        self.beta_scale, self.chunk_size = beta_scale, chunk_size
        self._float_params: dict[str, torch.Tensor] = {}
        if self.v_heads % k_heads:
            raise ValueError(f"{self.v_heads} value heads cannot share {k_heads} key heads evenly")
        qkv_channels = 2 * k_heads * d_k + self.v_heads * d_v
        if conv.channels != qkv_channels:
            raise ValueError(f"the convolution has {conv.channels} channels, q, k and v {qkv_channels}")

    def quantizable_linears(self) -> list[LinearSite]:
        return [*self.projections.quantizable_linears(), LinearSite("o", self, "out_proj")]

    def forward(self, x: torch.Tensor, batch: BatchLayout, cache) -> torch.Tensor:
        """``cache["conv"]`` and ``cache["delta"]`` are the layer's windows ``[slots + 1, channels,
        K - 1]`` and states ``[slots + 1, v_heads, d_k, d_v]``."""
        qkv, z, b, a = self.projections(x)
        if (
            batch.decode is not None
            and (normed := self._decode_kernels(qkv, z, b, a, batch, cache)) is not None
        ):
            return self.out_proj(normed)
        q, k, v = self._heads(self.conv(qkv, batch, cache["conv"]))
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        beta = b.sigmoid().float() * self.beta_scale
        o = self._recurrence(q, k, v, g, beta, batch, cache["delta"]).to(x.dtype)
        return self.out_proj(self.norm(o, z).reshape(x.shape[0], -1))

    def _decode_kernels(
        self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, batch: BatchLayout, cache
    ) -> torch.Tensor | None:
        """A fixed-shape decode step's convolution, recurrence and gated norm in two launches
        (``engine.kernels.recurrent``): the normed outputs ``[rows, v_heads * d_v]``, or None where
        the kernels do not apply (checked before either runs, so no state has moved)."""
        if not recurrent.delta_heads_fit(self.d_k, self.d_v) or batch.positions.dtype != torch.int64:
            return None
        dtype = qkv.dtype
        if not (b.dtype == a.dtype == z.dtype == self.norm.weight.dtype == dtype):
            return None
        mixed = self.conv.decode_kernel(qkv, batch, cache["conv"])
        if mixed is None:
            return None
        out = recurrent.gated_delta_step(
            mixed, a.contiguous(), b.contiguous(), z.reshape(qkv.shape[0], -1).contiguous(),
            self._float_param("A_log"), self._float_param("dt_bias"), self.norm.weight, cache["delta"],
            batch.decode.state_slots, batch.positions, key_heads=self.k_heads, key_dim=self.d_k,
            beta_scale=self.beta_scale, norm_eps=self.norm.eps,
        )  # fmt: skip
        if out is None:  # only where the extension lacks the kernel, which conv_step found
            raise RuntimeError("the CUDA extension has conv_step but no gated_delta_step")
        return out

    def _float_param(self, name: str) -> torch.Tensor:
        """A float32 copy of a small parameter, made once (a decode graph reads it in place)."""
        cached = self._float_params.get(name)
        if cached is None:
            cached = self._float_params[name] = getattr(self, name).detach().float().contiguous()
        return cached

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries and keys ``[rows, v_heads, d_k]`` (normalised, queries scaled, each key head
        repeated for the value heads it serves) and values ``[rows, v_heads, d_v]``, float32."""
        rows, kd = mixed.shape[0], self.k_heads * self.d_k
        q, k, v = mixed.float().split([kd, kd, self.v_heads * self.d_v], dim=-1)
        q = l2_normalize(q.view(rows, self.k_heads, self.d_k)) * self.d_k**-0.5
        k = l2_normalize(k.view(rows, self.k_heads, self.d_k))
        ratio = self.v_heads // self.k_heads
        if ratio > 1:
            q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
        return q, k, v.view(rows, self.v_heads, self.d_v)

    def _recurrence(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        batch: BatchLayout,
        states: torch.Tensor,
    ) -> torch.Tensor:
        """Every row's output, each sequence's state read from its slot (zeros at position 0)
        and written back after its last row."""
        if batch.decode is not None:  # one token per row: fixed shapes, slots on the device
            slots, before = decode_states_before(states, batch)
            o, states[slots] = gated_delta_step(q, k, v, g, beta, before)
            return o
        o = torch.empty_like(v)
        for seq in batch.sequences:
            rows = seq.rows
            before = seq.state_before(states)
            if seq.length == 1:  # a decode row: the step form, as in a fixed-shape decode step
                one, after = gated_delta_step(q[rows], k[rows], v[rows], g[rows], beta[rows], before[None])
                o[rows], states[seq.state_slot] = one, after[0]
            else:  # a prompt: the GPU's one-launch scan, else the chunked form
                args = (q[rows], k[rows], v[rows], g[rows], beta[rows], before)
                scanned = recurrent.gated_delta_scan(*args)
                o[rows], states[seq.state_slot] = (
                    scanned if scanned is not None else gated_delta_chunked(*args, self.chunk_size)
                )
        return o
