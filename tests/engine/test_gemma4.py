"""Gemma 4 (text) against transformers on tiny random models of each size's layer kinds
(tests/engine/tiny_gemma4.py): prompt logits, decode through the Generator over the paged cache
(the CPU's per-sequence path and the fixed-shape batched one), ragged batches; the layers as read
(per-layer head shapes, keys doubling as values, shared keys and values, experts beside the MLP,
per-layer inputs), the cache they keep, and configs in the Hub's spelling."""

from __future__ import annotations

import json

import pytest
import torch
from parity import random_ids, reference_logits, rel_err
from ragged_batch import alone_logits, ragged_batch_logits
from tiny_gemma4 import LAYOUTS, build_tiny_gemma4

from engine.architectures import architecture_for
from engine.cache.paged import PagedKVCache, cache_footprint
from engine.config import ModelConfig
from engine.config_footprint import config_footprint
from engine.errors import ModelLoadError
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import score_tokens
from engine.model import load_model
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE
from engine.modules.parallel_experts import ParallelExperts
from engine.options import EngineOptions

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``layout -> (directory, our model, transformers' model)``, each built once."""
    built = {}

    def get(layout: str):
        if layout not in built:
            directory = tmp_path_factory.mktemp(f"gemma4-{layout}")
            reference = build_tiny_gemma4(layout, directory)
            built[layout] = (directory, load_model(directory, device="cpu"), reference)
        return built[layout]

    return get


def test_the_layers_are_read_as_gemma4(tiny):
    _, e2b, reference = tiny("e2b")
    spec = [layer.mixer for layer in e2b.spec.layers]
    assert [(m.head_dim, m.num_kv_heads, m.sliding_window) for m in spec[:3]] == [
        (16, 2, 8),
        (16, 2, 8),
        (32, 2, None),
    ]
    assert [m.kv_source for m in spec] == [None, None, None, 1, 1, 2]  # the last of each type before
    assert all(m.value_norm and m.scale == 1.0 and not m.values_from_keys for m in spec)
    rope = spec[2].rope
    assert (rope.kind, rope.partial_rotary_factor, rope.theta) == ("proportional", 0.25, 1e6)
    blocks = e2b.module.blocks
    assert [len(b.mixer.qkv.linears) for b in blocks] == [3, 3, 3, 1, 1, 1]  # readers project q alone
    assert [b.feed_forward.down.in_features for b in blocks] == [96] * 3 + [192] * 3  # double-wide
    for ours, theirs in zip(blocks, reference.model.layers):
        assert torch.equal(ours.output_scale, theirs.layer_scalar)
        assert ours.per_layer_input.gate.out_features == 8 and ours.feed_forward_out_norm is not None
    assert e2b.module.per_layer_inputs.table.shape == (320, 6 * 8)

    _, moe_model, reference = tiny("26b-a4b")
    full = moe_model.spec.layers[5].mixer
    assert (full.head_dim, full.num_kv_heads, full.values_from_keys) == (32, 1, True)
    assert (
        not moe_model.spec.layers[0].mixer.values_from_keys and moe_model.spec.layers[0].mixer.bidirectional
    )
    assert not full.bidirectional  # an image's tokens see each other in sliding layers only
    assert len(moe_model.module.blocks[5].mixer.qkv.linears) == 2  # no v_proj
    block = moe_model.module.blocks[0]
    ff = block.feed_forward
    assert block.feed_forward_norm is None and isinstance(ff, ParallelExperts)  # it reads the stream
    assert isinstance(ff.mlp, GatedMLP) and isinstance(ff.moe, SparseMoE) and len(ff.moe.experts) == 8
    router = reference.model.layers[0].router
    assert torch.equal(ff.moe.expert_scale, router.per_expert_scale)
    assert torch.equal(ff.moe.router.scale, router.scale) and ff.moe.top_k == 2 and ff.moe.normalize


def test_every_routing_choice_is_clear(tiny):
    """No parity result of the mixture of experts rests on a near-tie between two experts: the
    second and third choices' probabilities lie far more apart than float32 rounding moves them."""
    _, _, reference = tiny("26b-a4b")
    probabilities = []
    hooks = [
        layer.router.register_forward_hook(lambda m, a, out: probabilities.append(out[0]))
        for layer in reference.model.layers
    ]
    try:
        reference_logits(reference, random_ids(64))
    finally:
        for hook in hooks:
            hook.remove()
    top = torch.cat(probabilities).topk(3, dim=-1).values
    assert float((top[:, 1] - top[:, 2]).min()) > 1e-5


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("chunk", [20, 512])
def test_prompt_logits_match_transformers(tiny, layout, chunk):
    """64 tokens (eight sliding windows) prefilled in pieces of 20 or at once."""
    _, model, reference = tiny(layout)
    ids = random_ids(64)
    cache = PagedKVCache.for_model(model.spec, 256, page_size=16)
    assert (
        rel_err(score_tokens(model.module, cache, ids, chunk=chunk), reference_logits(reference, ids)) <= TOL
    )


def test_the_features_the_parity_rests_on_are_in_play(tiny):
    """Without the value norm, a layer's scalar, the per-layer inputs or the shared keys and
    values, the logits are far from transformers'."""
    _, model, reference = tiny("e2b")
    ids = random_ids(64)
    expected = reference_logits(reference, ids)
    blocks = model.module.blocks

    def error() -> float:
        return rel_err(
            score_tokens(model.module, PagedKVCache.for_model(model.spec, 128, page_size=16), ids), expected
        )

    def without(obj, name: str, value) -> float:
        saved = getattr(obj, name)
        setattr(obj, name, value)
        try:
            return error()
        finally:
            setattr(obj, name, saved)

    assert without(blocks[0].mixer, "value_norm", None) > 100 * TOL
    assert without(blocks[4], "output_scale", torch.ones(1)) > 100 * TOL
    assert without(blocks[3], "per_layer_input", None) > 100 * TOL

    class OwnCache(PagedKVCache):  # every layer keeps its keys and values apart, as a reader of
        def layer(self, index):  # layer 1's would if it read its own (empty) pages
            return super().layer(index) if index < 3 else self._spare[index]

    cache = OwnCache.for_model(model.spec, 128, page_size=16)
    cache._spare = {i: PagedKVCache(1, 2, 16, 8, page_size=16).layer(0) for i in (3, 4)}
    cache._spare[5] = PagedKVCache(1, 2, 32, 8, page_size=16).layer(0)
    assert rel_err(score_tokens(model.module, cache, ids), expected) > 100 * TOL


def _generate_logits(model, prompt: list[int], new: int, **generator_args) -> tuple[torch.Tensor, list[int]]:
    """Greedy decode of ``new`` tokens after ``prompt``: every step's logits (the model's output,
    soft-capped: not the head's) and the tokens."""
    seen: list[torch.Tensor] = []
    hook = model.module.register_forward_hook(
        lambda m, a, out: seen.append(out.float()) if out.shape[0] else None
    )
    try:
        gen = Generator(model, cache_tokens=128, page_size=8, max_chunk_tokens=16, **generator_args)
        (result,) = gen.generate([Job(prompt, max_new_tokens=new, stop_token_ids=())])
    finally:
        hook.remove()
    assert len(result.token_ids) == new == len(seen)
    return torch.cat(seen), result.token_ids


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("batched_decode", [False, True])
def test_generator_decode_matches_transformers(tiny, layout, batched_decode):
    """40 prompt tokens then 24 decoded ones over 8-token pages, the per-sequence decode path or
    the fixed-shape batched one: every step's logits are transformers' over the same sequence."""
    _, model, reference = tiny(layout)
    prompt = random_ids(40, seed=5)
    got, tokens = _generate_logits(model, prompt, 24, options=EngineOptions(batched_decode=batched_decode))
    expected = reference_logits(reference, (prompt + tokens)[:-1])[len(prompt) - 1 :]
    assert rel_err(got, expected) <= TOL
    assert got.argmax(-1).tolist() == tokens


@pytest.mark.parametrize("layout", ["e2b", "26b-a4b"])
def test_ragged_batch_matches_single_runs(tiny, layout):
    """Three sequences prefilled together in pieces of 16 tokens, then decode steps in the mixed
    and the fixed-shape paths: each sequence's logits are those it gets alone (the readers of
    shared keys and values read their own sequence's)."""
    _, model, _ = tiny(layout)
    seqs = [random_ids(n, seed=10 + n) for n in (37, 5, 70)]
    decode = [random_ids(4, seed=20 + i) for i in range(3)]
    for seq, extra, logits in zip(seqs, decode, ragged_batch_logits(model, seqs, decode, chunk=16)):
        assert rel_err(logits, alone_logits(model, seq + extra)) < 1e-5


def test_readers_of_shared_keys_keep_no_cache(tiny):
    directory, model, _ = tiny("e2b")
    cache = PagedKVCache.for_model(model.spec, 64, page_size=16)
    assert cache.layer(3) is cache.layer(1) and cache.layer(5) is cache.layer(2)
    footprint = cache_footprint(model.spec)
    assert footprint.kv_layers == ((2, 16), (2, 16), (2, 32))
    assert config_footprint(json.loads((directory / "config.json").read_text())) == footprint
    # the nbytes of the cache count each layer's storage once
    assert cache.nbytes == sum(cache.layer(i).nbytes for i in range(3))


@pytest.mark.parametrize("layout", ["31b", "e4b"])
def test_a_config_in_the_hubs_spelling_reads_the_same(tiny, tmp_path, layout):
    """The Hub's config.json gives full layers' shapes as global_head_dim and
    num_global_key_value_heads (transformers 5.25 saves them per layer, per_layer_config)."""
    directory, model, _ = tiny(layout)
    config = json.loads((directory / "config.json").read_text())
    config.pop("per_layer_config")
    config.update(global_head_dim=32, num_global_key_value_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = architecture_for("Gemma4ForCausalLM").spec(ModelConfig.from_dir(tmp_path))
    assert spec.layers == model.spec.layers
    assert config_footprint(config) == cache_footprint(spec)


def test_bidirectional_attention_everywhere_is_refused(tiny, tmp_path):
    directory, _, _ = tiny("31b")
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_bidirectional_attention": "all"}))
    with pytest.raises(ModelLoadError, match="bidirectional"):
        architecture_for("Gemma4ForCausalLM").spec(ModelConfig.from_dir(tmp_path))


def test_a_synthetic_model_with_per_layer_inputs_builds_and_runs(tiny):
    """Benchmarks' random-weight models: the E4B layout at 4 bits, its per-layer inputs included."""
    from engine.loading.synthetic_store import synthetic_model

    directory, _, _ = tiny("e4b")
    config = json.loads((directory / "config.json").read_text())
    model = synthetic_model(config, bits=4, dtype=torch.float32, exl3_mode="dense")
    assert model.module.per_layer_inputs is not None
    logits = score_tokens(
        model.module, PagedKVCache.for_model(model.spec, 32, page_size=16), list(range(3, 19))
    )
    assert torch.isfinite(logits).all()
