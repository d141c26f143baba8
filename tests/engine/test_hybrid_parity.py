"""The gated-delta-net hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid) against
transformers on tiny random models, and their recurrent state through the generator: chunked
prefill, continuous batching, a reused slot, the fixed-shape decode path; and their conversion."""

from __future__ import annotations

import pytest
import torch
from parity import random_ids, reference_logits, rel_err
from ragged_batch import alone_logits, ragged_batch_logits

from engine.cache.paged import PagedKVCache
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import score_tokens
from engine.layers.gated_delta_net import GatedDeltaNetSpec
from engine.model import load_model
from engine.modules.attention import Attention
from engine.modules.gated_delta_net import GatedDeltaNet
from engine.options import EngineOptions

HYBRIDS = ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "OlmoHybridForCausalLM"]
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tiny_model_factory):
    """Each hybrid loaded once: ``variant -> (our model, transformers' model)``."""
    loaded = {}

    def get(variant: str):
        if variant not in loaded:
            directory, reference = tiny_model_factory(variant)
            loaded[variant] = (load_model(directory, device="cpu"), reference)
        return loaded[variant]

    return get


@pytest.mark.parametrize("variant", HYBRIDS)
def test_layers_are_delta_nets_beside_attention(variant, models):
    model, _ = models(variant)
    blocks = model.module.blocks
    assert [type(block.mixer) for block in blocks] == [GatedDeltaNet, Attention, GatedDeltaNet, GatedDeltaNet]
    spec = model.spec.layers[0].mixer
    assert isinstance(spec, GatedDeltaNetSpec) and (spec.num_k_heads, spec.num_v_heads) == (2, 4)
    assert spec.head_grouped == (variant == "Qwen3NextForCausalLM")
    olmo = variant == "OlmoHybridForCausalLM"
    assert blocks[1].mixer.output_gate != olmo and spec.beta_scale == (2.0 if olmo else 1.0)
    # OLMo's attention layers are post-norm: no norm before the sub-layers, one after each.
    assert (blocks[1].mixer_norm is None, blocks[1].mixer_out_norm is not None) == (olmo, olmo)


@pytest.mark.parametrize("variant", HYBRIDS)
@pytest.mark.parametrize("chunk", [20, 512])
def test_logits_match_transformers(variant, chunk, models):
    """64 tokens prefilled in pieces of 20 (each continuing from the state the last one left) or
    at once."""
    model, reference = models(variant)
    ids = random_ids(64)
    expected = reference_logits(reference, ids)
    cache = PagedKVCache.for_model(model.spec, 256, page_size=16)
    got = score_tokens(model.module, cache, ids, chunk=chunk)
    assert rel_err(got, expected) < TOL


@pytest.mark.parametrize("variant", ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "OlmoHybridForCausalLM"])
def test_a_prompt_across_the_delta_rules_chunks_matches_transformers(variant, models):
    """150 tokens in one piece: three of the delta rule's 64-token chunks, the last one partial;
    then in pieces that end inside them."""
    model, reference = models(variant)
    ids = random_ids(150, seed=4)
    expected = reference_logits(reference, ids)
    for chunk in (150, 70):
        cache = PagedKVCache.for_model(model.spec, 256, page_size=16)
        assert rel_err(score_tokens(model.module, cache, ids, chunk=chunk), expected) < TOL


def test_olmo_hybrid_reads_its_norms_under_either_naming(tiny_model_copy, models):
    """transformers saves OLMo-Hybrid's norms under OLMo-core's names (``attention_layer_norm``,
    ``feedforward_layer_norm``); a checkpoint may also carry the names transformers uses in
    memory (``input_layernorm``, ``post_attention_layernorm``), which ExLlamaV3 reads. Both load
    to the same logits."""
    from safetensors.torch import load_file, save_file

    _, reference = models("OlmoHybridForCausalLM")
    directory = tiny_model_copy("OlmoHybridForCausalLM")
    tensors = load_file(str(directory / "model.safetensors"))
    renamed = {
        k.replace("attention_layer_norm", "input_layernorm").replace(
            "feedforward_layer_norm", "post_attention_layernorm"
        ): v
        for k, v in tensors.items()
    }
    assert renamed.keys() != tensors.keys()
    save_file(renamed, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(directory, device="cpu")
    ids = random_ids(40, seed=9)
    got = score_tokens(model.module, PagedKVCache.for_model(model.spec, 64, page_size=16), ids)
    assert rel_err(got, reference_logits(reference, ids)) < TOL


# -- the recurrent state through batches and the generator ------------------------------------


@pytest.mark.parametrize("variant", ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "OlmoHybridForCausalLM"])
def test_ragged_batch_matches_single_runs(variant, models):
    """Three sequences of different lengths: prefilled together in pieces of at most 16 tokens,
    then two decode steps in the mixed path (row by row) and two in the fixed-shape path (padded
    to four rows, the padding on a scratch page and the scratch state slot). Each sequence's
    logits are those it gets alone."""
    model, _ = models(variant)
    seqs = [random_ids(n, seed=10 + n) for n in (37, 5, 70)]
    decode = [random_ids(4, seed=20 + i) for i in range(3)]
    got = ragged_batch_logits(model, seqs, decode, chunk=16)
    for seq, extra, logits in zip(seqs, decode, got):
        assert rel_err(logits, alone_logits(model, seq + extra)) < 1e-5


