"""Pipelined sampled decode (the next step launched from the last one's tokens still on the device,
drawn with those tokens as the sampler's pending tokens): on the CPU the generator runs the same
logic eagerly (``pipelined_decode=True`` forced, the torch reference as the device sampler), so seeded jobs
must give the tokens of the unpipelined path, whatever the batch. The GPU test
(tests/cuda/test_pipelined_sampling_gpu.py) checks it with CUDA graphs and the kernel."""

import pytest
import torch
from generation_cases import SAMPLED_SETTINGS, random_prompts

from engine.generation import generator as generator_mod
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.sampling import SamplingSettings
from engine.options import EngineOptions

SETTINGS = SAMPLED_SETTINGS


def _generator(llama, pipeline: bool, device_sampling: bool = True, **kwargs) -> Generator:
    kwargs = {"cache_tokens": 1024, "page_size": 16, "max_batch_size": 4, **kwargs}
    options = EngineOptions(pipelined_decode=pipeline, sampling_on_device=device_sampling)
    return Generator(llama, options=options, **kwargs)


def _jobs(settings, limits=(12, 7, 15, 10, 9), stop=(), seed=0):
    prompts = random_prompts([9, 30, 4, 17, 12][: len(settings)], seed)
    cases = zip(prompts, limits, settings)
    return [Job(p, max_new_tokens=n, sampling=s, stop_token_ids=stop) for p, n, s in cases]


def _summary(results):
    return [(r.token_ids, r.stop_reason, r.new_tokens) for r in results]


@pytest.fixture
def landings(monkeypatch):
    """The sampled flights that landed, and the pending tensors the draws were given."""
    seen = {"sampled": 0, "pending": 0}
    land, draw = Generator._land, generator_mod._draw_rows

    def counting_land(self):
        seen["sampled"] += self._flight.sampled
        return land(self)

    def counting_draw(runs, logits, pending=None):
        seen["pending"] += pending is not None
        return draw(runs, logits, pending)

    monkeypatch.setattr(Generator, "_land", counting_land)
    monkeypatch.setattr(generator_mod, "_draw_rows", counting_draw)
    return seen


def test_pipelined_sampling_gives_the_unpipelined_tokens(llama, landings):
    piped = _generator(llama, pipeline=True)
    a = piped.generate(_jobs(SETTINGS))  # five jobs, batch of four: the fifth joins later
    assert landings["sampled"] >= 6 and landings["pending"] >= 5  # the pipeline really ran
    b = _generator(llama, pipeline=False).generate(_jobs(SETTINGS))
    host = _generator(llama, pipeline=False, device_sampling=False).generate(_jobs(SETTINGS))
    assert _summary(a) == _summary(b) == _summary(host)
    assert [r.new_tokens for r in a] == [12, 7, 15, 10, 9]
    assert piped.cache.pages.available == piped.cache.num_pages and piped._flight is None


def test_without_the_pending_token_the_penalties_would_differ(llama, monkeypatch):
    # The check above must be able to fail: drop the pending token and the penalised jobs change.
    want = _summary(_generator(llama, pipeline=False).generate(_jobs(SETTINGS)))
    original = generator_mod.sample_reference  # what the CPU draws with (no kernel there)
    monkeypatch.setattr(
        generator_mod, "sample_reference", lambda logits, rows, u, pending=None: original(logits, rows, u)
    )
    assert _summary(_generator(llama, pipeline=True).generate(_jobs(SETTINGS))) != want


def test_stop_tokens_and_different_lengths(llama, landings):
    free = _generator(llama, pipeline=False).generate(_jobs(SETTINGS[:4], limits=(14, 14, 14, 14)))
    stop = (free[0].token_ids[4], free[2].token_ids[6])  # ends job 0 early, maybe others
    limits = (14, 3, 20, 1)
    a = _generator(llama, pipeline=True).generate(_jobs(SETTINGS[:4], limits, stop))
    b = _generator(llama, pipeline=False).generate(_jobs(SETTINGS[:4], limits, stop))
    assert _summary(a) == _summary(b)
    assert a[0].stop_reason == "eos" and len(a[0].token_ids) <= 5
    assert landings["sampled"] > 0


def test_mixed_greedy_and_sampled_rows_pipeline_together(llama, landings):
    settings = [SamplingSettings.greedy(), SETTINGS[0], SamplingSettings.greedy(), SETTINGS[2]]
    a = _generator(llama, pipeline=True).generate(_jobs(settings, seed=2))
    assert landings["sampled"] >= 10  # one sampled flight for the whole batch
    b = _generator(llama, pipeline=False).generate(_jobs(settings, seed=2))
    assert _summary(a) == _summary(b)
    # The greedy rows are the plain greedy generator's tokens too.
    plain = _generator(llama, pipeline=False).generate(_jobs([settings[0]] * 4, seed=2))
    assert a[0].token_ids == plain[0].token_ids and a[2].token_ids == plain[2].token_ids


def test_many_seeded_batches(llama):
    g = torch.Generator().manual_seed(11)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    for trial in range(4):
        settings = [
            SamplingSettings(
                temperature=pick([0.0, 0.5, 1.0, 1.5]),
                top_k=pick([0, 5, 50]),
                top_p=pick([1.0, 0.8]),
                min_p=pick([0.0, 0.1]),
                repetition_penalty=pick([1.0, 1.5, 3.0]),
                presence_penalty=pick([0.0, 1.0]),
                frequency_penalty=pick([0.0, 0.6]),
                seed=trial * 10 + i,
            )
            for i in range(5)
        ]
        limits = [int(torch.randint(1, 16, (1,), generator=g)) for _ in range(5)]
        a = _generator(llama, pipeline=True).generate(_jobs(settings, limits, seed=trial))
        b = _generator(llama, pipeline=False).generate(_jobs(settings, limits, seed=trial))
        assert _summary(a) == _summary(b), trial


def test_cancel_while_a_sampled_step_is_in_flight(llama):
    piped = _generator(llama, pipeline=True)
    long_job, other = _jobs(SETTINGS[:2], limits=(50, 6))
    piped.enqueue(long_job)
    piped.enqueue(other)
    got, tokens = [], []

    def step():
        for r in piped.iterate():
            (got if r.job is long_job else tokens).extend(r.token_ids)

    while len(got) < 4:
        step()
    assert piped._flight is not None and piped._flight.sampled
    piped.cancel(long_job)
    while piped.num_remaining_jobs:
        step()
    (want,) = _generator(llama, pipeline=False).generate([_jobs(SETTINGS[:2], limits=(50, 6))[1]])
    assert tokens == want.token_ids
    assert piped.cache.pages.available == piped.cache.num_pages


def test_host_sampling_stays_unpipelined(llama, landings):
    (r,) = _generator(llama, pipeline=True, device_sampling=False).generate(_jobs(SETTINGS[:1]))
    assert r.new_tokens == 12 and landings["sampled"] == 0
