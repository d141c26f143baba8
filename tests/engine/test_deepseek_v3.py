"""DeepSeek-V3 against transformers on tiny random models (tests/engine/tiny_deepseek.py): multi-head
latent attention with and without the query LoRA, interleaved YaRN RoPE or plain rotate-half,
dense first layers then DeepSeek's grouped sigmoid routing. And its compressed cache: one row of
``kv_lora_rank + qk_rope_head_dim`` numbers per position and layer (what transformers' own cache
holds), read back decompressed for prompts and through the absorbed weights for decode steps,
through the generator's paged cache, ragged batches and prefix reuse, quantized to 2-8 bits, and
counted so by the memory estimate."""

from __future__ import annotations

import json

import pytest
import torch
from parity import random_ids, reference_logits, rel_err
from ragged_batch import alone_logits, ragged_batch_logits
from tiny_deepseek import VARIANTS, build_tiny_deepseek, routing_margin

from engine.cache.latent import LatentCacheLayer
from engine.cache.paged import PagedKVCache, cache_footprint, kv_bytes_per_token
from engine.cache.quantized import DenseStore, QuantizedStore
from engine.config_footprint import config_footprint
from engine.errors import UsageError
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import StepItem, run_step, score_tokens
from engine.inspect import inspect_model
from engine.layers.latent_attention import LatentAttentionSpec
from engine.model import load_model
from engine.modules.latent_attention import LatentAttention, softmax_scale
from engine.modules.mlp import GatedMLP
from engine.modules.moe import SparseMoE
from engine.modules.rope import RopeSpec
from engine.options import EngineOptions

TOL = 1e-4
WIDTH = 32 + 16  # kv_lora_rank + qk_rope_head_dim of the tiny models
MIN_MARGIN = 1e-5  # routing choices this far from a tie: ~100x float32 rounding of the scores


