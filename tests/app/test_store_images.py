"""Images in the store: content-addressed (a duplicate costs nothing), released with the last
message that shows them, migrated onto an old database, exported and imported with the chat."""

from __future__ import annotations

import base64
import io
import json
import sqlite3
from pathlib import Path

import pytest
from PIL import Image

from app.store import ImageBlob, Store
from app.store.export import JSON_VERSION, ImportFormatError, from_json, to_json, to_markdown
from app.store.migrations import LATEST_VERSION, migrate


def png(color: tuple[int, int, int], size: tuple[int, int] = (8, 6)) -> ImageBlob:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return ImageBlob(buffer.getvalue(), "image/png", *size)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "chat.sqlite3")
    yield s
    s.close()


def test_duplicates_are_stored_once_and_released_with_the_last_reference(store: Store) -> None:
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    a = store.create_conversation("a")
    b = store.create_conversation("b")
    m1 = store.add_message(a.id, None, "user", "two of the same", images=[red, red])
    store.add_message(a.id, m1.id, "user", "and blue", images=[blue])
    m3 = store.add_message(b.id, None, "user", "red again elsewhere", images=[red])
    assert store.image_count() == 2
    assert store.message(m1.id).images == [red.sha256, red.sha256]
    assert [m.images for m in store.current_path(a.id)] == [[red.sha256, red.sha256], [blue.sha256]]
    assert store.image_data(red.sha256) == red.data
    meta = store.image(red.sha256)
    assert (meta.mime, meta.width, meta.height, meta.size) == ("image/png", 8, 6, len(red.data))

    # Deleting conversation a (its messages cascade) releases blue; red is still shown in b.
    store.delete_conversation(a.id)
    assert store.image_count() == 1 and store.message(m3.id).images == [red.sha256]
    with pytest.raises(KeyError):
        store.image_data(blue.sha256)
    store.delete_message(m3.id)
    assert store.image_count() == 0


def test_a_message_can_refer_to_a_stored_image_by_hash(store: Store) -> None:
    red = png((255, 0, 0))
    conv = store.create_conversation()
    first = store.add_message(conv.id, None, "user", "look", images=[red])
    edited = store.add_message(conv.id, None, "user", "look again", images=first.images)
    assert edited.images == [red.sha256] and store.image_count() == 1
    store.delete_message(first.id)
    assert store.image_data(red.sha256) == red.data  # still shown by the edit


def test_an_old_database_gains_the_image_tables(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    migrate(db, target=3)
    db.execute("INSERT INTO conversations (title, created_at, updated_at) VALUES ('old', 0, 0)")
    db.execute(
        "INSERT INTO messages (conversation_id, role, content, created_at) VALUES (1, 'user', 'hi', 0)"
    )
    db.close()
    store = Store(path)
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == LATEST_VERSION
    assert store.message(1).images == []
    store.add_message(1, 1, "user", "now with a picture", images=[png((1, 2, 3))])
    assert store.image_count() == 1
    store.close()


def test_json_export_embeds_images_once_and_import_restores_them(store: Store, tmp_path: Path) -> None:
    red, blue = png((255, 0, 0)), png((0, 0, 255), (3, 9))
    conv = store.create_conversation("pictures")
    m1 = store.add_message(conv.id, None, "user", "what is this?", images=[red, blue])
    m2 = store.add_message(conv.id, m1.id, "assistant", "two squares")
    store.add_message(conv.id, m2.id, "user", "and this one again?", images=[red])
    data = json.loads(json.dumps(to_json(store, conv.id)))  # through real JSON text
    assert data["version"] == JSON_VERSION
    assert sorted(data["images"]) == sorted([red.sha256, blue.sha256])  # each image once
    assert base64.b64decode(data["images"][blue.sha256]["data"]) == blue.data
    assert data["images"][blue.sha256]["width"] == 3

    other = Store(tmp_path / "other.sqlite3")
    new_id = from_json(other, data)
    path = other.current_path(new_id)
    assert [(m.role, m.content) for m in path] == [(m.role, m.content) for m in store.current_path(conv.id)]
    assert [m.images for m in path] == [[red.sha256, blue.sha256], [], [red.sha256]]
    assert other.image_data(blue.sha256) == blue.data and other.image_count() == 2
    # Importing it again adds a conversation but no image bytes.
    from_json(other, data)
    assert other.image_count() == 2
    other.close()

    assert "*[2 images attached]*" in to_markdown(store, conv.id)


def test_import_refuses_damaged_images_and_adds_nothing(store: Store) -> None:
    red = png((255, 0, 0))
    conv = store.create_conversation("pictures")
    store.add_message(conv.id, None, "user", "see", images=[red])
    data = to_json(store, conv.id)
    before = len(store.conversations())

    damaged = json.loads(json.dumps(data))
    damaged["images"][red.sha256]["data"] = base64.b64encode(b"not the picture").decode()
    with pytest.raises(ImportFormatError, match="damaged"):
        from_json(store, damaged)
    missing = json.loads(json.dumps(data))
    missing["images"] = {}
    with pytest.raises(ImportFormatError, match="image"):
        from_json(store, missing)
    assert len(store.conversations()) == before


def test_version_1_exports_still_import(store: Store) -> None:
    v1 = {
        "format": "trellis-chat-conversation",
        "version": 1,
        "title": "old",
        "messages": [{"id": 1, "parent_id": None, "role": "user", "content": "hello"}],
        "current_leaf_id": 1,
    }
    cid = from_json(store, v1)
    assert [(m.content, m.images) for m in store.current_path(cid)] == [("hello", [])]
