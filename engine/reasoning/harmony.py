"""gpt-oss's "harmony" reply format: a reply is a run of messages, each a header and a body,

``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>``

(the prompt's ``<|start|>assistant`` opens the first header). The header names the message's
channel: ``analysis`` is the model's chain of thought, ``final`` the answer to show,
``commentary`` tool calls and their preambles. Here ``final`` (or a message with no channel)
is the answer and every other channel reasoning; headers are structure, shown as neither.

The markers are special tokens of the gpt-oss vocabulary, so the generator's text leaves them
out; the splitter reads them off the token ids and so never sees half of one, however the reply
is cut into steps. A step's text is what its tokens completed, which comes before any marker
among them (a marker decodes to nothing): text first, then markers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from engine.reasoning import ReplyParts

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

MARKERS = {
    "start": "<|start|>",
    "channel": "<|channel|>",
    "message": "<|message|>",
    "constrain": "<|constrain|>",
    "end": "<|end|>",
    "return": "<|return|>",
    "call": "<|call|>",
}
REQUIRED = ("start", "channel", "message", "end")
ANSWER_CHANNEL = "final"
_HEADER, _BODY, _BETWEEN = "header", "body", "between"


class HarmonySplitter:
    """One reply's :class:`~engine.reasoning.ReplySplitter` over harmony messages; ``markers``
    maps the vocabulary's marker ids to their names (:data:`MARKERS`)."""

    def __init__(self, markers: Mapping[int, str]) -> None:
        self._markers = dict(markers)
        self._reset()

    def _reset(self) -> None:
        self._state = _HEADER  # the prompt ends in the first message's header
        self._channel: str | None = None  # the header's channel name so far; None: no channel
        self._naming = False  # the header's text is the channel's name (after <|channel|>)
        self._to_answer = True
        self._any_marker = False
        self._unstructured = ""  # text before any marker: the whole reply, if none ever comes

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> HarmonySplitter | None:
        """A splitter for a model whose vocabulary has the harmony markers; else None."""
        ids = {name: tokenizer.token_to_id(text) for name, text in MARKERS.items()}
        if any(ids[name] is None for name in REQUIRED):
            return None
        return cls({i: name for name, i in ids.items() if i is not None})

    def feed(self, text: str, token_ids: Sequence[int]) -> ReplyParts:
        out = self._text(text) if text else ReplyParts()
        for token in token_ids:
            marker = self._markers.get(int(token))
            if marker is not None:
                self._any_marker = True
                self._marker(marker)
        return out

    def finish(self) -> ReplyParts:
        # A model that never wrote a marker (no harmony at all): its text was all answer.
        out = ReplyParts(answer=self._unstructured) if not self._any_marker else ReplyParts()
        self._reset()
        return out

    def _text(self, text: str) -> ReplyParts:
        if self._state == _BODY:
            return ReplyParts(answer=text) if self._to_answer else ReplyParts(reasoning=text)
        if self._state == _HEADER:
            if self._naming:
                self._channel = (self._channel or "") + text
            if not self._any_marker:
                self._unstructured += text
            return ReplyParts()
        # Between messages nothing but a header should come; stray text is kept as answer.
        return ReplyParts(answer=text)

    def _marker(self, marker: str) -> None:
        if marker == "start" or (marker == "channel" and self._state != _HEADER):
            self._state, self._channel, self._naming = _HEADER, None, False
        if marker == "channel":
            self._channel, self._naming = "", True
        elif marker == "constrain":  # "<|constrain|>json": the format of a tool call, not the name
            self._naming = False
        elif marker == "message":
            name = (self._channel or "").split(" to=")[0].split()
            self._to_answer = self._channel is None or (name or [""])[0] == ANSWER_CHANNEL
            self._state, self._naming = _BODY, False
        elif marker in ("end", "return", "call"):
            self._state = _BETWEEN
