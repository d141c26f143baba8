"""LFM2 and LFM2-MoE: tiny random models built with transformers (tests/engine/tiny_models.py),
each with short-convolution and attention layers, against transformers' logits; their state
slots under chunked prefill, continuous batching and the fixed-shape decode path; their configs'
spellings; and their conversion to EXL3."""

from __future__ import annotations

import json

import pytest
import torch
from parity import rel_err
from ragged_batch import alone_logits, ragged_batch_logits
from safetensors.torch import load_file
from tiny_models import build_tiny_model

from engine.architectures import architecture_for
from engine.cache.paged import PagedKVCache
from engine.config import ModelConfig
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import score_tokens
from engine.layers.attention import AttentionSpec
from engine.layers.short_conv import ShortConvSpec
from engine.model import load_model
from engine.modules.attention import Attention
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE
from engine.modules.short_conv import ShortConv
from engine.options import EngineOptions

DENSE, MOE = "Lfm2ForCausalLM", "Lfm2MoeForCausalLM"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny(variant) -> (directory, transformers model)``. The MoE's ``expert_bias`` (zeros
    at initialisation, and a buffer the usual perturbation skips) is made random, on the same
    scale as the router's scores, so that it changes which experts some tokens get."""
    built = {}

    def factory(variant: str):
        if variant not in built:
            directory = tmp_path_factory.mktemp(variant)
            model = build_tiny_model(variant, directory)
            if variant == MOE:
                gen = torch.Generator().manual_seed(3)
                with torch.no_grad():
                    for layer in model.model.layers[model.config.num_dense_layers :]:
                        bias = layer.feed_forward.expert_bias
                        bias.copy_(torch.randn(bias.shape, generator=gen) * 0.05)
                model.save_pretrained(directory, safe_serialization=True)
            built[variant] = (directory, model, load_model(directory, device="cpu"))
        return built[variant]

    return factory


def test_a_16_bit_model_keeps_the_selection_bias_in_float32(tiny):
    """A bf16 model keeps its routers' selection bias in float32, unrounded: the bias only
    decides which experts win, and bf16 rounding could reorder experts with close scores."""
    directory, _, fp32 = tiny(MOE)
    bf16 = load_model(directory, device="cpu", dtype="bfloat16")
    moes = [b.feed_forward for b in bf16.module.blocks if isinstance(b.feed_forward, SparseMoE)]
    assert moes and all(m.selection_bias.dtype == torch.float32 for m in moes)
    exact = [
        b.feed_forward.selection_bias for b in fp32.module.blocks if isinstance(b.feed_forward, SparseMoE)
    ]
    assert all(torch.equal(m.selection_bias, e) for m, e in zip(moes, exact))


@pytest.mark.parametrize("variant", [DENSE, MOE])
def test_logits_match_transformers(variant, tiny):
    """64 tokens prefilled in chunks of 20 (the convolution windows cross chunks)."""
    _, reference, model = tiny(variant)
    ids = torch.randint(0, reference.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0].float()
    cache = PagedKVCache.for_model(model.spec, 256, page_size=16, max_sequences=1)
    got = score_tokens(model.module, cache, ids.tolist(), chunk=20)
    assert got.shape == expected.shape
    assert rel_err(got, expected) < 1e-4


def test_the_layers_are_those_the_config_lists(tiny):
    directory, reference, model = tiny(DENSE)
    blocks = model.module.blocks
    assert [type(b.mixer) for b in blocks] == [ShortConv, Attention, ShortConv, Attention]
    assert all(isinstance(b.feed_forward, GatedMLP) for b in blocks)
    assert blocks[1].mixer.q_norm is not None and blocks[1].mixer.k_norm is not None
    # 192 configured -> 2/3 -> rounded up to a multiple of 48, as transformers sizes w1/w3/w2.
    assert (
        blocks[0].feed_forward.down.in_features
        == 144
        == reference.model.layers[0].feed_forward.w2.in_features
    )
    assert model.spec.tie_word_embeddings and model.spec.norm_eps == 1e-5


