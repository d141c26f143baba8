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


def _plain_kept(x: torch.Tensor, s: SamplingSettings, top_p: float, min_p: float) -> set[int]:
    """The truncation rules spelled out over the whole vocabulary, in float64, as the module
    docstring states them: the independent definition the reference's thresholds, integer weights
    and top-p window are checked against."""
    x = x.double()
    if 0 < s.top_k < x.numel():
        x = x.masked_fill(x < x.sort(descending=True).values[s.top_k - 1], float("-inf"))
    p = torch.softmax(x, 0)  # over what top-k kept: top-p's mass and min-p's ratio both use it
    keep = torch.isfinite(x)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if top_p < 1:
        xs, order = x.sort(descending=True)
        before = p[order].cumsum(0) - p[order]
        # A tie group shares the mass before its first member.
        before = before[torch.searchsorted(-xs, -xs, side="left")]
        keep[order] &= before < top_p
    return set(keep.nonzero().squeeze(1).tolist())


@pytest.mark.parametrize(
    "settings",
    [
        SamplingSettings(top_k=40),
        SamplingSettings(top_p=0.9),
        SamplingSettings(min_p=0.05),
        SamplingSettings(top_p=0.95, min_p=0.05),
        SamplingSettings(top_k=200, top_p=0.8, min_p=0.01),
        SamplingSettings(top_p=0.999),  # needs a window far past 64 tokens
        SamplingSettings(),
    ],
)
@pytest.mark.parametrize("spread", [0.3, 3.0])  # nearly flat (wide top-p windows) or peaked
def test_truncation_is_the_plain_definition(settings, spread):
    # The reference keeps what the plain definition keeps, up to float rounding exactly at a
    # boundary: between what it keeps with top_p and min_p nudged by 1e-6 either way (a long
    # top-p tail, 10k tokens of ~1e-7 each, puts a few tokens inside that margin).
    s = settings

    def top_p(f: float) -> float:
        return min(1.0, s.top_p * f) if s.top_p < 1.0 else 1.0

    for seed in range(5):
        x = torch.randn(20000, generator=torch.Generator().manual_seed(seed)) * spread
        kept = set(torch.isfinite(truncate(x, s)).nonzero().squeeze(1).tolist())
        fewest = _plain_kept(x, s, top_p(1 - 1e-6), s.min_p * (1 + 1e-6))
        most = _plain_kept(x, s, top_p(1 + 1e-6), s.min_p * (1 - 1e-6))
        assert fewest <= kept <= most
        assert len(most) - len(fewest) <= 8


def test_truncation_never_revives_masked_out_tokens():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    x[::2] = float("-inf")  # a constraint allows only the odd ids
    kept = torch.isfinite(truncate(x, SamplingSettings(top_p=0.9, min_p=0.01))).nonzero().squeeze(1)
    assert len(kept) and all(i % 2 == 1 for i in kept.tolist())
    mask = torch.zeros(1000, dtype=torch.bool)
    mask[1::2] = True
    sampler = Sampler(SamplingSettings(temperature=1.5, top_p=0.9, seed=0))
    y = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    assert all(sampler.sample(y, [], [], mask) % 2 == 1 for _ in range(200))


def test_sampling_matches_the_truncated_softmax():
    # Frequencies over 8000 draws against the probabilities truncate + softmax define (a
    # frequency's standard deviation is at most 0.0056: 0.02 is 3.5 of them).
    x = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -3.0, -9.0])
    settings = SamplingSettings(temperature=0.7, top_p=0.95, min_p=0.02, seed=5)
    sampler = Sampler(settings)
    expected = torch.softmax(truncate(x / 0.7, settings), -1)
    counts = torch.bincount(torch.tensor([sampler.sample(x, [], []) for _ in range(8000)]), minlength=7)
    freq = counts.float() / 8000
    assert (counts[expected == 0] == 0).all()
    assert torch.allclose(freq, expected, atol=0.02)


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


def test_sampler_keeps_the_context_ids_as_the_context_grows():
    # The sampler's incremental distinct-id set gives the penalties apply_penalties computes from
    # the whole context, step after step, and starts over for a shorter (different) context.
    g = torch.Generator().manual_seed(2)
    settings = SamplingSettings(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.2, seed=0)
    sampler = Sampler(settings)
    context = torch.randint(0, 300, (50,), generator=g).tolist()
    for step in range(40):
        context += torch.randint(0, 300, (1 + step % 3,), generator=g).tolist()
        logits = torch.randn(300, generator=g)
        ids = sampler.context_ids(context)
        cached = apply_penalties(logits.clone(), settings, context, context[-10:], ids)
        assert torch.equal(cached, apply_penalties(logits.clone(), settings, context, context[-10:]))
    short = [5, 6, 7]
    assert sorted(sampler.context_ids(short).tolist()) == short


def test_argmax_rows_on_the_cpu_is_torch_argmax() -> None:
    from engine import kernels
    from engine.generation.generator import _argmax_rows

    x = torch.tensor([[1.0, 3.0, 3.0], [float("nan"), 5.0, float("nan")]])
    assert kernels.sampling.argmax_rows(x) is None  # no kernel on the CPU: the caller's torch.argmax
    assert _argmax_rows([x[:1], None, x[1:]]) == {0: 1, 2: 0}
    assert x.argmax(dim=-1).tolist() == [1, 0]
