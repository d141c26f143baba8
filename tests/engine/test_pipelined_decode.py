"""Pipelined greedy decode (the next step launched before the host reads the last one's tokens):
on the CPU it runs the same logic eagerly, so every scheduling case is checked against the
plain generator here; the GPU test (tests/cuda/test_cuda_graphs.py) checks it with graphs."""

from generation_cases import random_prompts

from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.sampling import SamplingSettings
from engine.options import EngineOptions


def _pair(llama, device_sampling=None, **kwargs):
    kwargs = {"cache_tokens": 1024, "page_size": 16, "max_batch_size": 4, **kwargs}
    piped = EngineOptions(pipelined_decode=True, sampling_on_device=device_sampling)
    plain = EngineOptions(pipelined_decode=False, sampling_on_device=device_sampling)
    return Generator(llama, options=piped, **kwargs), Generator(llama, options=plain, **kwargs)


def _summary(results):
    return [(r.token_ids, r.stop_reason, r.new_tokens) for r in results]


def test_pipelined_steps_actually_run(llama, monkeypatch):
    piped, _ = _pair(llama)
    landed = []
    original = Generator._land
    monkeypatch.setattr(Generator, "_land", lambda self: landed.append(1) or original(self))
    (result,) = piped.generate([Job(random_prompts([12])[0], max_new_tokens=10, stop_token_ids=())])
    assert result.new_tokens == 10
    assert len(landed) >= 8  # every decode token after the prefill came through a landing


def test_same_tokens_as_plain_decode_for_a_batch_of_lengths(llama):
    piped, plain = _pair(llama)
    ps = random_prompts([30, 5, 17, 44, 9])  # five jobs, batch of four: the fifth joins later
    limits = [12, 3, 1, 20, 7]
    jobs_a = [Job(p, max_new_tokens=n, stop_token_ids=()) for p, n in zip(ps, limits)]
    jobs_b = [Job(p, max_new_tokens=n, stop_token_ids=()) for p, n in zip(ps, limits)]
    assert _summary(piped.generate(jobs_a)) == _summary(plain.generate(jobs_b))
    assert piped.cache.pages.available == piped.cache.num_pages  # nothing leaked
    assert piped._flight is None


def test_stop_token_mid_pipeline(llama):
    piped, plain = _pair(llama)
    prompt = random_prompts([21], seed=3)[0]
    (free,) = plain.generate([Job(prompt, max_new_tokens=12, stop_token_ids=())])
    stop = free.token_ids[5]  # stops at (or before) the sixth new token
    a = piped.generate([Job(prompt, max_new_tokens=12, stop_token_ids=(stop,))])
    b = plain.generate([Job(prompt, max_new_tokens=12, stop_token_ids=(stop,))])
    assert _summary(a) == _summary(b) and a[0].stop_reason == "eos"
    assert piped.cache.pages.available == piped.cache.num_pages


def test_cancel_while_a_step_is_in_flight(llama):
    piped, _ = _pair(llama)
    p1, p2 = random_prompts([15, 25], seed=4)
    long_job = Job(p1, max_new_tokens=50, stop_token_ids=())
    other = Job(p2, max_new_tokens=6, stop_token_ids=())
    piped.enqueue(long_job)
    piped.enqueue(other)
    seen = []
    while len(seen) < 4:
        seen += [r for r in piped.iterate() if r.job is long_job]
    assert piped._flight is not None  # a step for both jobs is running
    piped.cancel(long_job)
    finished = []
    while piped.num_remaining_jobs:
        finished += [r for r in piped.iterate() if r.job is other and r.done]
    assert [r.new_tokens for r in finished] == [6]
    assert long_job not in piped._by_job
    # Afterwards the generator is clean and gives the plain generator's tokens.
    _, plain = _pair(llama)
    job = Job(p2, max_new_tokens=6, stop_token_ids=())
    assert _summary(piped.generate([job])) == _summary(plain.generate([Job(p2, 6, stop_token_ids=())]))
    assert piped.cache.pages.available == piped.cache.num_pages


def test_job_enqueued_mid_decode_joins_without_changing_tokens(llama):
    piped, plain = _pair(llama)
    p1, p2 = random_prompts([18, 33], seed=6)
    first = Job(p1, max_new_tokens=15, stop_token_ids=())
    piped.enqueue(first)
    out = {first: []}
    for _ in range(6):
        for r in piped.iterate():
            out[r.job] += r.token_ids
    second = Job(p2, max_new_tokens=9, stop_token_ids=())
    piped.enqueue(second)
    out[second] = []
    while piped.num_remaining_jobs:
        for r in piped.iterate():
            out[r.job] += r.token_ids
    ref = plain.generate([Job(p1, 15, stop_token_ids=()), Job(p2, 9, stop_token_ids=())])
    assert [out[first], out[second]] == [r.token_ids for r in ref]


def test_host_sampled_jobs_are_not_pipelined(llama):
    # Host sampling (device_sampling off) needs each step's logits on the host: no step in flight,
    # ever. (Device-sampled jobs are pipelined: tests/engine/test_pipelined_sampling.py.)
    piped, _ = _pair(llama, device_sampling=False)
    sampling = SamplingSettings(temperature=0.8, top_k=20, seed=1)
    job = Job(random_prompts([10])[0], max_new_tokens=5, stop_token_ids=(), sampling=sampling)
    piped.enqueue(job)
    new_tokens = 0
    while piped.num_remaining_jobs:
        new_tokens += sum(len(r.token_ids) for r in piped.iterate())
        assert piped._flight is None
    assert new_tokens == 5


def test_option_and_default(llama):
    # On the CPU (no graphs) the default is off; on a GPU it is on unless the options say off.
    assert Generator(llama, cache_tokens=256)._pipeline is False
    assert EngineOptions.from_environment({"TRELLIS_NO_PIPELINE": "1"}).pipelined_decode is False
    assert EngineOptions.from_environment({}).pipelined_decode is None  # where graphs run
    forced = EngineOptions(pipelined_decode=True)
    assert Generator(llama, cache_tokens=256, options=forced)._pipeline is True  # explicit wins
