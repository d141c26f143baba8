"""The chat pane driven through the real main window (offscreen) with the scripted engine:
send, streaming in order, stop, regenerate, edit-and-branch, branch switching, errors."""

from __future__ import annotations

from fake_engine import default_reply
from gui_helpers import load_model, send, visible_texts, wait_idle
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication


def test_send_streams_in_order_and_saves(qtbot, window, fake_engine) -> None:
    load_model(qtbot, window)
    snapshots: list[str] = []

    def snapshot(top_left, _bottom_right, _roles=()):
        item = window.chat.model.item(top_left.row())
        if item.role == "assistant":
            snapshots.append(item.content)

    window.chat.model.dataChanged.connect(snapshot)
    send(qtbot, window, "hello world")

    expected = default_reply([{"role": "user", "content": "hello world"}])
    assert visible_texts(window) == [("user", "hello world"), ("assistant", expected)]
    # Streamed text arrived in order: every update extends the previous one.
    growing = [s for s in snapshots if s]
    assert len(growing) >= 2
    assert all(b.startswith(a) for a, b in zip(growing, growing[1:]))
    # Saved, complete, with stats; the conversation is titled after the first message.
    cid = window.chat.conversation_id
    path = window.store.current_path(cid)
    assert [(m.role, m.content, m.complete) for m in path] == [
        ("user", "hello world", True),
        ("assistant", expected, True),
    ]
    assert path[1].stats["stop_reason"] == "eos" and path[1].stats["new_tokens"] > 0
    assert window.store.conversation(cid).title == "hello world"
    # Rendered: the code block has a Copy link that copies exactly the code.
    reply_widget = window.chat_pane.view.message_widget(1)
    assert "print" in reply_widget.plain_text()
    reply_widget.body.copyRequested.emit(0)
    assert QGuiApplication.clipboard().text() == "print('hello world')"
    # The engine saw the system prompt then the user message.
    assert fake_engine.calls[0]["messages"][0]["role"] == "system"
    assert fake_engine.calls[0]["messages"][-1] == {"role": "user", "content": "hello world"}
    assert "tokens/s" in window.chat_pane.speed_label.text()
    assert window.chat_pane.context_meter.maximum() == 2048 and window.chat_pane.context_meter.value() > 0


