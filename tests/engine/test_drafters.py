"""The n-gram drafter's index, the adaptive draft length, and the drafting command-line flags."""

from __future__ import annotations

import pytest

from engine.cli import build_parser
from engine.errors import UsageError
from engine.generation.speculative.draft_length import DraftLength, best_length, expected_tokens
from engine.generation.speculative.drafter import DraftRequest
from engine.generation.speculative.ngram import NgramDrafter, NgramIndex
from engine.options import EngineOptions


def _propose(drafter: NgramDrafter, key, tokens, k=4) -> list[int]:
    return drafter.propose([DraftRequest(key, tokens, k)])[0].tokens


def test_the_longest_matching_suffix_and_its_latest_occurrence_win() -> None:
    d = NgramDrafter(min_n=1, max_n=3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [7, 1, 2, 3, 9, 1, 2, 4, 8, 2]
    assert _propose(d, "a", tokens) == [4, 8, 2, 4]  # "2" last followed at 6 -> 4 8 2 (then loops)
    tokens += [9, 1, 2]  # "9 1 2": matched at 4..6, continued by 4
    assert _propose(d, "a", tokens, 3) == [4, 8, 2]
    assert _propose(d, "b", [5, 6, 7]) == []  # nothing repeats


def test_a_loop_is_continued_past_the_end_with_its_period() -> None:
    d = NgramDrafter()
    assert _propose(d, "x", [3, 4, 3, 4, 3, 4], 5) == [3, 4, 3, 4, 3]


def test_a_shorter_or_changed_sequence_is_indexed_again() -> None:
    index = NgramIndex(2, 3)
    index.update([1, 2, 3, 1, 2])
    assert index.lookup(2) == [3, 1]
    index.update([1, 2, 3, 1, 5])  # the last token changed (a rewind): no stale entries
    assert index.lookup(2) == []
    index.update([1, 2])
    assert index.tokens == [1, 2] and index.lookup(2) == []


def test_forget_drops_a_sequences_index() -> None:
    d = NgramDrafter()
    _propose(d, "k", [1, 2, 1, 2])
    d.forget("k")
    assert "k" not in d._indexes


def test_draft_length_follows_the_acceptance_rate() -> None:
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert best_length(0.95, 8, 0.1) == 8 and best_length(0.2, 8, 0.1) == 1
    length = DraftLength(max_tokens=6, extra_token_cost=0.1)
    for _ in range(10):
        length.update(drafted=length.tokens, accepted=length.tokens)
    assert length.tokens == 6  # all kept: the longest drafts
    for _ in range(10):
        length.update(drafted=length.tokens, accepted=0)
    assert length.tokens == 1  # none kept: one token at a time (costs a tenth of a step)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--draft", "sometimes"], "--draft takes off, auto, ngram, model:DIR or mtp"),
        (["--draft-tokens", "0"], "--draft-tokens must be a whole number in 1..8"),
        (["--draft", "model:/no/such/dir"], "draft model /no/such/dir does not exist"),
    ],
)
def test_generate_checks_the_drafting_flags_before_loading(tmp_path, argv, message) -> None:
    from engine.commands.generate import draft_options
    from engine.errors import InputNotFoundError

    args = build_parser().parse_args(["generate", "-m", str(tmp_path), "-p", "hi", *argv])
    args.options = EngineOptions()  # what the dispatcher sets
    with pytest.raises((UsageError, InputNotFoundError), match=message):
        draft_options(args)


def test_generate_passes_the_drafter_to_the_engine_options(tmp_path) -> None:
    from engine.commands.generate import draft_options, sampling_from_args

    argv = ["generate", "-m", str(tmp_path), "-p", "hi", "--draft", "ngram", "--draft-tokens", "6"]
    argv += ["--dry-multiplier", "0.8", "--ban", "Paris", "--ban", "Lyon", "--xtc-probability", "0.5"]
    args = build_parser().parse_args(argv)
    args.options = EngineOptions()
    options = draft_options(args)
    assert (options.draft, options.draft_tokens) == ("ngram", 6)
    settings = sampling_from_args(args)
    assert settings.dry_multiplier == 0.8 and settings.xtc_probability == 0.5
    assert settings.banned_strings == ("Paris", "Lyon")
    with pytest.raises(UsageError, match="^--ban must be a list of non-empty strings"):
        sampling_from_args(
            build_parser().parse_args(["generate", "-m", str(tmp_path), "-p", "hi", "--ban", ""])
        )


def test_front_ends_default_to_auto_unless_the_environment_chooses(llama) -> None:
    from engine.generation.speculative.factory import make_drafter

    assert EngineOptions().draft == "off"  # the library drafts only when asked
    assert EngineOptions().with_front_end_draft({}).draft == "auto"
    assert EngineOptions(draft="off").with_front_end_draft({"TRELLIS_DRAFT": "off"}).draft == "off"
    assert make_drafter("auto", llama).kind == "ngram"  # a CPU model: n-gram drafting
    assert make_drafter("off", llama) is None
