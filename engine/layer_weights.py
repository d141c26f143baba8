"""What each decoder layer of a checkpoint stores, from its tensor names and sizes alone (the
safetensors headers ``engine.inspect`` reads): torch-free, for the memory estimate of a layer
split (``engine.placement_memory``), where layers differ (dense first layers before mixtures of
experts, wider global attention layers, EXL3 layers of different bit rates).

A tensor belongs to decoder layer ``i`` where its name starts with a decoder prefix the
architectures use (``engine.architectures``: ``model.``, Nemotron-H's ``backbone.``, and the
vision-language nestings ``model.language_model.`` and ``language_model.model.``) followed by
``layers.{i}.``. Anything else (embedding, final norm, head, a vision tower's layers, MTP layers
kept after the main ones) belongs to no decoder layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DECODER_LAYER = re.compile(
    r"(?:model\.language_model\.|language_model\.model\.|model\.|backbone\.)layers\.(\d+)\."
)


def decoder_layer(name: str, num_layers: int) -> int | None:
    """The decoder layer of ``num_layers`` that tensor ``name`` belongs to, or None (an index at
    or past ``num_layers`` is an MTP layer stored after the main ones, which the model does not
    run)."""
    match = _DECODER_LAYER.match(name)
    if match is None:
        return None
    index = int(match.group(1))
    return index if index < num_layers else None


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights: ``stored_bytes`` in the files (EXL3 packed), of which
    ``expert_bytes`` are routed experts, and ``parameters`` (an EXL3 matrix counted as the
    numbers it decodes to)."""

    stored_bytes: int = 0
    expert_bytes: int = 0
    parameters: int = 0


class LayerTally:
    """Adds up the tensors of a checkpoint by the decoder layer they belong to."""

    def __init__(self, num_layers: int | None) -> None:
        self._layers = [[0, 0, 0] for _ in range(num_layers or 0)]
        self._seen = False

    def add(self, name: str, nbytes: int, parameters: int, expert: bool) -> bool:
        """Count tensor ``name`` (``nbytes`` stored, ``parameters`` numbers, a routed expert's
        where ``expert``) to its layer; False where it belongs to none."""
        layer = decoder_layer(name, len(self._layers))
        if layer is None:
            return False
        sizes = self._layers[layer]
        sizes[0] += nbytes
        sizes[1] += nbytes if expert else 0
        sizes[2] += parameters
        self._seen = True
        return True

    def layers(self) -> tuple[LayerWeights, ...]:
        """Each decoder layer's weights, in order; empty where no tensor named a decoder layer
        (names of a layout this module does not know: the sizes per layer are unknown)."""
        if not self._seen:
            return ()
        return tuple(LayerWeights(*sizes) for sizes in self._layers)
