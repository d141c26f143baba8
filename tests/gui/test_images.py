"""Images in the chat, through the real main window (offscreen) and the scripted engine: attach by
the button, by drop and by paste; thumbnails in the composer and the conversation; full-size view;
what the engine receives; storage across a restart; export/import; text-only models; bad images."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from gui_helpers import load_model, send, wait_idle
from PIL import Image
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QColor, QDragEnterEvent, QDropEvent, QGuiApplication, QImage
from PySide6.QtWidgets import QApplication, QFileDialog

from engine.api import GenerationRequest


def png_bytes(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def image_file(
    folder: Path, name: str, color: tuple[int, int, int], size: tuple[int, int] = (40, 30)
) -> Path:
    path = folder / name
    path.write_bytes(png_bytes(color, size))
    return path


def drop(widget, mime: QMimeData) -> None:
    """What a drag from a file manager delivers: enter, then drop, at the widget's centre."""
    target = widget.viewport()
    centre = target.rect().center()
    actions = Qt.DropAction.CopyAction
    enter = QDragEnterEvent(centre, actions, mime, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(target, enter)
    assert enter.isAccepted()
    event = QDropEvent(
        QPointF(centre), actions, mime, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier
    )
    QApplication.sendEvent(target, event)


def qimage(color: tuple[int, int, int], width: int, height: int) -> QImage:
    image = QImage(width, height, QImage.Format.Format_RGB32)
    image.fill(QColor(*color))
    return image


def strip_count(window) -> int:
    row = window.chat_pane.attachment_strip.row
    return len(row.buttons) if window.chat_pane.attachment_strip.isVisible() else 0


@pytest.fixture
def vision(fake_engine):
    fake_engine.sees_images = True
    return fake_engine


def test_attach_button_send_and_see_thumbnails(qtbot, window, vision, tmp_path, monkeypatch) -> None:
    red = image_file(tmp_path, "red.png", (255, 0, 0), (40, 30))
    blue = image_file(tmp_path, "blue.png", (0, 0, 255), (12, 50))
    load_model(qtbot, window)
    pane = window.chat_pane
    monkeypatch.setattr(QFileDialog, "getOpenFileNames", lambda *a, **k: ([str(red), str(blue)], ""))
    qtbot.mouseClick(pane.attach_button, Qt.MouseButton.LeftButton)
    assert strip_count(window) == 2
    assert "40×30" in pane.attachment_strip.row.buttons[0].toolTip()
    assert not pane.attachment_strip.notice.isVisible()  # this model sees images

    send(qtbot, window, "what colours are these?")
    # The engine got one user message of content parts, images first, and the bytes in order.
    call = vision.image_calls[-1]
    assert call["messages"][-1] == {
        "role": "user",
        "content": [
            {"type": "image"},
            {"type": "image"},
            {"type": "text", "text": "what colours are these?"},
        ],
    }
    assert call["images"] == [red.read_bytes(), blue.read_bytes()]
    assert vision.calls[-1]["media"].image_sizes == [(40, 30), (12, 50)]
    assert window.chat.model.item(1).content.startswith("You said: what colours are these?")
    # The composer is empty again; the conversation shows the thumbnails.
    assert strip_count(window) == 0 and pane.composer.toPlainText() == ""
    user_widget = pane.view.message_widget(0)
    assert user_widget.thumbnails is not None and user_widget.thumbnails.isVisible()
    assert len(user_widget.thumbnails.buttons) == 2
    icon = user_widget.thumbnails.buttons[1].icon().pixmap(72, 72)
    assert icon.height() > icon.width()  # a tall image stays tall
    assert pane.view.message_widget(1).thumbnails is None  # the reply has none

    # Clicking a thumbnail shows the image at full size.
    qtbot.mouseClick(user_widget.thumbnails.buttons[0], Qt.MouseButton.LeftButton)
    viewer = pane.image_viewer
    assert viewer.isVisible() and "40×30" in viewer.windowTitle()
    assert viewer.label.pixmap().size().toTuple() == (40, 30)
    viewer.close()


def test_drop_files_and_image_data_on_the_composer(qtbot, window, tmp_path) -> None:
    pane = window.chat_pane
    files = QMimeData()
    files.setUrls(
        [QUrl.fromLocalFile(str(image_file(tmp_path, f"{i}.png", (i * 60, 0, 0)))) for i in range(2)]
    )
    drop(pane.composer, files)
    assert strip_count(window) == 2
    data = QMimeData()
    data.setImageData(qimage((0, 200, 0), 20, 10))
    drop(pane.composer, data)
    assert strip_count(window) == 3
    blob = pane.attachments.blobs()[2]
    assert (blob.mime, blob.width, blob.height) == ("image/png", 20, 10)
    assert pane.composer.toPlainText() == ""  # nothing went in as text
    # Text still drops as text.
    text = QMimeData()
    text.setText("dropped words")
    drop(pane.composer, text)
    assert "dropped words" in pane.composer.toPlainText() and strip_count(window) == 3
    # The × removes one.
    qtbot.mouseClick(pane.attachment_strip.row.remove_buttons[0], Qt.MouseButton.LeftButton)
    assert strip_count(window) == 2


def test_paste_send_restart_and_the_image_is_still_there(qtbot, make_window, vision) -> None:
    window = make_window()
    load_model(qtbot, window)
    pane = window.chat_pane
    QGuiApplication.clipboard().setImage(qimage((10, 20, 30), 33, 17))
    pane.composer.setFocus()
    qtbot.keyClick(pane.composer, Qt.Key.Key_V, Qt.KeyboardModifier.ControlModifier)
    assert strip_count(window) == 1 and pane.composer.toPlainText() == ""
    pasted = pane.attachments.blobs()[0]
    assert (pasted.width, pasted.height) == (33, 17)
    # An image alone can be sent (no text needed).
    qtbot.keyClick(pane.composer, Qt.Key.Key_Return)
    wait_idle(qtbot, window)
    cid = window.chat.conversation_id
    assert window.store.conversation(cid).title == "Image"
    assert vision.image_calls[-1]["images"] == [pasted.data]
    # The same picture pasted again in a second message is stored once.
    QGuiApplication.clipboard().setImage(qimage((10, 20, 30), 33, 17))
    pane.composer.paste()
    send(qtbot, window, "same picture again")
    assert window.store.image_count() == 1
    # Both images of the conversation go to the engine on the second turn.
    assert vision.image_calls[-1]["images"] == [pasted.data, pasted.data]
    window.close()

    again = make_window()
    assert again.chat.conversation_id == cid
    path = again.store.current_path(cid)
    assert [m.images for m in path if m.role == "user"] == [[pasted.sha256], [pasted.sha256]]
    widget = again.chat_pane.view.message_widget(0)
    assert widget.thumbnails is not None and len(widget.thumbnails.buttons) == 1
    qtbot.mouseClick(widget.thumbnails.buttons[0], Qt.MouseButton.LeftButton)
    assert again.chat_pane.image_viewer.label.pixmap().size().toTuple() == (33, 17)


def test_a_text_only_model_refuses_new_images_and_leaves_old_ones_out(
    qtbot, window, fake_engine, tmp_path
) -> None:
    fake_engine.sees_images = True
    load_model(qtbot, window, "vision-model")
    pane = window.chat_pane
    pane.attach([image_file(tmp_path, "a.png", (1, 1, 1))])
    send(qtbot, window, "describe it")
    assert len(fake_engine.calls) == 1

    # Now a text-only model: a message with an image is refused, nothing is lost or stored.
    fake_engine.sees_images = False
    load_model(qtbot, window, "text-model")
    pane.attach([image_file(tmp_path, "b.png", (2, 2, 2))])
    assert pane.attachment_strip.notice.isVisible()
    assert "cannot see images" in pane.attachment_strip.notice.text()
    send(qtbot, window, "and this?")
    assert pane.attachment_strip.notice.text().startswith("Not sent: text-model cannot see images")
    assert not pane.error_label.isVisible()  # said once, beside the images
    assert pane.composer.toPlainText() == "and this?" and strip_count(window) == 1
    assert len(window.chat.model.items()) == 2 and len(fake_engine.calls) == 1
    assert window.store.image_count() == 1
    # The controller refuses too (for any caller), and says why.
    errors: list[str] = []
    window.chat.errorOccurred.connect(errors.append)
    assert not window.chat.submit("and this?", pane.attachments.blobs())
    assert errors and "text-model cannot see images" in errors[0] and len(window.chat.model.items()) == 2

    # Without the image it goes, and the earlier image is left out, as the reply says.
    qtbot.mouseClick(pane.attachment_strip.row.remove_buttons[0], Qt.MouseButton.LeftButton)
    assert not pane.attachment_strip.notice.isVisible()
    send(qtbot, window, "then just text")
    messages = fake_engine.calls[-1]["messages"]
    assert all(isinstance(m["content"], str) for m in messages)
    assert {"role": "user", "content": "describe it"} in messages
    reply = window.store.current_path(window.chat.conversation_id)[-1]
    assert reply.stats["images_left_out"] == 1
    assert "1 image left out" in pane.view.message_widget(3).stats_label.text()


def test_bad_images_are_refused_with_reasons_and_good_ones_attach(qtbot, window, tmp_path) -> None:
    pane = window.chat_pane
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    text = tmp_path / "notes.txt"
    text.write_text("not a picture")
    good = image_file(tmp_path, "good.png", (9, 9, 9))
    assert pane.attach([empty, text, good, tmp_path / "missing.png"]) == 1
    message = pane.error_label.text()
    assert pane.error_label.isVisible()
    assert "empty.png is empty" in message and "notes.txt is not an image" in message
    assert "cannot read missing.png" in message
    assert strip_count(window) == 1


def test_an_image_the_engine_cannot_decode_gives_a_readable_error(qtbot, window, vision, tmp_path) -> None:
    load_model(qtbot, window)
    pane = window.chat_pane
    data = png_bytes((5, 5, 5), (64, 64))
    broken = tmp_path / "truncated.png"
    broken.write_bytes(data[: len(data) // 2])  # a valid header, pixels cut off
    assert pane.attach([broken]) == 1  # the header reads; the pixels fail when the engine decodes
    send(qtbot, window, "what is this?")
    assert "Could not finish the reply" in pane.error_label.text() and "corrupt" in pane.error_label.text()
    assert window.chat.model.items()[-1].role == "user"  # the empty reply was dropped; Regenerate can retry
    assert window.chat_pane.send_button.isEnabled()


def test_export_and_import_keep_the_images(qtbot, window, vision, tmp_path) -> None:
    load_model(qtbot, window)
    window.chat_pane.attach([image_file(tmp_path, "x.png", (7, 8, 9), (21, 13))])
    send(qtbot, window, "keep this")
    original = window.chat.conversation_id
    sha = window.store.current_path(original)[0].images[0]
    exported = window.export_conversation(tmp_path / "chat.json", "json")
    window.chat.delete_conversation(original)
    assert window.store.image_count() == 0  # nothing left refers to it

    imported = window.import_conversation(exported)
    assert window.chat.conversation_id == imported
    assert window.store.current_path(imported)[0].images == [sha]
    widget = window.chat_pane.view.message_widget(0)
    assert widget.thumbnails is not None and len(widget.thumbnails.buttons) == 1
    assert window.chat_pane.images.image(sha).size().toTuple() == (21, 13)


def test_worker_fits_a_conversation_with_images_to_the_context(qtbot, engine_client, vision) -> None:
    with qtbot.waitSignal(engine_client.loaded, timeout=5000) as loaded:
        engine_client.load("/models/vlm", cache_bits=(4, 8))
    assert loaded.args[0].sees_images is True and loaded.args[0].cache_bits == (4, 8)
    assert vision.load_options[-1]["cache_bits"] == (4, 8)
    old, new = png_bytes((1, 0, 0)), png_bytes((0, 1, 0))
    messages = [
        {"role": "user", "content": "old " * 1200, "images": [old]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "new", "images": [new]},
    ]
    with qtbot.waitSignal(engine_client.generationFinished, timeout=5000) as finished:
        engine_client.generate(messages, GenerationRequest(max_new_tokens=1500))
    stats = finished.args[1]
    assert stats.stop_reason == "eos" and stats.trimmed_messages == 1
    # The oldest turn went, and its image with it; the prompt the engine streams is the one sent.
    assert vision.image_calls[-1]["images"] == [new]
    assert vision.calls[-1]["messages"][0]["content"] == "ok"
    assert stats.prompt_tokens == vision.calls[-1]["prompt_tokens"]
    # Counting a conversation with images counts the images' tokens too.
    with qtbot.waitSignal(engine_client.tokensCounted, timeout=5000) as counted:
        engine_client.count_tokens(messages[2:])
    assert counted.args[1] == 1 + 4 + 16
