"""DRY, XTC, top-n-sigma, typical-p and banned strings: each changes what is drawn as its
definition says, and each test fails without the sampler (the same draw with it off differs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from chi_square import goodness_of_fit

from engine.cache.paged import PagedKVCache
from engine.errors import SamplingSettingError, UsageError
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.samplers.banned_strings import BannedStringGuard
from engine.generation.samplers.dry import dry_penalties
from engine.generation.sampling import Sampler, SamplingSettings, active_processors
from engine.generation.speculative.ngram import NgramDrafter
from engine.generation.step import score_tokens
from engine.model import load_model

TRAINED = Path(__file__).parents[1] / "data" / "tiny-hybrids" / "qwen3_5"


def _longest_repeat(ids: list[int]) -> int:
    """The longest n such that some n tokens occur twice in ``ids``."""
    n = 0
    while True:
        grams = [tuple(ids[i : i + n + 1]) for i in range(len(ids) - n)]
        if len(set(grams)) == len(grams):
            return n
        n += 1


# -- DRY -------------------------------------------------------------------------------------


def test_dry_penalises_the_token_that_extends_a_repeat() -> None:
    context = [5, 6, 7, 8, 1, 5, 6, 7]  # "5 6 7" again: 8 would make it 4 long
    amounts = dry_penalties(context, multiplier=0.8, base=1.75, allowed_length=2)
    assert amounts == pytest.approx({8: 0.8 * 1.75 ** (3 - 2)})
    assert dry_penalties(context, 0.8, 1.75, allowed_length=4) == {}  # a repeat of 3 is allowed
    assert dry_penalties(context, 0.8, 1.75, 2, breakers={6}) == {}  # a breaker ends the match
    assert dry_penalties([5, 5, 5, 5], 1.0, 2.0, 2) == pytest.approx({5: 2.0})  # "5 5 5" again


def test_dry_breaks_a_forced_loop_in_the_sampler() -> None:
    # A "model" that always prefers to continue the cycle 1 2 3 by a margin of 3: without DRY
    # the cycle never ends, with it the repeat grows a penalty that soon outweighs the margin.
    def run(settings: SamplingSettings) -> list[int]:
        sampler = Sampler(settings)
        tokens = [1, 2, 3]
        for _ in range(30):
            logits = torch.zeros(10)
            logits[tokens[-3]] = 3.0  # the token that continues the cycle
            tokens.append(sampler.sample(logits, tokens, tokens[3:]))
        return tokens

    assert _longest_repeat(run(SamplingSettings.greedy())) == 30
    looped = run(SamplingSettings(temperature=0.0, dry_multiplier=0.8))
    assert _longest_repeat(looped) <= 6


@pytest.mark.slow
def test_dry_breaks_a_greedy_repetition_loop_of_a_trained_model() -> None:
    from engine.tokenizer import Tokenizer

    model, tok = load_model(TRAINED, device="cpu"), Tokenizer.from_dir(TRAINED)
    prompt = tok.encode("Once upon a time, the old man")

    def reply(multiplier: float) -> list[int]:
        gen = Generator(model, tok, cache_tokens=1024, page_size=16)
        settings = SamplingSettings(temperature=0.0, dry_multiplier=multiplier)
        return gen.generate([Job(prompt, 120, settings)])[0].token_ids

    assert _longest_repeat(reply(0.0)) >= 12  # it quotes itself, 19 tokens at a time
    assert _longest_repeat(reply(0.8)) <= 8


# -- XTC, top-n-sigma, typical-p ------------------------------------------------------------

PROBS = torch.tensor([0.45, 0.3, 0.15, 0.07, 0.03])
LOGITS = PROBS.log()


def _counts(settings: SamplingSettings, n: int = 3000) -> torch.Tensor:
    sampler = Sampler(settings)
    counts = torch.zeros(len(PROBS))
    for _ in range(n):
        counts[sampler.sample(LOGITS, [1], [])] += 1
    return counts


def test_xtc_removes_the_top_choices_but_the_least_likely_of_them() -> None:
    counts = _counts(SamplingSettings(temperature=1.0, xtc_threshold=0.1, xtc_probability=1.0, seed=1))
    assert counts[0] == counts[1] == 0  # 0.45 and 0.3 are above 0.1; 0.15 is the least of those kept
    assert goodness_of_fit(counts, torch.tensor([0, 0, 0.15, 0.07, 0.03])) >= 1e-3
    half = _counts(SamplingSettings(temperature=1.0, xtc_threshold=0.1, xtc_probability=0.5, seed=1))
    mixture = 0.5 * PROBS + 0.5 * torch.tensor([0, 0, 0.15, 0.07, 0.03]) / 0.25
    assert goodness_of_fit(half, mixture) >= 1e-3
    plain = _counts(SamplingSettings(temperature=1.0, seed=1))
    assert plain[0] > 1000  # without XTC the likeliest token is drawn most


def test_xtc_leaves_a_single_likely_token_alone() -> None:
    counts = _counts(SamplingSettings(temperature=1.0, xtc_threshold=0.35, xtc_probability=1.0, seed=2))
    assert goodness_of_fit(counts, PROBS) >= 1e-3  # only 0.45 reaches 0.35: nothing changes


def test_top_n_sigma_keeps_tokens_within_n_deviations_of_the_best() -> None:
    finite = LOGITS
    cut = finite.max() - 1.0 * finite.std(unbiased=False)
    kept = (LOGITS >= cut).float() * PROBS
    counts = _counts(SamplingSettings(temperature=1.0, top_n_sigma=1.0, seed=3))
    assert counts[kept == 0].sum() == 0 and 0 < int((kept > 0).sum()) < len(PROBS)
    assert goodness_of_fit(counts, kept) >= 1e-3


def test_typical_p_keeps_the_tokens_nearest_the_entropy() -> None:
    entropy = -(PROBS * PROBS.log()).sum()
    order = (-PROBS.log() - entropy).abs().argsort()
    kept = torch.zeros_like(PROBS)
    mass = 0.0
    for i in order.tolist():  # the fewest, nearest first, reaching 0.5
        kept[i] = PROBS[i]
        mass += float(PROBS[i])
        if mass >= 0.5:
            break
    counts = _counts(SamplingSettings(temperature=1.0, typical_p=0.5, seed=4))
    assert counts[kept == 0].sum() == 0 and int((kept > 0).sum()) < len(PROBS)
    assert goodness_of_fit(counts, kept) >= 1e-3


def test_the_new_samplers_are_host_processors_and_validated() -> None:
    names = {
        "dry": SamplingSettings(dry_multiplier=0.8),
        "xtc": SamplingSettings(xtc_probability=0.5),
        "top_n_sigma": SamplingSettings(top_n_sigma=1.0),
        "typical_p": SamplingSettings(typical_p=0.9),
        "banned_strings": SamplingSettings(banned_strings=["x"]),
    }
    for name, settings in names.items():
        active = [p for p in active_processors(settings) if p.name == name]
        assert active and not active[0].device, name
    for bad, field in [
        (dict(dry_allowed_length=0), "dry_allowed_length"),
        (dict(dry_base=0.9), "dry_base"),
        (dict(xtc_threshold=1.5), "xtc_threshold"),
        (dict(top_n_sigma=-1.0), "top_n_sigma"),
        (dict(typical_p=0.0), "typical_p"),
        (dict(banned_strings="Paris"), "banned_strings"),  # a string, not a list of them
        (dict(banned_strings=["ok", ""]), "banned_strings"),
        (dict(dry_sequence_breakers=[3]), "dry_sequence_breakers"),
    ]:
        with pytest.raises(SamplingSettingError, match=f"^{field} must be"):
            SamplingSettings(**bad).validate()


# -- banned strings --------------------------------------------------------------------------


def test_the_guard_holds_back_what_may_start_a_banned_string() -> None:
    guard = BannedStringGuard(["Paris"])
    assert guard.feed(1, "The capital is ") == ("The capital is ", [1], None)
    assert guard.feed(2, "Par") == ("", [], None)  # might become "Paris"
    assert guard.feed(3, "is") == ("", [], 1)  # it did: go back to reply token 1 ("Par")
    assert guard.count == 1
    assert guard.feed(4, "Lyon") == ("Lyon", [4], None)
    assert guard.feed(5, "Pa") == ("", [], None)
    assert guard.feed(6, "rty") == ("Party", [5, 6], None)  # a false alarm is released whole
    assert guard.feed(7, "...P") == ("", [], None)  # held whole: the token's text ends in "P"
    assert guard.finish() == ("...P", [7])


def test_text_ending_with_a_banned_start_stays_held_whatever_follows() -> None:
    # "a" then "a": the first "a" may not be shown, since after a rewind of the second one a
    # "b" could follow it and spell "ab" across text already shown.
    guard = BannedStringGuard(["ab"])
    assert guard.feed(1, "a") == ("", [], None)
    assert guard.feed(2, "a") == ("", [], None)
    assert guard.feed(3, "b") == ("", [], 1)  # the "ab" starts at reply token 1
    assert guard.feed(4, "c") == ("ac", [1, 4], None)


@pytest.fixture(scope="module")
def byte_models(tiny_model_factory, tmp_path_factory):
    from test_constraints import ByteTokenizer

    tok = ByteTokenizer(tmp_path_factory.mktemp("bytes"))
    models = {}
    for variant in ("LlamaForCausalLM", "Qwen3_5ForCausalLM"):
        directory, _ = tiny_model_factory(variant)
        models[variant] = load_model(directory, device="cpu")
    return models, tok


def _ab_replies(model, tok, banned, drafter=None, temperature=1.0) -> list:
    # A bias makes the random model write mostly "a" and "b": "ab" turns up in every reply.
    gen = Generator(model, tok, cache_tokens=2048, page_size=16, drafter=drafter)
    settings = [
        SamplingSettings(
            temperature=temperature, seed=s, logit_bias={97: 6.0, 98: 6.0}, banned_strings=banned
        )
        for s in range(6)
    ]
    results = gen.generate([Job([5, 6, 7], 60, s, stop_token_ids=()) for s in settings])
    assert gen.cache.pages.available == gen.cache.num_pages
    return results


@pytest.mark.parametrize("variant", ["LlamaForCausalLM", "Qwen3_5ForCausalLM"])
@pytest.mark.parametrize("drafting", [False, True])
def test_a_banned_string_never_appears_in_sampled_replies(byte_models, variant, drafting) -> None:
    models, tok = byte_models
    model = models[variant]
    assert all("ab" in r.text for r in _ab_replies(model, tok, ()))
    replies = _ab_replies(model, tok, ("ab",), NgramDrafter() if drafting else None)
    for r in replies:
        assert "ab" not in r.text and r.new_tokens == 60 and len(r.token_ids) == 60
        assert tok.decode(r.token_ids) == r.text  # the ids reported are the text shown


def test_a_rewound_hybrid_decodes_as_if_the_bans_were_always_there(byte_models) -> None:
    # Greedy with bans: every reply token is the argmax, among the tokens not banned at its
    # position, of logits computed afresh over the whole sequence. A recurrent state restored
    # wrongly after a rewind would give other logits.
    models, tok = byte_models
    model = models["Qwen3_5ForCausalLM"]
    settings = SamplingSettings(temperature=0.0, logit_bias={97: 6.0, 98: 6.0}, banned_strings=["ab", "ba"])
    gen = Generator(model, tok, cache_tokens=2048, page_size=16)
    job = Job([5, 6, 7], 50, settings, stop_token_ids=())
    gen.enqueue(job)
    run = gen._queue[-1]
    while gen.num_remaining_jobs:
        gen.iterate()
    tokens = run.tokens
    assert run.sampler.bans, "the bias should have made the model write a banned string"
    logits = score_tokens(model.module, PagedKVCache.for_model(model.spec, 128, 16), tokens)
    for position in range(run.prompt_len, len(tokens)):
        row = logits[position - 1].clone()
        row[97] += 6.0
        row[98] += 6.0
        row[list(run.sampler.bans.get(position, ()))] = float("-inf")
        assert tokens[position] == int(row.argmax()), position
    text = tok.decode(tokens[run.prompt_len :])
    assert "ab" not in text and "ba" not in text


def test_banned_strings_need_a_tokenizer_and_no_constraint(byte_models) -> None:
    from engine.generation import constraints as C

    models, tok = byte_models
    model = models["LlamaForCausalLM"]
    settings = SamplingSettings(banned_strings=["x"])
    with pytest.raises(UsageError, match="need a generator with a tokenizer"):
        Generator(model).enqueue(Job([1, 2], 5, settings))
    with pytest.raises(UsageError, match="cannot be combined with a constraint"):
        Generator(model, tok).enqueue(Job([1, 2], 5, settings, constraint=C.regex("[a-z]+")))


@pytest.mark.slow
def test_the_starter_model_never_says_a_banned_word(smollm2_dir) -> None:
    from engine.session import ChatSession

    session = ChatSession.load(smollm2_dir, device="cpu", cache_tokens=2048)
    ids = session.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])

    def replies(banned) -> list[str]:
        jobs = [
            Job(ids, 24, SamplingSettings(temperature=0.3, seed=s, banned_strings=banned)) for s in range(6)
        ]
        return [r.text for r in session.generator.generate(jobs)]

    assert sum("Paris" in text for text in replies(())) >= 4
    assert not any("Paris" in text for text in replies(["Paris"]))
