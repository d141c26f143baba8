"""The decoder-only transformer: embedding, a stack of blocks, final norm, LM head."""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine.cache.state import SequenceState
from engine.modules.batch import BatchLayout
from engine.modules.linear import LinearSite
from engine.modules.norms import add_and_norm
from engine.modules.splice import InputSplice


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` as ``dtype`` would store it."""
    return float(torch.tensor(value, dtype=dtype))


class DecoderBlock(nn.Module):
    """One decoder layer, pre-norm residual: ``h + mixer(norm(h))``, then ``+ feed_forward(norm(.))``.

    The mixer is any mixer kind's module (attention, a recurrent kind), the feed-forward any
    feed-forward kind's (gated MLP, mixture of experts); see ``engine.layers``. A block may have
    only one of the two (None for the other, with its norms). ``state`` is what the mixer keeps
    per sequence (``engine.cache.state``), for whoever makes a cache for this block alone (the
    converter). The optional ``*_out_norm`` give Gemma's "sandwich" layout, where each sub-layer's
    output is normalised again before it joins the residual stream. Gemma 4 adds a third branch,
    ``per_layer_input(h, x)`` on the layer's per-layer input ``x`` (``engine.modules.per_layer_input``),
    and multiplies the layer's whole output by ``output_scale``. ``residual_scale`` multiplies each
    sub-layer's output before it joins the stream (HyperCLOVA X). A ``parallel`` block feeds the
    mixer's normalised input to the feed-forward too and adds both outputs at once (Cohere).
    """

    def __init__(
        self,
        mixer_norm: nn.Module | None = None,
        mixer: nn.Module | None = None,
        feed_forward_norm: nn.Module | None = None,
        feed_forward: nn.Module | None = None,
        mixer_out_norm: nn.Module | None = None,
        feed_forward_out_norm: nn.Module | None = None,
        state: SequenceState | None = None,
        per_layer_input: nn.Module | None = None,
        output_scale: torch.Tensor | None = None,
        residual_scale: float = 1.0,
        parallel: bool = False,
    ) -> None:
        super().__init__()
        if mixer is None and feed_forward is None:
            raise ValueError("a decoder block needs a mixer, a feed-forward or both")
        if parallel and (mixer is None or feed_forward is None):
            raise ValueError("a parallel decoder block needs both a mixer and a feed-forward")
        # Registered in the order they run: the converter writes a block's tensors in this order.
        self.mixer_norm, self.mixer, self.mixer_out_norm = mixer_norm, mixer, mixer_out_norm
        self.feed_forward_norm, self.feed_forward = feed_forward_norm, feed_forward
        self.feed_forward_out_norm = feed_forward_out_norm
        self.per_layer_input = per_layer_input
        self.register_buffer("output_scale", output_scale)
        self.residual_scale = residual_scale
        # The feed-forward reads the mixer's input, and their outputs join the stream together.
        self.parallel = parallel
        self.state = state

    @property
    def dynamic_decode(self) -> str | None:
        """What makes a decode step's work depend on its tokens (a name, e.g. mixture-of-experts),
        or None: then a CUDA graph can replay it."""
        mixer = getattr(self.mixer, "dynamic_decode", None)
        return mixer or getattr(self.feed_forward, "dynamic_decode", None)

    def quantizable_linears(self) -> list[LinearSite]:
        return [
            site
            for part in (self.mixer, self.feed_forward, self.per_layer_input)
            if part is not None
            for site in part.quantizable_linears()
        ]

    def forward(
        self, h: torch.Tensor, batch: BatchLayout, cache, layer_input: torch.Tensor | None = None
    ) -> torch.Tensor:
        h, m = self.residual_forward(h, None, batch, cache, layer_input)
        return h if m is None else h + m

    def residual_forward(
        self,
        h: torch.Tensor,
        pending: torch.Tensor | None,
        batch: BatchLayout,
        cache,
        layer_input: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block with its last residual add left to the caller: returns ``(h, m)`` whose sum
        is :meth:`forward`'s output. It takes its input the same way, as ``h + pending`` (the
        previous block's deferred add; None: just ``h``), so every add runs together with the norm
        that reads its sum (:func:`add_and_norm`: one launch on the GPU instead of two). The sums
        are the very tensors the unfused block computes, so the results are bit for bit the same.
        ``layer_input``: this layer's per-layer input, for its ``per_layer_input`` branch. A block
        with an ``output_scale`` scales the sum itself and leaves nothing pending (None).
        """
        if self.mixer is not None:
            h, x = _add_and_norm(h, pending, self.mixer_norm)
            pending = self.mixer(x, batch, cache)
            if self.mixer_out_norm is not None:  # Gemma's sandwich norm: before the add, not fused
                pending = self.mixer_out_norm(pending)
            pending = self._scaled(pending)
        if self.feed_forward is not None and self.parallel:  # x: the mixer's input, pending its output
            pending = pending + self._scaled(self.feed_forward(x))
        elif self.feed_forward is not None:
            h, x = _add_and_norm(h, pending, self.feed_forward_norm)
            pending = self.feed_forward(x)
            if self.feed_forward_out_norm is not None:
                pending = self.feed_forward_out_norm(pending)
            pending = self._scaled(pending)
        if self.per_layer_input is not None:  # reads the stream with the feed-forward's output in
            h = h + pending
            pending = self.per_layer_input(h, layer_input)
        if self.output_scale is not None:
            return (h + pending) * self.output_scale, None
        return h, pending

    def _scaled(self, delta: torch.Tensor) -> torch.Tensor:
        """A sub-layer's output times ``residual_scale`` (a Python number: graph-capturable)."""
        return delta if self.residual_scale == 1.0 else delta * self.residual_scale


def _add_and_norm(
    h: torch.Tensor, pending: torch.Tensor | None, norm: nn.Module | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + pending, norm(h + pending))``, or ``(h, norm(h))`` where nothing is pending; a
    sub-layer without a pre-norm (None) reads the sum itself."""
    if norm is None:
        h = h if pending is None else h + pending
        return h, h
    return (h, norm(h)) if pending is None else add_and_norm(h, pending, norm)


class CausalLM(nn.Module):
    def __init__(
        self,
        embedding: nn.Embedding,
        blocks: list[DecoderBlock],
        final_norm: nn.Module,
        lm_head: nn.Module,
        embed_scale: float = 1.0,
        final_softcap: float | None = None,
        per_layer_inputs: nn.Module | None = None,
        embed_norm: nn.Module | None = None,
        logit_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.embedding = embedding
        self.blocks = nn.ModuleList(blocks)
        self.final_norm, self.lm_head = final_norm, lm_head
        self.embed_scale, self.final_softcap = embed_scale, final_softcap
        # Gemma 4's per-layer inputs, [tokens, layers, width] per step (None: no such inputs).
        self.per_layer_inputs = per_layer_inputs
        self.embed_norm = embed_norm  # nanochat normalises the embeddings (None: not)
        self.logit_scale = logit_scale

    @property
    def dtype(self) -> torch.dtype:
        weight = self.embedding.weight
        # An int8 table (engine.modules.int8) stores codes; its rows come out in the model's dtype.
        return weight.dtype if weight.is_floating_point() else self.embedding.dtype

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device

    @property
    def static_decode(self) -> bool:
        """Whether a decode step launches the same kernels on the same shapes whatever its tokens
        are, so that a CUDA graph can replay it (not so where a block's :attr:`dynamic_decode`
        names a reason, e.g. a mixture of experts: which experts run depends on the router)."""
        return self.dynamic_decode is None

    @property
    def dynamic_decode(self) -> str | None:
        """The first reason a block gives why its decode step's work depends on its tokens."""
        return next((block.dynamic_decode for block in self.blocks if block.dynamic_decode), None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embedding(input_ids)
        if self.embed_scale != 1.0:
            # Gemma scales embeddings by sqrt(hidden), rounded to the activation dtype first. A
            # Python number (not a tensor made per call) keeps the step free of host tensors, so a
            # CUDA graph can capture it.
            h = h * _rounded(self.embed_scale, h.dtype)
        return h if self.embed_norm is None else self.embed_norm(h)

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: BatchLayout,
        cache,
        logit_rows: torch.Tensor | None = None,
        splice: InputSplice | None = None,
        hidden_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[len(logit_rows), vocab]`` (all rows when ``logit_rows`` is None), float32.

        ``input_ids`` is the flat ``[tokens]`` batch described by ``batch``; ``cache`` gives each
        block its layer of the cache via ``cache.layer(i)``. ``splice`` gives some rows' input vectors
        directly (image embeddings at their placeholder tokens). ``hidden_rows`` (opt-in, for an
        MTP drafter): also the final hidden states of those rows, after the final norm (what the
        LM head reads), returned as ``(logits, hidden)``.
        """
        h = self.embed(input_ids)
        if splice is not None:
            h = splice.apply(h)
        layer_inputs = None
        if self.per_layer_inputs is not None:
            layer_inputs = self.per_layer_inputs(input_ids, h, None if splice is None else splice.rows)
        # The residual stream is h + pending: each block's last add is done by the next block's
        # first norm (or the final norm), fused with it (DecoderBlock.residual_forward).
        pending: torch.Tensor | None = None
        for i, block in enumerate(self.blocks):
            layer_input = None if layer_inputs is None else layer_inputs[:, i]
            h, pending = block.residual_forward(h, pending, batch, cache.layer(i), layer_input)
            if splice is not None and i < len(splice.layer_additions):  # adds to the whole stream
                h, pending = splice.after_layer(i, h if pending is None else h + pending), None
        hidden = None if hidden_rows is None else self._final(h, pending, hidden_rows)
        logits = self.head_logits(self._final(h, pending, logit_rows))
        return logits if hidden is None else (logits, hidden)

    def _final(
        self, h: torch.Tensor, pending: torch.Tensor | None, rows: torch.Tensor | None
    ) -> torch.Tensor:
        """The final norm of the stream ``h + pending`` at ``rows`` (all where None); the add is
        elementwise, so rows are selected first and only those added."""
        if rows is not None:
            h = h[rows]
            pending = None if pending is None else pending[rows]
        return self.final_norm(h) if pending is None else add_and_norm(h, pending, self.final_norm)[1]

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final hidden states ``x`` (after the final norm): the LM head, then
        the model's logit scale and soft cap."""
        logits = self.lm_head(x).float()
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