def test_the_moe_router_is_read_as_lfm2_moe_routes(tiny):
    directory, reference, model = tiny(MOE)
    blocks = model.module.blocks
    assert isinstance(blocks[0].feed_forward, GatedMLP)  # num_dense_layers = 1
    moe = blocks[2].feed_forward
    assert isinstance(moe, SparseMoE) and all(isinstance(b.feed_forward, SparseMoE) for b in blocks[1:])
    assert (moe.scoring, moe.normalize, moe.scale, moe.top_k) == ("sigmoid", True, 1.5, 2)
    torch.testing.assert_close(moe.selection_bias, reference.model.layers[2].feed_forward.expert_bias)
    assert not model.spec.tie_word_embeddings


def test_hub_config_spellings(tmp_path):
    """The Hub's LFM2 configs name the attention layers in ``full_attn_idxs`` (no
    ``layer_types``), the MLP width ``block_ff_dim`` and the tying ``tie_embedding``."""
    config = {
        "architectures": [DENSE],
        "vocab_size": 320,
        "hidden_size": 64,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "full_attn_idxs": [1, 4],
        "block_ff_dim": 768,
        "block_ffn_dim_multiplier": 1.5,
        "block_multiple_of": 256,
        "block_auto_adjust_ff_dim": True,
        "conv_L_cache": 4,
        "conv_bias": True,
        "tie_embedding": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = architecture_for(DENSE).spec(ModelConfig.from_dir(tmp_path))
    mixers = [layer.mixer for layer in spec.layers]
    assert [type(m) for m in mixers] == [
        ShortConvSpec,
        AttentionSpec,
        ShortConvSpec,
        ShortConvSpec,
        AttentionSpec,
    ]
    assert mixers[0] == ShortConvSpec(hidden_size=64, kernel_size=4, bias=True)
    assert mixers[1].qk_norm and mixers[1].rope.theta == 1e6
    assert spec.layers[0].feed_forward.intermediate_size == 768  # 768 -> 512 -> 768 -> 768
    assert not spec.tie_word_embeddings


@pytest.mark.parametrize("variant", [DENSE, MOE])
def test_ragged_batch_matches_single_runs(variant, tiny):
    """Three sequences share mixed steps, their prompts split mid-way into chunks of at most 7
    tokens; then decode steps, mixed and in the fixed-shape path (a padding row on the scratch
    page and slot). Every row's logits are those of the sequence run alone."""
    _, _, model = tiny(variant)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (19, 5, 26)]
    decode = [torch.randint(0, 320, (4,), generator=gen).tolist() for _ in seqs]
    # The sequences take slots 1, 2 and 0, not in their order.
    got = ragged_batch_logits(model, seqs, decode, chunk=7, slots=[1, 2, 0])
    for seq, extra, logits in zip(seqs, decode, got):
        assert rel_err(logits, alone_logits(model, seq + extra)) < 1e-5


@pytest.mark.parametrize("variant", [DENSE, MOE])
@pytest.mark.parametrize("batched_decode", [False, True])
def test_continuous_batching_generates_what_each_job_alone_does(variant, batched_decode, tiny):
    """The generator admits three jobs with prompts prefilled in chunks of 8 beside the others'
    decode steps (row by row, or the fixed-shape path): each job's greedy tokens are those it
    gets alone, and every state slot comes back."""
    _, _, model = tiny(variant)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 21, 12)]
    options = EngineOptions(batched_decode=batched_decode)

    def generate(batch: list[list[int]]) -> tuple[list[list[int]], Generator]:
        engine = Generator(model, cache_tokens=256, page_size=8, max_chunk_tokens=8, options=options)
        results = engine.generate([Job(p, max_new_tokens=6, stop_token_ids=()) for p in batch])
        return [r.token_ids for r in results], engine

    together, engine = generate(prompts)
    assert engine.cache.state_slots.available == engine.cache.state_slots.count > 0
    assert together == [generate([p])[0][0] for p in prompts]
    assert all(len(t) == 6 for t in together)


