"""NemotronH: tiny random models built with transformers (Mamba-2, attention and MLP blocks, and
Nemotron 3's MoE blocks; tests/engine/tiny_models.py) against transformers' logits, and the engine
around the recurrent layers: ragged continuous batching, a cancelled job's state slot taken by
the next job, the fixed-shape decode path, conversion to EXL3, random-weight models of the
shape, and config.json as the Hub writes it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from parity import rel_err
from ragged_batch import ragged_batch_logits
from safetensors import safe_open
from tiny_models import build_tiny_model

from engine.cache.paged import KVCacheLayer, PagedKVCache
from engine.cache.recurrent import RecurrentStateLayer
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import score_tokens
from engine.model import load_model
from engine.modules.attention import Attention
from engine.modules.feed_forward import FeedForward
from engine.modules.mamba2 import Mamba2
from engine.modules.moe import SparseMoE
from engine.options import EngineOptions

VARIANT = "NemotronHForCausalLM"
MAMBA_LAYERS, ATTENTION_LAYERS, MLP_LAYERS = (0, 3), (1, 5), (2, 4)


def _build(variant: str, directory: Path):
    """The tiny model with its Mamba-2 ``D``, ``A_log`` and ``dt_bias`` (and its routers'
    correction bias) moved off their initial values (ones, log(1..heads), zeros...), so that each
    head's (and expert's) own value is what the parity checks."""
    reference = build_tiny_model(variant, directory)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, t in [*reference.named_parameters(), *reference.named_buffers()]:
            if name.endswith((".D", ".A_log", ".dt_bias", ".e_score_correction_bias")):
                t.add_(0.3 * torch.randn(t.shape, generator=gen))
    reference.save_pretrained(directory)
    return reference


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """``(directory, transformers model)`` of the dense tiny NemotronH."""
    directory = tmp_path_factory.mktemp("nemotron-h")
    return directory, _build(VARIANT, directory)


@pytest.fixture(scope="module")
def model(source):
    return load_model(source[0], device="cpu")


def _prompts(lengths=(37, 5, 70), seed=2) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=gen).tolist() for n in lengths]


def _alone(model, tokens: list[int]) -> torch.Tensor:
    return score_tokens(model.module, PagedKVCache.for_model(model.spec, 256, page_size=16), tokens)


@pytest.mark.parametrize("chunk", [64, 20, 1])
def test_logits_match_transformers(source, model, chunk):
    """64 tokens in one step, in steps of 20 (across the scan's 16-token chunks and the cache's
    pages) and one by one (the recurrent state carried through every step)."""
    _, reference = source
    ids = torch.randint(0, 320, (64,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids[None], use_cache=False).logits[0].float()
    cache = PagedKVCache.for_model(model.spec, 256, page_size=16)
    got = score_tokens(model.module, cache, ids.tolist(), chunk=chunk)
    assert rel_err(got, expected) < 1e-4


def test_mixture_of_experts_logits_match_transformers(tmp_path):
    """Nemotron 3's MoE blocks (sigmoid router with correction bias, best group of two, scaled
    weights, latent experts, shared expert) beside Mamba-2, attention and MLP blocks."""
    reference = _build(f"{VARIANT}-moe", tmp_path)
    ids = torch.randint(0, 320, (64,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids[None], use_cache=False).logits[0].float()
    model = load_model(tmp_path, device="cpu")
    moe = model.module.blocks[1].feed_forward
    assert isinstance(moe, SparseMoE) and moe.scoring == "sigmoid" and moe.latent_in is not None
    assert (moe.num_groups, moe.groups_per_token, moe.scale) == (2, 1, 2.5)
    cache = PagedKVCache.for_model(model.spec, 256, page_size=16)
    assert rel_err(score_tokens(model.module, cache, ids.tolist(), chunk=20), expected) < 1e-4


def test_a_time_step_limit_clamps_as_in_transformers(source, tmp_path):
    """``time_step_limit`` (here tight enough to clamp most steps) from config.json."""
    directory, reference = source
    limit = (0.05, 0.2)
    for path in directory.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["time_step_limit"] = list(limit)
    (tmp_path / "config.json").write_text(json.dumps(config))
    clamped = load_model(tmp_path, device="cpu")
    assert clamped.module.blocks[0].mixer.dt_limit == limit
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(5))
    mixers = [reference.model.layers[i].mixer for i in MAMBA_LAYERS]
    try:
        for mixer in mixers:
            mixer.time_step_limit = limit
        with torch.no_grad():
            expected = reference(ids[None], use_cache=False).logits[0].float()
    finally:
        for mixer in mixers:
            mixer.time_step_limit = (0.0, math.inf)
    got = score_tokens(clamped.module, PagedKVCache.for_model(clamped.spec, 64, page_size=16), ids.tolist())
    assert rel_err(got, expected) < 1e-4
    assert rel_err(got, _alone(load_model(directory, device="cpu"), ids.tolist())) > 1e-3  # it did clamp


def test_each_layer_is_one_block_and_only_mamba_layers_keep_a_state(model):
    blocks = model.module.blocks
    for i in MAMBA_LAYERS:
        assert isinstance(blocks[i].mixer, Mamba2) and blocks[i].feed_forward is None
    for i in ATTENTION_LAYERS:
        assert isinstance(blocks[i].mixer, Attention) and blocks[i].feed_forward is None
        assert blocks[i].mixer.rope is None  # no positional encoding
    for i in MLP_LAYERS:
        assert blocks[i].mixer is None and isinstance(blocks[i].feed_forward, FeedForward)
    cache = PagedKVCache.for_model(model.spec, 64, page_size=16, max_sequences=3)
    layers = [cache.layer(i) for i in range(6)]
    assert [type(layer) for layer in layers] == [
        RecurrentStateLayer,
        KVCacheLayer,
        type(None),
        RecurrentStateLayer,
        type(None),
        KVCacheLayer,
    ]
    # A slot per sequence and the scratch row: the window of x, B and C, each head's state.
    assert layers[0]["conv"].shape == (4, 8 * 8 + 2 * 2 * 16, 3)
    assert layers[0]["ssm"].shape == (4, 8, 8, 16) and layers[0]["ssm"].dtype == torch.float32


def test_ragged_batch_matches_single_runs(model):
    """Three sequences share the cache: prefilled together in chunks of 16, then decode steps
    with all three rows, row by row and in fixed shapes with a padding row; each sequence's
    logits are those it gets alone."""
    seqs = _prompts()
    decode = _prompts((6, 6, 6), seed=9)
    got = ragged_batch_logits(model, seqs, decode, chunk=16)
    for seq, extra, logits in zip(seqs, decode, got):
        assert rel_err(logits, _alone(model, seq + extra)) < 1e-5


def _greedy_reference(model, prompt: list[int], tokens: list[int]) -> None:
    logits = _alone(model, prompt + tokens[:-1])[len(prompt) - 1 :]
    assert logits.argmax(-1).tolist() == tokens


@pytest.mark.parametrize("batched_decode", [False, True])
def test_continuous_batching_equals_each_sequence_alone(model, batched_decode):
    """Three jobs at once, prompts prefilled 8 tokens a step (the longer ones split mid-way, beside
    the others' decode steps); decode steps row by row or in the fixed-shape path. Each job's
    tokens are those of its sequence alone, and every state slot comes back."""
    prompts = _prompts((23, 5, 12), seed=4)
    options = EngineOptions(batched_decode=batched_decode)
    gen = Generator(model, cache_tokens=256, page_size=8, max_chunk_tokens=8, options=options)
    results = gen.generate([Job(p, max_new_tokens=6, stop_token_ids=()) for p in prompts])
    assert gen.cache.state_slots.available == gen.cache.state_slots.count
    for prompt, result in zip(prompts, results):
        assert len(result.token_ids) == 6
        _greedy_reference(model, prompt, result.token_ids)


def test_a_cancelled_jobs_slot_gives_the_next_sequence_a_fresh_start(model):
    """One state slot: a job is cancelled halfway through its prompt, its state left in the slot;
    the next sequence in that slot gets the logits (and the next job the tokens) of a fresh
    cache."""
    cache = PagedKVCache.for_model(model.spec, 256, page_size=8, max_sequences=1)
    gen = Generator(model, cache=cache, max_chunk_tokens=8)
    first, second = _prompts((30, 19), seed=6)
    job = Job(first, max_new_tokens=8, stop_token_ids=())
    gen.enqueue(job)
    gen.iterate()
    gen.iterate()
    assert cache.layer(0)["ssm"][0].abs().sum() > 0 and cache.layer(3)["conv"][0].abs().sum() > 0
    gen.cancel(job)
    assert cache.state_slots.available == 1
    torch.testing.assert_close(
        score_tokens(model.module, cache, second), _alone(model, second), rtol=0, atol=0
    )
    (result,) = gen.generate([Job(second, max_new_tokens=6, stop_token_ids=())])
    _greedy_reference(model, second, result.token_ids)


def test_conversion_quantizes_the_projections_and_keeps_the_small_tensors(source, tmp_path, monkeypatch):
    """Mamba-2's in_proj and out_proj, attention's q/k/v/o and the MLPs' up/down are quantized;
    the convolution, A_log, D, dt_bias and the norms are copied in 16 bits; the result loads,
    scores close to the source and generates."""
    from quant_helpers import cheap_encoder, tiny_convert_options

    import engine.convert.quantize as quantize_mod
    from engine.convert.pipeline import convert_model
    from engine.exl3 import EXL3Linear

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    options = tiny_convert_options()
    out = tmp_path / "exl3"
    convert_model(source[0], out, options, log=lambda m: None)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = {key: f.get_slice(key).get_dtype() for key in f.keys()}
    layer = "backbone.layers.{}.mixer."
    quantized = [layer.format(0) + p for p in ("in_proj", "out_proj")]
    quantized += [layer.format(1) + p for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    quantized += [layer.format(2) + p for p in ("up_proj", "down_proj")]
    for key in quantized:
        assert f"{key}.trellis" in stored and f"{key}.weight" not in stored
    kept = [
        layer.format(3) + p for p in ("conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias", "norm.weight")
    ]
    kept += ["backbone.layers.3.norm.weight", "backbone.norm_f.weight"]
    assert all(stored[key] == "F16" for key in kept)

    converted = load_model(out, device="cpu", dtype=torch.float32)
    mixer = converted.module.blocks[3].mixer
    assert isinstance(mixer.in_proj, EXL3Linear) and isinstance(mixer.out_proj, EXL3Linear)
    ids = _prompts((24,), seed=7)[0]
    want = _alone(load_model(source[0], device="cpu"), ids).log_softmax(-1)
    got = _alone(converted, ids).log_softmax(-1)
    assert float((want.exp() * (want - got)).sum(-1).mean()) < 0.02  # KL of 6 bits, greedy encoder
    (result,) = Generator(converted, cache_tokens=64, page_size=8).generate(
        [Job([5, 6, 7], max_new_tokens=3)]
    )
    assert len(result.token_ids) >= 1


def test_a_random_weight_model_of_the_shape_builds(source):
    """Benchmarks' synthetic models (EXL3 projections, random small tensors) of the family run."""
    from engine.loading.synthetic_store import synthetic_model

    config = json.loads((source[0] / "config.json").read_text())
    synthetic = synthetic_model(config, bits=4, dtype=torch.float32, exl3_mode="dense")
    assert isinstance(synthetic.module.blocks[0].mixer, Mamba2)
    cache = PagedKVCache.for_model(synthetic.spec, 32, page_size=16)
    assert torch.isfinite(score_tokens(synthetic.module, cache, list(range(3, 19)))).all()


def test_hub_config_with_a_pattern(tmp_path):
    """config.json as the Hub's NemotronH checkpoints write it: ``hybrid_override_pattern`` with
    ``num_hidden_layers``, legacy Mamba field names, a JSON ``Infinity`` time-step limit."""
    from engine.architectures import architecture_for
    from engine.config import ModelConfig
    from engine.errors import ModelLoadError

    config = {
        "architectures": ["NemotronHForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 64,
        "num_hidden_layers": 5,
        "hybrid_override_pattern": "M-*M-",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attention_head_dim": 32,
        "intermediate_size": 96,
        "mamba_num_heads": 8,
        "mamba_head_dim": 8,
        "ssm_state_size": 16,
        "mamba_n_groups": 4,
        "mamba_d_conv": 3,
        "layer_norm_epsilon": 1e-5,
    }
    (tmp_path / "config.json").write_text(json.dumps(config)[:-1] + ', "time_step_limit": [0.0, Infinity]}')
    spec = architecture_for("NemotronHForCausalLM").spec(ModelConfig.from_dir(tmp_path))
    kinds = [
        (layer.mixer and layer.mixer.kind, layer.feed_forward and layer.feed_forward.kind)
        for layer in spec.layers
    ]
    mamba, mlp, attention = ("mamba2", None), (None, "plain_mlp"), ("attention", None)
    assert kinds == [mamba, mlp, attention, mamba, mlp]
    m = spec.layers[0].mixer
    assert (m.groups, m.conv_kernel, m.dt_limit, m.chunk_size) == (4, 3, None, 128)
    assert spec.layers[2].mixer.head_dim == 32 and spec.layers[2].mixer.rope is None
    assert spec.layers[1].feed_forward.activation == "relu2"
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 6}))
    with pytest.raises(ModelLoadError, match="hybrid_override_pattern"):
        architecture_for("NemotronHForCausalLM").spec(ModelConfig.from_dir(tmp_path))


