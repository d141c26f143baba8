"""Reading a checkpoint's multi-token-prediction layer into an :class:`MtpHead`, from the same
weight store and module library as the model (``--draft mtp`` only: the main model never reads
these tensors, so they cost no memory unless asked for).

The first MTP layer is built; checkpoints with more than one draft every token from it (each
published one has a single MTP layer). Its decoder layer has the kinds of one of the main layers
(``MtpNames.like``: the last one, or the last attention layer of a hybrid), read at the MTP
layer's own prefix; its embedding is the model's.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.architectures import architecture_for
from engine.architectures.mtp_names import MtpNames, declared_mtp_layers
from engine.errors import UsageError
from engine.layers.spec import LayerSpec, ModelSpec
from engine.loading.builder import LayerReader, ModelBuilder
from engine.loading.safetensors_store import WeightStore
from engine.modules.mtp_head import MtpHead


def mtp_layer_spec(spec: ModelSpec, like: str) -> LayerSpec:
    """The main layer whose kinds the MTP layer has (``MtpNames.like``)."""
    if like == "last_attention":
        for layer in reversed(spec.layers):
            if layer.mixer is not None and layer.mixer.kind in ("attention", "latent_attention"):
                return layer
        raise ValueError("the model has no attention layer for its MTP layer to be like")
    return spec.layers[-1]


def build_mtp_head(model: Any, store: Any = None) -> MtpHead:
    """The MTP layer of ``model`` (a :class:`~engine.model.LoadedModel`), read from ``store``
    (default: its directory's safetensors). A UsageError says why where the checkpoint has none
    this engine can read."""
    config = model.config
    arch = architecture_for(config.architecture)
    name = model.directory.name
    if not declared_mtp_layers(config.raw):
        raise UsageError(f"--draft mtp: {name} has no MTP heads in its config.json")
    names = arch.mtp
    if names is None:
        raise UsageError(
            f"--draft mtp: {name} declares MTP heads, but reading them is not supported for "
            f"{config.architecture} (supported: Qwen3-Next/Qwen3.5, DeepSeek-V3, GLM-4.5, MiMo)"
        )
    store = store if store is not None else WeightStore(model.directory)
    j = int(config.require("num_hidden_layers")) if names.after_main_layers else 0
    with torch.inference_mode():
        return _build(model, store, names, j)


def _build(model: Any, store: Any, names: MtpNames, j: int) -> MtpHead:
    spec, name = model.spec, model.directory.name
    arch = architecture_for(model.config.architecture)
    builder = ModelBuilder(
        spec, arch.tensor_names(store.has), store, model.dtype, model.device, spec.max_position_embeddings
    )
    projection = names.projection.format(j=j)
    if not builder.has_linear(projection):
        raise UsageError(
            f"--draft mtp: {name} declares MTP heads in its config.json, but its weights lack them "
            f"('{projection}.weight' is missing: a checkpoint saved without its MTP layers?)"
        )
    h = spec.hidden_size
    reader = LayerReader(builder, names.block.format(j=j), {})
    block = builder.layer_block(mtp_layer_spec(spec, names.like), reader)
    head_key = names.head.format(j=j) if names.head else None
    if head_key is not None and builder.has_linear(head_key):
        head = builder.linear(head_key, h, spec.vocab_size, False)
    else:
        head = model.module.lm_head
    return MtpHead(
        builder.norm(names.embed_norm.format(j=j), h),
        builder.norm(names.hidden_norm.format(j=j), h),
        builder.linear(projection, 2 * h, h, False),
        block,
        builder.norm(names.final_norm.format(j=j), h),
        head,
        hidden_first=names.hidden_first,
        hands_on_normed=names.hands_on_normed,
    ).eval()
