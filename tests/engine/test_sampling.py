import pytest
import torch

from engine.generation.sampling import Sampler, SamplingSettings, apply_penalties, truncate
from engine.generation.stops import StopStringMatcher


def test_greedy_takes_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingSettings.greedy()).sample(logits, [], []) == 1


def test_top_k_keeps_only_k_best():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    out = truncate(logits, SamplingSettings(top_k=2))
    assert torch.isinf(out[[0, 3]]).all() and torch.isfinite(out[[1, 2]]).all()


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    out = truncate(probs.log(), SamplingSettings(top_p=0.7))
    # 0.5 alone < 0.7, so the second token is needed; the third is not.
    assert torch.isfinite(out[:2]).all() and torch.isinf(out[2:]).all()


def test_min_p_scales_with_best_probability():
    probs = torch.tensor([0.6, 0.3, 0.06, 0.04])
    out = truncate(probs.log(), SamplingSettings(min_p=0.09))  # threshold 0.054
    assert torch.isfinite(out[:3]).all() and torch.isinf(out[3])


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0])
    s = SamplingSettings(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits.clone(), s, context=[0, 1, 2], generated=[2, 2])
    assert out.tolist() == pytest.approx([1.0, -4.0, 0.5 - 0.5 - 0.5, 1.0])


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))

    def draw(seed):
        sampler = Sampler(SamplingSettings(temperature=1.0, seed=seed))
        return [sampler.sample(logits, [], []) for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_sampling_follows_distribution():
    logits = torch.tensor([0.0, 0.0, 10.0, -10.0]).log_softmax(-1)
    sampler = Sampler(SamplingSettings(temperature=1.0, seed=1))
    draws = [sampler.sample(logits, [], []) for _ in range(200)]
    assert draws.count(2) > 190 and 3 not in draws


def test_invalid_settings_are_rejected():
    with pytest.raises(ValueError, match="top_p"):
        Sampler(SamplingSettings(top_p=0.0))
    with pytest.raises(ValueError, match="temperature"):
        Sampler(SamplingSettings(temperature=-1))


def test_stop_string_holds_back_partial_match():
    m = StopStringMatcher(["</answer>"])
    assert m.feed("The answer </") == ("The answer ", False)
    assert m.feed("ans") == ("", False)
    assert m.feed("wer> trailing") == ("", True)


def test_stop_string_releases_false_alarm():
    m = StopStringMatcher(["STOP"])
    assert m.feed("ST") == ("", False)
    assert m.feed("ART") == ("START", False)
    assert m.feed("S") == ("", False)
    assert m.flush() == "S"


def test_earliest_stop_string_wins():
    m = StopStringMatcher(["bb", "a"])
    assert m.feed("xxbba") == ("xx", True)
