"""AFMoE (Arcee's Trinity) and Step 3.5 / 3.7 against transformers, on tiny random models
(tiny_models.py) whose routers decide clearly (spread_routers.py): mixtures of experts beside a
dense first layer, attention whose heads' outputs are gated by a projection of their own (per
feature, per head), sliding and global layers. Each family's layers as its config lays them out,
its logits over 64 tokens, the Generator's decode over the paged cache, and the Hub configs'
spellings (Step 3.5's ``Step3p5ForCausalLM`` checkpoints among them)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from parity import random_ids, reference_logits, rel_err
from spread_routers import build_spread_model, smallest_margin

from engine.architectures import architecture_for
from engine.cache.paged import PagedKVCache, cache_footprint
from engine.config import ModelConfig
from engine.config_footprint import config_footprint
from engine.errors import ModelLoadError
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import score_tokens
from engine.model import load_model
from engine.modules.attention import Attention
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE

AFMOE, STEP = "AfmoeForCausalLM", "Step3p7ForConditionalGeneration"
FAMILIES = [AFMOE, STEP]
TOL = 1e-4


def _ours(model, ids: list[int], chunk: int = 512) -> torch.Tensor:
    return score_tokens(model.module, PagedKVCache.for_model(model.spec, 256, page_size=16), ids, chunk=chunk)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``variant -> (directory, our model, transformers' model)``, each built once."""
    built = {}

    def get(variant: str):
        if variant not in built:
            directory = tmp_path_factory.mktemp(variant)
            reference = build_spread_model(variant, directory)
            built[variant] = (directory, load_model(directory, device="cpu"), reference)
        return built[variant]

    return get


# -- the layers -------------------------------------------------------------------------------


def test_afmoe_layers_follow_its_config(models):
    _, model, reference = models(AFMOE)
    blocks = model.module.blocks
    assert isinstance(blocks[0].feed_forward, GatedMLP)  # num_dense_layers = 1
    moes = [b.feed_forward for b in blocks[1:]]
    assert all(isinstance(m, SparseMoE) for m in moes)
    moe = moes[0]
    assert (moe.scoring, moe.normalize, moe.scale, moe.top_k) == ("sigmoid", True, 2.0, 2)
    assert moe.shared is not None and moe.shared_gate is None
    assert moe.shared.down.in_features == 2 * 32  # two shared experts' width
    torch.testing.assert_close(moe.selection_bias, reference.model.layers[1].mlp.expert_bias)
    # Sliding layers (0, 2) rotate; the global ones (1, 3) see everything, unrotated.
    attention = [b.mixer for b in blocks]
    assert [a.sliding_window for a in attention] == [16, None, 16, None]
    assert [a.rope is not None for a in attention] == [True, False, True, False]
    assert all(a.gate_proj.out_features == 64 and not a.gate_per_head for a in attention)
    assert all(b.mixer_out_norm is not None and b.feed_forward_out_norm is not None for b in blocks)
    assert model.module.embed_scale == 8.0  # muP: sqrt(64)
    assert not model.spec.tie_word_embeddings


def test_step_layers_follow_its_config(models):
    _, model, reference = models(STEP)
    blocks = model.module.blocks
    attention = [b.mixer for b in blocks]
    assert all(isinstance(a, Attention) for a in attention)
    # Sliding layers have twice the query heads (per_layer_config), each gated by g_proj.
    assert [a.num_heads for a in attention] == [4, 8, 8, 4]
    assert [a.gate_proj.out_features for a in attention] == [4, 8, 8, 4]
    assert all(a.gate_per_head and a.num_kv_heads == 2 for a in attention)
    assert [a.sliding_window for a in attention] == [None, 16, 16, None]
    assert [a.rope.rotary_dim for a in attention] == [8, 16, 16, 8]  # full layers: half rotated
    assert model.spec.norm_offset == 1.0  # zero-centred norms
    dense, moes = blocks[0].feed_forward, [b.feed_forward for b in blocks[1:]]
    assert isinstance(dense, GatedMLP) and dense.limit == pytest.approx(0.1)
    assert all(isinstance(m, SparseMoE) for m in moes)
    assert (moes[0].scoring, moes[0].normalize, moes[0].scale) == ("sigmoid", True, 2.5)
    # swiglu_limits [0, 0, .1, .1] (routed), swiglu_limits_shared [.1, .1, 0, 0] (shared, dense)
    assert [m.experts[0].limit for m in moes] == [None, pytest.approx(0.1), pytest.approx(0.1)]
    assert [m.shared.limit for m in moes] == [pytest.approx(0.1), None, None]
    bias = reference.model.language_model.layers[1].mlp.gate.e_score_correction_bias
    torch.testing.assert_close(moes[0].selection_bias, bias)


