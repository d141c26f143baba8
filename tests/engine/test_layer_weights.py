"""Which decoder layer a checkpoint's tensor belongs to (engine.layer_weights), for each nesting
the architectures read, and what belongs to none."""

from __future__ import annotations

import pytest

from engine.layer_weights import LayerTally, LayerWeights, decoder_layer


@pytest.mark.parametrize(
    "name,layer",
    [
        ("model.layers.12.self_attn.q_proj.weight", 12),
        ("model.language_model.layers.3.mlp.down_proj.weight", 3),  # transformers 5 vision-language
        ("language_model.model.layers.0.input_layernorm.weight", 0),  # transformers 4 vision-language
        ("backbone.layers.5.mixer.in_proj.weight", 5),  # Nemotron-H
        ("model.layers.7.mlp.experts.gate_up_proj", 7),
        ("model.embed_tokens.weight", None),
        ("lm_head.weight", None),
        ("model.norm.weight", None),
        ("model.vision_tower.encoder.layers.2.mlp.fc1.weight", None),
        ("vision_tower.transformer.layers.2.attention.q_proj.weight", None),
        ("mtp.layers.0.self_attn.q_proj.weight", None),  # Qwen3-Next's MTP layer
        ("model.layers.16.eh_proj.weight", None),  # DeepSeek's MTP layer, after the 16 main ones
        ("model.layers.x.weight", None),
    ],
)
def test_a_tensors_decoder_layer(name: str, layer: int | None) -> None:
    assert decoder_layer(name, 16) == layer


def test_the_tally_adds_up_each_layer() -> None:
    tally = LayerTally(2)
    assert tally.add("model.layers.1.mlp.experts.down_proj", 100, 50, expert=True)
    assert tally.add("model.layers.1.self_attn.o_proj.weight", 10, 5, expert=False)
    assert not tally.add("model.embed_tokens.weight", 1000, 500, expert=False)
    assert tally.layers() == (LayerWeights(), LayerWeights(110, 100, 55))
    # no tensor named a layer: the sizes per layer are unknown, not zero
    assert LayerTally(2).layers() == () and LayerTally(None).layers() == ()
