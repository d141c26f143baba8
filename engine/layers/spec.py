"""A model as a list of layers: :class:`ModelSpec` holds what the whole model shares and one
:class:`LayerSpec` per decoder layer, each a *mixer* (what moves information between positions:
attention, or a recurrent kind) and a *feed-forward* (what transforms each position alone: a
gated MLP, a mixture of experts), each with its pre-norm.

Specs are plain data read from config.json by an architecture (``engine.architectures``). A
mixer's or feed-forward's spec names its kind (``kind``), and the registry (``engine.layers``)
maps that name to how such a layer is built and what it keeps per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


class MixerSpec:
    """Base of a mixer kind's spec (a frozen dataclass); ``kind`` is its name in ``MIXERS``."""

    kind: ClassVar[str]


class FeedForwardSpec:
    """Base of a feed-forward kind's spec (a frozen dataclass); ``kind`` is its name in
    ``FEED_FORWARDS``."""

    kind: ClassVar[str]


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: ``h += mixer(norm(h))``, then ``h += feed_forward(norm(h))``.

    ``sandwich_norms``: each sub-layer's output is normalised again before it joins the residual
    stream (Gemma 2 and 3).
    """

    mixer: MixerSpec
    feed_forward: FeedForwardSpec
    sandwich_norms: bool = False


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

    @property
    def num_layers(self) -> int:
        return len(self.layers)
