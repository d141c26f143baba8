"""Multi-head attention with grouped KV heads, over a paged KV cache.

Variants are options, not subclasses: grouped-query attention (Ainslie et al., 2023),
RMSNorm of queries and keys per head (Qwen3, Gemma 3) or across all heads (OLMo 2/3),
sliding-window layers (Mistral, Gemma 2/3), logit soft-capping (Gemma 2), layers without
positional rotation (SmolLM3's NoPE), learned attention sinks (gpt-oss: one logit per head in
the softmax's denominator, see ``engine.modules.attention_sinks``), a sigmoid gate on each head's
output (Qwen3-Next, Qwen3.5: ``q_proj`` gives every head's query followed by its gate),
rotation of only the first part of each head (``RopeSpec.partial_rotary_factor``), rotation of
adjacent pairs of dimensions (``RopeSpec.adjacent_pairs``, Ernie 4.5: queries and keys reordered
into the usual halves first),
a sigmoid output gate from a projection of its own, per feature (AFMoE's ``gate_proj``) or one
per head (Step 3.5's ``g_proj``); Gemma 4's values RMS-normalised without a learned scale, keys
that double as values (no ``v_proj``), layers that read an earlier layer's keys and values from
the cache (projecting queries only), and layers that stay causal over an image's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.cache.decode_attention import paged_decode_attention
from engine.modules.attention_sinks import sdpa_with_sinks, softmax_with_sinks
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


# The most bytes of float32 scores ``[heads, queries, keys]`` a prompt's attention may form at once;
# above it the queries go in blocks (:func:`_attend_in_blocks`). SDPA's fused kernels never form
# them, but its math fallback does (head dims its flash kernel does not take, such as Gemma 4's
# 512), and so does the softcap path: a 4K-token chunk over 32K keys with 32 heads is 16 GiB.
SCORE_BLOCK_BYTES = 1 << 30


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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference attention for one sequence.

    ``q`` is ``[n, heads, d]`` at absolute ``q_positions``; ``k``/``v`` are ``[L, kv_heads, d]`` at
    ``k_positions``. A query sees keys at or before its position and, with a window, fewer than
    ``window`` positions back. Queries and keys both inside one ``bidirectional`` span see each
    other whatever their order (the window still applies). ``sinks`` ``[heads]``: each head's
    learned sink logit (:func:`softmax_with_sinks`). Returns ``[n, heads, d]``. Query positions
    ascend, as a prompt's do.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    n, length = q.shape[0], k.shape[0]
    # A whole prompt from position 0 with no window is plain causal attention: SDPA's own causal
    # path is faster than an explicit mask.
    plain_causal = n == length and not bidirectional and (window is None or window >= length)
    # Which, at a head size the flash kernels take, never forms the scores.
    flash_causal = plain_causal and softcap is None and sinks is None and q.shape[2] <= 256
    rows = max(1, SCORE_BLOCK_BYTES // (4 * heads * length))
    if n > rows and not flash_causal:
        return _attend_in_blocks(
            rows, q, k, v, q_positions, k_positions, scale, window, softcap, bidirectional, sinks
        )
    # One query (a decode step) is handed exactly the keys it may see - the caller starts the
    # keys inside the window and nothing lies after the query - so it needs no mask at all, and
    # SDPA takes its fastest path.
    # SDPA has no softcap: with one the scores are computed here, masked. Sinks go through SDPA
    # as one more key (sdpa_with_sinks), which needs the mask spelled out.
    explicit = softcap is not None
    if sinks is None and (n == 1 or (plain_causal and not explicit)):
        allowed = None
    else:
        allowed = visibility(q_positions, k_positions, window, bidirectional)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if sinks is not None and not explicit:
        out = sdpa_with_sinks(qh, kh, vh, allowed, scale, sinks)
    elif not explicit:
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
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is None:
            weights = torch.softmax(scores.float(), dim=-1)
        else:
            weights = softmax_with_sinks(scores, sinks[:, None])
        out = torch.matmul(weights.to(vh.dtype), vh)
    return out.transpose(0, 1)


def _attend_in_blocks(
    rows: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    bidirectional: Sequence[tuple[int, int]],
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`attend` for ``rows`` queries at a time, each block over only the keys it can see:
    none after its last query (unless a bidirectional span reaches further), none a window or more
    before its first. Keys at consecutive positions (a cache's) are cut by index; others are all
    handed to every block."""
    length = k.shape[0]
    first = int(k_positions[0])
    consecutive = int(k_positions[-1]) - first == length - 1
    out = []
    for start in range(0, q.shape[0], rows):
        at = q_positions[start : start + rows]
        lo, hi = 0, length
        if consecutive:
            if window is not None:
                lo = max(0, int(at[0]) - window + 1 - first)
            if not bidirectional:
                hi = min(length, int(at[-1]) + 1 - first)
        out.append(
            attend(
                q[start : start + rows],
                k[lo:hi],
                v[lo:hi],
                at,
                k_positions[lo:hi],
                scale,
                window,
                softcap,
                bidirectional,
                sinks,
            )
        )
    return torch.cat(out)


