"""GLM-4.5, MiniMax-M2, Ernie 4.5 MoE and dots.llm1 against transformers, on tiny random models
(tiny_models.py) whose routers decide clearly (decisive_routers.py): each family's dense and
sparse layers where its config puts them, its router and attention options, its logits over a
64-token prompt, and the Generator's decode over the paged cache (one job's logits step by step,
three jobs batched). Then the config fields that the released checkpoints spell otherwise than
transformers saves them, and the adjacent-pair RoPE of Ernie 4.5 against its definition."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from decisive_routers import ROUTED_MOE, build_routed_tiny_model
from parity import random_ids, reference_logits, rel_err
from safetensors.torch import load_file, save_file

from engine.architectures import architecture_for
from engine.cache.paged import PagedKVCache
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import score_tokens
from engine.layers.spec import ModelSpec
from engine.model import load_model
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE
from engine.modules.rope import RopeSpec, RotaryEmbedding
from engine.options import EngineOptions

TOL = 1e-4

# What each tiny config (tiny_models.py) makes of the layers: which are sparse; the router's
# scoring, experts per token, (groups, groups kept), weight scale, shared expert; and the
# attention's rotated dims per head, q/k norm width (0: none), adjacent pairs, windows.
ROUTERS = {
    "Glm4MoeForCausalLM": ([1, 2, 3], "sigmoid", 3, (4, 2), 2.5, True),
    "MiniMaxM2ForCausalLM": ([0, 1, 2, 3], "sigmoid", 2, (1, 1), 1.0, False),
    "Ernie4_5_MoeForCausalLM": ([1, 2], "softmax", 2, (1, 1), 1.0, True),
    "Dots1ForCausalLM": ([1, 2, 3], "sigmoid", 3, (2, 1), 2.0, True),
}
ATTENTION = {
    "Glm4MoeForCausalLM": (16, 32, False, [None] * 4),
    "MiniMaxM2ForCausalLM": (8, 4 * 32, False, [None] * 4),
    "Ernie4_5_MoeForCausalLM": (16, 0, True, [None] * 4),
    "Dots1ForCausalLM": (32, 32, False, [None, None, 16, 16]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``variant -> (directory, our model, transformers' model)``, each built once."""
    built = {}

    def get(variant: str):
        if variant not in built:
            directory = tmp_path_factory.mktemp(variant)
            reference = build_routed_tiny_model(variant, directory)
            built[variant] = (directory, load_model(directory, device="cpu"), reference)
        return built[variant]

    return get


@pytest.mark.parametrize("variant", ROUTED_MOE)
def test_layers_routers_and_attention_are_read_from_the_config(variant, models):
    _, model, _ = models(variant)
    blocks = model.module.blocks
    sparse, scoring, top_k, groups, scale, shared = ROUTERS[variant]
    assert [i for i, b in enumerate(blocks) if isinstance(b.feed_forward, SparseMoE)] == sparse
    assert all(isinstance(b.feed_forward, GatedMLP) for i, b in enumerate(blocks) if i not in sparse)
    for i in sparse:
        moe = blocks[i].feed_forward
        assert (moe.scoring, moe.top_k, (moe.num_groups, moe.groups_per_token)) == (scoring, top_k, groups)
        assert moe.scale == scale and moe.normalize and moe.selection_bias is not None
        assert (moe.shared is not None, moe.shared_gate) == (shared, None)
    rotary_dim, norm_width, adjacent, windows = ATTENTION[variant]
    attention = blocks[0].mixer
    assert (attention.rope.rotary_dim, attention.rope.adjacent_pairs) == (rotary_dim, adjacent)
    width = attention.q_norm.weight.numel() if attention.q_norm is not None else 0
    assert width == norm_width
    assert [b.mixer.sliding_window for b in blocks] == windows


