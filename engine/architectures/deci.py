"""Nemotron-NAS / DeciLM (DeciLMForCausalLM: Llama-3.1-Nemotron-51B, Llama-3.3-Nemotron-Super-49B,
Llama-3.1-Nemotron-Ultra-253B): a Llama decoder whose layers were each cut to measure by a
neural architecture search. ``block_configs`` gives one entry per layer:

- ``attention.n_heads_in_group``: query heads per KV head (the layer's KV heads are
  ``num_attention_heads / n_heads_in_group``); ``attention.no_op``: the layer has no attention
  (nor its ``input_layernorm``);
- ``ffn.ffn_mult``: the gated MLP's width, ``2 * ffn_mult * hidden_size / 3`` rounded up to a
  multiple of 256 (or ``ffn.intermediate_size`` where given); ``ffn.no_op``: no MLP (nor its
  ``post_attention_layernorm``).

Sub-layers replaced by a single linear (``replace_with_linear``) and the sink, sparse and
windowed attention options are refused with a message naming the layer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.architectures.base import Architecture
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.layers.gated_mlp import GatedMLPSpec
from engine.layers.spec import LayerSpec, ModelSpec

# Options of a block's attention / ffn entry that no released checkpoint's run needs and the
# engine does not have; set (true or non-null), they are refused.
_UNSUPPORTED = {
    "attention": (
        "replace_with_linear",
        "sparsify",
        "num_sink_tokens",
        "unshifted_sink",
        "use_prefill_window_in_sink_attention",
        "window_length",
    ),
    "ffn": ("replace_with_linear", "sparsify"),
}


def ffn_width(ffn_mult: float, hidden_size: int) -> int:
    """The MLP width of a block's ``ffn_mult``: two thirds of ``ffn_mult * hidden_size``, rounded
    down, then up to a multiple of 256."""
    width = int(2 * ffn_mult * hidden_size / 3)
    return -(-width // 256) * 256


class Deci(Architecture):
    hf_names = ("DeciLMForCausalLM",)

    def spec(self, cfg: ModelConfig) -> ModelSpec:
        spec = super().spec(cfg)
        where = cfg.directory / "config.json"
        blocks = cfg.require("block_configs")
        if len(blocks) != spec.num_layers:
            raise ModelLoadError(
                f"{where}: block_configs has {len(blocks)} entries for {spec.num_layers} layers"
            )
        layers = tuple(self._layer(cfg, i, layer, blocks[i]) for i, layer in enumerate(spec.layers))
        return replace(spec, layers=layers)

    def _layer(self, cfg: ModelConfig, i: int, layer: LayerSpec, block: dict[str, Any]) -> LayerSpec:
        where = cfg.directory / "config.json"
        parts = {part: block.get(part) or {} for part in _UNSUPPORTED}
        for part, options in _UNSUPPORTED.items():
            for option in options:
                if parts[part].get(option):
                    raise ModelLoadError(f"{where}: layer {i}'s {part} sets '{option}': not supported")
        attention, ffn = parts["attention"], parts["ffn"]
        mixer = None
        if not attention.get("no_op"):
            heads = layer.mixer.num_heads
            group = int(attention.get("n_heads_in_group") or 1)
            if heads % group:
                raise ModelLoadError(f"{where}: layer {i}: {heads} heads do not form groups of {group}")
            mixer = replace(layer.mixer, num_kv_heads=heads // group)
        feed_forward = None
        if not ffn.get("no_op"):
            width = ffn.get("intermediate_size")
            if width is None and ffn.get("ffn_mult") is None:
                raise ModelLoadError(f"{where}: layer {i}'s ffn gives neither ffn_mult nor intermediate_size")
            if width is None:
                width = ffn_width(float(ffn["ffn_mult"]), int(cfg.require("hidden_size")))
            feed_forward = replace(layer.feed_forward, intermediate_size=int(width))
        if mixer is None and feed_forward is None:
            raise ModelLoadError(f"{where}: layer {i} has neither attention nor an MLP (both no_op)")
        return replace(layer, mixer=mixer, feed_forward=feed_forward)

    def mlp(self, cfg: ModelConfig) -> GatedMLPSpec:
        # Each block gives its own width (above); the model-wide config may state none.
        return GatedMLPSpec(
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            activation=cfg.get("hidden_act") or "silu",
            bias=bool(cfg.get("mlp_bias", False)),
        )
