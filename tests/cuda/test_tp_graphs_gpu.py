"""Tensor-parallel decode through CUDA graphs with the NCCL collectives captured: the same greedy
tokens as one process, and the decode steps really replayed from graphs.

A run of one rank in a real NCCL process group (``start_tensor_parallel(..., group_of_one=True)``)
runs on one GPU: the model sharded whole, its all-reduces issued and captured as with more
ranks. The two-GPU case runs where two GPUs are visible."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.cache.paged import PagedKVCache
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import score_tokens
from engine.model import load_model
from engine.options import EngineOptions

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from generation_cases import random_prompts  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.cuda


def _greedy(model, tokens: int, lengths=(37, 20, 9)) -> tuple[list[list[int]], Generator]:
    """Greedy jobs batched together (3 rows: the 4-row graph with padding), graphs on."""
    options = dataclasses.replace(EngineOptions(), cuda_graphs=True)
    gen = Generator(model, cache_tokens=1024, page_size=16, max_batch_size=4, options=options)
    jobs = [Job(p, tokens, stop_token_ids=[]) for p in random_prompts(list(lengths), seed=5)]
    results = gen.generate(jobs)
    return [r.token_ids for r in results], gen


def _assert_same_tokens(model, prompts, ours, reference, tie: float) -> None:
    """Equal tokens, or a divergence only at a near tie of the reference's logits (another
    kernel order rounds the other way there, and the rest of the sequence follows)."""
    for prompt, a, b in zip(prompts, reference, ours):
        if a == b:
            continue
        i = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        cache = PagedKVCache.for_model(model.spec, 1024, page_size=16, dtype=model.dtype, device="cuda")
        logits = score_tokens(model.module, cache, list(prompt) + a[:i])[-1]
        gap = (logits[a[i]] - logits[b[i]]).abs().item()
        assert gap < tie * logits.abs().max().item(), f"diverged at token {i} with a margin of {gap}"


def _count_captured_all_reduces(monkeypatch) -> list[int]:
    """A list that grows by one for each all-reduce issued while a CUDA graph is being captured."""
    captured: list[int] = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            captured.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting)
    return captured


def _one_rank_case(request, case: str) -> tuple[Path, str | None, str]:
    if case == "dense-llama":
        directory = request.getfixturevalue("tmp_path")
        build_tiny_model("LlamaForCausalLM", directory)
        return directory, None, "float32"
    request.getfixturevalue("cuda_extension")  # streaming EXL3 runs on the extension's kernels
    return request.getfixturevalue("exl3_dir") / "tiny-llama-exl3-4.0bpw-h6-mul1", "streaming", "float16"


@pytest.mark.parametrize("case", ["dense-llama", "exl3-streaming"])
def test_one_rank_nccl_graphs_match_the_single_process(case, request, monkeypatch) -> None:
    from engine.parallel.launch import start_tensor_parallel

    directory, exl3_mode, dtype = _one_rank_case(request, case)
    single = load_model(directory, device="cuda", dtype=dtype, exl3_mode=exl3_mode)
    reference, _ = _greedy(single, 32)
    prompts = random_prompts([37, 20, 9], seed=5)
    captured = _count_captured_all_reduces(monkeypatch)
    model, run, _ = start_tensor_parallel(
        directory, 1, device="cuda", dtype=dtype, exl3_mode=exl3_mode, group_of_one=True
    )
    with run:
        assert dist.get_backend() == "nccl" and dist.get_world_size() == 1
        tokens, gen = _greedy(model, 32)
        graphs = gen._graphs
        assert graphs is not None and graphs.failed is None, graphs.failed
        assert graphs.captured and graphs.replays >= 28, (graphs.captured, graphs.replays)
        del gen, graphs  # the graphs (their NCCL launches) go before the process group does
        torch.cuda.synchronize()
    # Two sums per layer (attention, MLP) and the embedding's, in each captured graph.
    layers = len(single.module.blocks)
    assert len(captured) >= 2 * layers + 1, captured
    assert [len(t) for t in tokens] == [32] * 3
    if dtype == "float32":
        assert tokens == reference
    else:
        _assert_same_tokens(single, prompts, tokens, reference, tie=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("variant", ["LlamaForCausalLM", "Qwen3MoeForCausalLM"])
def test_tp_two_gpus_graphs_match_one(variant, tmp_path) -> None:
    """Two ranks replay the same graphs (a dense model), or run every decode step eagerly alike
    (a mixture whose experts are dealt across ranks: its step's work depends on the router)."""
    from engine.parallel.launch import start_tensor_parallel

    build_tiny_model(variant, tmp_path)
    single = load_model(tmp_path, device="cuda", dtype="float32")
    reference, _ = _greedy(single, 64)
    del single
    model, run, _ = start_tensor_parallel(tmp_path, 2, device="cuda", dtype="float32")
    with run:
        tokens, gen = _greedy(model, 64)
        if model.module.dynamic_decode is None:
            assert gen._graphs is not None and gen._graphs.failed is None, gen._graphs.failed
            assert gen._graphs.captured and gen._graphs.replays >= 60
        else:
            assert gen._graphs is None
        del gen
        torch.cuda.synchronize()
    assert tokens == reference
