"""A model as a list of layers: :class:`ModelSpec` holds what the whole model shares and one
:class:`LayerSpec` per decoder layer, each a *mixer* (what moves information between positions:
attention, or a recurrent kind) and a *feed-forward* (what transforms each position alone: a
gated MLP, a mixture of experts), each with its pre-norm; a layer may have only one of the two.

Specs are plain data read from config.json by an architecture (``engine.architectures``). A
mixer's or feed-forward's spec names its kind (``kind``), and the registry (``engine.layers``)
maps that name to how such a layer is built and what it keeps per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


class MixerSpec:
    """Base of a mixer kind's spec (a frozen dataclass); ``kind`` is its name in ``MIXERS``."""

    kind: ClassVar[str]


class FeedForwardSpec:
    """Base of a feed-forward kind's spec (a frozen dataclass); ``kind`` is its name in
    ``FEED_FORWARDS``. ``reads_residual``: the kind takes the residual stream as it is and
    normalises it inside, so its layer has no pre-norm before it (Gemma 4's dense MLP and
    experts side by side, each behind its own norm)."""

    kind: ClassVar[str]
    reads_residual: ClassVar[bool] = False


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: ``h += mixer(norm(h))``, then ``h += feed_forward(norm(h))``.

    Either sub-layer may be None where the layer has only the other one, with its own pre-norm
    and residual (NemotronH's layers are each a Mamba-2, an attention, an MLP or an MoE block).
    ``sandwich_norms``: each sub-layer's output is normalised again before it joins the residual
    stream (Gemma 2 and 3). ``pre_norms`` False: the sub-layers read the residual stream as it is,
    and with ``sandwich_norms`` the layer is post-norm, ``h += norm(mixer(h))`` (OLMo 2/3's
    attention layers). ``per_layer_input``: a third residual branch after the feed-forward reads
    the layer's slice of the per-layer inputs (``ModelSpec.per_layer_inputs``), and
    ``output_scale``: the layer's output, residual stream and all, is multiplied by a stored
    scalar (Gemma 4's per-layer embeddings and ``layer_scalar``). ``residual_scale``: each
    sub-layer's output is multiplied by it before it joins the stream (HyperCLOVA X's
    ``residual_multiplier``). ``parallel``: the mixer and the feed-forward both read the one
    pre-norm's output and join the stream together, ``h += mixer(norm(h)) + feed_forward(norm(h))``
    (Cohere; the layer has no feed-forward norm).
    """

    mixer: MixerSpec | None
    feed_forward: FeedForwardSpec | None
    sandwich_norms: bool = False
    pre_norms: bool = True
    per_layer_input: bool = False
    output_scale: bool = False
    residual_scale: float = 1.0
    parallel: bool = False

    def __post_init__(self) -> None:
        if self.mixer is None and self.feed_forward is None:
            raise ValueError("a layer needs a mixer, a feed-forward or both")


@dataclass(frozen=True)
class ModelSpec:
    """Everything the module library needs to assemble one decoder-only model."""

    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    layers: tuple[LayerSpec, ...]
    norm_eps: float
    norm_offset: float = 0.0  # Gemma's norms scale by (1 + weight)
    embed_scale: float = 1.0
    final_softcap: float | None = None
    tie_word_embeddings: bool = False
    head_bias: bool = False  # the head adds a bias, tied or not (Ernie 4.5's use_bias)
    # The norms subtract the mean: LayerNorm with a scale and no bias (Cohere); else RMSNorm.
    layer_norm: bool = False
    # Inputs computed once per step for every layer from the tokens and their embeddings
    # (engine.layers.per_layer_input.PerLayerInputSpec: Gemma 4's per-layer embeddings), or None.
    per_layer_inputs: Any = None
    # Every RMSNorm without a learned scale: none is stored (nanochat).
    unweighted_norms: bool = False
    # The embeddings are RMS-normalised before the first layer, with the final norm's settings (nanochat).
    embed_norm: bool = False
    # The logits are multiplied by it (HyperCLOVA X's logits_scaling, Cohere's logit_scale).
    logit_scale: float = 1.0

    @property
    def num_layers(self) -> int:
        return len(self.layers)
