"""The dense families whose layers differ from Llama's in their norms, MLPs, RoPE or layer
patterns (tests/engine/tiny_dense_families.py): our logits against transformers' on tiny random
models, the layer kinds each config reads into, several sequences in one batch, and an EXL3 model
in the layout ExLlamaV3 stores the family in."""

from __future__ import annotations

import json

import pytest
import torch
from parity import random_ids, reference_logits, rel_err
from ragged_batch import alone_logits, ragged_batch_logits
from safetensors import safe_open
from tiny_dense_families import DENSE_FAMILIES, EXLLAMAV3_LAYER, build_tiny_dense_model

from engine.cache.paged import PagedKVCache
from engine.exl3 import EXL3Linear
from engine.generation.step import score_tokens
from engine.loading.synthetic_store import write_synthetic_model
from engine.model import load_model
from engine.modules.feed_forward import FeedForward
from engine.modules.layer_norm import LayerNorm
from engine.modules.mlp import GatedMLP
from engine.modules.xielu import XIELU

TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family built and loaded once: ``variant -> (directory, our model, transformers')``."""
    loaded = {}

    def get(variant: str):
        if variant not in loaded:
            directory = tmp_path_factory.mktemp(variant)
            reference = build_tiny_dense_model(variant, directory)
            loaded[variant] = (directory, load_model(directory, device="cpu"), reference)
        return loaded[variant]

    return get


@pytest.mark.parametrize("variant", DENSE_FAMILIES)
def test_logits_match_transformers(variant, models):
    """64 tokens prefilled in pieces of 20, across pages of 16."""
    _, model, reference = models(variant)
    ids = random_ids(64)
    cache = PagedKVCache.for_model(model.spec, 256, page_size=16)
    got = score_tokens(model.module, cache, ids, chunk=20)
    assert rel_err(got, reference_logits(reference, ids)) < TOL


# Per family: which of the four layers rotate their queries and keys, and which slide (a window
# of 16) rather than attend to everything.
ROTATES_AND_SLIDES = {
    "Exaone4ForCausalLM": ([True, False, True, False], [True, False, True, False]),
    "Exaone4ForCausalLM-global": ([True] * 4, [False] * 4),
    "Olmo3ForCausalLM": ([True] * 4, [True, True, True, False]),
    "Cohere2ForCausalLM": ([True, True, True, False], [True, True, True, False]),
}


@pytest.mark.parametrize("variant", DENSE_FAMILIES)
def test_rotation_and_windows_per_layer(variant, models):
    _, model, _ = models(variant)
    mixers = [block.mixer for block in model.module.blocks]
    rotates, slides = ROTATES_AND_SLIDES.get(variant, ([True] * 4, [False] * 4))
    assert [m.rope is not None for m in mixers] == rotates
    assert [m.sliding_window == 16 for m in mixers] == slides
    assert all(m.sliding_window is None for m, s in zip(mixers, slides) if not s)
    rope = next(m.rope for m in mixers if m.rope is not None)
    # GLM-4, Ernie 4.5 and Cohere rotate adjacent pairs; GLM-4 only the first half of each head.
    assert rope.adjacent_pairs == variant.startswith(("Glm4", "Ernie4_5", "Cohere"))
    assert rope.rotary_dim == (16 if variant.startswith("Glm4") else mixers[0].head_dim)


def test_norm_placements_and_feed_forwards(models):
    """Where each family's norms sit and what its MLP is."""

    def block(variant: str):
        return models(variant)[1].module.blocks[0]

    def key(norm) -> str:
        return norm.key.rpartition(".")[2]

    glm = block("Glm4ForCausalLM")  # sandwich norms
    assert [key(glm.mixer_norm), key(glm.mixer_out_norm)] == ["input_layernorm", "post_self_attn_layernorm"]
    assert [key(glm.feed_forward_norm), key(glm.feed_forward_out_norm)] == [
        "post_attention_layernorm",
        "post_mlp_layernorm",
    ]
    assert isinstance(glm.feed_forward, GatedMLP)
    for variant in ("Exaone4ForCausalLM", "Olmo3ForCausalLM"):  # post-norm: no norm before the sub-layers
        post = block(variant)
        assert post.mixer_norm is None and post.feed_forward_norm is None
        assert [key(post.mixer_out_norm), key(post.feed_forward_out_norm)] == [
            "post_attention_layernorm",
            "post_feedforward_layernorm",
        ]
    olmo, exaone = block("Olmo3ForCausalLM").mixer, block("Exaone4ForCausalLM").mixer
    assert olmo.qk_norm_across_heads and olmo.q_norm.weight.shape == (64,)
    assert not exaone.qk_norm_across_heads and exaone.q_norm.weight.shape == (16,)
    # Command R: attention and MLP side by side after one LayerNorm; per-head q/k norm scales.
    cohere = models("CohereForCausalLM")[1].module
    parallel = cohere.blocks[0]
    assert parallel.parallel and parallel.feed_forward_norm is None
    assert isinstance(parallel.mixer_norm, LayerNorm) and isinstance(cohere.final_norm, LayerNorm)
    assert parallel.mixer.q_norm.weight.shape == (4, 16) and parallel.mixer.k_norm.weight.shape == (2, 16)
    assert cohere.logit_scale == 0.25 and block("Cohere2ForCausalLM").mixer.q_norm is None
    # Arcee and Apertus: no gate; Apertus' activation has weights of its own in each layer.
    assert isinstance(block("ArceeForCausalLM").feed_forward, FeedForward)
    apertus = [layer.feed_forward.act for layer in models("ApertusForCausalLM")[1].module.blocks]
    assert all(isinstance(act, XIELU) for act in apertus) and apertus[0].positive != apertus[1].positive
    seed = block("SeedOssForCausalLM").mixer  # q/k/v biases, none on o_proj
    assert seed.qkv.linears[0].bias is not None and seed.o_proj.bias is None


@pytest.mark.parametrize("variant", ["Exaone4ForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM"])
def test_ragged_batch_matches_single_runs(variant, models):
    """Sliding and NoPE layers, parallel blocks: three sequences chunked together, then decode
    steps on the mixed and the fixed-shape paths, give each sequence's logits alone."""
    _, model, _ = models(variant)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (37, 5, 40)]
    decode = [torch.randint(3, 320, (4,), generator=gen).tolist() for _ in prompts]
    together = ragged_batch_logits(model, prompts, decode, chunk=16)
    for logits, prompt, extra in zip(together, prompts, decode):
        assert rel_err(logits, alone_logits(model, prompt + extra)) < 1e-5


