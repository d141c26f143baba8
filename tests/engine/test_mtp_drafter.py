"""Drafting with a checkpoint's own multi-token-prediction layer (``--draft mtp``) on tiny random
Qwen3.5 and DeepSeek-V3 models with an MTP layer added in the Hub's layout (tiny_mtp.py): its
drafts' distributions against an independent reference of the published maths, exact greedy
output with drafts, the errors for models without MTP layers, and a layer built to agree with
its model, whose drafts are kept."""

from __future__ import annotations

import pytest
import torch
from test_constraints import ByteTokenizer
from tiny_mtp import build_echo_mtp, build_with_mtp

from engine.cache.paged import PagedKVCache
from engine.errors import UsageError
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.sampling_settings import SamplingSettings
from engine.generation.speculative.drafter import DraftRequest, Observation
from engine.generation.speculative.factory import make_drafter
from engine.generation.speculative.mtp import MtpDrafter
from engine.generation.step import StepItem, run_step_with_hidden
from engine.model import load_model
from engine.options import EngineOptions

VARIANTS = ["Qwen3_5ForCausalLM", "Qwen3NextForCausalLM", "DeepseekV3ForCausalLM"]


@pytest.fixture(scope="module", params=VARIANTS)
def with_mtp(request, tmp_path_factory):
    """``(engine model, transformers model, reference of its MTP layer)``."""
    directory = tmp_path_factory.mktemp(request.param)
    hf, reference = build_with_mtp(request.param, directory)
    return load_model(directory, device="cpu"), hf, reference


def _prompts(lengths, seed=1, high=300):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, high, (n,), generator=g).tolist() for n in lengths]


def _prefill(model, prompt):
    """The engine's logits and final hidden states of ``prompt``, in one step."""
    cache = PagedKVCache.for_model(model.spec, 256, 16, model.dtype, model.device)
    slot = cache.state_slots.allocate() if cache.state_slots.count else None
    item = StepItem(prompt, 0, cache.pages.allocate(2), "last", state_slot=slot)
    (logits,), (hidden,) = run_step_with_hidden(model.module, cache, [item])
    return logits, hidden


def test_draft_distributions_match_the_published_maths(with_mtp):
    model, hf, reference = with_mtp
    (prompt,) = _prompts([21])
    logits, hidden = _prefill(model, prompt)
    with torch.no_grad():
        target = hf.model(torch.tensor([prompt])).last_hidden_state[0]
    # The hidden states handed over are those the LM head reads: after the final norm.
    torch.testing.assert_close(hidden, target, atol=1e-5, rtol=1e-5)
    _check_drafts(model, prompt, logits, hidden, reference)


def test_mimo_drafts_read_the_hidden_state_first(tmp_path):
    from tiny_more_families import build_mimo
    from tiny_mtp import mimo_reference

    build_mimo(tmp_path)
    model = load_model(tmp_path, device="cpu")
    (prompt,) = _prompts([17], seed=3)
    logits, hidden = _prefill(model, prompt)
    _check_drafts(model, prompt, logits, hidden, mimo_reference(tmp_path))


def _check_drafts(model, prompt, logits, target, reference) -> None:
    """The MTP drafter fed the prefill of ``prompt`` (its ``logits``, final hidden states
    ``target``) drafts 4 tokens at temperature 1, each from the distribution ``reference`` gives."""
    hidden = target
    tokens = prompt + [int(logits[-1].argmax())]
    drafter = MtpDrafter(model, 256, page_size=16)
    drafter.observe([Observation("job", tokens, 0, prompt, hidden)])
    (draft,) = drafter.propose([DraftRequest("job", tokens, 4, temperature=1.0, seed=3)])
    assert len(draft) == 4
    # The reference runs the MTP layer over the whole sequence each time: the target's hidden
    # states at the prompt's positions, then the hidden state each drafting step handed on.
    states, nexts = target, tokens[1:]
    for i in range(4):
        ref_logits, handed = reference.run(nexts, states)
        want = torch.log_softmax(ref_logits[-1], dim=-1)
        torch.testing.assert_close(draft.q[i].log(), want, atol=1e-4, rtol=1e-4)
        states, nexts = torch.cat([states, handed[-1:]]), nexts + [draft.tokens[i]]


def _jobs(prompts, new=40, stops=None):
    stops = stops or [()] * len(prompts)
    return [Job(p, new, stop_strings=s, stop_token_ids=()) for p, s in zip(prompts, stops)]