def test_shift_enter_is_a_new_line(qtbot, window) -> None:
    composer = window.chat_pane.composer
    composer.setFocus()
    qtbot.keyClicks(composer, "line one")
    qtbot.keyClick(composer, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(composer, "line two")
    assert composer.toPlainText() == "line one\nline two"
    assert window.chat.model.rowCount() == 0


def test_escape_stops_mid_reply_and_keeps_the_partial_text(qtbot, window, fake_engine) -> None:
    fake_engine.reply = lambda m: "token " * 400
    fake_engine.token_delay = 0.005
    load_model(qtbot, window)
    send(qtbot, window, "go on forever", wait=False)
    qtbot.waitUntil(
        lambda: len(window.chat.model.items()) == 2 and len(window.chat.model.item(1).content) > 30
    )
    assert window.chat_pane.stop_button.isEnabled() and not window.chat_pane.send_button.isEnabled()
    assert not window.chat_pane.view.message_widget(0).edit_button.isEnabled()  # no second reply now
    qtbot.keyClick(window.chat_pane.composer, Qt.Key.Key_Escape)
    wait_idle(qtbot, window)

    reply = window.store.current_path(window.chat.conversation_id)[-1]
    assert reply.complete and reply.stats["stop_reason"] == "cancelled"
    assert 0 < len(reply.content) < len("token " * 400)
    assert window.chat.model.item(1).content == reply.content  # nothing lost between screen and disk
    assert window.chat_pane.view.message_widget(1).status_label.text() == "stopped"
    assert window.chat_pane.send_button.isEnabled()
    assert window.chat_pane.view.message_widget(0).edit_button.isEnabled()


def test_partial_reply_is_saved_while_streaming(qtbot, window, fake_engine) -> None:
    fake_engine.reply = lambda m: "slow " * 300
    fake_engine.token_delay = 0.006
    load_model(qtbot, window)
    send(qtbot, window, "take your time", wait=False)
    cid = window.chat.conversation_id

    def saved_partial():
        path = window.store.current_path(cid)
        return len(path) == 2 and not path[1].complete and len(path[1].content) > 0

    qtbot.waitUntil(saved_partial, timeout=4000)
    window.chat.stop()
    wait_idle(qtbot, window)


def test_regenerate_adds_a_sibling_and_both_stay_reachable(qtbot, window, fake_engine) -> None:
    replies = iter(["First answer.", "Second answer."])
    fake_engine.reply = lambda m: next(replies)
    load_model(qtbot, window)
    send(qtbot, window, "question")
    first_id = window.chat.model.item(1).id

    qtbot.mouseClick(window.chat_pane.regenerate_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, window)
    assert visible_texts(window) == [("user", "question"), ("assistant", "Second answer.")]
    widget = window.chat_pane.view.message_widget(1)
    assert widget.branch_label.isVisible() and widget.branch_label.text() == "2/2"

    qtbot.mouseClick(widget.prev_button, Qt.MouseButton.LeftButton)
    assert visible_texts(window) == [("user", "question"), ("assistant", "First answer.")]
    assert window.chat.model.item(1).id == first_id
    assert window.chat_pane.view.message_widget(1).branch_label.text() == "1/2"
    siblings = window.store.siblings(first_id)
    assert [m.content for m in siblings] == ["First answer.", "Second answer."]


def test_edit_starts_a_branch_and_the_old_branch_is_still_reachable(qtbot, window, fake_engine) -> None:
    fake_engine.reply = lambda m: f"Reply to {m[-1]['content']}"
    load_model(qtbot, window)
    send(qtbot, window, "first question")
    send(qtbot, window, "second question")
    assert len(visible_texts(window)) == 4

    # Edit the first user message in place and send it.
    first = window.chat_pane.view.message_widget(0)
    qtbot.mouseClick(first.edit_button, Qt.MouseButton.LeftButton)
    assert first.editor.isVisible()
    first.editor.setPlainText("edited question")
    qtbot.keyClick(first.editor, Qt.Key.Key_Return)
    wait_idle(qtbot, window)
    assert visible_texts(window) == [("user", "edited question"), ("assistant", "Reply to edited question")]
    # The new history was sent to the engine: only the edited message, not the old turns.
    assert [m["content"] for m in fake_engine.calls[-1]["messages"] if m["role"] == "user"] == [
        "edited question"
    ]

    first = window.chat_pane.view.message_widget(0)
    assert first.branch_label.text() == "2/2"
    qtbot.mouseClick(first.prev_button, Qt.MouseButton.LeftButton)
    assert visible_texts(window) == [
        ("user", "first question"),
        ("assistant", "Reply to first question"),
        ("user", "second question"),
        ("assistant", "Reply to second question"),
    ]
    qtbot.mouseClick(window.chat_pane.view.message_widget(0).next_button, Qt.MouseButton.LeftButton)
    assert visible_texts(window)[0] == ("user", "edited question")


def test_escape_in_the_edit_box_cancels_the_edit(qtbot, window) -> None:
    load_model(qtbot, window)
    send(qtbot, window, "keep me")
    first = window.chat_pane.view.message_widget(0)
    qtbot.mouseClick(first.edit_button, Qt.MouseButton.LeftButton)
    qtbot.keyClick(first.editor, Qt.Key.Key_Escape)
    assert not first.editor.isVisible() and first.body.isVisible()
    assert len(window.store.messages(window.chat.conversation_id)) == 2


def test_engine_error_is_shown_and_the_app_keeps_working(qtbot, window, fake_engine) -> None:
    load_model(qtbot, window)
    fake_engine.generate_error = RuntimeError("CUDA out of memory. Tried to allocate 20 GiB")
    send(qtbot, window, "this will fail")
    assert window.chat_pane.error_label.isVisible()
    assert window.chat_pane.error_label.text().startswith("Out of memory")
    # The failed empty reply is not kept; the user message is, ready to regenerate.
    assert visible_texts(window) == [("user", "this will fail")]
    fake_engine.generate_error = None
    qtbot.mouseClick(window.chat_pane.regenerate_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, window)
    assert [r for r, _ in visible_texts(window)] == ["user", "assistant"]


def test_error_after_some_text_keeps_the_text(qtbot, window, fake_engine) -> None:
    load_model(qtbot, window)
    fake_engine.generate_error = RuntimeError("device lost")
    fake_engine.fail_after_tokens = 3
    send(qtbot, window, "partial please")
    item = window.chat.model.item(1)
    assert item.content and "device lost" in item.error
    saved = window.store.message(item.id)
    assert saved.content == item.content and saved.stats["stop_reason"] == "error"


def test_sending_without_a_model_explains(qtbot, window) -> None:
    send(qtbot, window, "anyone there?")
    assert "no model is loaded" in window.chat_pane.error_label.text()


def test_conversation_settings_reach_the_engine(qtbot, window, fake_engine) -> None:
    load_model(qtbot, window)
    window.chat.new_conversation()
    window.chat.set_system_prompt("Answer in French.")
    window.chat.set_sampling("precise", {"temperature": 0.1, "max_new_tokens": 7})
    send(qtbot, window, "bonjour")
    call = fake_engine.calls[-1]
    assert call["messages"][0] == {"role": "system", "content": "Answer in French."}
    assert call["settings"]["temperature"] == 0.1 and call["settings"]["top_p"] == 0.9
    assert call["max_new_tokens"] == 7
    assert window.chat.model.item(1).stats["stop_reason"] == "max_new_tokens"


def test_switching_conversation_mid_reply_stops_it_and_saves_it_where_it_belongs(
    qtbot, window, fake_engine
) -> None:
    fake_engine.reply = lambda m: "long " * 400
    fake_engine.token_delay = 0.005
    load_model(qtbot, window)
    send(qtbot, window, "first chat", wait=False)
    first = window.chat.conversation_id
    qtbot.waitUntil(lambda: len(window.chat.model.items()) == 2 and bool(window.chat.model.item(1).content))
    window.chat.new_conversation()
    wait_idle(qtbot, window)
    assert window.chat.model.rowCount() == 0
    reply = window.store.current_path(first)[-1]
    assert reply.role == "assistant" and reply.complete and reply.stats["stop_reason"] == "cancelled"
    assert reply.content.startswith("long")
    fake_engine.reply = lambda m: "fresh"
    send(qtbot, window, "second chat")
    assert visible_texts(window) == [("user", "second chat"), ("assistant", "fresh")]


def test_closing_the_window_mid_reply_commits_the_text_so_far(qtbot, make_window, fake_engine) -> None:
    fake_engine.reply = lambda m: "word " * 400
    fake_engine.token_delay = 0.005
    window = make_window()
    load_model(qtbot, window)
    send(qtbot, window, "then I quit", wait=False)
    qtbot.waitUntil(
        lambda: len(window.chat.model.items()) == 2 and len(window.chat.model.item(1).content) > 20
    )
    shown = None

    def remember():
        nonlocal shown
        shown = window.chat.model.item(1).content

    window.chat.busyChanged.connect(lambda busy: remember() if not busy else None)
    window.close()
    reply = window.store.current_path(window.chat.conversation_id)[-1]
    assert reply.complete and reply.stats["stop_reason"] == "cancelled"
    assert reply.content == shown and reply.content.startswith("word")


def test_models_refuse_changes_from_other_threads(qtbot) -> None:
    import threading

    from app.chat.message_model import ChatMessageModel, MessageItem
    from app.gui_thread import WrongThreadError

    model = ChatMessageModel()
    model.append(MessageItem(1, "user", "hi"))  # GUI thread: fine
    errors: list[BaseException] = []

    def worker():
        try:
            model.append_text(0, " there")
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], WrongThreadError)
    assert model.item(0).content == "hi"


def test_long_conversation_opens_a_page_at_a_time(qtbot, window) -> None:
    from PySide6.QtWidgets import QAbstractSlider

    from app.chat.view import PAGE

    store = window.store
    conv = store.create_conversation("long one")
    parent = None
    for i in range(60):
        parent = store.add_message(conv.id, parent, "user" if i % 2 == 0 else "assistant", f"message {i}").id
    window.conversations.refresh()
    window.chat.open_conversation(conv.id)
    view = window.chat_pane.view
    assert window.chat.model.rowCount() == 60
    assert len(view.message_widgets()) == PAGE and view.first_built_row == 60 - PAGE
    assert view.message_widgets()[-1].plain_text().strip() == "message 59"
    # Scrolling to the top (as the user does) builds the older page.
    view.verticalScrollBar().triggerAction(QAbstractSlider.SliderAction.SliderToMinimum)
    qtbot.waitUntil(lambda: view.first_built_row == 0)
    assert len(view.message_widgets()) == 60
    assert view.message_widget(0).plain_text().strip() == "message 0"
