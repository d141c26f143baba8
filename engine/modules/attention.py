"""Multi-head attention with grouped KV heads, over a paged KV cache.

Variants are options, not subclasses: grouped-query attention (Ainslie et al., 2023),
RMSNorm of queries and keys per head (Qwen3, Gemma 3) or across all heads (OLMo 2/3),
sliding-window layers (Mistral, Gemma 2/3), logit soft-capping (Gemma 2), layers without
positional rotation (SmolLM3's NoPE), a sigmoid gate on each head's output (Qwen3-Next, Qwen3.5:
``q_proj`` gives every head's query followed by its gate), rotation of only the first part of
each head (``RopeSpec.partial_rotary_factor``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.cache.decode_attention import paged_decode_attention
from engine.modules.batch import BatchLayout, SequenceSlice
from engine.modules.linear import LinearSite, ProjectionGroup
from engine.modules.rope import RotaryEmbedding


def visibility(
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    window: int | None,
    bidirectional: Sequence[tuple[int, int]] = (),
) -> torch.Tensor:
    """``[n, L]`` bool: which keys each query may attend to."""
    allowed = k_positions[None, :] <= q_positions[:, None]
    for lo, hi in bidirectional:
        q_in = (q_positions >= lo) & (q_positions < hi)
        k_in = (k_positions >= lo) & (k_positions < hi)
        allowed |= q_in[:, None] & k_in[None, :]
    if window is not None:
        allowed &= k_positions[None, :] > q_positions[:, None] - window
    return allowed


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    bidirectional: Sequence[tuple[int, int]] = (),
) -> torch.Tensor:
    """Reference attention for one sequence.

    ``q`` is ``[n, heads, d]`` at absolute ``q_positions``; ``k``/``v`` are ``[L, kv_heads, d]`` at
    ``k_positions``. A query sees keys at or before its position and, with a window, fewer than
    ``window`` positions back. Queries and keys both inside one ``bidirectional`` span see each
    other whatever their order (the window still applies). Returns ``[n, heads, d]``.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    # One query (a decode step) is handed exactly the keys it may see - the caller starts the
    # keys inside the window and nothing lies after the query - so it needs no mask at all, and
    # SDPA takes its fastest path.
    n, length = q.shape[0], k.shape[0]
    # A whole prompt from position 0 with no window is plain causal attention: SDPA's own causal
    # path is faster than an explicit mask.
    plain_causal = n == length and not bidirectional and (window is None or window >= length)
    if n == 1 or (plain_causal and softcap is None):
        allowed = None
    else:
        allowed = visibility(q_positions, k_positions, window, bidirectional)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if softcap is None:
        out = F.scaled_dot_product_attention(
            qh[None],
            kh[None],
            vh[None],
            attn_mask=allowed,
            is_causal=allowed is None and n > 1,
            scale=scale,
            enable_gqa=heads != kv_heads,
        )[0]
    else:
        group = heads // kv_heads
        kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
        scores = torch.matmul(qh, kh.transpose(1, 2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(vh.dtype), vh)
    return out.transpose(0, 1)


def attend_one(
    q: torch.Tensor,
    runs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query ``[1, heads, d]`` over keys/values given as runs of ``[n_i, kv_heads, d]`` (views
    of a paged cache, in position order) that it may all see: :func:`attend` for a decode step,
    without gathering the runs into one tensor. Each KV head's query heads are handled together
    and the softmax spans every run (float32). Returns ``[1, heads, d]``.
    """
    heads, d = q.shape[1], q.shape[2]
    kv_heads = runs[0][0].shape[1]
    grouped = q[0].view(kv_heads, heads // kv_heads, d)
    # [n, kv_heads, d] viewed per head is a strided matrix BLAS reads in place (rows h*d apart).
    scores = torch.cat([torch.matmul(grouped, k.permute(1, 2, 0)) for k, _ in runs], dim=-1)
    scores = scores.float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    weights = torch.softmax(scores, dim=-1).to(q.dtype)
    out, start = None, 0
    for _, v in runs:
        part = torch.matmul(weights[..., start : start + v.shape[0]], v.permute(1, 0, 2))
        out = part if out is None else out + part
        start += v.shape[0]
    return out.reshape(1, heads, d)


class Attention(nn.Module):
    def __init__(
        self,
        qkv: ProjectionGroup,
        o_proj: nn.Module,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        rope: RotaryEmbedding | None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        qk_norm_across_heads: bool = False,
        output_gate: bool = False,
    ) -> None:
        super().__init__()
        self.qkv, self.o_proj = qkv, o_proj
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.rope = scale, rope
        self.q_norm, self.k_norm = q_norm, k_norm
        self.sliding_window, self.softcap = sliding_window, softcap
        self.qk_norm_across_heads, self.output_gate = qk_norm_across_heads, output_gate

    def quantizable_linears(self) -> list[LinearSite]:
        return [*self.qkv.sites(("q", "k", "v")), LinearSite("o", self, "o_proj")]

    def forward(self, x: torch.Tensor, batch: BatchLayout, cache) -> torch.Tensor:
        q, gate = self._project(x, batch, cache)
        if batch.decode is not None:
            return self._output(self._decode(q, batch, cache), gate)
        # One sequence owning every row (a lone prompt or decode step) keeps attend's result as
        # is: no copy into a separate output (a device-to-device memcpy per layer).
        single = len(batch.sequences) == 1 and batch.sequences[0].length == q.shape[0]
        out = None if single else torch.empty_like(q)
        for seq in batch.sequences:
            rows = seq.rows
            first = self._first_visible(seq)
            slots = seq.slots[first : seq.end_position]
            # A decode step on the CPU reads the cache in place (the gather was most of the step
            # at 4K context); a multi-token prompt, images or a quantized cache gather as below.
            runs = cache.read_runs(slots) if seq.length == 1 and not seq.bidirectional else None
            if runs is not None:
                o = attend_one(q[rows], runs, self.scale, self.softcap)
            else:
                keys, values = cache.read(slots)
                o = attend(
                    q[rows],
                    keys,
                    values,
                    batch.positions[rows],
                    batch.key_positions(first, seq.end_position, x.device),
                    self.scale,
                    self.sliding_window,
                    self.softcap,
                    seq.bidirectional,
                )
            if out is None:
                out = o
            else:
                out[rows] = o
        return self._output(out, gate)

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """``o_proj`` of the heads' outputs ``[rows, heads, head_dim]``, each gated first where
        the layer has output gates."""
        out = out.reshape(-1, self.num_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _project(
        self, x: torch.Tensor, batch: BatchLayout, cache
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This step's queries ``[rows, heads, head_dim]``, rotated, and output gates
        ``[rows, heads * head_dim]`` (None without); its keys and values written to the cache."""
        plain = self.q_norm is None and not self.output_gate
        if batch.decode is not None and x.is_cuda and self.rope is not None and plain:
            # A decode step on the GPU: the q/k/v GEMV also rotates and writes (one launch).
            tables = batch.rope_tables(self.rope, x.dtype)
            q = cache.project_rotated(self.qkv, x, tables, batch.write_slots, self.head_dim)
            if q is not None:
                return q.view(-1, self.num_heads, self.head_dim), None
        q, k, v = self.qkv(x)
        gate = None
        if self.output_gate:
            q, gate = q.view(-1, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
            gate = gate.reshape(-1, self.num_heads * self.head_dim)
        if self.q_norm is not None and self.qk_norm_across_heads:  # one norm over all heads
            q, k = self.q_norm(q.reshape(q.shape[0], -1)), self.k_norm(k)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        rotated = None
        if self.rope is not None:
            tables = batch.rope_tables(self.rope, q.dtype)
            # On the GPU one launch rotates q and k and writes the keys and values (dense cache).
            rotated = cache.write_rotated(batch.write_slots, q, k, v, tables) if q.is_cuda else None
            if rotated is None:
                q, k = self.rope.apply_pair(q, k, tables)
        if rotated is None:
            cache.write(batch.write_slots, k, v)
            return q, gate
        return rotated, gate

    def _decode(self, q: torch.Tensor, batch: BatchLayout, cache) -> torch.Tensor:
        """Every sequence's one query at once, from the padded block tables (no host sync)."""
        d = batch.decode
        return paged_decode_attention(
            q,
            cache,
            d.block_tables,
            d.lengths,
            d.page_size,
            self.scale,
            window=self.sliding_window,
            softcap=self.softcap,
        )

    def _first_visible(self, seq: SequenceSlice) -> int:
        """Earliest position any of this step's queries can see: skip reading older keys."""
        if self.sliding_window is None:
            return 0
        return max(0, seq.past - self.sliding_window + 1)