@pytest.mark.parametrize("variant", ROUTED_MOE)
@pytest.mark.parametrize("chunk", [20, 64])
def test_logits_match_transformers(variant, chunk, models):
    """64 tokens prefilled at once or in pieces of 20 (across the cache's 16-token pages)."""
    _, model, reference = models(variant)
    ids = random_ids(64, seed=1)
    expected = reference_logits(reference, ids)
    got = score_tokens(model.module, PagedKVCache.for_model(model.spec, 256, page_size=16), ids, chunk=chunk)
    err = rel_err(got, expected)
    print(f"{variant} chunk {chunk}: relative error {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("variant", ROUTED_MOE)
def test_generator_decode_logits_match_transformers(variant, models):
    """One job through the Generator (its 40-token prompt in 16-token chunks over 8-token pages,
    then 12 greedy steps): the logits of every step that makes a token are transformers' at that
    position of the prompt and reply."""
    _, model, reference = models(variant)
    prompt = random_ids(40, seed=2)
    seen: list[torch.Tensor] = []

    def record(module, args, out):
        if out.shape[0]:  # a step that wants logits: the prompt's last chunk, then each decode step
            seen.append(out.float())

    gen = Generator(model, cache_tokens=256, page_size=8, max_chunk_tokens=16)
    hook = model.module.lm_head.register_forward_hook(record)
    try:
        (result,) = gen.generate([Job(prompt, max_new_tokens=12, stop_token_ids=())])
    finally:
        hook.remove()
    assert len(result.token_ids) == len(seen) == 12
    expected = reference_logits(reference, prompt + result.token_ids[:-1])[len(prompt) - 1 :]
    got = torch.cat(seen)
    err = rel_err(got, expected)
    print(f"{variant} decode: relative error {err:.2e}")
    assert err < TOL
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist() == result.token_ids


@pytest.mark.parametrize("variant", ROUTED_MOE)
@pytest.mark.parametrize("batched_decode", [False, True])
def test_batched_jobs_decode_what_transformers_predicts(variant, batched_decode, models):
    """Three jobs at once, prompts in chunks of 8 beside the others' decode steps, decode steps
    row by row or in the fixed-shape path: each job's greedy tokens are the argmax of
    transformers' logits over its own prompt and reply, and every page comes back."""
    _, model, reference = models(variant)
    prompts = [random_ids(n, seed=30 + n) for n in (5, 23, 12)]
    options = EngineOptions(batched_decode=batched_decode)
    gen = Generator(model, cache_tokens=256, page_size=8, max_chunk_tokens=8, options=options)
    free = gen.cache.pages.available
    results = gen.generate([Job(p, max_new_tokens=8, stop_token_ids=()) for p in prompts])
    for prompt, result in zip(prompts, results):
        assert len(result.token_ids) == 8
        logits = reference_logits(reference, prompt + result.token_ids[:-1])[len(prompt) - 1 :]
        assert logits.argmax(-1).tolist() == result.token_ids
    assert gen.cache.pages.available == free


@pytest.mark.parametrize("variant", ROUTED_MOE)
def test_the_apps_cache_estimate_is_the_engines(variant, models):
    """The torch-free reading of config.json (the app's memory estimate) gives the KV layout the
    engine allocates: which layers keep keys and values, of which shape."""
    from engine.cache.paged import cache_footprint
    from engine.config_footprint import config_footprint

    directory, model, _ = models(variant)
    config = json.loads((directory / "config.json").read_text())
    assert config_footprint(config) == cache_footprint(model.spec)


# -- config.json as the released checkpoints write it -----------------------------------------


def _spec(models, variant: str, tmp_path: Path, **changes) -> ModelSpec:
    """The spec our reading gives the tiny model's config.json with ``changes`` (None: the
    field removed), from a copy of the model directory."""
    directory = tmp_path / "model"
    shutil.copytree(models(variant)[0], directory)
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    cfg = ModelConfig.from_dir(directory)
    return architecture_for(cfg.architecture).spec(cfg)


def _sparse_layers(spec: ModelSpec) -> list[int]:
    return [i for i, layer in enumerate(spec.layers) if layer.feed_forward.kind == "sparse_moe"]


def test_glm_defaults_to_half_rotary_heads_one_dense_layer_and_no_qk_norm(models, tmp_path):
    """GLM-4.5's config class fills in partial_rotary_factor 0.5 and first_k_dense_replace 1."""
    plain = {"rope_theta": 10000.0}
    spec = _spec(
        models,
        "Glm4MoeForCausalLM",
        tmp_path,
        rope_parameters=plain,
        first_k_dense_replace=None,
        use_qk_norm=None,
    )
    attention = spec.layers[0].mixer
    assert attention.rope.partial_rotary_factor == 0.5 and not attention.qk_norm
    assert attention.qkv_bias and not attention.o_bias
    assert _sparse_layers(spec) == [1, 2, 3]
    flat = _spec(
        models, "Glm4MoeForCausalLM", tmp_path / "c", partial_rotary_factor=0.25, rope_parameters=plain
    )
    assert flat.layers[0].mixer.rope.partial_rotary_factor == 0.25


def test_minimax_m2_reads_rotary_dim_and_never_slides(models, tmp_path):
    """The released config gives ``rotary_dim`` (no partial_rotary_factor) and may carry a
    sliding_window that MiniMax-M2 does not use."""
    spec = _spec(
        models,
        "MiniMaxM2ForCausalLM",
        tmp_path,
        rope_parameters=None,
        rope_theta=5e6,
        rotary_dim=16,
        sliding_window=8,
        use_sliding_window=True,
    )
    rope = spec.layers[0].mixer.rope
    assert (rope.partial_rotary_factor, rope.theta) == (0.5, 5e6)
    assert {layer.mixer.sliding_window for layer in spec.layers} == {None}


def test_a_minimax_m2_checkpoint_in_transformers_memory_layout_loads(models, tmp_path):
    """Saved without transformers' conversion back: the block under ``mlp``, its experts fused
    3-D (``gate_up_proj``, ``down_proj``), the bias at ``mlp.e_score_correction_bias``."""
    source, model, _ = models("MiniMaxM2ForCausalLM")
    directory = tmp_path / "model"
    shutil.copytree(source, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    out = {k: v for k, v in tensors.items() if ".block_sparse_moe." not in k}
    for i in range(4):
        old, new = f"model.layers.{i}.block_sparse_moe", f"model.layers.{i}.mlp"
        out[f"{new}.gate.weight"] = tensors[f"{old}.gate.weight"]
        out[f"{new}.e_score_correction_bias"] = tensors[f"{old}.e_score_correction_bias"]
        e = [f"{old}.experts.{j}" for j in range(8)]
        out[f"{new}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{x}.w1.weight"], tensors[f"{x}.w3.weight"]]) for x in e]
        )
        out[f"{new}.experts.down_proj"] = torch.stack([tensors[f"{x}.w2.weight"] for x in e])
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    fused = load_model(directory, device="cpu")
    ids = random_ids(32, seed=5)
    expected = score_tokens(model.module, PagedKVCache.for_model(model.spec, 64, page_size=16), ids)
    got = score_tokens(fused.module, PagedKVCache.for_model(fused.spec, 64, page_size=16), ids)
    torch.testing.assert_close(got, expected)


