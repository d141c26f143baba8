"""The Generator: continuous batching, prefix reuse, cancel, stop conditions (tiny models)."""

import pytest
import torch

from engine.cache.paged import PagedKVCache
from engine.errors import ContextOverflowError, SamplingSettingError, UsageError
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.sampling import SamplingSettings, active_processors
from engine.generation.step import score_tokens
from engine.options import EngineOptions


def prompts(n, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (length,), generator=g).tolist() for length in lengths[:n]]


def greedy_alone(model, prompt, n):
    """Reference greedy continuation: full recomputation each step, no generator."""
    seq = list(prompt)
    for _ in range(n):
        cache = PagedKVCache.for_model(model.spec, len(seq) + 1, page_size=16)
        seq.append(int(score_tokens(model.module, cache, seq)[-1].argmax()))
    return seq[len(prompt) :]


def test_continuous_batching_matches_single_runs(llama):
    gen = Generator(llama, cache_tokens=1024, page_size=16, max_chunk_tokens=24, max_batch_size=3)
    ps = prompts(4, [40, 7, 65, 20])
    jobs = [Job(p, max_new_tokens=8, stop_token_ids=()) for p in ps]
    results = gen.generate(jobs)  # 4 jobs, batch of 3: the fourth joins when one finishes
    for p, r in zip(ps, results):
        assert r.token_ids == greedy_alone(llama, p, 8)
        assert r.stop_reason == "max_new_tokens" and r.new_tokens == 8
    assert gen.cache.pages.available == gen.cache.num_pages  # every page returned


def test_prefix_reuse_prefills_only_new_tokens(llama):
    gen = Generator(llama, cache_tokens=512, page_size=16)
    turn1 = prompts(1, [50])[0]
    (r1,) = gen.generate([Job(turn1, max_new_tokens=6, stop_token_ids=())])
    # Next turn: the whole first turn (prompt + reply) plus a new user message.
    turn2 = turn1 + r1.token_ids + prompts(1, [9], seed=5)[0]
    before = gen.prefilled_tokens
    (r2,) = gen.generate([Job(turn2, max_new_tokens=6, stop_token_ids=())])
    full_pages = (len(turn1) + 6 - 1) // 16 * 16  # pages filled during turn 1 (last token not cached)
    assert r2.cached_tokens == full_pages == 48
    assert gen.prefilled_tokens - before == len(turn2) - r2.cached_tokens
    cold = Generator(llama, cache_tokens=512, page_size=16)
    (r_cold,) = cold.generate([Job(turn2, max_new_tokens=6, stop_token_ids=())])
    assert r_cold.cached_tokens == 0
    assert r2.token_ids == r_cold.token_ids


def test_prefix_reuse_logits_match_cold_run(llama):
    """Logits of a job that starts on cached pages equal a cold computation."""
    cache = PagedKVCache.for_model(llama.spec, 256, page_size=16)
    gen = Generator(llama, cache=cache)
    base = prompts(1, [40])[0]
    gen.generate([Job(base, max_new_tokens=1, stop_token_ids=())])
    extended = base + [5, 6, 7]
    job = Job(extended, max_new_tokens=1, stop_token_ids=(), sampling=SamplingSettings.greedy())
    gen.enqueue(job)
    gen._admit()
    run = gen._by_job[job]
    assert run.cached_tokens == 32
    from engine.generation.step import StepItem, run_step

    (warm,) = run_step(llama.module, cache, [StepItem(extended[32:], 32, run.pages, "all")])
    cold = score_tokens(llama.module, PagedKVCache.for_model(llama.spec, 64, page_size=16), extended)[32:]
    assert torch.allclose(warm, cold, atol=1e-5, rtol=1e-5)
    gen.cancel(job)


def test_cancel_frees_pages(llama):
    gen = Generator(llama, cache_tokens=256, page_size=16)
    job = Job(prompts(1, [30])[0], max_new_tokens=100, stop_token_ids=())
    gen.enqueue(job)
    gen.iterate()
    assert gen.cache.pages.available < gen.cache.num_pages
    gen.cancel(job)
    assert gen.num_remaining_jobs == 0
    assert gen.cache.pages.available == gen.cache.num_pages


def test_eos_stops(llama):
    p = prompts(1, [12])[0]
    first = greedy_alone(llama, p, 1)[0]
    gen = Generator(llama, cache_tokens=128, page_size=16)
    (r,) = gen.generate([Job(p, max_new_tokens=10, stop_token_ids=[first])])
    assert r.stop_reason == "eos" and r.token_ids == [first]


def test_prompt_longer_than_cache_is_a_clear_error(llama):
    gen = Generator(llama, cache_tokens=64, page_size=16)
    with pytest.raises(ContextOverflowError, match="does not fit the cache of 64 tokens"):
        gen.enqueue(Job(list(range(3, 100)), max_new_tokens=4))


def test_generation_stops_at_cache_capacity(llama):
    gen = Generator(llama, cache_tokens=64, page_size=16)
    (r,) = gen.generate([Job(list(range(3, 60)), max_new_tokens=50, stop_token_ids=())])
    # Cut by the context, not by the budget of 50: the reason says which.
    assert r.new_tokens == 64 - 57 and r.stop_reason == "context_length"
    assert gen.context_length == 64


