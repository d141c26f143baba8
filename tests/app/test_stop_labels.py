"""What a finished reply's footer says about why it ended (a static method: no widget built)."""

from __future__ import annotations

import pytest

from app.chat.message_model import MessageItem
from app.chat.message_widget import MessageWidget


@pytest.mark.parametrize(
    "reason, label",
    [
        ("max_new_tokens", "hit the token limit"),
        ("context_length", "context is full"),  # the engine's reason for a reply cut by the context
        ("eos", ""),
        ("cancelled", "stopped"),
    ],
)
def test_each_stop_reason_has_its_own_label(reason: str, label: str) -> None:
    item = MessageItem(id=1, role="assistant", content="text", stats={"stop_reason": reason})
    assert MessageWidget._status(item) == label