def test_ernie_places_experts_by_start_end_and_interval(models, tmp_path):
    """(i + 1) % interval == 0 between the start and end indices, -1 meaning the last layer;
    ``moe_use_aux_free`` false: no correction bias."""
    spec = _spec(
        models,
        "Ernie4_5_MoeForCausalLM",
        tmp_path,
        moe_layer_start_index=0,
        moe_layer_end_index=-1,
        moe_layer_interval=2,
        moe_use_aux_free=False,
    )
    assert _sparse_layers(spec) == [1, 3]
    moe = spec.layers[1].feed_forward
    assert not moe.selection_bias and moe.shared_expert_size == 2 * 32 and moe.shared_expert_bias
    assert spec.head_bias and spec.tie_word_embeddings


def test_dots1_without_layer_types_slides_from_max_window_layers(models, tmp_path):
    spec = _spec(models, "Dots1ForCausalLM", tmp_path, layer_types=None, max_window_layers=1)
    assert [layer.mixer.sliding_window for layer in spec.layers] == [None, 16, 16, 16]
    spec = _spec(models, "Dots1ForCausalLM", tmp_path / "b", layer_types=None, sliding_window=None)
    assert {layer.mixer.sliding_window for layer in spec.layers} == {None}


def test_more_experts_per_token_than_experts_is_refused_naming_the_config(models, tmp_path):
    with pytest.raises(ModelLoadError, match="config.json.*9 experts per token"):
        _spec(models, "Glm4MoeForCausalLM", tmp_path, num_experts_per_tok=9)
    with pytest.raises(ModelLoadError, match="groups"):
        _spec(models, "Dots1ForCausalLM", tmp_path / "b", n_group=3)


# -- Ernie 4.5's rotation of adjacent pairs -----------------------------------------------------


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_adjacent_pair_rope_keeps_the_definitions_dot_products(partial):
    """Pairs (2i, 2i + 1) turned by frequency i, written out here: queries and keys reordered
    into halves and rotated the usual way have the same dot products, at any two positions."""
    head_dim, theta = 16, 500000.0
    rope = RotaryEmbedding(RopeSpec(theta, adjacent_pairs=True, partial_rotary_factor=partial), head_dim, 64)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(10, 2, head_dim, generator=gen), torch.randn(10, 2, head_dim, generator=gen)
    positions = torch.tensor([0, 1, 2, 5, 9, 17, 30, 31, 50, 63])

    def by_definition(x: torch.Tensor) -> torch.Tensor:
        r = rope.rotary_dim
        inv = 1.0 / theta ** (torch.arange(0, r, 2).double() / r)
        angle = positions.double()[:, None, None] * inv
        even, odd = x[..., 0:r:2].double(), x[..., 1:r:2].double()
        turned = torch.stack(
            (even * angle.cos() - odd * angle.sin(), odd * angle.cos() + even * angle.sin()), -1
        )
        return torch.cat((turned.flatten(-2), x[..., r:].double()), -1)

    tables = rope.tables(positions, torch.float32)
    ours_q, ours_k = (rope.apply(rope.halves_from_pairs(x), tables) for x in (q, k))
    expected = torch.einsum("qhd,khd->hqk", by_definition(q), by_definition(k))
    got = torch.einsum("qhd,khd->hqk", ours_q.double(), ours_k.double())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    plain = RotaryEmbedding(RopeSpec(theta, partial_rotary_factor=partial), head_dim, 64)
    unordered = torch.einsum("qhd,khd->hqk", plain.apply(q, tables).double(), plain.apply(k, tables).double())
    assert not torch.allclose(unordered, expected, atol=1e-3)  # the layout matters
