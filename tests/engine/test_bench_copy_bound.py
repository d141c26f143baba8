"""The copy bound of ``bench --draft``: decode steps a reply needs when every draft is the best
earlier run of the sequence; no n-gram drafter needs fewer."""

from __future__ import annotations

import random

import pytest

from engine.bench.speculative import copy_bound_steps
from engine.generation.speculative.ngram import NgramIndex


def test_a_copied_reply_takes_one_step_per_draft_and_token():
    context = list(range(1, 11))
    assert copy_bound_steps(context, context, max_tokens=4) == 2  # 4 kept + 1 own token, twice
    assert copy_bound_steps(context, [50, 51, 52], max_tokens=4) == 3  # nothing to copy


def test_a_run_reaching_the_end_goes_on_with_its_own_start():
    # [7, 8] copied past its end repeats itself: the whole looping reply is one draft.
    assert copy_bound_steps([7, 8], [7, 8, 7, 8, 7], max_tokens=4) == 1
    assert copy_bound_steps([7, 8], [7, 8, 7, 8, 7], max_tokens=2) == 2


def _ngram_steps(context: list[int], reply: list[int], max_tokens: int) -> int:
    """Steps the n-gram drafter takes on ``reply`` (each draft judged against the reply)."""
    index, i, steps = NgramIndex(2, 4), 0, 0
    while i < len(reply):
        index.update(context + reply[:i])
        draft = index.lookup(max_tokens)
        kept = 0
        while kept < len(draft) and i + kept < len(reply) and draft[kept] == reply[i + kept]:
            kept += 1
        i, steps = i + kept + 1, steps + 1
    return steps


@pytest.mark.parametrize("seed", range(20))
def test_no_ngram_drafter_beats_the_bound(seed):
    rng = random.Random(seed)
    vocab = rng.choice([4, 8, 30])
    context = [rng.randrange(vocab) for _ in range(rng.randrange(5, 60))]
    reply: list[int] = []
    while len(reply) < 60:  # pieces copied from what came before, and fresh tokens
        seq = context + reply
        if rng.random() < 0.6:
            start = rng.randrange(len(seq))
            reply += seq[start : start + rng.randrange(1, 12)]
        else:
            reply.append(rng.randrange(vocab))
    for k in (1, 4, 8):
        bound = copy_bound_steps(context, reply, k)
        assert len(reply) / (k + 1) <= bound <= _ngram_steps(context, reply, k)


def test_the_draft_bench_reports_the_bound_of_its_plain_replies():
    from engine.bench.speculative import _row, format_table

    def reply(seconds: float, steps: int) -> dict:
        return {"tokens": [1, 2, 3, 1, 2, 3], "decode_s": seconds, "decode_steps": steps}

    runs = {"plain": [[reply(1.0, 5)]], "draft": [[reply(0.5, 3)]]}
    row = _row("set", runs, {"verify_steps": 2, "drafted": 4, "accepted": 2}, 1, [[9, 1, 2, 3]], 4)
    # After the prefill's token 1, the reply 2 3 1 2 3 copies the run 2 3 1 (going on from its
    # own start): 4 drafts kept and the step's own token, one step.
    assert row["copy_bound_tokens_per_step"] == 5.0 and row["tokens_per_decode_step"] == 5 / 3
    table = format_table(
        {
            "draft": "ngram",
            "draft_tokens": 4,
            "new_tokens": 6,
            "sampling": "greedy",
            "repeats": 1,
            "threads": 1,
            "sets": [row],
        }
    )
    assert "bound" in table.splitlines()[1] and " 5.00 " in table.splitlines()[2]