def test_a_budget_that_ends_exactly_at_the_context_reports_the_context(llama):
    # Both limits fall on the same token: the full context wins (a larger budget would not help).
    gen = Generator(llama, cache_tokens=64, page_size=16)
    (exact, under) = gen.generate(
        [
            Job(list(range(3, 60)), max_new_tokens=7, stop_token_ids=()),
            Job(list(range(3, 60)), max_new_tokens=6, stop_token_ids=()),
        ]
    )
    assert (exact.new_tokens, exact.stop_reason) == (7, "context_length")
    assert (under.new_tokens, under.stop_reason) == (6, "max_new_tokens")


@pytest.mark.parametrize("budget", [0, -5, 2.5, None, True])
def test_a_job_without_a_positive_budget_is_refused(llama, budget):
    # 0 used to generate one token anyway, and a negative budget failed deep in the cache.
    gen = Generator(llama, cache_tokens=64, page_size=16)
    with pytest.raises(UsageError, match=f"max_new_tokens must be a whole number >= 1, got {budget!r}"):
        gen.enqueue(Job([5, 6, 7], max_new_tokens=budget))
    assert gen.num_remaining_jobs == 0 and gen.cache.pages.available == gen.cache.num_pages


def test_bad_sampling_settings_are_refused_at_enqueue(llama):
    gen = Generator(llama, cache_tokens=64, page_size=16)
    with pytest.raises(SamplingSettingError, match="top_p"):
        gen.enqueue(Job([5, 6, 7], max_new_tokens=4, sampling=SamplingSettings(top_p=float("nan"))))
    # Checked before the context: the settings are what the caller must fix first.
    with pytest.raises(SamplingSettingError, match="temperature"):
        gen.enqueue(Job(list(range(3, 100)), max_new_tokens=4, sampling=SamplingSettings(temperature=-1)))
    with pytest.raises(UsageError, match="at least one input token"):
        gen.enqueue(Job([], max_new_tokens=4))
    assert gen.num_remaining_jobs == 0


def test_plain_greedy_takes_the_batched_argmax_and_matches_the_sampler(llama, monkeypatch):
    import engine.generation.generator as generator_module

    ps = prompts(3, [30, 9, 50], seed=3)
    calls = []
    real = generator_module._argmax_rows
    monkeypatch.setattr(generator_module, "_argmax_rows", lambda rows: calls.append(len(rows)) or real(rows))
    fast = Generator(llama, cache_tokens=1024, page_size=16).generate(
        [Job(p, max_new_tokens=10, stop_token_ids=()) for p in ps]
    )
    assert calls and max(calls) == 3  # one batched argmax per step, all three rows at once
    # The same jobs through the per-row sampler (the argmax shortcut disabled) give the same tokens.
    monkeypatch.setattr(generator_module, "_argmax_rows", lambda rows: {})
    slow = Generator(llama, cache_tokens=1024, page_size=16).generate(
        [Job(p, max_new_tokens=10, stop_token_ids=()) for p in ps]
    )
    assert [r.token_ids for r in fast] == [r.token_ids for r in slow]


def test_penalised_or_sampled_jobs_use_the_sampler(llama, monkeypatch):
    import engine.generation.generator as generator_module

    monkeypatch.setattr(generator_module, "_argmax_rows", lambda rows: pytest.fail("argmax shortcut used"))
    jobs = [
        Job(prompts(1, [12])[0], 6, SamplingSettings(temperature=0.0, repetition_penalty=1.3)),
        Job(prompts(1, [12], seed=1)[0], 6, SamplingSettings(temperature=0.8, seed=1), stop_token_ids=()),
    ]
    results = Generator(llama, cache_tokens=1024, page_size=16).generate(jobs)
    assert all(len(r.token_ids) == 6 for r in results)
    assert not active_processors(SamplingSettings.greedy())
    assert active_processors(SamplingSettings(temperature=0.0, presence_penalty=0.5))


@pytest.mark.parametrize("sampled", [False, True])
def test_batched_decode_steps_give_the_same_tokens(llama, monkeypatch, sampled):
    """Decode steps through the fixed-shape path (the GPU's eager path beyond the graphs' rows)
    give each job the tokens the row-by-row path gives it."""
    import engine.generation.generator as generator_mod

    calls = []
    real = generator_mod.run_decode_step
    monkeypatch.setattr(
        generator_mod, "run_decode_step", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k)
    )
    ps = prompts(5, [30, 7, 45, 12, 20])
    greedy = SamplingSettings.greedy()
    sampling = SamplingSettings(temperature=0.9, top_p=0.95, seed=11) if sampled else greedy

    def run(batched):
        options = EngineOptions(batched_decode=batched)
        gen = Generator(llama, cache_tokens=1024, page_size=16, max_batch_size=4, options=options)
        return [r.token_ids for r in gen.generate([Job(p, 10, sampling, stop_token_ids=()) for p in ps])]

    row_by_row = run(False)
    assert not calls
    assert run(True) == row_by_row
    assert calls and max(calls) == 4  # decode steps of up to 4 rows went the batched way


def test_a_constrained_reply_cut_by_the_context_is_reported_incomplete(exl3_dir):
    from engine.generation import constraints
    from engine.model import load_model
    from engine.tokenizer import Tokenizer

    directory = exl3_dir / "tiny-llama-hf"  # a real tokenizer, which a constraint needs
    model = load_model(directory, device="cpu", dtype="float32")
    gen = Generator(model, Tokenizer.from_dir(directory), cache_tokens=32, page_size=16)
    job = Job(list(range(3, 28)), max_new_tokens=50, constraint=constraints.regex("[a-z]{100}"))
    (r,) = gen.generate([job])
    assert r.new_tokens == 32 - 25 and r.stop_reason == "context_length"
    assert "incomplete: generation stopped (context_length)" in r.error
