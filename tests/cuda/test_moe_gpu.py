"""Mixture-of-experts models on a CUDA GPU, the same greedy tokens as the CPU reference path: dense
experts decode eagerly (no CUDA graphs); EXL3 experts through the device-routed kernels, their
decode steps replayed from CUDA graphs as the eager steps run. (Their logits against transformers
on the GPU: test_engine_cuda.py; the kernels themselves: test_moe_expert_gemv.py.)"""

import sys
from pathlib import Path

import pytest

from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.model import load_model

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from tiny_models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("variant", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def test_moe_greedy_tokens_on_gpu_match_cpu(variant, tmp_path):
    build_tiny_model(variant, tmp_path)
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 17)]

    def greedy(device: str) -> list[list[int]]:
        model = load_model(tmp_path, device=device, dtype="float32")
        gen = Generator(model, cache_tokens=512, page_size=16)
        if device == "cuda":
            assert not gen._use_graphs  # data-dependent expert choice: decoded eagerly
        jobs = [Job(p, max_new_tokens=12, stop_token_ids=()) for p in prompts]
        return [r.token_ids for r in gen.generate(jobs)]

    assert greedy("cuda") == greedy("cpu")


# Tiny EXL3 mixtures (random 4-bit weights written as our converter writes them): experts the
# device-routed kernels take, so their decode steps replay from CUDA graphs.
_SHAPES = {
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 192,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 256,
        "intermediate_size": 320,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "sliding_window": 32,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    },
}
_PROMPTS = (5, 23, 40)
_NEW_TOKENS = 64


def _exl3_moe(name: str, directory: Path) -> Path:
    from engine.loading.synthetic_store import write_synthetic_model

    return write_synthetic_model(_SHAPES[name], 4, directory / name, codebook="mul1")


def _greedy_jobs() -> list[Job]:
    return [
        Job(list(range(3 + i, 3 + i + n)), max_new_tokens=_NEW_TOKENS, stop_token_ids=())
        for i, n in enumerate(_PROMPTS)
    ]


def _greedy(model, graphs: bool):
    from engine.options import EngineOptions

    gen = Generator(model, cache_tokens=1024, page_size=16, options=EngineOptions(cuda_graphs=graphs))
    return [r.token_ids for r in gen.generate(_greedy_jobs())], gen


def _same_up_to_near_ties(reference_model, expected, got, tie: float) -> None:
    """Equal greedy tokens, except where the two paths' roundings meet a near tie of the
    reference's logits (then the rest of the sequence may differ)."""
    from engine.cache.paged import PagedKVCache
    from engine.generation.step import score_tokens

    for job, a, b in zip(_greedy_jobs(), expected, got):
        assert len(a) == len(b) == _NEW_TOKENS
        if a == b:
            continue
        i = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        cache = PagedKVCache.for_model(
            reference_model.spec,
            1024,
            page_size=16,
            dtype=reference_model.dtype,
            device=reference_model.device,
        )
        logits = score_tokens(reference_model.module, cache, list(job.input_ids) + a[:i])[-1].float()
        gap = (logits[a[i]] - logits[b[i]]).abs().item()
        assert gap < tie * logits.abs().max().item(), f"diverged at token {i} with a margin of {gap}"


@pytest.mark.parametrize("name", list(_SHAPES))
def test_exl3_moe_decodes_in_graphs_as_eagerly(name, tmp_path):
    from engine.modules.moe import SparseMoE

    model = load_model(_exl3_moe(name, tmp_path), device="cuda", dtype="float16")
    moes = [b.feed_forward for b in model.module.blocks if isinstance(b.feed_forward, SparseMoE)]
    assert moes and all(m.stacked is not None and m.dynamic_decode is None for m in moes)
    eager, gen_eager = _greedy(model, graphs=False)
    graphed, gen = _greedy(model, graphs=True)
    assert gen._use_graphs and gen._graphs is not None and gen._graphs.failed is None, gen._graphs.failed
    assert gen._graphs.captured  # the decode steps really replayed from graphs
    _same_up_to_near_ties(model, eager, graphed, tie=2e-2)


@pytest.mark.parametrize("name", list(_SHAPES))
def test_exl3_moe_greedy_tokens_on_gpu_match_cpu(name, tmp_path):
    directory = _exl3_moe(name, tmp_path)
    gpu, _ = _greedy(load_model(directory, device="cuda", dtype="float32"), graphs=True)
    cpu_model = load_model(directory, device="cpu", dtype="float32")  # dense dequantized experts
    cpu, _ = _greedy(cpu_model, graphs=False)
    # The GPU's GEMVs round their rotated inputs to fp16: a near tie may resolve either way.
    _same_up_to_near_ties(cpu_model, cpu, gpu, tie=2e-2)


def test_gpt_oss_sink_layers_decode_through_the_attention_kernel(tmp_path, monkeypatch):
    """Every gpt-oss layer has attention sinks, its sliding-window layers and its full ones alike:
    their decode steps run the paged attention kernel, never the torch reference, and each call's
    output equals the reference's computed exactly (float32) on the same inputs.

    Per call, not by greedy tokens against a reference run: two attention implementations differ
    by rounding, and a top-2 router turns a rounding-sized difference into another expert (whole
    logits apart, no near tie of the final logits), so token equality is no test of the kernel."""
    import engine.cache.decode_attention as decode_attention
    from engine.kernels import attention as kernel_attention

    model = load_model(_exl3_moe("gpt_oss", tmp_path), device="cuda", dtype="float16")
    mixers = [b.mixer for b in model.module.blocks]
    assert all(m.sinks is not None for m in mixers)
    assert [m.sliding_window for m in mixers] == [32, None]  # the prompts + 64 tokens pass 32
    kernel = kernel_attention.paged_decode_attention
    reference_attention = decode_attention.paged_decode_attention_reference
    errors = {32: [], None: []}  # by window
    calls = {"reference": 0}

    def checked_kernel(q, layer, tables, lengths, page, scale, window, softcap, sinks=None, **kwargs):
        out = kernel(q, layer, tables, lengths, page, scale, window, softcap, sinks=sinks, **kwargs)
        assert out is not None and sinks is not None
        exact = reference_attention(
            q.float(), layer, tables, lengths, page, scale, window, softcap, sinks.float()
        )
        errors[window].append(((out.float() - exact).norm() / exact.norm()).item())
        return out

    def counted_reference(*args, **kwargs):
        calls["reference"] += 1
        return reference_attention(*args, **kwargs)

    monkeypatch.setattr(kernel_attention, "paged_decode_attention", checked_kernel)
    monkeypatch.setattr(decode_attention, "paged_decode_attention_reference", counted_reference)
    _greedy(model, graphs=False)
    assert calls["reference"] == 0
    for window, errs in errors.items():  # one launch per layer and decode step: ~63 steps each
        assert len(errs) >= _NEW_TOKENS // 2, (window, len(errs))
        assert max(errs) < 2e-3, (window, max(errs))  # fp16 q and cache: the kernel tests' bound
