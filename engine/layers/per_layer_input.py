"""Per-layer inputs (Gemma 4's per-layer embeddings) as the builder reads them: the model's table,
projection and norm that make every layer's input (:class:`~engine.modules.per_layer_input.PerLayerInputs`),
and each layer's branch that uses its slice (:class:`~engine.modules.per_layer_input.PerLayerBranch`).
A model has them where its ``ModelSpec.per_layer_inputs`` is a :class:`PerLayerInputSpec`, and a
layer its branch where ``LayerSpec.per_layer_input`` is set."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from engine.modules.per_layer_input import PerLayerBranch, PerLayerInputs

if TYPE_CHECKING:
    from engine.loading.builder import LayerReader, ModelBuilder


@dataclass(frozen=True)
class PerLayerInputSpec:
    """``vocab_size`` rows of ``width`` numbers per layer (vocab_size_per_layer_input,
    hidden_size_per_layer_input); image rows read row ``pad_token_id``; the branches' activation."""

    vocab_size: int
    width: int
    pad_token_id: int = 0
    activation: str = "gelu_pytorch_tanh"


@dataclass(frozen=True)
class PerLayerInputNames:
    """The model's tensors (under the decoder's prefix) and each layer's (under its own)."""

    kind: ClassVar[str] = "per_layer_input"

    table: str = "embed_tokens_per_layer"
    projection: str = "per_layer_model_projection"
    projection_norm: str = "per_layer_projection_norm"
    gate: str = "per_layer_input_gate"
    branch_projection: str = "per_layer_projection"
    branch_norm: str = "post_per_layer_input_norm"


NAMES = PerLayerInputNames()


def build_per_layer_inputs(
    builder: ModelBuilder, names: PerLayerInputNames, table: torch.Tensor | None = None
) -> PerLayerInputs:
    """The model's :class:`PerLayerInputs`, on the builder's device; ``table``: rows to use instead
    of the stored table (the converter's, gathered for its calibration tokens)."""
    spec, prefix = builder.spec, builder.names.prefix
    ple = spec.per_layer_inputs
    packed = spec.num_layers * ple.width
    if table is None:
        table = builder.tensor(f"{prefix}{names.table}.weight", [ple.vocab_size, packed])
    projection = builder.linear(f"{prefix}{names.projection}", spec.hidden_size, packed, False)
    norm = builder.norm(f"{prefix}{names.projection_norm}", ple.width)
    return PerLayerInputs(table, projection, norm, spec.num_layers, ple.width, ple.pad_token_id)


def build_branch(reader: LayerReader, spec: PerLayerInputSpec, names: PerLayerInputNames) -> PerLayerBranch:
    """One layer's branch on its per-layer input."""
    h, w = reader.hidden_size, spec.width
    return PerLayerBranch(
        reader.linear(names.gate, h, w),
        reader.linear(names.branch_projection, w, h),
        reader.norm(names.branch_norm, h),
        spec.activation,
    )