def test_the_step_clamps_bite(models):
    """The tiny model's limits change its output: without them, the logits are far from
    transformers' (so the parity below tests the clamps)."""
    _, model, reference = models(STEP)
    ids = random_ids(64, seed=1)
    clamped = [m for m in model.module.modules() if isinstance(m, GatedMLP) and m.limit is not None]
    assert len(clamped) == 2 * 8 + 2  # layers 2 and 3's experts, layer 1's shared expert, the dense MLP
    limits = [m.limit for m in clamped]
    try:
        for m in clamped:
            m.limit = None
        unclamped = _ours(model, ids)
    finally:
        for m, limit in zip(clamped, limits):
            m.limit = limit
    assert rel_err(unclamped, reference_logits(reference, ids)) > 100 * TOL


# -- against transformers ---------------------------------------------------------------------


@pytest.mark.parametrize("variant", FAMILIES)
@pytest.mark.parametrize("chunk", [20, 512])
def test_logits_match_transformers(variant, chunk, models):
    """64 tokens (four sliding windows) prefilled at once or in pieces of 20; no expert choice
    is within 1e-5 of flipping, so rounding cannot make ours and transformers' differ."""
    _, model, reference = models(variant)
    ids = random_ids(64, seed=1)
    assert smallest_margin(model, ids) > 1e-5
    assert rel_err(_ours(model, ids, chunk), reference_logits(reference, ids)) < TOL


@pytest.mark.parametrize("variant", FAMILIES)
def test_the_generator_decodes_as_transformers_scores(variant, models):
    """Three greedy jobs at once (prompts cut into chunks of 8 beside the others' decode steps,
    pages of 8 tokens, replies past the sliding window): each reply is what transformers' logits
    choose at every step, and transformers' logits over prompt and reply are ours."""
    _, model, reference = models(variant)
    prompts = [random_ids(n, seed=30 + n) for n in (5, 23, 12)]
    gen = Generator(model, cache_tokens=256, page_size=8, max_chunk_tokens=8)
    results = gen.generate([Job(p, max_new_tokens=20, stop_token_ids=()) for p in prompts])
    for prompt, result in zip(prompts, results):
        assert len(result.token_ids) == 20
        sequence = prompt + result.token_ids
        expected = reference_logits(reference, sequence[:-1])
        assert expected[len(prompt) - 1 :].argmax(-1).tolist() == result.token_ids
        assert rel_err(_ours(model, sequence[:-1]), expected) < TOL


# -- Step 3.5's checkpoints and the Hub configs' spellings ------------------------------------


