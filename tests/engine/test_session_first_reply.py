"""What the app's first reply needs from a session: a warm-up at load time (so the first reply
does not start with seconds of silence), progress while a long prompt is read, and plain-text
completion for a base model (no chat template)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.api import GenerationRequest
from engine.completion_text import completion_text
from engine.errors import EngineError

GREEDY = {"temperature": 0.0}


@pytest.fixture
def session(tiny_llama_hf: Path):
    """The fixtures' tiny Llama, which has no chat template of its own (a base model)."""
    from engine.session import ChatSession

    session = ChatSession.load(tiny_llama_hf, device="cpu", cache_tokens=256)
    yield session
    session.unload()


def test_warm_up_runs_the_model_once_and_leaves_nothing_behind(session) -> None:
    generator = session.generator
    assert generator.prefilled_tokens == 0 and not session.warmed_up
    session.warm_up()
    read = generator.prefilled_tokens
    assert read > 0 and session.warmed_up and generator.num_remaining_jobs == 0
    session.warm_up()  # once per session: a second call (or a first reply) does not warm up again
    assert generator.prefilled_tokens == read
    # The warm-up leaves no trace in what the model says.
    messages = [{"role": "user", "content": "Once upon a time"}]
    request = GenerationRequest(GREEDY, max_new_tokens=6, completion=True)
    warm = "".join(c.text for c in session.stream(messages, request))
    assert generator.prefilled_tokens > read
    from engine.session import ChatSession

    cold_session = ChatSession.load(session.model.directory, device="cpu", cache_tokens=256)
    cold = "".join(c.text for c in cold_session.stream(messages, request))
    assert warm == cold


def test_prefill_progress_is_reported_while_a_long_prompt_is_read(session) -> None:
    session.generator.max_chunk_tokens = 16  # a long prompt in a few steps, as on a real machine
    messages = [{"role": "user", "content": "word " * 60}]
    seen: list[tuple[int, int]] = []
    request = GenerationRequest(GREEDY, max_new_tokens=2, completion=True)
    chunks = list(
        session.stream(messages, request, on_prefill=lambda done, total: seen.append((done, total)))
    )
    total = chunks[-1].prompt_tokens
    assert total > 48 and seen[0] == (0, total)
    assert [done for done, _ in seen] == list(range(0, total, 16))  # one report per step, in order
    assert all(t == total for _, t in seen)


def test_a_base_model_replies_by_plain_text_completion(session) -> None:
    assert not session.has_chat_template
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "The capital of France is"},
        {"role": "assistant", "content": " Paris."},
        {"role": "user", "content": "The capital of Italy is"},
    ]
    text = completion_text(messages)
    assert text == "The capital of France is Paris.\n\nThe capital of Italy is"  # no system prompt
    expected = session.tokenizer.encode(text)
    last = list(session.stream(messages, GenerationRequest(GREEDY, 3, completion=True)))[-1]
    assert last.done and last.prompt_tokens == len(expected) == session.count_tokens(
        messages, completion=True
    )
    with pytest.raises(EngineError, match="no chat template"):  # a chat needs a template
        list(session.stream(messages, GenerationRequest(GREEDY, 3)))
