"""Tool use through MCP in the app: a test MCP server (tests/support/mcp_test_server.py, the
official SDK over stdio, two tools), a scripted engine whose reply calls one, and the user's
answer. "Allow" runs the tool and its result reaches the model; "deny" sends a refusal; the
calls and results are stored with the conversation, survive reopening the store, and go through
export and import."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from gui_helpers import load_model, send, visible_texts

from app.store.export import from_json, to_json

SERVER = Path(__file__).parents[1] / "support" / "mcp_test_server.py"


def add_call(messages: list[dict]) -> list[dict]:
    """The scripted model: asks for add(2, 3) until it has a result, then answers."""
    if messages and messages[-1]["role"] == "tool":
        return []
    return [
        {"id": "call_7", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    ]


def answer(messages: list[dict]) -> str:
    last = messages[-1]
    return f"Tool said: {last['content']}" if last["role"] == "tool" else "Let me compute."


@pytest.fixture
def tool_window(qtbot, window, fake_engine, tmp_path):
    log = tmp_path / "mcp.log"
    fake_engine.tool_calls = add_call
    fake_engine.reply = answer
    dialog = window.open_tools()
    with qtbot.waitSignal(window.tool_manager.toolsChanged, timeout=60000):
        assert dialog.add("calc", f"{sys.executable} {SERVER} {log}")
    dialog.close()
    assert sorted(window.tool_manager.tools) == ["add", "shout"]
    load_model(qtbot, window)
    window.chat.new_conversation()
    window.chat_pane.tools_check.click()  # tools on for this conversation
    assert window.store.conversation(window.chat.conversation_id).tools_enabled
    window.mcp_log = log
    return window


def ask_and_wait_for_approval(qtbot, window) -> None:
    send(qtbot, window, "What is 2 + 3?", wait=False)
    qtbot.waitUntil(lambda: window.chat_pane.tool_approval.isVisible(), timeout=10000)
    assert (
        "add" in window.chat_pane.tool_approval.label.text()
        and '"a": 2' in window.chat_pane.tool_approval.label.text()
    )


def test_allow_runs_the_tool_and_the_result_reaches_the_model(qtbot, tool_window, fake_engine, data_dir):
    window = tool_window
    ask_and_wait_for_approval(qtbot, window)
    offered = fake_engine.calls[-1]["request"].tools
    assert {t["function"]["name"] for t in offered} == {"add", "shout"}
    assert window.chat.busy
    window.chat_pane.tool_approval.allow_button.click()
    qtbot.waitUntil(lambda: not window.chat.busy, timeout=60000)
    assert window.mcp_log.read_text() == "add 2 3\n"
    assert visible_texts(window)[-1] == ("assistant", "Tool said: 5")
    sent = fake_engine.calls[-1]["messages"]
    assert sent[-2]["tool_calls"][0]["function"]["name"] == "add"
    assert sent[-1] == {"role": "tool", "tool_call_id": "call_7", "content": "5"}
    # Shown under the reply that made the call, folded until clicked.
    calling = window.chat.model.items()[-2]
    assert calling.tool_calls[0]["status"] == "done" and calling.tool_calls[0]["result"] == "5"

    # Stored: a fresh store on the same file (as after a restart) has the call and its result.
    from app import paths
    from app.store import Store

    conversation_id = window.chat.conversation_id
    reopened = Store(paths.database_path())
    try:
        path = reopened.current_path(conversation_id)
        (stored,) = [m for m in path if m.tool_calls]
        assert stored.tool_calls[0] | {"result": "5"} == {
            "id": "call_7",
            "name": "add",
            "arguments": '{"a": 2, "b": 3}',
            "status": "done",
            "result": "5",
        }
        assert path[-1].content == "Tool said: 5"
        # Export and import keep them.
        exported = json.loads(json.dumps(to_json(reopened, conversation_id)))
        copy = from_json(reopened, exported)
        assert [m.tool_calls for m in reopened.current_path(copy)] == [m.tool_calls for m in path]
    finally:
        reopened.close()


def test_deny_sends_a_refusal_to_the_model(qtbot, tool_window, fake_engine):
    window = tool_window
    ask_and_wait_for_approval(qtbot, window)
    window.chat_pane.tool_approval.deny_button.click()
    qtbot.waitUntil(lambda: not window.chat.busy, timeout=10000)
    assert not window.mcp_log.exists()  # the tool never ran
    refusal = fake_engine.calls[-1]["messages"][-1]
    assert refusal["role"] == "tool" and "denied" in refusal["content"]
    assert visible_texts(window)[-1] == ("assistant", f"Tool said: {refusal['content']}")
    assert window.chat.model.items()[-2].tool_calls[0]["status"] == "denied"


def test_always_allow_skips_the_question_next_time_and_rounds_are_limited(qtbot, tool_window, fake_engine):
    window = tool_window
    ask_and_wait_for_approval(qtbot, window)
    window.chat_pane.tool_approval.always_button.click()
    qtbot.waitUntil(lambda: not window.chat.busy, timeout=60000)
    assert window.settings.get("tools.always_allowed") == ["add"]
    # A model that never stops calling: the loop ends at the limit of rounds, without asking.
    fake_engine.tool_calls = lambda messages: add_call([])
    window.chat.max_tool_rounds = 2
    errors: list[str] = []
    window.chat.errorOccurred.connect(errors.append)
    send(qtbot, window, "Again", wait=False)
    qtbot.waitUntil(lambda: not window.chat.busy, timeout=120000)
    assert not window.chat_pane.tool_approval.isVisible()
    assert errors and "called tools 2 times in a row" in errors[-1]
    assert window.mcp_log.read_text().count("add 2 3") == 3


def test_tools_off_offers_none(qtbot, tool_window, fake_engine):
    window = tool_window
    window.chat_pane.tools_check.click()
    send(qtbot, window, "What is 2 + 3?")
    assert fake_engine.calls[-1]["request"].tools == ()
    assert visible_texts(window)[-1] == ("assistant", "Let me compute.")