@pytest.mark.slow
def test_conversion_quantizes_the_linears_and_keeps_the_convolutions(tmp_path, monkeypatch):
    """``convert_model`` with the cheap encoder: every projection (the convolutions' in/out ones
    too) becomes EXL3, the convolution weights are copied as stored (16 bits), and the result
    loads and scores close to the source."""
    from quant_helpers import cheap_encoder, tiny_convert_options

    import engine.convert.quantize as quantize_mod
    from engine.convert.pipeline import convert_model
    from engine.exl3 import EXL3Linear

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    source = tmp_path / "source"
    build_tiny_model(DENSE, source)
    # few codes per value: the greedy encoder's cost grows with 2 ** bits
    options = tiny_convert_options(bits=3.0, head_bits=3)
    convert_model(source, tmp_path / "exl3", options, log=lambda m: None)
    tensors = load_file(str(tmp_path / "exl3" / "model.safetensors"))
    for proj in ("conv.in_proj", "conv.out_proj", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
        assert f"model.layers.0.{proj}.trellis" in tensors and f"model.layers.0.{proj}.weight" not in tensors
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        assert f"model.layers.1.self_attn.{proj}.trellis" in tensors
    conv = tensors["model.layers.2.conv.conv.weight"]
    assert conv.dtype == torch.float16 and conv.shape == (64, 1, 3)
    original = load_file(str(source / "model.safetensors"))["model.layers.2.conv.conv.weight"]
    torch.testing.assert_close(conv.float(), original, rtol=1e-3, atol=1e-4)

    quantized = load_model(tmp_path / "exl3", device="cpu")
    linears = [m for m in quantized.module.modules() if isinstance(m, EXL3Linear)]
    assert len(linears) == 2 * 2 + 4 * 2 + 3 * 4 + 1  # conv in/out, q/k/v/o, w1/w3/w2, head
    assert isinstance(quantized.module.blocks[0].mixer.in_proj, EXL3Linear)
    ids = list(range(3, 35))
    logprobs = []
    for model in (load_model(source, device="cpu"), quantized):
        cache = PagedKVCache.for_model(model.spec, 64, page_size=16, max_sequences=1)
        logprobs.append(score_tokens(model.module, cache, ids).log_softmax(-1))
    kl = float((logprobs[0].exp() * (logprobs[0] - logprobs[1])).sum(-1).mean())
    assert 0 < kl < 0.02, kl  # ~0.002 at 3 bits


def test_a_synthetic_model_of_the_moe_shape_builds(tiny):
    """Benchmarks' random-weight models of an LFM2-MoE shape: convolutions, the expert bias
    and quantized experts come from the kinds like a checkpoint's."""
    from engine.exl3 import EXL3Linear
    from engine.loading.synthetic_store import synthetic_model

    directory, _, _ = tiny(MOE)
    shape = json.loads((directory / "config.json").read_text())
    shape.update(hidden_size=128, intermediate_size=256, moe_intermediate_size=128)
    model = synthetic_model(shape, bits=4, dtype=torch.float32, exl3_mode="dense")
    conv, moe = model.module.blocks[2].mixer, model.module.blocks[2].feed_forward
    assert isinstance(conv, ShortConv) and isinstance(conv.in_proj, EXL3Linear)
    assert moe.selection_bias.shape == (8,) and isinstance(moe.experts[0].down, EXL3Linear)
    cache = PagedKVCache.for_model(model.spec, 32, page_size=16, max_sequences=1)
    assert torch.isfinite(score_tokens(model.module, cache, list(range(3, 19)))).all()


@pytest.mark.cuda
def test_decode_graphs_capture_lfm2_on_a_gpu(tiny):
    """On a GPU the dense LFM2's decode steps (convolution windows in the state slots) are
    captured in CUDA graphs: the tokens are those of eager steps, and the logits of a float32
    model those of transformers."""
    directory, reference, _ = tiny(DENSE)
    model = load_model(directory, device="cuda", dtype="float32")
    ids = torch.randint(0, 320, (64,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0].float()
    cache = PagedKVCache.for_model(model.spec, 256, page_size=16, max_sequences=1, device="cuda")
    assert rel_err(score_tokens(model.module, cache, ids.tolist(), chunk=20).cpu(), expected) < 1e-4
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 21, 12)]
    jobs = [Job(p, max_new_tokens=64, stop_token_ids=()) for p in prompts]
    tokens = {}
    for graphs in (False, True):
        engine = Generator(model, cache_tokens=512, page_size=8, options=EngineOptions(cuda_graphs=graphs))
        tokens[graphs] = [r.token_ids for r in engine.generate(jobs)]
        assert engine.cache.state_slots.available == engine.cache.state_slots.count
    assert engine._graphs is not None and engine._graphs.failed is None and engine._graphs.captured
    assert tokens[True] == tokens[False]