def _decisive(reference, ids: list[int]) -> None:
    """The routing on ``ids`` is far from any tie, and depends on the token."""
    margin, choices = routing_margin(reference, ids)
    assert margin > MIN_MARGIN and choices > 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each variant built and loaded once: ``variant -> (our model, transformers' model, directory)``."""
    loaded = {}

    def get(variant: str):
        if variant not in loaded:
            directory = tmp_path_factory.mktemp(variant)
            reference = build_tiny_deepseek(variant, directory)
            loaded[variant] = (load_model(directory, device="cpu"), reference, directory)
        return loaded[variant]

    return get


# -- the model --------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_layers_are_latent_attention_then_dense_mlps_and_experts(variant, models):
    model, reference, _ = models(variant)
    blocks = model.module.blocks
    dense = reference.config.first_k_dense_replace
    assert all(isinstance(b.mixer, LatentAttention) for b in blocks)
    assert [isinstance(b.feed_forward, GatedMLP) for b in blocks] == [i < dense for i in range(4)]
    assert all(isinstance(b.feed_forward, SparseMoE) for b in blocks[dense:])
    moe = blocks[-1].feed_forward
    assert (moe.scoring, moe.num_groups, moe.groups_per_token) == (
        "sigmoid",
        *[reference.config.n_group, reference.config.topk_group],
    )
    lora = variant == "DeepseekV3ForCausalLM"
    mixer = blocks[0].mixer
    assert (mixer.q_a_proj is not None) == lora and mixer.interleaved == lora
    # The softmax scale, YaRN's mscale correction included, is transformers' own.
    assert mixer.scale == pytest.approx(reference.model.layers[0].self_attn.scaling, rel=1e-12)
    if lora:
        assert mixer.scale > (16 + 16) ** -0.5  # the correction is there to check


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default"},
        {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.5},
        {"rope_type": "yarn", "factor": 4.0},  # no mscale_all_dim: no correction
        {"rope_type": "linear", "factor": 2.0, "mscale_all_dim": 1.0},
    ],
)
def test_the_softmax_scale_is_transformers(params):
    from transformers.modeling_rope_utils import yarn_apply_mscale

    rope = RopeSpec(10000.0, params["rope_type"], {k: v for k, v in params.items() if k != "rope_type"})
    assert softmax_scale(192, rope) == pytest.approx(yarn_apply_mscale(params, 192**-0.5), rel=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunk", [20, 64])
def test_logits_match_transformers(variant, chunk, models):
    """64 tokens prefilled at once, or in pieces of 20 (each piece's queries over the latent rows
    the earlier pieces left in the cache)."""
    model, reference, _ = models(variant)
    ids = random_ids(64)
    _decisive(reference, ids)
    expected = reference_logits(reference, ids)
    cache = PagedKVCache.for_model(model.spec, 256, page_size=16)
    assert rel_err(score_tokens(model.module, cache, ids, chunk=chunk), expected) <= TOL


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("batched_decode", [False, True])
def test_generator_decode_matches_transformers(variant, batched_decode, models):
    """Greedy decoding through the generator and its paged cache: every step's logits (the
    prompt's last, then one per decode step: the absorbed form, row by row or in the fixed-shape
    path) are transformers' logits of the whole sequence at that position."""
    model, reference, _ = models(variant)
    prompt, steps = random_ids(21, seed=3), 12
    seen: list[torch.Tensor] = []

    def record(module, args, out):
        if out.shape[0]:
            seen.append(out.float())

    gen = Generator(
        model, cache_tokens=128, page_size=8, options=EngineOptions(batched_decode=batched_decode)
    )
    hook = model.module.lm_head.register_forward_hook(record)
    try:
        (result,) = gen.generate([Job(prompt, max_new_tokens=steps, stop_token_ids=())])
    finally:
        hook.remove()
    sequence = prompt + result.token_ids
    _decisive(reference, sequence)
    expected = reference_logits(reference, sequence)[len(prompt) - 1 : -1]
    assert len(seen) == len(result.token_ids) == steps
    got = torch.cat(seen)
    assert rel_err(got, expected) <= TOL
    assert got.argmax(-1).tolist() == result.token_ids


# -- the compressed cache ---------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_cache_keeps_the_latent_and_the_rotated_key_per_token(variant, models):
    """Each layer's cache is one row of kv_lora_rank + qk_rope_head_dim numbers per slot, no
    per-head keys or values; after a prompt it holds what transformers' own cache holds: the
    normalised latent and the rotated shared key of every position."""
    model, reference, _ = models(variant)
    cache = PagedKVCache.for_model(model.spec, 64, page_size=16)
    slots = cache.capacity
    for i in range(model.spec.num_layers):
        layer = cache.layer(i)
        assert isinstance(layer, LatentCacheLayer) and isinstance(layer.store, DenseStore)
        assert layer.store.data.shape == (slots, 1, WIDTH)
    assert cache.nbytes == model.spec.num_layers * slots * WIDTH * 4  # float32, nothing else
    heads, qk, v = 4, 16 + 16, 24
    assert heads * (qk + v) == 224  # what per-head keys and values would take, not 48

    ids = random_ids(37, seed=5)
    pages = cache.pages.allocate(3)
    run_step(model.module, cache, [StepItem(ids, 0, pages, "last")])
    with torch.no_grad():
        theirs = reference(torch.tensor([ids]), use_cache=True).cache
    positions = cache.slots(pages, 0, len(ids))
    for i in range(model.spec.num_layers):
        expected = torch.cat((theirs.layers[i].keys[0, 0], theirs.layers[i].values[0, 0]), dim=-1)
        assert rel_err(cache.layer(i).read(positions), expected) < 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
def test_ragged_batch_matches_single_runs(variant, models):
    """Three sequences prefilled together in pieces of at most 16 tokens, then decode steps in the
    mixed path and the fixed-shape path (padded with a row on a scratch page): each sequence's
    logits are those it gets alone."""
    model, _, _ = models(variant)
    seqs = [random_ids(n, seed=10 + n) for n in (37, 5, 70)]
    decode = [random_ids(4, seed=20 + i) for i in range(3)]
    got = ragged_batch_logits(model, seqs, decode, chunk=16)
    for seq, extra, logits in zip(seqs, decode, got):
        assert rel_err(logits, alone_logits(model, seq + extra)) < 1e-5


def test_continuous_batching_and_prefix_reuse(models):
    """Jobs that share a prompt prefix run together; the later ones start on the first one's
    cached latent pages and still produce the tokens of a cold run."""
    model, _, _ = models("DeepseekV3ForCausalLM")
    prefix = random_ids(24, seed=40)
    prompts = [prefix + random_ids(n, seed=41 + n) for n in (3, 9, 14)]
    gen = Generator(model, cache_tokens=256, page_size=8, max_chunk_tokens=8, max_batch_size=3)
    (first,) = gen.generate([Job(prompts[0], max_new_tokens=5, stop_token_ids=())])
    results = gen.generate([Job(p, max_new_tokens=5, stop_token_ids=()) for p in prompts])
    assert [r.cached_tokens for r in results] == [24, 24, 24]  # three full pages of the prefix
    assert gen.cache.pages.available == gen.cache.num_pages
    cold = Generator(model, cache_tokens=256, page_size=8, max_batch_size=1)
    for prompt, result in zip(prompts, results):
        (alone,) = cold.generate([Job(prompt, max_new_tokens=5, stop_token_ids=())])
        assert result.token_ids == alone.token_ids
    assert results[0].token_ids == first.token_ids


# Relative error bounds of the first layer's cached rows and of the logits, by the rows' width.
QUANTIZED_ROWS = {8: 0.01, 6: 0.04, 4: 0.15, 2: 0.6}
QUANTIZED_LOGITS = {8: 0.05, 6: 0.1, 4: 0.2, 2: 0.8}


@pytest.mark.parametrize("bits", [(8, 8), (4, 6), (4, 4), (2, 2)])
def test_a_quantized_cache_stores_the_row_as_one_head(bits, models):
    """At 2-8 bits a layer's row is one quantized "head" of 48 numbers, at the wider of the key
    and value widths. The first layer's rows (computed before any cache is read) come back within
    that width's rounding of the unquantized ones, and the logits stay near the unquantized
    cache's (further off than the rows: a perturbed score can move a token to other experts)."""
    model, _, _ = models("DeepseekV3ForCausalLM")
    ids, width = random_ids(64, seed=2), max(bits)

    def run(cache_bits):
        cache = PagedKVCache.for_model(model.spec, 64, page_size=16, bits=cache_bits)
        pages = cache.pages.allocate(4)
        logits = run_step(model.module, cache, [StepItem(ids, 0, pages, "all")])[0]
        return cache, logits, cache.layer(0).read(cache.slots(pages, 0, len(ids)))

    _, expected, rows = run((16, 16))
    cache, logits, quantized_rows = run(bits)
    store = cache.layer(0).store
    assert isinstance(store, QuantizedStore) and store.bits == width
    assert store.codes.shape == (64, 1, WIDTH // 8, width)  # one head of 48, bit planes
    # 48 numbers at b bits plus one fp16 scale per group of 16, per layer.
    assert kv_bytes_per_token(model.spec, bits) == 4 * (WIDTH * width // 8 + 3 * 2)
    assert 0 < rel_err(quantized_rows, rows) < QUANTIZED_ROWS[width]
    assert 0 < rel_err(logits, expected) < QUANTIZED_LOGITS[width]


def test_a_row_the_quantized_cache_cannot_pack_is_refused_by_name():
    with pytest.raises(UsageError, match="latent attention rows.*44 numbers.*16 bits"):
        LatentCacheLayer(44, 16, (4, 4), torch.float32, "cpu")
    assert isinstance(LatentCacheLayer(44, 16, (16, 16), torch.float32, "cpu").store, DenseStore)


def test_the_memory_estimate_counts_the_latent_row(models):
    """The app's torch-free estimate from config.json equals the engine's footprint, and both
    equal what the cache allocates, unquantized and quantized."""
    model, _, directory = models("DeepseekV3ForCausalLM")
    config = json.loads((directory / "config.json").read_text())
    footprint = config_footprint(config)
    assert footprint == cache_footprint(model.spec)
    assert footprint.latent_layers == (WIDTH,) * 4 and footprint.kv_layers == ()
    for bits in [(16, 16), (8, 8), (4, 6), (2, 2)]:
        assert footprint.kv_bytes_per_token(bits, 2) == kv_bytes_per_token(model.spec, bits, 2)
        cache = PagedKVCache.for_model(model.spec, 256, page_size=64, bits=bits)
        assert cache.nbytes == footprint.cache_bytes(256, bits, dense_bytes=4)
    info = inspect_model(directory)
    assert info.footprint == footprint and info.kv_cache_bytes(1000, 2) == 1000 * 4 * WIDTH * 2


def test_cache_capacity_counts_the_latent_row(models, capsys):
    from argparse import Namespace

    from engine.commands.cache_capacity import run

    _, _, directory = models("DeepseekV3ForCausalLM")
    assert run(Namespace(model=str(directory), budget_gb=1.0, json=True)) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["bytes_per_token"] == 4 * WIDTH * 2  # fp16
    assert run(Namespace(model=str(directory), budget_gb=1.0, json=False)) == 0
    assert "latent" in capsys.readouterr().out


def test_the_spec_reads_the_latent_shape(models):
    model, _, _ = models("DeepseekV3ForCausalLM-plain")
    spec = model.spec.layers[0].mixer
    assert isinstance(spec, LatentAttentionSpec)
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_nope_head_dim, spec.v_head_dim) == (0, 32, 16, 24)
    assert not spec.rope_interleave and spec.rope.kind == "default"


# -- on a GPU ---------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [(16, 16), (4, 4)])
def test_on_a_gpu_latent_attention_runs_the_torch_path_and_matches_the_cpu(models, bits):
    """On CUDA no per-head paged-attention kernel runs for these layers (their cache holds rows,
    not keys and values): a prompt's logits, and every decode step's through the generator's
    fixed-shape path, equal the CPU's."""
    cpu, _, directory = models("DeepseekV3ForCausalLM")
    gpu = load_model(directory, device="cuda", dtype="float32")
    ids = random_ids(64)
    expected = score_tokens(cpu.module, PagedKVCache.for_model(cpu.spec, 128, page_size=16, bits=bits), ids)
    cache = PagedKVCache.for_model(gpu.spec, 128, page_size=16, dtype=gpu.dtype, device=gpu.device, bits=bits)
    assert rel_err(score_tokens(gpu.module, cache, ids, chunk=20).cpu(), expected) < 1e-3  # TF32 may be on

    seen: list[torch.Tensor] = []
    hook = gpu.module.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.float().cpu()))
    try:
        gen = Generator(gpu, cache_tokens=128, page_size=8, cache_bits=bits)
        (result,) = gen.generate([Job(random_ids(21, seed=3), max_new_tokens=12, stop_token_ids=())])
    finally:
        hook.remove()
    sequence = random_ids(21, seed=3) + result.token_ids
    cold = PagedKVCache.for_model(cpu.spec, 128, page_size=8, bits=bits)
    reference = score_tokens(cpu.module, cold, sequence, chunk=1)[20:-1]  # decode steps on the CPU
    assert rel_err(torch.cat([s for s in seen if s.shape[0]]), reference) < 1e-3


