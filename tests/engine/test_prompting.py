"""The prompt policy (engine.prompting) and the boundary types (engine.api), without a model:
fitting a conversation to the context, what happens to images, and the request/stats values."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from engine.api import GenerationRequest, ImagePolicy, ReplyStats, StreamChunk
from engine.prompting import (
    ImagesRefusedError,
    apply_image_policy,
    build_prompt,
    count_prompt_tokens,
    fit_to_context,
    with_image_parts,
    without_images,
)

IMAGE_TOKENS = 10


def words(content) -> int:
    if isinstance(content, str):
        return len(content.split())
    return sum(len(p["text"].split()) for p in content if p["type"] == "text")


def count(messages) -> int:
    """Words + 2 per message, and IMAGE_TOKENS per attached image."""
    return sum(words(m["content"]) + 2 + IMAGE_TOKENS * len(m.get("images") or ()) for m in messages)


def conversation(turns: int, words_per_message: int = 8) -> list[dict]:
    history = [{"role": "system", "content": "be brief"}]
    for i in range(turns):
        history.append({"role": "user", "content": f"q{i} " + "w " * (words_per_message - 1)})
        history.append({"role": "assistant", "content": f"a{i} " + "w " * (words_per_message - 1)})
    history.append({"role": "user", "content": "last"})
    return history


# -- fit_to_context --------------------------------------------------------------------------------


def test_a_conversation_that_fits_is_untouched_and_the_reply_keeps_its_budget() -> None:
    history = conversation(2)
    fit = fit_to_context(history, 50, 1000, count)
    assert fit.messages == history and fit.dropped == 0 and fit.max_new_tokens == 50


def test_the_oldest_turns_go_first_and_the_system_prompt_and_newest_stay() -> None:
    history = conversation(6)
    assert count(history) + 20 > 80
    fit = fit_to_context(history, 20, 80, count)
    assert fit.messages[0] == history[0] and fit.messages[-1] == history[-1]
    assert fit.messages == [history[0], *history[len(history) - len(fit.messages) + 1 :]]
    assert fit.dropped == len(history) - len(fit.messages) > 0
    assert count(fit.messages) + 20 <= 80
    # Only as many as needed: one more message would not have fitted.
    with_one_more = [history[0], history[-len(fit.messages)], *fit.messages[1:]]
    assert count(with_one_more) + 20 > 80
    assert fit.max_new_tokens == 20


def test_the_reply_is_capped_by_what_the_context_has_left() -> None:
    history = [{"role": "user", "content": "w " * 10}]  # 12 tokens
    fit = fit_to_context(history, 1000, 40, count)
    assert fit.dropped == 0 and fit.max_new_tokens == 40 - 12


def test_a_huge_reply_budget_reserves_at_most_half_the_context() -> None:
    history = conversation(3)
    assert count(history) + 100 <= 200 < count(history) + 10_000
    fit = fit_to_context(history, 10_000, 200, count)
    assert fit.dropped == 0  # nothing erased for the sake of the reply
    assert fit.max_new_tokens == 200 - count(history)


def test_what_cannot_fit_even_alone_is_passed_on_for_the_engine_to_refuse() -> None:
    history = [
        {"role": "system", "content": "s " * 50},
        {"role": "user", "content": "old"},
        {"role": "user", "content": "u " * 50},
    ]
    fit = fit_to_context(history, 10, 60, count)
    assert fit.messages == [history[0], history[2]] and fit.dropped == 1
    assert fit.max_new_tokens == 10  # nothing left to cap it with


def test_an_unknown_context_length_counts_and_drops_nothing() -> None:
    def refuse(_messages):
        raise AssertionError("counted")

    fit = fit_to_context(conversation(3), 77, 0, refuse)
    assert fit.dropped == 0 and fit.max_new_tokens == 77


def test_images_count_toward_the_context_and_leave_with_their_message() -> None:
    history = [
        {"role": "user", "content": "old", "images": [b"a", b"b", b"c"]},  # 33 tokens
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "new", "images": [b"d"]},  # 13 tokens
    ]
    fit = fit_to_context(history, 30, 40, count)  # 49 + 20 > 40
    assert fit.messages == history[1:] and fit.dropped == 1
    assert fit.max_new_tokens == 40 - (3 + 13)


# -- images ------------------------------------------------------------------------------------------


def test_image_parts_come_before_the_text_and_images_in_prompt_order() -> None:
    messages = [
        {"role": "user", "content": "first", "images": [b"1", b"2"]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second", "images": [b"3"]},
    ]
    parts, images = with_image_parts(messages)
    assert images == [b"1", b"2", b"3"]
    assert parts[0] == {
        "role": "user",
        "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "first"}],
    }
    assert parts[1] == {"role": "assistant", "content": "ok"}
    assert without_images(messages) == (
        [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "second"},
        ],
        3,
    )


def test_a_model_that_sees_images_gets_them_all() -> None:
    messages = [{"role": "user", "content": "x", "images": [b"1"]}]
    assert apply_image_policy(messages, True, ImagePolicy.REFUSE, "m") == (messages, 0)


def test_a_text_only_model_leaves_old_images_out_and_refuses_new_ones() -> None:
    old = [{"role": "user", "content": "see", "images": [b"1", b"2"]}, {"role": "assistant", "content": "ok"}]
    shown, left_out = apply_image_policy(
        [*old, {"role": "user", "content": "go on"}], False, "refuse_new", "m"
    )
    assert left_out == 2 and all("images" not in m for m in shown)
    with pytest.raises(ImagesRefusedError, match="tiny cannot see images"):
        apply_image_policy(
            [*old, {"role": "user", "content": "and?", "images": [b"3"]}], False, "refuse_new", "tiny"
        )
    newest = [{"role": "user", "content": "and?", "images": [b"3"]}]
    assert apply_image_policy(newest, False, ImagePolicy.LEAVE_OUT, "m")[1] == 1
    with pytest.raises(ImagesRefusedError):
        apply_image_policy(old, False, ImagePolicy.REFUSE, "m")
    assert apply_image_policy([{"role": "user", "content": "hi"}], False, ImagePolicy.REFUSE, "m")[1] == 0


# -- build_prompt --------------------------------------------------------------------------------------


class Encoder:
    """Stands in for a session's encode: one token per word + 2 per message + IMAGE_TOKENS per image."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[dict], list[bytes]]] = []

    def __call__(self, messages: list[dict], images: list[bytes]) -> tuple[list[int], object]:
        self.calls.append((messages, images))
        placeholders = sum(
            1
            for m in messages
            if not isinstance(m["content"], str)
            for p in m["content"]
            if p["type"] == "image"
        )
        assert placeholders == len(images)
        n = sum(words(m["content"]) + 2 for m in messages) + IMAGE_TOKENS * len(images)
        return list(range(n)), ("media", tuple(images)) if images else None


