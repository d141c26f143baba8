"""Deleting a message from its hover toolbar: a user message goes with its reply, a reply goes
alone (all its versions, tool rounds included); the store, the title and the context meter follow,
Edit > Undo (Ctrl+Z) brings the messages back in place, and nothing can be deleted mid-reply."""

from __future__ import annotations

from gui_helpers import load_model, send, visible_texts, wait_idle
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox

from app import paths
from app.store import Store


def _two_exchanges(qtbot, window) -> None:
    load_model(qtbot, window)
    send(qtbot, window, "first question")
    send(qtbot, window, "second question")
    assert [role for role, _ in visible_texts(window)] == ["user", "assistant"] * 2


def _click_delete(qtbot, window, row: int) -> None:
    qtbot.mouseClick(window.chat_pane.view.message_widget(row).delete_button, Qt.MouseButton.LeftButton)


def _meter(window) -> int:
    return window.chat_pane.context_meter.value()


def _stored(cid: int) -> list[str]:
    reopened = Store(paths.database_path())  # a second connection sees only what was committed
    try:
        return [m.content for m in reopened.current_path(cid)]
    finally:
        reopened.close()


def test_deleting_a_user_message_takes_its_reply_and_undo_brings_them_back(qtbot, window, asked) -> None:
    _two_exchanges(qtbot, window)
    cid = window.chat.conversation_id
    before = visible_texts(window)
    assert window.store.conversation(cid).title == "first question"
    with qtbot.waitSignal(window.chat.contextChanged):  # the count of the branch, as after undo
        window.chat.refresh_context()
    full = _meter(window)

    _click_delete(qtbot, window, 0)
    assert asked == ["Delete this message and its reply?"]
    assert visible_texts(window) == before[2:]
    assert _stored(cid) == [text for _, text in before[2:]]
    # The automatic title named the deleted message: it follows the new first one.
    assert window.store.conversation(cid).title == "second question"
    qtbot.waitUntil(lambda: 0 < _meter(window) < full)  # the meter counts what is left

    # Ctrl+Z where the deletion left the focus: everything back, in place.
    qtbot.keyClick(window.chat_pane.view, Qt.Key.Key_Z, Qt.KeyboardModifier.ControlModifier)
    assert visible_texts(window) == before
    assert _stored(cid) == [text for _, text in before]
    assert window.store.conversation(cid).title == "first question"
    qtbot.waitUntil(lambda: _meter(window) == full)
    assert not window.chat.can_undo_delete()  # one level


def test_deleting_a_reply_removes_all_its_versions_and_keeps_the_question(qtbot, window, asked) -> None:
    _two_exchanges(qtbot, window)
    cid = window.chat.conversation_id
    assert window.chat.regenerate()
    wait_idle(qtbot, window)
    assert window.chat.model.item(3).sibling_count == 2
    before = visible_texts(window)

    _click_delete(qtbot, window, 3)
    assert asked == ["Delete this reply and its other versions (2 in all)?"]
    assert visible_texts(window) == before[:3]
    assert _stored(cid) == [text for _, text in before[:3]]
    assert len(window.store.messages(cid)) == 3

    window.edit_actions["undo"].trigger()  # Edit > Undo from the menu
    assert visible_texts(window) == before
    assert window.chat.model.item(3).sibling_count == 2


def test_a_no_keeps_the_message(qtbot, window, monkeypatch) -> None:
    _two_exchanges(qtbot, window)
    monkeypatch.setattr(QMessageBox, "question", staticmethod(lambda *a, **k: QMessageBox.StandardButton.No))
    before = visible_texts(window)
    _click_delete(qtbot, window, 1)
    assert visible_texts(window) == before and not window.chat.can_undo_delete()


def test_delete_is_disabled_while_a_reply_streams(qtbot, window, fake_engine, asked) -> None:
    fake_engine.reply = lambda m: "token " * 400
    fake_engine.token_delay = 0.005
    load_model(qtbot, window)
    send(qtbot, window, "go on", wait=False)
    qtbot.waitUntil(lambda: len(window.chat.model.items()) == 2 and bool(window.chat.model.item(1).content))
    user = window.chat_pane.view.message_widget(0)
    assert user.delete_button.isVisibleTo(user) and not user.delete_button.isEnabled()
    assert not window.chat_pane.view.message_widget(1).delete_button.isVisibleTo(user)  # the reply itself
    assert not window.chat.delete_message(window.chat.model.item(0).id)
    window.chat.stop()
    wait_idle(qtbot, window)
    assert window.chat_pane.view.message_widget(0).delete_button.isEnabled()


def test_undo_is_forgotten_when_another_conversation_opens_or_a_reply_starts(qtbot, window, asked) -> None:
    _two_exchanges(qtbot, window)
    cid = window.chat.conversation_id
    _click_delete(qtbot, window, 3)
    assert window.chat.can_undo_delete()
    window.chat.new_conversation()
    window.chat.open_conversation(cid)
    assert not window.chat.can_undo_delete()
    window.edit_actions["undo"].trigger()
    assert len(visible_texts(window)) == 3
    _click_delete(qtbot, window, 1)
    send(qtbot, window, "a new turn")  # the conversation moved on: the deletion stays
    assert not window.chat.can_undo_delete()


def test_the_tool_round_of_a_reply_goes_with_it(qtbot, window, asked) -> None:
    store = window.store
    cid = store.create_conversation("Tools").id
    question = store.add_message(cid, None, "user", "what is 2 + 3?").id
    calling = store.add_message(cid, question, "assistant", "Let me compute.").id
    store.set_tool_calls(
        calling,
        [{"id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}', "status": "done", "result": "5"}],
    )
    store.add_message(cid, calling, "assistant", "Tool said: 5")
    window.chat.open_conversation(cid)
    assert window.chat.model.item(1).tool_calls

    _click_delete(qtbot, window, 2)  # the answer after the tool call: the whole reply goes
    assert visible_texts(window) == [("user", "what is 2 + 3?")]
    assert [m.id for m in store.messages(cid)] == [question]
    window.undo()
    assert [item.content for item in window.chat.model.items()] == [
        "what is 2 + 3?",
        "Let me compute.",
        "Tool said: 5",
    ]
    assert window.chat.model.item(1).tool_calls[0]["result"] == "5"


def test_ctrl_z_in_the_message_box_undoes_typing_first_then_the_deletion(qtbot, window, asked) -> None:
    _two_exchanges(qtbot, window)
    before = visible_texts(window)
    _click_delete(qtbot, window, 2)
    composer = window.chat_pane.composer
    composer.setFocus()
    qtbot.keyClicks(composer, "draft")
    qtbot.keyClick(composer, Qt.Key.Key_Z, Qt.KeyboardModifier.ControlModifier)
    assert composer.toPlainText() == "" and visible_texts(window) == before[:2]  # the typing went
    qtbot.keyClick(composer, Qt.Key.Key_Z, Qt.KeyboardModifier.ControlModifier)
    assert visible_texts(window) == before  # nothing left to undo there: the messages came back
