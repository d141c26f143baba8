"""Tensor parallelism on the CPU (gloo, 2 and 4 processes): each rank's shard of a tiny model,
driven by rank 0 (this test's process), gives the single-process logits and greedy tokens."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from parallel_cases import assert_logits_close, greedy_jobs, step_logits

from engine.model import load_model
from engine.parallel.launch import RankFailedError, start_tensor_parallel

HYBRIDS = Path(__file__).parent.parent / "data" / "tiny-hybrids"


def _gqa_one_kv_head(tiny_model_factory, tmp_path_factory) -> Path:
    """A tiny Llama with one KV head for four query heads: it does not divide across 2 ranks."""
    import transformers as tf
    from tiny_models import COMMON, build_tiny_model

    directory = tmp_path_factory.mktemp("llama_one_kv_head")
    build_tiny_model(
        "LlamaForCausalLM", directory, config=tf.LlamaConfig(**{**COMMON, "num_key_value_heads": 1})
    )
    return directory


CASES = {
    # id: (model directory from the fixtures, ranks, EXL3 mode, cache bits)
    "dense-llama": (lambda f, t, e: f("LlamaForCausalLM")[0], 2, None, (16, 16)),
    "gqa-one-kv-head": (lambda f, t, e: _gqa_one_kv_head(f, t), 2, None, (16, 16)),
    "exl3-streaming": (lambda f, t, e: e() / "tiny-llama-exl3-4.0bpw-h6-mul1", 2, "streaming", (16, 16)),
    "moe": (lambda f, t, e: f("Qwen3MoeForCausalLM")[0], 2, None, (16, 16)),
    "hybrid-gated-delta-net": (lambda f, t, e: HYBRIDS / "qwen3_5", 2, None, (16, 16)),
    "quantized-cache": (lambda f, t, e: f("LlamaForCausalLM")[0], 2, None, (4, 6)),
}
SLOW_CASES = {
    "gqa-four-ranks": (lambda f, t, e: f("LlamaForCausalLM")[0], 4, None, (16, 16)),
    "hybrid-mamba2-one-group": (lambda f, t, e: HYBRIDS / "nemotron_h", 2, None, (16, 16)),  # replicated
    "hybrid-mamba2-split": (lambda f, t, e: f("NemotronHForCausalLM")[0], 2, None, (16, 16)),
    "exl3-dense-four-ranks": (lambda f, t, e: e() / "tiny-llama-exl3-4.0bpw-h6-mul1", 4, None, (16, 16)),
}
PARAMS = [pytest.param(k, id=k) for k in CASES] + [
    pytest.param(k, id=k, marks=pytest.mark.slow) for k in SLOW_CASES
]


@pytest.mark.parametrize("case", PARAMS)
def test_tp_matches_single_process(case, tiny_model_factory, tmp_path_factory, request) -> None:
    make_dir, world, exl3_mode, bits = {**CASES, **SLOW_CASES}[case]
    directory = make_dir(tiny_model_factory, tmp_path_factory, lambda: request.getfixturevalue("exl3_dir"))
    single = load_model(directory, device="cpu", exl3_mode=exl3_mode)
    reference_logits = step_logits(single, bits)
    reference_tokens, reference_cached = greedy_jobs(single, bits)
    del single
    model, run, _ = start_tensor_parallel(directory, world, device="cpu", exl3_mode=exl3_mode)
    with run:
        assert_logits_close(step_logits(model, bits), reference_logits)
        tokens, cached = greedy_jobs(model, bits)
    assert [len(t) for t in tokens] == [64, 64, 64]
    assert reference_cached > 0 and cached == reference_cached  # the late job reused pages
    assert tokens == reference_tokens


def test_exl3_split_keeps_tiles_where_blocks_allow(exl3_dir) -> None:
    """q/o and the MLP split on whole 128-blocks stay packed; k/v (one 64-wide head per rank)
    are decoded, and the report names them."""
    from engine.exl3.exl3_linear import EXL3Linear
    from engine.parallel.sharding import shard_model

    model = load_model(exl3_dir / "tiny-llama-exl3-4.0bpw-h6-mul1", device="cpu", exl3_mode="streaming")
    report = shard_model(model.module, 0, 2)
    attention = model.module.blocks[0].mixer.inner
    q, k, v = attention.qkv.linears
    assert isinstance(q, EXL3Linear) and not isinstance(k, EXL3Linear) and not isinstance(v, EXL3Linear)
    assert isinstance(attention.o_proj, EXL3Linear) and attention.o_proj.in_features == 128
    mlp = model.module.blocks[0].feed_forward.inner
    assert all(isinstance(linear, EXL3Linear) for linear in [*mlp.gate_up.linears, mlp.down])
    assert sorted(report.decoded) == sorted(
        f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in ("k", "v")
    )


def test_killed_rank_ends_the_run_and_a_new_one_starts(tiny_model_factory) -> None:
    from engine.generation.generator import Generator
    from engine.generation.job import Job

    directory = tiny_model_factory("LlamaForCausalLM")[0]
    model, run, _ = start_tensor_parallel(directory, 2, device="cpu")
    with pytest.raises(RankFailedError, match="rank 1 was killed") as caught:
        with run:
            gen = Generator(model, cache_tokens=2048, page_size=16, max_batch_size=2)
            gen.enqueue(Job(list(range(3, 30)), 1000, stop_token_ids=[]))
            for _ in range(5):
                gen.iterate()
            os.kill(run.pids[0], signal.SIGKILL)
            killed = time.monotonic()
            while gen.num_remaining_jobs:
                gen.iterate()
    assert time.monotonic() - killed < 5
    assert caught.value.rank == 1
    model, run, _ = start_tensor_parallel(directory, 2, device="cpu")  # the machine is usable again
    with run:
        (result,) = Generator(model, cache_tokens=256, page_size=16).generate(
            [Job([3, 4, 5], 4, stop_token_ids=[])]
        )
    assert len(result.token_ids) == 4


def test_a_run_left_open_ends_when_the_next_one_starts(tiny_model_factory) -> None:
    # The process group belongs to the process: a run dropped without close() must not leave the
    # next run unable to make its own.
    from engine.generation.generator import Generator
    from engine.generation.job import Job

    directory = tiny_model_factory("LlamaForCausalLM")[0]
    _, dropped, _ = start_tensor_parallel(directory, 2, device="cpu")
    model, run, _ = start_tensor_parallel(directory, 2, device="cpu")
    assert all(p.exitcode is not None for p in dropped.processes)
    with run:
        (result,) = Generator(model, cache_tokens=256, page_size=16).generate(
            [Job([3, 4, 5], 4, stop_token_ids=[])]
        )
    assert len(result.token_ids) == 4


def test_one_rank_is_the_single_process_model(tiny_model_factory, monkeypatch) -> None:
    """``--tp 1`` costs nothing: no process is started, no process group made, no step
    broadcast; the model is the one ``load_model`` gives, and so are its logits."""
    import argparse

    import torch.distributed as dist

    import engine.parallel.launch as launch
    from engine.modules.decoder import CausalLM
    from engine.parallel.command_line import parallel_model

    def refuse(*args, **kwargs):
        raise AssertionError("a run of one rank made a process or a process group")

    monkeypatch.setattr(launch.mp, "get_context", refuse)
    monkeypatch.setattr(launch.dist, "init_process_group", refuse)
    monkeypatch.setattr(launch.messages, "send", refuse)
    directory = tiny_model_factory("LlamaForCausalLM")[0]
    args = argparse.Namespace(tp=1, split_layers=None, model=str(directory), device="cpu")
    assert parallel_model(args, None, None) is None  # the CLI loads the model as without --tp
    model, run, report = start_tensor_parallel(directory, 1, device="cpu")
    with run:
        assert type(model.module) is CausalLM and model.cache_states is None
        assert report.lines() == []
        assert run.pids == [] and not dist.is_initialized()
        logits = step_logits(model)
    reference = step_logits(load_model(directory, device="cpu"))
    assert all(torch.equal(a, b) for a, b in zip(logits, reference))


def test_greedy_steps_gather_no_vocabulary_rows(tiny_model_factory, monkeypatch) -> None:
    """Plain greedy steps reduce each row to its best (value, id) across ranks: rank 0 never
    gathers a whole row (a gather is a collective: no rank does) and the tokens are the single
    process's; a sampled job's steps gather the rows."""
    import engine.parallel.vocab as vocab
    from engine.generation.generator import Generator
    from engine.generation.job import Job
    from engine.generation.sampling_settings import SamplingSettings

    directory = tiny_model_factory("LlamaForCausalLM")[0]
    prompts = [list(range(3, 40)), list(range(50, 61))]

    def greedy(model) -> list[list[int]]:
        gen = Generator(model, cache_tokens=512, page_size=16, max_batch_size=2)
        return [r.token_ids for r in gen.generate([Job(p, 24, stop_token_ids=[]) for p in prompts])]

    reference = greedy(load_model(directory, device="cpu"))
    gathered: list[torch.Size] = []
    real_gather = vocab.gather_to_leader
    monkeypatch.setattr(vocab, "gather_to_leader", lambda t: gathered.append(t.shape) or real_gather(t))
    model, run, _ = start_tensor_parallel(directory, 2, device="cpu")
    with run:
        assert greedy(model) == reference
        assert gathered == []
        sampled = SamplingSettings(temperature=0.8, seed=5)
        Generator(model, cache_tokens=512, page_size=16).generate(
            [Job(prompts[0], 4, stop_token_ids=[], sampling=sampled)]
        )
    assert gathered and all(shape[-1] == model.module.inner.lm_head.per_rank for shape in gathered)


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        "Phi3ForCausalLM",  # fused q/k/v and gate/up matrices
        "Qwen3NextForCausalLM",  # gated attention heads, a gated shared expert, head-grouped delta nets
        "DeepseekV3ForCausalLM",  # latent attention replicated, grouped expert choice
        "Gemma2ForCausalLM",  # soft-capping, sliding windows, sandwich norms
        "OlmoHybridForCausalLM",  # attention with a q/k norm across heads replicated, delta nets split
        "NemotronHForCausalLM",  # Mamba-2 split by its two groups
        "NemotronHForCausalLM-moe",  # a latent mixture of experts, replicated
    ],
)
def test_tp_logits_of_more_families(variant, tiny_model_factory) -> None:
    directory = tiny_model_factory(variant)[0]
    reference = step_logits(load_model(directory, device="cpu"))
    model, run, _ = start_tensor_parallel(directory, 2, device="cpu")
    with run:
        assert_logits_close(step_logits(model), reference)


def test_a_failed_step_stops_later_steps(tiny_model_factory) -> None:
    """A step that fails part way on rank 0 leaves the ranks' collectives unpaired: later steps
    refuse instead of running out of step with the other ranks, and leaving the run ends them."""
    from engine.generation.generator import Generator
    from engine.generation.job import Job

    class Broken(torch.nn.Module):
        def forward(self, x):
            raise ValueError("broken layer")

    model, run, _ = start_tensor_parallel(tiny_model_factory("LlamaForCausalLM")[0], 2, device="cpu")
    job = Job([3, 4, 5], 4, stop_token_ids=[])
    with pytest.raises(RuntimeError, match="failed earlier"), run:
        attention = model.module.inner.blocks[1].mixer.inner
        working, attention.o_proj = attention.o_proj, Broken()
        with pytest.raises(ValueError, match="broken layer"):
            Generator(model, cache_tokens=256, page_size=16).generate([job])
        attention.o_proj = working
        Generator(model, cache_tokens=256, page_size=16).generate([job])
    assert all(p.exitcode is not None for p in run.processes)