def _check_tokens_against_alone(model, prompts, results) -> None:
    """Each job's greedy tokens are the argmax of its sequence's logits computed alone."""
    for prompt, result in zip(prompts, results):
        assert result.cached_tokens == 0
        sequence = prompt + result.token_ids
        cache = PagedKVCache.for_model(model.spec, 128, page_size=8)
        logits = score_tokens(model.module, cache, sequence[:-1])[len(prompt) - 1 :]
        assert logits.argmax(-1).tolist() == result.token_ids


@pytest.mark.parametrize("batched_decode", [False, True])
def test_continuous_batching_keeps_each_sequence_its_state(models, batched_decode):
    """Three jobs at once, prompts split into chunks of 8 tokens beside the others' decode steps,
    decode steps row by row or in the fixed-shape path: each job's tokens are its tokens alone,
    and every slot comes back."""
    model, _ = models("Qwen3NextForCausalLM")
    prompts = [random_ids(n, seed=30 + n) for n in (5, 23, 12)]
    options = EngineOptions(batched_decode=batched_decode)
    gen = Generator(model, cache_tokens=256, page_size=8, max_chunk_tokens=8, options=options)
    results = gen.generate([Job(p, max_new_tokens=6, stop_token_ids=()) for p in prompts])
    assert [len(r.token_ids) for r in results] == [6, 6, 6]
    assert gen.cache.state_slots.available == gen.cache.state_slots.count
    _check_tokens_against_alone(model, prompts, results)


def test_a_cancelled_jobs_slot_starts_the_next_job_fresh(models):
    """One state slot: a job cancelled mid-reply leaves its state there; the next job takes the
    slot and its logits, step by step, are those of a fresh run."""
    model, _ = models("Qwen3_5ForCausalLM")
    cache = PagedKVCache.for_model(model.spec, 256, page_size=8, max_sequences=1)
    gen = Generator(model, cache=cache, max_chunk_tokens=8)
    first = Job(random_ids(30, seed=7), max_new_tokens=50, stop_token_ids=())
    gen.enqueue(first)
    while not any(r.token_ids for r in gen.iterate()):  # prefilled, and a token out
        pass
    gen.iterate()
    assert cache.layer(0)["delta"][0].abs().sum() > 0  # the first job's state is in the slot
    gen.cancel(first)
    assert cache.state_slots.available == 1

    prompt = random_ids(12, seed=8)
    seen: list[torch.Tensor] = []  # the logits of each step that wants some (the prompt's last chunk, decode)

    def record(module, args, out):
        if out.shape[0]:
            seen.append(out.float())

    hook = model.module.lm_head.register_forward_hook(record)
    try:
        (result,) = gen.generate([Job(prompt, max_new_tokens=5, stop_token_ids=())])
    finally:
        hook.remove()
    sequence = prompt + result.token_ids
    fresh = score_tokens(model.module, PagedKVCache.for_model(model.spec, 64, page_size=8), sequence[:-1])
    assert len(seen) == len(result.token_ids) == 5
    assert rel_err(torch.cat(seen), fresh[len(prompt) - 1 :]) < 1e-5


# -- conversion -------------------------------------------------------------------------------


