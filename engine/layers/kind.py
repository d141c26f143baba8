"""What the engine knows about a kind of layer, so that nothing else has to.

A *mixer kind* (:class:`MixerKind`) and a *feed-forward kind* (:class:`FeedForwardKind`) each
bundle the default names of their weights in a layer, the function that builds their module from
a checkpoint, and, for a mixer, the state it keeps per sequence. The builder, the cache and the
converter look a kind up by its spec's ``kind`` in the registry (``engine.layers``) and call
these; none of them names a kind.

The module a kind builds:

- computes ``forward(x, batch, cache)`` (mixer: ``x`` the flat batch's rows, ``batch`` the
  step's :class:`~engine.modules.batch.BatchLayout`, ``cache`` the layer's storage for the state
  it declared, None without any) or ``forward(x)`` (feed-forward);
- lists its quantizable linears, ``quantizable_linears() -> list[LinearSite]``, for the converter;
- may set ``dynamic_decode`` (a class attribute or a property: a name such as
  ``"mixture-of-experts"``, or None) where the work of a decode step depends on its tokens, so no
  CUDA graph can replay it (a mixture whose experts the device-routed kernels take answers None).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from engine.cache.state import SequenceState

if TYPE_CHECKING:
    from engine.loading.builder import LayerReader

Build = Callable[["LayerReader", Any, Any], nn.Module]  # (reader, spec, names) -> module


@dataclass(frozen=True)
class MixerKind:
    """``names``: where its weights sit in a layer, by default (a frozen dataclass of key names
    whose ``kind`` is the kind's name; an architecture may give other ones, ``TensorNames.parts``).
    ``build(reader, spec, names)``: the module. ``state(spec)``: what the cache keeps per
    sequence for such a layer (:mod:`engine.cache.state`), or None."""

    names: Any
    build: Build
    state: Callable[[Any], SequenceState | None]


@dataclass(frozen=True)
class FeedForwardKind:
    """As :class:`MixerKind`, without per-sequence state: a feed-forward sees each row alone."""

    names: Any
    build: Build
