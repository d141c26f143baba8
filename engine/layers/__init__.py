"""The kinds of layer a model is made of, and the registry that names them.

A model is a list of layers (:class:`~engine.layers.spec.LayerSpec`), each a mixer and a
feed-forward of some kind (or only one of the two). The builder, the cache and the converter find
a kind here by the ``kind`` of its spec; a new kind is a module, a spec, a build function and one
line below (docs/ADDING_AN_ARCHITECTURE.md).
"""

from __future__ import annotations

from engine.cache.state import SequenceState
from engine.layers.attention import ATTENTION
from engine.layers.gated_delta_net import GATED_DELTA_NET
from engine.layers.gated_mlp import GATED_MLP
from engine.layers.kind import FeedForwardKind, MixerKind
from engine.layers.latent_attention import LATENT_ATTENTION
from engine.layers.mamba2 import MAMBA2
from engine.layers.parallel_experts import PARALLEL_EXPERTS
from engine.layers.plain_mlp import PLAIN_MLP
from engine.layers.short_conv import SHORT_CONV
from engine.layers.sparse_moe import SPARSE_MOE
from engine.layers.spec import FeedForwardSpec, LayerSpec, MixerSpec, ModelSpec

MIXERS: dict[str, MixerKind] = {
    "attention": ATTENTION,
    "gated_delta_net": GATED_DELTA_NET,
    "latent_attention": LATENT_ATTENTION,
    "mamba2": MAMBA2,
    "short_conv": SHORT_CONV,
}

FEED_FORWARDS: dict[str, FeedForwardKind] = {
    "gated_mlp": GATED_MLP,
    "plain_mlp": PLAIN_MLP,
    "parallel_experts": PARALLEL_EXPERTS,
    "sparse_moe": SPARSE_MOE,
}


def sequence_states(spec: ModelSpec) -> list[SequenceState | None]:
    """What each layer keeps per sequence, as its mixer kind declares it (nothing for a layer
    without a mixer)."""
    return [
        None if layer.mixer is None else MIXERS[layer.mixer.kind].state(layer.mixer) for layer in spec.layers
    ]


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
