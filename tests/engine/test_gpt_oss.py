"""gpt-oss against transformers on a tiny random model (tests/engine/tiny_gpt_oss.py): sliding and
full layers with attention sinks, experts with biases and the clamped SwiGLU, a biased router;
prompt logits, and decode through the Generator over the paged cache (the CPU's per-sequence
path, the fixed-shape batched path, and a quantized cache)."""

from __future__ import annotations

import pytest
import torch
from parity import random_ids, reference_logits, rel_err
from tiny_gpt_oss import build_tiny_gpt_oss, routing_margin

import engine.cache.decode_attention as decode_attention
from engine.cache.paged import PagedKVCache
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import score_tokens
from engine.model import load_model
from engine.modules.attention import Attention
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE
from engine.options import EngineOptions

TOL = 1e-4
WINDOW = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(our model, transformers' model)``, the tiny gpt-oss saved as transformers saves it."""
    directory = tmp_path_factory.mktemp("gpt-oss")
    reference = build_tiny_gpt_oss(directory)
    return load_model(directory, device="cpu"), reference


def test_the_layers_are_read_as_gpt_oss(tiny):
    model, reference = tiny
    blocks = model.module.blocks
    assert [b.mixer.sliding_window for b in blocks] == [WINDOW, None, WINDOW, None]
    for ours, theirs in zip(blocks, reference.model.layers):
        assert isinstance(ours.mixer, Attention) and ours.mixer.sinks.dtype == torch.float32
        assert torch.equal(ours.mixer.sinks, theirs.self_attn.sinks.float())
        assert ours.mixer.o_proj.bias is not None
    moe = blocks[0].feed_forward
    assert isinstance(moe, SparseMoE) and len(moe.experts) == 4 and moe.top_k == 2 and moe.normalize
    assert torch.equal(moe.router.bias, reference.model.layers[0].mlp.router.bias)
    expert = moe.experts[1]
    assert isinstance(expert, GatedMLP) and expert.activation == "quick_gelu"
    assert (expert.limit, expert.limit_after_act, expert.up_offset) == (7.0, False, 1.0)
    # transformers' fused [experts, in, out] tensors, gate and up columns alternating
    hf = reference.model.layers[0].mlp.experts
    gate, up = expert.gate_up.linears
    assert torch.equal(gate.weight, hf.gate_up_proj[1][:, 0::2].T)
    assert torch.equal(up.weight, hf.gate_up_proj[1][:, 1::2].T)
    assert torch.equal(up.bias, hf.gate_up_proj_bias[1][1::2])
    assert torch.equal(expert.down.weight, hf.down_proj[1].T) and torch.equal(
        expert.down.bias, hf.down_proj_bias[1]
    )


def test_every_routing_choice_is_clear_and_the_tokens_differ(tiny):
    """No parity result below rests on a near-tie between two experts' logits."""
    _, reference = tiny
    margin, choices = routing_margin(reference, random_ids(64))
    assert margin > 1e-3 and choices > 2


@pytest.mark.parametrize("chunk", [20, 512])
def test_prompt_logits_match_transformers(tiny, chunk):
    """64 tokens (eight sliding windows) prefilled in pieces of 20 or at once."""
    model, reference = tiny
    ids = random_ids(64)
    cache = PagedKVCache.for_model(model.spec, 256, page_size=16)
    assert (
        rel_err(score_tokens(model.module, cache, ids, chunk=chunk), reference_logits(reference, ids)) <= TOL
    )


def test_the_features_the_parity_rests_on_are_in_play(tiny):
    """The experts' gates and ups go beyond the clamp, and without the sinks (or with the
    sliding layers seeing everything) the logits are far from transformers'."""
    model, reference = tiny
    ids = random_ids(64)
    expected = reference_logits(reference, ids)
    seen = []
    hooks = [
        e.gate_up.register_forward_hook(lambda m, a, out: seen.append(out))
        for b in model.module.blocks
        for e in b.feed_forward.experts
    ]
    try:
        score_tokens(model.module, PagedKVCache.for_model(model.spec, 128, page_size=16), ids)
    finally:
        for hook in hooks:
            hook.remove()
    assert max(float(g.max()) for g, _ in seen) > 7.0 and max(float(u.abs().max()) for _, u in seen) > 7.0

    def error_with(**changes) -> float:
        saved = {(i, k): getattr(b.mixer, k) for i, b in enumerate(model.module.blocks) for k in changes}
        for b in model.module.blocks:
            for k, v in changes.items():
                setattr(b.mixer, k, v)
        try:
            cache = PagedKVCache.for_model(model.spec, 128, page_size=16)
            return rel_err(score_tokens(model.module, cache, ids), expected)
        finally:
            for (i, k), v in saved.items():
                setattr(model.module.blocks[i].mixer, k, v)

    assert error_with(sinks=None) > 100 * TOL
    assert error_with(sliding_window=None) > 100 * TOL


def _generate_logits(model, prompt: list[int], new: int, **generator_args) -> tuple[torch.Tensor, list[int]]:
    """Greedy decode of ``new`` tokens after ``prompt``: the logits of every step (the prompt's
    last position, then each decode step) and the tokens."""
    seen: list[torch.Tensor] = []
    hook = model.module.lm_head.register_forward_hook(
        lambda m, a, out: seen.append(out.float()) if out.shape[0] else None
    )
    try:
        gen = Generator(model, cache_tokens=128, page_size=8, max_chunk_tokens=16, **generator_args)
        (result,) = gen.generate([Job(prompt, max_new_tokens=new, stop_token_ids=())])
    finally:
        hook.remove()
    assert len(result.token_ids) == new == len(seen)
    return torch.cat(seen), result.token_ids


@pytest.mark.parametrize("batched_decode", [False, True])
def test_generator_decode_matches_transformers(tiny, batched_decode, monkeypatch):
    """40 prompt tokens then 24 decoded ones over 8-token pages: every step's logits are
    transformers' over the same sequence. The batched path is the paged decode reference, sinks
    included."""
    model, reference = tiny
    calls = []
    original = decode_attention.paged_decode_attention_reference

    def spy(*args):
        calls.append(args[-1])
        return original(*args)

    monkeypatch.setattr(decode_attention, "paged_decode_attention_reference", spy)
    prompt = random_ids(40, seed=5)
    options = EngineOptions(batched_decode=batched_decode)
    got, tokens = _generate_logits(model, prompt, 24, options=options)
    sequence = prompt + tokens
    assert routing_margin(reference, sequence[:-1])[0] > 1e-3
    expected = reference_logits(reference, sequence[:-1])[len(prompt) - 1 :]
    assert rel_err(got, expected) <= TOL
    assert got.argmax(-1).tolist() == tokens
    if batched_decode:
        assert len(calls) == 23 * 4 and all(s is not None for s in calls)  # each decode step, each layer
    else:
        assert not calls


def test_a_quantized_cache_keeps_the_sinks(tiny):
    """An 8-bit cache (keys and values read back dequantized, in the prompt's and decode's
    paths): close to transformers, and much closer than without the sinks."""
    model, reference = tiny
    prompt = random_ids(40, seed=6)
    got, tokens = _generate_logits(model, prompt, 24, cache_bits=(8, 8))
    sequence = prompt + tokens
    expected = reference_logits(reference, sequence[:-1])[len(prompt) - 1 :]
    error, first = rel_err(got, expected), rel_err(got[:1], expected[:1])  # ~0.007, ~0.001
    saved = [b.mixer.sinks for b in model.module.blocks]
    try:
        for b in model.module.blocks:
            b.mixer.sinks = None
        # the prompt's last position: the one step whose sequence is the same without sinks
        sinkless = rel_err(_generate_logits(model, prompt, 24, cache_bits=(8, 8))[0][:1], expected[:1])
    finally:
        for b, s in zip(model.module.blocks, saved):
            b.mixer.sinks = s
    assert error < 2e-2 and sinkless > 10 * first


def test_the_hubs_config_json_is_read(tmp_path):
    """gpt-oss-20b's config.json as the Hub has it (transformers 4 fields: ``rope_theta`` and a
    YaRN ``rope_scaling`` without truncation, ``swiglu_limit``, no ``swiglu_alpha``)."""
    import json

    from engine.architectures import architecture_for
    from engine.config import ModelConfig

    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "head_dim": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "num_hidden_layers": 24,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "sliding_window": 128,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "rms_norm_eps": 1e-05,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "max_position_embeddings": 131072,
        "vocab_size": 201088,
        "tie_word_embeddings": False,
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn"],
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_dir(tmp_path)
    spec = architecture_for(cfg.architecture).spec(cfg)
    attention = [layer.mixer for layer in spec.layers]
    assert [a.sliding_window for a in attention[:4]] == [128, None, 128, None]
    assert all(a.sinks and a.qkv_bias and a.o_bias and a.head_dim == 64 for a in attention)
    rope = attention[0].rope
    assert (rope.kind, rope.theta, rope.params["factor"], rope.params["truncate"]) == (
        "yarn",
        150000.0,
        32.0,
        False,
    )
    moe = spec.layers[0].feed_forward
    assert (moe.num_experts, moe.experts_per_token, moe.intermediate_size) == (32, 4, 2880)
    assert (moe.limit, moe.up_offset, moe.activation, moe.normalize) == (7.0, 1.0, "quick_gelu", True)
    assert spec.norm_eps == 1e-5 and not spec.tie_word_embeddings