def _step3p5_config(saved: dict) -> dict:
    """The tiny Step 3.7 model's text config as Step 3.5's Hub configs spell it: per-layer RoPE
    lists, the sliding layers' heads in attention_other_setting, KV heads as attention groups,
    MoE layers as a string, the experts' fields under their old names; every per-layer list
    padded with one multi-token-prediction layer, which is not run."""
    text = saved["text_config"]
    n = text["num_hidden_layers"]
    full, sliding = text["rope_parameters"]["full_attention"], text["rope_parameters"]["sliding_attention"]
    types = text["layer_types"]
    return {
        "architectures": ["Step3p5ForCausalLM"],
        "model_type": "step3p5",
        "vocab_size": text["vocab_size"],
        "hidden_size": text["hidden_size"],
        "intermediate_size": text["intermediate_size"],
        "num_hidden_layers": n,
        "num_attention_heads": text["num_attention_heads"],
        "num_attention_groups": text["num_key_value_heads"],
        "head_dim": text["head_dim"],
        "max_position_embeddings": text["max_position_embeddings"],
        "rms_norm_eps": text["rms_norm_eps"],
        "layer_types": [*types, "full_attention"],
        "sliding_window": text["sliding_window"],
        "attention_other_setting": {
            "attention_type": "sliding_attention",
            "num_attention_heads": text["num_sliding_attention_heads"],
            "num_attention_groups": text["num_key_value_heads"],
            "head_dim": text["head_dim"],
        },
        "use_head_wise_attn_gate": True,
        "use_qk_norm": True,
        "rope_theta": [(full if t == "full_attention" else sliding)["rope_theta"] for t in types] + [1.0],
        "partial_rotary_factors": [0.5 if t == "full_attention" else 1.0 for t in types] + [1.0],
        "moe_layers_enum": ",".join(str(i) for i, t in enumerate(text["mlp_layer_types"]) if t == "sparse"),
        "moe_num_experts": text["n_routed_experts"],
        "moe_top_k": text["num_experts_per_tok"],
        "moe_intermediate_size": text["moe_intermediate_size"],
        "share_expert_dim": text["share_expert_dim"],
        "moe_router_activation": "sigmoid",
        "moe_router_scaling_factor": text["moe_router_scaling_factor"],
        "use_moe_router_bias": True,
        "norm_expert_weight": True,
        "swiglu_limits": [*text["swiglu_limits"], 0.0],
        "swiglu_limits_shared": [*text["swiglu_limits_shared"], 0.0],
        "num_nextn_predict_layers": 1,
        "zero_centered": True,
        "sink": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def test_a_step3p5_checkpoint_runs_as_step3p7s_text_model(models, tmp_path):
    """Step 3.5's checkpoints (``Step3p5ForCausalLM``, model type ``step3p5``: transformers'
    Step3p7TextConfig) store the decoder as Step 3.7's do; with their config's spellings they
    give the same logits, and a text-only checkpoint has no vision tower to carry."""
    directory, _, reference = models(STEP)
    saved = json.loads((directory / "config.json").read_text())
    shutil.copy(directory / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(_step3p5_config(saved)))
    model = load_model(tmp_path, device="cpu")
    assert model.vision is None
    assert [b.mixer.num_heads for b in model.module.blocks] == [4, 8, 8, 4]
    ids = random_ids(64, seed=1)
    assert rel_err(_ours(model, ids), reference_logits(reference, ids)) < TOL


def test_step_rope_scaling_applies_to_the_full_layers_only(models, tmp_path):
    directory, _, _ = models(STEP)
    config = _step3p5_config(json.loads((directory / "config.json").read_text()))
    config["rope_scaling"] = {"type": "llama3", "factor": 2.0, "original_max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = architecture_for("Step3p5ForCausalLM").spec(ModelConfig.from_dir(tmp_path))
    ropes = [layer.mixer.rope for layer in spec.layers]
    assert [r.kind for r in ropes] == ["llama3", "default", "default", "llama3"]
    full, sliding = (1e4, 0.5), (500, 1.0)  # (theta, partial rotary factor)
    assert [(r.theta, r.partial_rotary_factor) for r in ropes] == [full, sliding, sliding, full]


def test_step3p5s_rope_switch_per_layer(models, tmp_path):
    """Step 3.5's configs may switch RoPE off per layer (``use_rope_layers``; empty: all on)."""
    directory, _, _ = models(STEP)
    config = _step3p5_config(json.loads((directory / "config.json").read_text()))
    config["use_rope_layers"] = [True, False, True, True, True]
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = architecture_for("Step3p5ForCausalLM").spec(ModelConfig.from_dir(tmp_path))
    assert [layer.mixer.rope is not None for layer in spec.layers] == [True, False, True, True]


@pytest.mark.parametrize("field", ["use_bidirectional_attention", "sink"])
def test_step_options_the_engine_lacks_are_refused(models, tmp_path, field):
    directory, _, _ = models(STEP)
    config = json.loads((directory / "config.json").read_text())
    config["text_config"][field] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=field):
        architecture_for(STEP).spec(ModelConfig.from_dir(tmp_path))


def test_afmoe_layer_types_without_a_list(models, tmp_path):
    """Without ``layer_types``, every ``global_attn_every_n_layers``-th layer is global (and
    unrotated), the others sliding; Arcee's own routing fields are read where present."""
    directory, _, _ = models(AFMOE)
    config = json.loads((directory / "config.json").read_text())
    del config["layer_types"]
    config.update(num_hidden_layers=6, global_attn_every_n_layers=3)
    config.update(route_norm=False, n_group=2, topk_group=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = architecture_for(AFMOE).spec(ModelConfig.from_dir(tmp_path))
    mixers = [layer.mixer for layer in spec.layers]
    assert [m.sliding_window for m in mixers] == [16, 16, None, 16, 16, None]
    assert [m.rope is not None for m in mixers] == [True, True, False, True, True, False]
    moe = spec.layers[1].feed_forward
    assert (moe.normalize, moe.num_groups, moe.groups_per_token) == (False, 2, 1)


def test_the_apps_cache_estimate_is_the_engines(models, tmp_path):
    """The app reads the cache's shape from config.json alone (engine.config_footprint): for
    AFMoE, Step 3.7 and Step 3.5's spelling (KV heads as attention groups) it is the engine's."""
    configs = [json.loads((models(v)[0] / "config.json").read_text()) for v in FAMILIES]
    configs.append(_step3p5_config(configs[1]))
    for i, config in enumerate(configs):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "config.json").write_text(json.dumps(config))
        cfg = ModelConfig.from_dir(tmp_path / str(i))
        assert config_footprint(config) == cache_footprint(architecture_for(cfg.architecture).spec(cfg))
