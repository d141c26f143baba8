"""ChatSession.stream, the front ends' way in: the app's messages and a GenerationRequest in, the
chat template, the context fitting and the image policy inside the engine, chunks out."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.api import GenerationRequest, ImagePolicy, SessionProtocol
from engine.errors import SamplingSettingError
from engine.generation.constraints import ConstraintError
from engine.prompting import ImagesRefusedError

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def session(exl3_dir: Path):
    """The fixtures' tiny Llama (no chat template of its own) with a small cache: 256 tokens."""
    from engine.session import ChatSession

    session = ChatSession.load(exl3_dir / "tiny-llama-hf", device="cpu", cache_tokens=256)
    session.tokenizer.chat_template = TEMPLATE
    yield session
    session.unload()


def test_the_session_is_a_session_protocol(session) -> None:
    assert isinstance(session, SessionProtocol)
    assert session.context_length == 256 and not session.sees_images and session.device == "cpu"


def test_stream_renders_the_template_and_streams_to_the_end(session) -> None:
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]
    chunks = list(session.stream(messages, GenerationRequest(GREEDY, max_new_tokens=4)))
    last = chunks[-1]
    assert last.done and last.stop_reason in ("eos", "max_new_tokens", "stop_string")
    assert 0 < last.new_tokens <= 4 and last.trimmed_messages == 0 and last.images_left_out == 0
    expected = session.tokenizer.encode_chat(messages, add_generation_prompt=True)
    assert last.prompt_tokens == len(expected) == session.count_tokens(messages)


def test_a_long_conversation_is_fitted_to_the_context(session) -> None:
    history = [{"role": "system", "content": "sys"}]
    for i in range(12):
        history.append(
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "word " * 20}
        )
    history.append({"role": "user", "content": "last"})
    assert session.count_tokens(history) > session.context_length
    last = list(session.stream(history, GenerationRequest(GREEDY, max_new_tokens=16)))[-1]
    assert last.done and last.trimmed_messages > 0
    assert last.prompt_tokens + 16 <= session.context_length


def test_images_for_a_text_only_model_follow_the_policy(session) -> None:
    old = [{"role": "user", "content": "see", "images": [b"png"]}, {"role": "assistant", "content": "ok"}]
    last = list(session.stream([*old, {"role": "user", "content": "go on"}], GenerationRequest(GREEDY, 2)))[
        -1
    ]
    assert last.done and last.images_left_out == 1
    newest = [*old, {"role": "user", "content": "and this?", "images": [b"png"]}]
    with pytest.raises(ImagesRefusedError, match="cannot see images"):
        next(session.stream(newest, GenerationRequest(GREEDY, 2)))
    last = list(session.stream(newest, GenerationRequest(GREEDY, 2, images=ImagePolicy.LEAVE_OUT)))[-1]
    assert last.images_left_out == 2


def test_bad_settings_and_schemas_fail_before_any_model_work(session) -> None:
    with pytest.raises(SamplingSettingError, match="top_p"):
        next(session.stream([{"role": "user", "content": "x"}], GenerationRequest({"top_p": 0.0})))
    with pytest.raises(ConstraintError, match="not valid JSON"):
        next(session.stream([{"role": "user", "content": "x"}], GenerationRequest(json_schema="{nope")))
    assert session.generator.num_remaining_jobs == 0


def test_closing_a_stream_early_frees_its_job(session) -> None:
    stream = session.stream([{"role": "user", "content": "hi"}], GenerationRequest(GREEDY, max_new_tokens=50))
    next(stream)
    assert session.generator.num_remaining_jobs == 1
    stream.close()
    assert session.generator.num_remaining_jobs == 0


def test_sampling_settings_are_built_by_name_and_checked() -> None:
    from engine.session import sampling_settings

    with pytest.raises(SamplingSettingError, match="top_p"):
        sampling_settings({"temperature": 0.7, "top_p": 0.0})
    assert sampling_settings({"temperature": 0.7, "top_p": 0.5, "unknown": 1}).top_p == 0.5