def test_the_converter_quantizes_the_projections_and_keeps_the_recurrence_in_16_bits(
    tiny_model_factory, tmp_path, monkeypatch
):
    """Qwen3-Next converted (with a cheap stand-in for the Viterbi search): the fused in_proj_qkvz
    and out_proj are quantized under their own names, as ExLlamaV3 stores them; in_proj_ba, the
    convolution, A_log, dt_bias and the gated norm are copied in 16 bits; the result loads, its
    delta nets run on EXL3 linears, and it generates."""
    from quant_helpers import cheap_encoder, tiny_convert_options
    from safetensors.torch import load_file

    import engine.convert.quantize as quantize_mod
    from engine.convert.pipeline import convert_model
    from engine.exl3 import EXL3Linear

    monkeypatch.setattr(quantize_mod, "encode_tiles", cheap_encoder)
    source, _ = tiny_model_factory("Qwen3NextForCausalLM")
    # few trellis codes per step: the stand-in encoder's cost grows with 2^bits
    options = tiny_convert_options(bits=2.0, head_bits=16, cal_rows=2)
    convert_model(source, tmp_path / "exl3", options, log=lambda m: None)
    tensors = load_file(str(tmp_path / "exl3" / "model.safetensors"))
    p = "model.layers.0.linear_attn."
    assert {p + "in_proj_qkvz.trellis", p + "out_proj.trellis"} <= set(tensors)
    for name in ("in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight"):
        assert tensors[p + name].dtype == torch.float16, name
    assert not any(k.startswith(p + "in_proj_ba.") and not k.endswith(".weight") for k in tensors)

    quantized = load_model(tmp_path / "exl3", device="cpu")
    mixer = quantized.module.blocks[0].mixer
    assert isinstance(mixer, GatedDeltaNet)
    assert isinstance(mixer.projections.qkvz, EXL3Linear) and isinstance(mixer.out_proj, EXL3Linear)
    (result,) = Generator(quantized, cache_tokens=64, page_size=8).generate(
        [Job([5, 6, 7], max_new_tokens=3, stop_token_ids=())]
    )
    assert len(result.token_ids) == 3


def test_a_synthetic_model_of_the_hybrid_shape_builds(tiny_model_factory):
    """Benchmarks' random-weight models take their tensors from the layers' kinds: Qwen3-Next's
    shape gives head-grouped delta nets, at 4 bits, that run."""
    import json

    from engine.loading.synthetic_store import synthetic_model
    from engine.modules.gated_delta_net import HeadGroupedProjections

    directory, _ = tiny_model_factory("Qwen3NextForCausalLM")
    config = json.loads((directory / "config.json").read_text())
    model = synthetic_model(config, bits=4, dtype=torch.float32, exl3_mode="dense")
    assert isinstance(model.module.blocks[0].mixer.projections, HeadGroupedProjections)
    cache = PagedKVCache.for_model(model.spec, 32, page_size=16)
    assert torch.isfinite(score_tokens(model.module, cache, list(range(3, 19)))).all()


@pytest.mark.cuda
def test_on_a_gpu_the_delta_nets_match_the_cpu_and_decode_in_graphs(tiny_model_factory):
    """Qwen3.5 (no mixture of experts: a decode step's work does not depend on its tokens) on a
    GPU: a prompt's logits are the CPU's, and decode steps captured in CUDA graphs (each row's
    state slot in the step's input buffer) give the tokens of eager steps."""
    directory, _ = tiny_model_factory("Qwen3_5ForCausalLM")
    ids = random_ids(150, seed=4)
    cpu = load_model(directory, device="cpu")
    expected = score_tokens(cpu.module, PagedKVCache.for_model(cpu.spec, 256, page_size=16), ids)
    model = load_model(directory, device="cuda", dtype="float32")
    assert model.module.static_decode
    got = score_tokens(
        model.module,
        PagedKVCache.for_model(model.spec, 256, page_size=16, dtype=model.dtype, device=model.device),
        ids,
        chunk=70,
    )
    assert rel_err(got.cpu(), expected) < 1e-3  # TF32 matmuls may be on
    jobs = [Job(random_ids(n, seed=n), max_new_tokens=64, stop_token_ids=()) for n in (5, 23, 12)]
    tokens = {}
    for graphs in (False, True):
        gen = Generator(model, cache_tokens=512, page_size=8, options=EngineOptions(cuda_graphs=graphs))
        tokens[graphs] = [r.token_ids for r in gen.generate(jobs)]
        assert gen.cache.state_slots.available == gen.cache.state_slots.count
    assert gen._graphs is not None and gen._graphs.failed is None and gen._graphs.captured
    assert tokens[True] == tokens[False]