def test_greedy_with_mtp_drafts_gives_the_plain_tokens(with_mtp, tmp_path):
    model, _, _ = with_mtp
    tok = ByteTokenizer(tmp_path)
    prompts = _prompts([6, 37, 70], high=256)
    kw = dict(cache_tokens=1024, page_size=16, max_batch_size=3)
    plain = Generator(model, tok, **kw).generate(_jobs(prompts))
    # A stop string from the middle of two replies: the drafted run stops where plain decoding does.
    stops = [[r.text[len(r.text) // 2 :][:2]] if r.text[len(r.text) // 2 :][:2] else [] for r in plain]
    stops[0] = []
    want = Generator(model, tok, **kw).generate(_jobs(prompts, stops=stops))
    gen = Generator(model, tok, options=EngineOptions(draft="mtp", draft_tokens=3), **kw)
    assert gen.speculation.drafter.kind == "mtp"
    got = gen.generate(_jobs(prompts, stops=stops))
    assert [(r.token_ids, r.text, r.stop_reason) for r in got] == [
        (r.token_ids, r.text, r.stop_reason) for r in want
    ]
    assert any(r.stop_reason == "stop_string" for r in got)
    stats = gen.speculation.stats
    assert stats.drafted > 0
    assert gen.cache.pages.available == gen.cache.num_pages
    drafter = gen.speculation.drafter
    assert drafter.cache.pages.available == drafter.cache.num_pages  # forgotten with each job


def test_a_reused_prompt_prefix_still_drafts_exactly(with_mtp):
    # The second job's prompt starts with the first one's pages: the target skips them, and the
    # MTP layer's sequence starts where its hidden states do.
    model, _, _ = with_mtp
    (head,) = _prompts([40], seed=5)
    prompts = [head + [7, 8], head + [9, 10, 11]]
    kw = dict(cache_tokens=1024, page_size=16)
    plain = [Generator(model, **kw).generate(_jobs([p], new=24))[0] for p in prompts]
    gen = Generator(model, options=EngineOptions(draft="mtp", draft_tokens=2), **kw)
    first = gen.generate(_jobs(prompts[:1], new=24))[0]
    drafted = gen.speculation.stats.drafted
    second = gen.generate(_jobs(prompts[1:], new=24))[0]
    assert [first.token_ids, second.token_ids] == [r.token_ids for r in plain]
    assert second.cached_tokens > 0 and gen.speculation.stats.drafted > drafted > 0


def test_models_without_mtp_layers_say_so(llama, tiny_model_copy):
    with pytest.raises(UsageError, match="has no MTP heads in its config.json"):
        make_drafter("mtp", llama)
    llama.config.raw["num_nextn_predict_layers"] = 1  # declared, but Llama has no MTP layout
    try:
        with pytest.raises(UsageError, match="reading them is not supported for LlamaForCausalLM"):
            make_drafter("mtp", llama)
    finally:
        del llama.config.raw["num_nextn_predict_layers"]
    # Declared in config.json, absent from the weights (a checkpoint saved without them).
    import json

    directory = tiny_model_copy("Qwen3_5ForCausalLM")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    with pytest.raises(UsageError, match=r"weights lack them \('mtp.fc.weight' is missing"):
        make_drafter("mtp", load_model(directory, device="cpu"))


def test_an_mtp_layer_that_agrees_with_its_model_gets_its_drafts_kept(tmp_path):
    build_echo_mtp(tmp_path)
    model = load_model(tmp_path, device="cpu")
    prompts = _prompts([12, 30, 50], seed=2)
    kw = dict(cache_tokens=1024, page_size=16)
    plain = Generator(model, **kw).generate(_jobs(prompts, new=48))
    gen = Generator(model, options=EngineOptions(draft="mtp", draft_tokens=4), **kw)
    got = gen.generate(_jobs(prompts, new=48))
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    stats = gen.speculation.stats
    assert stats.acceptance_rate > 0.8, stats
    assert stats.tokens_per_step > 2.5, stats
    # Sampled: the drafts are drawn from the layer's own distribution, which is the model's here,
    # so the acceptance rule min(1, p / q) keeps nearly all of them.
    sampled = Job(prompts[1], 48, sampling=SamplingSettings(temperature=0.8, seed=4), stop_token_ids=())
    gen = Generator(model, options=EngineOptions(draft="mtp", draft_tokens=4), **kw)
    (result,) = gen.generate([sampled])
    assert result.new_tokens == 48 and gen.speculation.stats.acceptance_rate > 0.8, gen.speculation.stats