@pytest.mark.cuda
def test_on_a_gpu_a_quantized_row_of_deepseeks_width_goes_through_the_cache_kernels():
    """DeepSeek-V3's rows (512 + 64 numbers) pack in groups of 32, so the quantized cache's write
    and read kernels take them, as one head: the same numbers as the torch reference."""
    layer = LatentCacheLayer(576, 64, (4, 4), torch.float16, "cuda")
    rows = torch.randn(10, 576, generator=torch.Generator().manual_seed(0)).half().cuda()
    slots = torch.arange(3, 13, device="cuda")
    layer.write(slots, rows)
    store = layer.store
    reference = store.dequantize(
        store.codes.index_select(0, slots), store.scales.index_select(0, slots), torch.float32
    )
    got = layer.read(slots).float()
    assert rel_err(got, reference[:, 0]) < 1e-3 and rel_err(got, rows.float()) < 0.15


def test_a_synthetic_model_of_the_shape_builds(models):
    """Benchmarks' random-weight models list their tensors by building the layers on the meta
    device: DeepSeek-V3's shape gives latent attention, at 4 bits, that runs."""
    from engine.exl3 import EXL3Linear
    from engine.loading.synthetic_store import synthetic_model

    _, _, directory = models("DeepseekV3ForCausalLM")
    config = json.loads((directory / "config.json").read_text())
    model = synthetic_model(config, bits=4, dtype=torch.float32, exl3_mode="dense")
    mixer = model.module.blocks[0].mixer
    assert isinstance(mixer, LatentAttention) and isinstance(mixer.kv_b_proj, EXL3Linear)
    cache = PagedKVCache.for_model(model.spec, 32, page_size=16)
    assert torch.isfinite(score_tokens(model.module, cache, list(range(3, 19)), chunk=5)).all()
