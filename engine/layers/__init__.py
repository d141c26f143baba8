"""The kinds of layer a model is made of, and the registry that names them.

A model is a list of layers (:class:`~engine.layers.spec.LayerSpec`), each a mixer and a
feed-forward of some kind. The builder, the cache and the converter find a kind here by the
``kind`` of its spec; a new kind is a module, a spec, a build function and one line below
(docs/ADDING_AN_ARCHITECTURE.md).
"""

from __future__ import annotations

from engine.cache.state import SequenceState
from engine.layers.attention import ATTENTION
from engine.layers.gated_mlp import GATED_MLP
from engine.layers.kind import FeedForwardKind, MixerKind
from engine.layers.sparse_moe import SPARSE_MOE
from engine.layers.spec import FeedForwardSpec, LayerSpec, MixerSpec, ModelSpec

MIXERS: dict[str, MixerKind] = {
    "attention": ATTENTION,
}

FEED_FORWARDS: dict[str, FeedForwardKind] = {
    "gated_mlp": GATED_MLP,
    "sparse_moe": SPARSE_MOE,
}


def sequence_states(spec: ModelSpec) -> list[SequenceState | None]:
    """What each layer keeps per sequence, as its mixer kind declares it."""
    return [MIXERS[layer.mixer.kind].state(layer.mixer) for layer in spec.layers]


__all__ = [
    "FEED_FORWARDS",
    "MIXERS",
    "FeedForwardKind",
    "FeedForwardSpec",
    "LayerSpec",
    "MixerKind",
    "MixerSpec",
    "ModelSpec",
    "sequence_states",
]
