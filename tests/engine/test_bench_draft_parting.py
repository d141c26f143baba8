"""``bench --draft`` tells a drafted greedy reply that parts from the plain one at a near-tie of
the target's logits (rounding of a differently batched step) from one that parts anywhere else
(a bug, exit status 1)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.bench.speculative import TIE_MARGIN, _row, first_difference, format_table, parting
from engine.generation.generator import Generator
from engine.generation.job import Job
from engine.generation.step import score_tokens

PROMPT = [5, 17, 42, 99, 7, 64, 23, 11]


def test_the_first_difference_of_two_replies():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 4, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one stopped where the other went on


@pytest.fixture(scope="module")
def scored(llama):
    """A session over the tiny Llama, its greedy reply to PROMPT, and the logits at token 5."""
    gen = Generator(llama, cache_tokens=512, page_size=16)
    reply = gen.generate([Job(PROMPT, 12, stop_token_ids=())])[0].token_ids
    session = SimpleNamespace(model=llama, generator=gen)
    logits = score_tokens(llama.module, gen.cache, PROMPT + reply[:5])[-1].float()
    return session, reply, logits


def _swapped(reply: list[int], token: int) -> list[int]:
    return reply[:5] + [token] + reply[6:]


def test_a_reply_parting_at_the_runner_up_is_measured_against_the_top_logit(scored):
    session, reply, logits = scored
    assert int(logits.argmax()) == reply[5]  # the plain reply is the scored argmax
    runner_up = int(logits.topk(2).indices[1])
    part = parting(session, PROMPT, reply, _swapped(reply, runner_up))
    expected = float(logits[reply[5]] - logits[runner_up]) / float(logits.abs().max())
    assert part["at"] == 5 and part["margin"] == pytest.approx(expected, rel=1e-4)
    assert part["tie"] == (expected <= TIE_MARGIN)
    assert session.generator.cache.pages.available == session.generator.cache.num_pages


def test_a_reply_parting_at_the_least_likely_token_is_no_tie(scored):
    session, reply, logits = scored
    part = parting(session, PROMPT, reply, _swapped(reply, int(logits.argmin())))
    assert part["at"] == 5 and part["margin"] > TIE_MARGIN and not part["tie"]
    assert parting(session, PROMPT, reply, list(reply)) is None


def _table_row(partings: list | None) -> dict:
    reply = {"tokens": [1, 2, 3, 4], "decode_s": 1.0, "decode_steps": 3}
    runs = {"plain": [[reply], [reply]], "draft": [[reply], [reply]]}
    totals = {"verify_steps": 1, "drafted": 2, "accepted": 1}
    return _row("set", runs, totals, 1, [[9], [8]], 4, partings)


@pytest.mark.parametrize(
    ("partings", "same", "shown"),
    [
        (None, None, "-"),  # sampled replies: not compared
        ([None, None], "yes", "yes"),
        ([None, {"at": 3, "margin": 0.004, "tie": True}], "tie", "tie"),
        ([{"at": 3, "margin": 0.004, "tie": True}, {"at": 1, "margin": 0.4, "tie": False}], "no", "NO"),
    ],
)
def test_the_table_says_yes_tie_or_no_for_greedy_replies(partings, same, shown):
    row = _table_row(partings)
    assert row["same_tokens"] == same
    assert [d["prompt"] for d in row["differences"]] == [i for i, p in enumerate(partings or []) if p]
    meta = {"draft": "ngram", "draft_tokens": 4, "new_tokens": 4, "sampling": "greedy", "repeats": 1}
    table = format_table(dict(meta, threads=1, sets=[row]))
    assert table.splitlines()[2].split()[-1] == shown


@pytest.mark.parametrize("sampled", [False, True])
def test_the_draft_bench_runs_end_to_end(tiny_llama_hf, tmp_path, sampled):
    import json
    import shutil

    from engine.cli import main

    # The fixture's random Llama, given a chat template, and <unk> for its end of sequence: it
    # answers every prompt with </s> at once otherwise.
    model = shutil.copytree(tiny_llama_hf, tmp_path / "model")
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    for name, key, value in [
        ("config.json", "eos_token_id", 0),
        ("generation_config.json", "eos_token_id", 0),
        ("tokenizer_config.json", "eos_token", "<unk>"),
    ]:
        config = json.loads((model / name).read_text())
        (model / name).write_text(json.dumps(dict(config, **{key: value})))
    out = tmp_path / "draft.json"
    argv = ["bench", "-m", str(model), "--device", "cpu", "--draft", "ngram"]
    argv += ["--decode-tokens", "24", "--repeats", "1", "--json", str(out)]
    status = main(argv + (["--sampled"] if sampled else []))
    result = json.loads(out.read_text())
    assert [row["set"] for row in result["sets"]] == ["code-edit", "chat"]
    # Greedy in float32 on the CPU every drafted reply is the plain one; sampled ones differ by
    # design and are not compared.
    for row in result["sets"]:
        assert row["same_tokens"] == (None if sampled else "yes") and row["differences"] == []
    assert status == 0 and sum(row["drafted"] for row in result["sets"]) > 0
