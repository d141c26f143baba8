"""Helpers shared by the tensor-parallel and layer-split tests: the same steps and jobs run on a
single-process model and on a parallel one, so their logits and tokens can be compared."""

from __future__ import annotations

import torch
from generation_cases import random_prompts

from engine.cache.paged import PagedKVCache
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import StepItem, run_step


def step_logits(model, cache_bits=(16, 16)) -> list[torch.Tensor]:
    """Logits of a two-sequence prefill (every row) and of the decode step after it."""
    cache = PagedKVCache.for_model(
        model.spec,
        512,
        16,
        model.dtype,
        model.device,
        cache_bits,
        states=model.cache_states,
        devices=model.layer_devices,
    )
    prompts = random_prompts([37, 20], seed=1)
    pages = [cache.pages.allocate(4) for _ in prompts]
    slots = [cache.state_slots.allocate() for _ in prompts]
    prefill = [StepItem(p, 0, pg, "all", state_slot=s) for p, pg, s in zip(prompts, pages, slots)]
    first = run_step(model.module, cache, prefill)
    decode = [StepItem([7], len(p), pg, "last", state_slot=s) for p, pg, s in zip(prompts, pages, slots)]
    second = run_step(model.module, cache, decode)
    return [*first, *second]


def assert_logits_close(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    """Within 1e-5 of the logits' scale (the sums across ranks round in another order)."""
    for a, b in zip(ours, reference):
        assert a.shape == b.shape
        scale = max(1.0, b.abs().max().item())
        assert (a - b).abs().max().item() <= 1e-5 * scale


def greedy_jobs(model, cache_bits=(16, 16), tokens: int = 64) -> tuple[list[list[int]], int]:
    """Three greedy jobs of ``tokens`` tokens, batched continuously: two from the start, a third
    joining later whose prompt begins with the first one's (served from its cached pages).
    Returns each job's tokens and the third job's cached prompt tokens."""
    gen = Generator(model, cache_tokens=1024, page_size=16, max_batch_size=3, cache_bits=cache_bits)
    a, b, tail = random_prompts([45, 30, 12], seed=3)
    jobs = [Job(a, tokens, stop_token_ids=[]), Job(b, tokens, stop_token_ids=[])]
    late = Job(a[:40] + tail, tokens, stop_token_ids=[])
    for job in jobs:
        gen.enqueue(job)
    out: dict = {job: [] for job in [*jobs, late]}
    cached = 0
    steps = 0
    while gen.num_remaining_jobs:
        for r in gen.iterate():
            out[r.job] += r.token_ids
            if r.job is late:
                cached = r.cached_tokens
        steps += 1
        if steps == 6:
            gen.enqueue(late)
    return [out[job] for job in [*jobs, late]], cached
