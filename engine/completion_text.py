"""Plain-text completion: a conversation as the text a base model continues.

A base model has no chat template: it was trained to continue text, not to answer turns. In
completion mode a front end's conversation becomes one text (no template, no role markers) and
the reply is what the model writes next. No torch here.

- System messages are left out: a base model has no notion of one, and a default "You are a
  helpful assistant." would only become the start of the story.
- A reply follows the text it continues directly (it *is* its continuation); a new message of
  the user starts a new paragraph, unless the text before it already ends in a line break.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _text_of(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def completion_text(messages: Sequence[dict[str, Any]]) -> str:
    """The text a base model continues for ``messages`` (the app's or the engine's form)."""
    text = ""
    for message in messages:
        if message.get("role") == "system":
            continue
        part = _text_of(message.get("content", ""))
        if text and message.get("role") != "assistant" and not text.endswith("\n"):
            text += "\n\n"
        text += part
    return text
