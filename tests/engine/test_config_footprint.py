"""The app's torch-free reading of a model's cache footprint from config.json
(``engine.config_footprint``) agrees with the engine's, from what the layers' kinds declare
(``engine.cache.paged.cache_footprint``), for every family with a tiny model: which layers keep
keys and values of which shape, and which keep a recurrent state of how many numbers."""

from __future__ import annotations

import json

import pytest

from engine.architectures import architecture_for
from engine.cache.paged import cache_footprint
from engine.config import ModelConfig
from engine.config_footprint import config_footprint
from engine.errors import ModelLoadError

HYBRIDS = [
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "OlmoHybridForCausalLM",
    "Lfm2ForCausalLM",
    "Lfm2MoeForCausalLM",
    "NemotronHForCausalLM",
    "NemotronHForCausalLM-moe",
]
PLAIN = ["LlamaForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"]
# The keys that list the layers; without them a family falls back to its interval, its attention
# indices or its pattern string.
LISTS = ("layer_types", "layers_block_type")


def _engine_footprint(directory):
    cfg = ModelConfig.from_dir(directory)
    return cache_footprint(architecture_for(cfg.architecture).spec(cfg))


@pytest.mark.parametrize("variant", HYBRIDS + PLAIN)
def test_the_config_footprint_is_the_engines(variant, tiny_model_factory):
    directory, _ = tiny_model_factory(variant)
    config = json.loads((directory / "config.json").read_text())
    engine = _engine_footprint(directory)
    assert config_footprint(config) == engine
    assert engine.recurrent == (variant in HYBRIDS)


@pytest.mark.parametrize("variant", HYBRIDS)
def test_without_a_layer_list_the_fallback_layouts_agree(variant, tiny_model_factory, tmp_path):
    directory, _ = tiny_model_factory(variant)
    config = json.loads((directory / "config.json").read_text())
    if variant.startswith("Qwen3"):
        config["full_attention_interval"] = 2
    elif variant.startswith("Lfm2"):
        config["full_attn_idxs"] = [0, 3]
    elif variant.startswith("Nemotron"):  # the saved layer list as a pattern string, reversed
        letters = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
        config["hybrid_override_pattern"] = "".join(letters[t] for t in config["layers_block_type"])[::-1]
    config = {k: v for k, v in config.items() if k not in LISTS}
    (tmp_path / "config.json").write_text(json.dumps(config))
    try:
        engine = _engine_footprint(tmp_path)
    except ModelLoadError:  # a family that needs the list (LFM2-MoE) is not estimated either way
        assert variant == "Lfm2MoeForCausalLM"
        return
    assert config_footprint(config) == engine
    assert engine.recurrent == (variant != "OlmoHybridForCausalLM")  # OLMo has no fallback: all attend


def test_a_malformed_hybrid_config_has_no_footprint():
    assert config_footprint({"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 4}) is None
