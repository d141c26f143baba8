"""A verify step as decode rows: a token and ``k`` drafted ones run as ``1 + k`` single-token
rows of the fixed-shape decode path (the shape CUDA graphs replay), with the logits of the
prefill-style step that computes them together."""

from __future__ import annotations

import pytest
import torch
from drafters import OracleDrafter

from engine.cache.paged import PagedKVCache
from engine.generation.decode_inputs import decode_rows, run_decode_step
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import StepItem, run_step
from engine.options import EngineOptions


def _cache(model) -> PagedKVCache:
    return PagedKVCache.for_model(model.spec, 512, 16, model.dtype, model.device, (16, 16), 4)


def _prefilled(model, prompts):
    """A cache holding ``prompts``, and each prompt's pages."""
    cache = _cache(model)
    tables = []
    for prompt in prompts:
        pages = cache.pages.allocate(4)
        run_step(model.module, cache, [StepItem(prompt, 0, pages, None)])
        tables.append(pages)
    return cache, tables


def test_decode_rows_expand_verify_items_and_refuse_the_rest():
    decode = StepItem([5], 7, [0])
    verify = StepItem([5, 6, 7], 7, [0, 1], logits=3)
    rows, spans = decode_rows([decode, verify])
    assert spans == [(0, 1), (1, 4)]
    assert [(r.tokens, r.past, r.logits) for r in rows[1:]] == [
        ([5], 7, "last"),
        ([6], 8, "last"),
        ([7], 9, "last"),
    ]
    assert all(r.block_table == [0, 1] for r in rows[1:])
    assert decode_rows([StepItem([5, 6], 7, [0])]) is None  # two tokens, one logit row: a chunk
    assert decode_rows([StepItem([5, 6], 7, [0], logits=2, state_slot=1)]) is None  # recurrent state
    assert decode_rows([StepItem([5, 6], 7, [0], logits="all")]) is None


@pytest.mark.parametrize("k", [1, 3, 8])
def test_verify_rows_give_the_verify_steps_logits(llama, k):
    g = torch.Generator().manual_seed(k)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 30)]
    draft = torch.randint(3, 300, (k + 1,), generator=g).tolist()

    def items(tables):
        return [
            StepItem([prompts[0][-1]], len(prompts[0]) - 1, tables[0]),
            StepItem(draft, len(prompts[1]) - 1, tables[1], logits=k + 1),
        ]

    results = []
    for step in (run_step, run_decode_step):
        cache, tables = _prefilled(llama, [p[:-1] for p in prompts])
        verified = step(llama.module, cache, items(tables))
        # The next step reads the keys and values the verify step wrote for every drafted token.
        (after,) = run_step(llama.module, cache, [StepItem([11], len(prompts[1]) + k, tables[1])])
        results.append([*verified, after])
    expected, got = results
    assert [t.shape for t in got] == [
        (1, llama.spec.vocab_size),
        (k + 1, llama.spec.vocab_size),
        (1, llama.spec.vocab_size),
    ]
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_drafted_greedy_through_decode_rows_gives_plain_tokens(llama):
    # batched_decode: verify steps that no graph replays go through the decode rows (as on a GPU).
    options = EngineOptions(batched_decode=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 40, 17)]

    def jobs():
        return [Job(p, 24, stop_token_ids=()) for p in prompts]

    plain = Generator(llama, cache_tokens=1024, page_size=16, options=options).generate(jobs())
    answers = {tuple(p): r.token_ids for p, r in zip(prompts, plain)}
    gen = Generator(
        llama, cache_tokens=1024, page_size=16, options=options, drafter=OracleDrafter(answers, 0.3)
    )
    drafted = gen.generate(jobs())
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert 0 < gen.speculation.stats.accepted < gen.speculation.stats.drafted