def test_a_layer_needs_a_mixer_or_a_feed_forward():
    from engine.layers import LayerSpec

    with pytest.raises(ValueError, match="a mixer, a feed-forward or both"):
        LayerSpec(None, None)


@pytest.mark.cuda
def test_the_gpu_runs_the_family_and_replays_its_decode_steps(source, model):
    """On a GPU: float32 logits as on the CPU (to TF32 convolutions), and decode steps captured in
    CUDA graphs (each row's state slot in the step's input buffer) give the tokens of eager steps,
    every slot coming back; bfloat16 runs too."""
    gpu = load_model(source[0], device="cuda", dtype="float32")
    ids = _prompts((40,), seed=8)[0]
    cache = PagedKVCache.for_model(gpu.spec, 64, page_size=16, device="cuda")
    assert rel_err(score_tokens(gpu.module, cache, ids).cpu(), _alone(model, ids)) < 1e-3
    jobs = [Job(p, max_new_tokens=64, stop_token_ids=()) for p in _prompts((23, 5, 12), seed=4)]
    tokens = {}
    for graphs in (False, True):
        gen = Generator(gpu, cache_tokens=512, page_size=8, options=EngineOptions(cuda_graphs=graphs))
        tokens[graphs] = [r.token_ids for r in gen.generate(jobs)]
        assert gen.cache.state_slots.available == gen.cache.state_slots.count
    assert gen._graphs is not None and gen._graphs.failed is None and gen._graphs.captured
    assert tokens[True] == tokens[False]
    half = load_model(source[0], device="cuda", dtype="bfloat16")
    (result,) = Generator(half, cache_tokens=64, page_size=8).generate([Job(ids[:9], max_new_tokens=4)])
    assert len(result.token_ids) >= 1