def test_build_prompt_sends_the_encoding_that_fits() -> None:
    encode = Encoder()
    history = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "old " * 20, "images": [b"old"]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "new", "images": [b"new"]},
    ]
    prompt = build_prompt(
        history,
        GenerationRequest(max_new_tokens=30),
        context_length=60,
        sees_images=True,
        model_name="vlm",
        encode=encode,
    )
    assert prompt.trimmed_messages == 1 and prompt.images_left_out == 0
    assert prompt.messages[0] == {"role": "system", "content": "sys"}
    assert prompt.messages[-1]["content"][0] == {"type": "image"}
    assert prompt.media == ("media", (b"new",)) and len(prompt.ids) == 3 + 3 + 13
    assert prompt.max_new_tokens == 30
    # Each candidate was encoded once: the last count's encoding is the one sent.
    assert [images for _, images in encode.calls] == [[b"old", b"new"], [b"new"]]


def test_build_prompt_for_a_text_only_model_leaves_images_out_and_says_how_many() -> None:
    encode = Encoder()
    history = [
        {"role": "user", "content": "see", "images": [b"1"]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "more"},
    ]
    prompt = build_prompt(
        history, GenerationRequest(), context_length=4096, sees_images=False, model_name="m", encode=encode
    )
    assert prompt.images_left_out == 1 and prompt.media is None
    assert prompt.messages == without_images(history)[0]
    assert count_prompt_tokens(history, sees_images=False, encode=encode) == 3 + 3 + 3
    assert count_prompt_tokens(history, sees_images=True, encode=encode) == 3 + 3 + 3 + IMAGE_TOKENS


# -- boundary values ---------------------------------------------------------------------------------


def test_a_request_is_frozen_and_holds_read_only_copies() -> None:
    sampling = {"temperature": 0.5}
    request = GenerationRequest(sampling, max_new_tokens=7, stop_strings=["\n\n"])
    sampling["temperature"] = 2.0
    assert request.sampling["temperature"] == 0.5 and request.stop_strings == ("\n\n",)
    with pytest.raises(TypeError):
        request.sampling["top_k"] = 1  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.max_new_tokens = 9  # type: ignore[misc]
    assert request.images is ImagePolicy.REFUSE_NEW


def test_reply_stats_from_the_last_chunk_and_their_saved_form() -> None:
    last = StreamChunk("", [], True, "eos", prompt_tokens=12, new_tokens=5, tokens_per_second=20.0)
    stats = ReplyStats.of("eos", last, seconds=0.5)
    assert stats.to_dict() == {
        "stop_reason": "eos",
        "prompt_tokens": 12,
        "new_tokens": 5,
        "tokens_per_second": 20.0,
        "seconds": 0.5,
    }
    trimmed = dataclasses.replace(last, trimmed_messages=2, images_left_out=1)
    saved = ReplyStats.of("error", trimmed, 1.0, "Out of memory").to_dict()
    assert (
        saved["error"] == "Out of memory" and saved["trimmed_messages"] == 2 and saved["images_left_out"] == 1
    )
    assert ReplyStats.of("cancelled", None, 0.1) == ReplyStats("cancelled", seconds=0.1)


def test_the_boundary_modules_do_not_import_torch() -> None:
    # The GUI thread imports engine.api; torch must load only on the engine thread.
    code = "import sys, engine.api, engine.prompting; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