def _stored(directory) -> tuple[set[str], set[str]]:
    """The EXL3 linears stored in ``directory`` (modules with a trellis), and its other tensors:
    norms by their module's name, anything else by its own."""
    keys: set[str] = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            keys |= set(f.keys())
    linears = {k.removesuffix(".trellis") for k in keys if k.endswith(".trellis")}
    others = {k.removesuffix(".weight") for k in keys if k.rpartition(".")[0] not in linears}
    return linears, others


@pytest.mark.parametrize("variant", [v for v in DENSE_FAMILIES if "-" not in v])
def test_an_exl3_model_in_exllamav3s_layout_loads(variant, models, tmp_path):
    """A 4-bit EXL3 model of the family's tiny shape, written in the reference converter's layout,
    holds each layer's modules under the names ExLlamaV3 reads them by (a fused source projection
    stored split), and loads and runs with every projection quantized."""
    directory, _, _ = models(variant)
    config = json.loads((directory / "config.json").read_text())
    out = write_synthetic_model(config, 4, tmp_path / "exl3", head_bits=6)

    linears, others = _stored(out)
    layer_linears, layer_others = EXLLAMAV3_LAYER[variant]
    layers = range(config["num_hidden_layers"])
    assert linears == {f"model.layers.{i}.{name}" for i in layers for name in layer_linears} | {"lm_head"}
    expected = {f"model.layers.{i}.{name}" for i in layers for name in layer_others}
    assert others - {"model.embed_tokens", "model.norm"} == expected

    model = load_model(out, device="cpu", dtype=torch.float32)
    assert len([m for m in model.module.modules() if isinstance(m, EXL3Linear)]) == len(linears)
    logits = score_tokens(model.module, PagedKVCache.for_model(model.spec, 32, page_size=16), random_ids(20))
    assert logits.shape == (20, config["vocab_size"]) and torch.isfinite(logits).all()


def test_exaone4_reads_its_pattern_string_where_no_layer_types_are_listed(models, tmp_path):
    """EXAONE 4's ``sliding_window_pattern`` "LLLG": repeated from layer 0, the last layer global
    whatever the pattern says; only the sliding layers rotate."""
    from engine.architectures import architecture_for
    from engine.config import ModelConfig

    config = json.loads((models("Exaone4ForCausalLM")[0] / "config.json").read_text())
    del config["layer_types"]
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "num_hidden_layers": 6, "sliding_window_pattern": "LLLG"})
    )
    cfg = ModelConfig.from_dir(tmp_path)
    layers = architecture_for(cfg.architecture).spec(cfg).layers
    slides = [True, True, True, False, True, False]
    assert [layer.mixer.sliding_window == 16 for layer in layers] == slides
    assert [layer.mixer.rope is not None for layer in layers] == slides