def attend_one(
    q: torch.Tensor,
    runs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query ``[1, heads, d]`` over keys/values given as runs of ``[n_i, kv_heads, d]`` (views
    of a paged cache, in position order) that it may all see: :func:`attend` for a decode step,
    without gathering the runs into one tensor. Each KV head's query heads are handled together
    and the softmax spans every run (float32), with each head's ``sinks`` logit in its
    denominator where given. Returns ``[1, heads, d]``.
    """
    heads, d = q.shape[1], q.shape[2]
    kv_heads = runs[0][0].shape[1]
    grouped = q[0].view(kv_heads, heads // kv_heads, d)
    # [n, kv_heads, d] viewed per head is a strided matrix BLAS reads in place (rows h*d apart).
    scores = torch.cat([torch.matmul(grouped, k.permute(1, 2, 0)) for k, _ in runs], dim=-1)
    scores = scores.float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if sinks is None:
        weights = torch.softmax(scores, dim=-1).to(q.dtype)
    else:  # heads are grouped [kv_heads, group] here, as the queries are
        weights = softmax_with_sinks(scores, sinks.view(kv_heads, heads // kv_heads)).to(q.dtype)
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
        sinks: torch.Tensor | None = None,
        gate_proj: nn.Module | None = None,
        gate_per_head: bool = False,
        value_norm: nn.Module | None = None,
        values_from_keys: bool = False,
        shared_kv: bool = False,
        bidirectional: bool = True,
    ) -> None:
        super().__init__()
        self.qkv, self.o_proj = qkv, o_proj
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.rope = scale, rope
        self.q_norm, self.k_norm = q_norm, k_norm
        self.sliding_window, self.softcap = sliding_window, softcap
        self.qk_norm_across_heads, self.output_gate = qk_norm_across_heads, output_gate
        # [heads] float32 learned sink logits, or None: every attention path reads this one
        # attribute (the paged decode kernel included).
        self.register_buffer("sinks", sinks)
        # The output gate's own projection: heads * head_dim outputs, or one per head.
        self.gate_proj, self.gate_per_head = gate_proj, gate_per_head
        # ``qkv`` gives q and k (values_from_keys: the values are the raw keys) or q alone
        # (shared_kv: ``cache`` is the storage of the layer whose keys and values it reads).
        self.value_norm, self.values_from_keys, self.shared_kv = value_norm, values_from_keys, shared_kv
        self.bidirectional = bidirectional

    def quantizable_linears(self) -> list[LinearSite]:
        gate = [LinearSite("g", self, "gate_proj")] if self.gate_proj is not None else []
        return [*self.qkv.sites(("q", "k", "v")), *gate, LinearSite("o", self, "o_proj")]

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
            spans = seq.bidirectional if self.bidirectional else ()
            first = self._first_visible(seq)
            slots = seq.slots[first : seq.end_position]
            # A decode step on the CPU reads the cache in place (the gather was most of the step
            # at 4K context); a multi-token prompt, images or a quantized cache gather as below.
            runs = cache.read_runs(slots) if seq.length == 1 and not spans else None
            if runs is not None:
                o = attend_one(q[rows], runs, self.scale, self.softcap, self.sinks)
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
                    spans,
                    self.sinks,
                )
            if out is None:
                out = o
            else:
                out[rows] = o
        return self._output(out, gate)

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """``o_proj`` of the heads' outputs ``[rows, heads, head_dim]``, each gated first where
        the layer has output gates (one per feature, or one per head)."""
        if gate is not None and self.gate_per_head:
            out = out * torch.sigmoid(gate).unsqueeze(-1)
        out = out.reshape(-1, self.num_heads * self.head_dim)
        if gate is not None and not self.gate_per_head:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _project(
        self, x: torch.Tensor, batch: BatchLayout, cache
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This step's queries ``[rows, heads, head_dim]``, rotated, and output gates
        ``[rows, heads * head_dim]``, or ``[rows, heads]`` per head (None without); its keys and
        values written to the cache."""
        gate = self.gate_proj(x) if self.gate_proj is not None else None
        adjacent = self.rope is not None and self.rope.adjacent_pairs
        plain = self.q_norm is None and not self.output_gate and not adjacent and self.value_norm is None
        plain = plain and not self.values_from_keys and not self.shared_kv
        if batch.decode is not None and x.is_cuda and self.rope is not None and plain:
            # A decode step on the GPU: the q/k/v GEMV also rotates and writes (one launch).
            tables = batch.rope_tables(self.rope, x.dtype)
            q = cache.project_rotated(self.qkv, x, tables, batch.write_slots, self.head_dim)
            if q is not None:
                return q.view(-1, self.num_heads, self.head_dim), gate
        q, k, v = self._raw_projections(x)
        if self.output_gate:
            q, gate = q.view(-1, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
            gate = gate.reshape(-1, self.num_heads * self.head_dim)
        if self.q_norm is not None and self.qk_norm_across_heads:  # one norm over all heads
            q, k = self.q_norm(q.reshape(q.shape[0], -1)), k if k is None else self.k_norm(k)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        if self.shared_kv:
            return self._queries_only(q, batch), gate
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.value_norm is not None:
            v = self.value_norm(v)
        if self.q_norm is not None and not self.qk_norm_across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        rotated = None
        if self.rope is not None:
            if adjacent:  # keys are cached reordered too: q.k is what attention reads
                q, k = self.rope.halves_from_pairs(q), self.rope.halves_from_pairs(k)
            tables = batch.rope_tables(self.rope, q.dtype)
            # On the GPU one launch rotates q and k and writes the keys and values (dense cache).
            rotated = cache.write_rotated(batch.write_slots, q, k, v, tables) if q.is_cuda else None
            if rotated is None:
                q, k = self.rope.apply_pair(q, k, tables)
        if rotated is None:
            cache.write(batch.write_slots, k, v)
            return q, gate
        return rotated, gate

    def _raw_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This step's queries, keys and values as projected: the keys stand in for the values
        where they double as them, and a layer reading another's keys and values has only
        queries (None for the others)."""
        if self.shared_kv:
            return self.qkv(x)[0], None, None
        if self.values_from_keys:
            q, k = self.qkv(x)
            return q, k, k
        return tuple(self.qkv(x))

    def _queries_only(self, q: torch.Tensor, batch: BatchLayout) -> torch.Tensor:
        """Normalised, rotated queries ``[rows, heads, head_dim]`` of a layer whose keys and values
        an earlier layer wrote to the cache (it writes nothing)."""
        if self.q_norm is not None and not self.qk_norm_across_heads:
            q = self.q_norm(q)
        if self.rope is None:
            return q
        if self.rope.adjacent_pairs:
            q = self.rope.halves_from_pairs(q)
        return self.rope.apply(q, batch.rope_tables(self.rope, q.dtype))

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
            sinks=self.sinks,
        )

    def _first_visible(self, seq: SequenceSlice) -> int:
        """Earliest position any of this step's queries can see: skip reading older keys."""
        if self.sliding_window is None:
            return 0
        return max(0, seq.past - self.sliding_window + 1)
