"""A reply's reasoning apart from its answer, as the reply streams in.

Reasoning models write their thinking before the answer, in a format of their own. A splitter
takes the reply as the generator streams it, one step's text and token ids at a time, and says
which of the new text is reasoning and which is answer (:class:`ReplyParts`); it holds nothing
back that it already knows the place of, and never needs to take text back.

Formats: gpt-oss's "harmony" channels (:mod:`engine.reasoning.harmony`). :func:`reply_splitter`
picks the format a tokenizer's vocabulary speaks (None: the reply is all answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class ReplyParts:
    """New text of a reply, by part."""

    reasoning: str = ""
    answer: str = ""

    def __add__(self, other: ReplyParts) -> ReplyParts:
        return ReplyParts(self.reasoning + other.reasoning, self.answer + other.answer)


class ReplySplitter(Protocol):
    def feed(self, text: str, token_ids: Sequence[int]) -> ReplyParts:
        """One step of the reply: its new ``text`` (special tokens left out, as the generator
        decodes it) and the ``token_ids`` it came from."""
        ...

    def finish(self) -> ReplyParts:
        """The reply ended: whatever was still held."""
        ...


def reply_splitter(tokenizer: Tokenizer | None) -> ReplySplitter | None:
    """A fresh splitter for one reply of a model with ``tokenizer``, or None where its replies
    have no reasoning part the engine knows how to find."""
    from engine.reasoning.harmony import HarmonySplitter

    if tokenizer is None:
        return None
    return HarmonySplitter.for_tokenizer(tokenizer)


__all__ = ["ReplyParts", "ReplySplitter", "reply_splitter"]
