"""Deleting messages from a conversation's branch and putting them back (app.store.deletion)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from app.store import ImageBlob, Store
from app.store.deletion import delete_span, deletion_span, restore
from app.store.export import from_json, to_json, to_markdown


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "chat.sqlite3")
    yield s
    s.close()


def _png() -> ImageBlob:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 10, 10)).save(buffer, "PNG")
    return ImageBlob(buffer.getvalue(), "image/png", 4, 4)


def _chat(store: Store) -> tuple[int, dict[str, int]]:
    """u1 -> a1 (and an older version a1x) -> u2 [image] -> a2 (tool calls) -> a2b -> u3 -> a3."""
    cid = store.create_conversation("Chat").id
    ids: dict[str, int] = {}
    ids["u1"] = store.add_message(cid, None, "user", "first question").id
    ids["a1x"] = store.add_message(cid, ids["u1"], "assistant", "first answer, old version").id
    ids["a1"] = store.add_message(cid, ids["u1"], "assistant", "first answer").id
    ids["u2"] = store.add_message(cid, ids["a1"], "user", "look at this", images=[_png()]).id
    ids["a2"] = store.add_message(cid, ids["u2"], "assistant", "").id
    store.set_tool_calls(
        ids["a2"], [{"id": "c1", "name": "look", "arguments": "{}", "status": "done", "result": "red"}]
    )
    ids["a2b"] = store.add_message(cid, ids["a2"], "assistant", "it is red").id
    ids["u3"] = store.add_message(cid, ids["a2b"], "user", "thanks").id
    ids["a3"] = store.add_message(cid, ids["u3"], "assistant", "you are welcome").id
    return cid, ids


def _contents(store: Store, cid: int) -> list[str]:
    return [m.content for m in store.current_path(cid)]


def test_the_span_is_a_user_message_with_its_reply_or_a_whole_reply(store: Store) -> None:
    cid, ids = _chat(store)
    path = store.current_path(cid)
    at = {m.id: i for i, m in enumerate(path)}
    row = {name: at[i] for name, i in ids.items() if i in at}
    assert deletion_span(path, ids["u2"]) == (row["u2"], row["a2b"])  # the reply's tool round too
    assert deletion_span(path, ids["a2b"]) == (row["a2"], row["a2b"])  # either part: the whole reply
    assert deletion_span(path, ids["a3"]) == (row["a3"], row["a3"])
    with pytest.raises(KeyError, match="not in the visible branch"):
        deletion_span(path, ids["a1x"])


def test_deleting_a_user_message_takes_its_reply_and_closes_the_branch(store: Store, tmp_path: Path) -> None:
    cid, ids = _chat(store)
    path = store.current_path(cid)
    deleted = delete_span(store, path, *deletion_span(path, ids["u2"]))
    assert sorted(deleted.ids) == sorted([ids["u2"], ids["a2"], ids["a2b"]])
    assert _contents(store, cid) == ["first question", "first answer", "thanks", "you are welcome"]
    assert store.image_count() == 0  # the image went with the last message that showed it
    assert store.search("red") == []  # and the text left the search index
    store.close()
    reopened = Store(tmp_path / "chat.sqlite3")
    try:
        assert _contents(reopened, cid) == ["first question", "first answer", "thanks", "you are welcome"]
        assert len(reopened.messages(cid)) == 5
        assert "look at this" not in to_markdown(reopened, cid)
        copy = from_json(reopened, to_json(reopened, cid))
        assert _contents(reopened, copy) == _contents(reopened, cid)
    finally:
        reopened.close()


def test_deleting_a_reply_takes_all_its_versions_only(store: Store) -> None:
    cid, ids = _chat(store)
    path = store.current_path(cid)
    deleted = delete_span(store, path, *deletion_span(path, ids["a1"]))
    assert sorted(deleted.ids) == sorted([ids["a1"], ids["a1x"]])
    assert _contents(store, cid) == [
        "first question",
        "look at this",
        "",
        "it is red",
        "thanks",
        "you are welcome",
    ]
    assert [m.id for m in store.siblings(ids["u2"])] == [ids["u2"]]


def test_deleting_the_last_reply_moves_the_leaf_to_its_question(store: Store) -> None:
    cid, ids = _chat(store)
    path = store.current_path(cid)
    delete_span(store, path, *deletion_span(path, ids["a3"]))
    assert store.conversation(cid).current_leaf_id == ids["u3"]


def test_deleting_the_only_exchange_leaves_an_empty_conversation_or_the_other_version(store: Store) -> None:
    cid = store.create_conversation("Chat").id
    old = store.add_message(cid, None, "user", "old wording").id
    store.add_message(cid, old, "assistant", "old answer")
    new = store.add_message(cid, None, "user", "new wording").id
    store.add_message(cid, new, "assistant", "new answer")
    path = store.current_path(cid)
    delete_span(store, path, *deletion_span(path, new))
    assert _contents(store, cid) == ["old wording", "old answer"]  # the edit's other version shows
    path = store.current_path(cid)
    delete_span(store, path, *deletion_span(path, old))
    assert store.current_path(cid) == [] and store.messages(cid) == []


def test_restore_puts_everything_back_in_place(store: Store) -> None:
    cid, ids = _chat(store)
    before = [(m.id, m.parent_id, m.role, m.content, m.images, m.tool_calls) for m in store.messages(cid)]
    path = store.current_path(cid)
    deleted = delete_span(store, path, *deletion_span(path, ids["u2"]))
    assert restore(store, deleted) == {}
    after = [(m.id, m.parent_id, m.role, m.content, m.images, m.tool_calls) for m in store.messages(cid)]
    assert after == before
    assert store.conversation(cid).current_leaf_id == ids["a3"]
    assert store.image_count() == 1 and store.search("red")


def test_restore_finds_new_ids_when_the_old_ones_were_taken(store: Store) -> None:
    cid, ids = _chat(store)
    path = store.current_path(cid)
    deleted = delete_span(store, path, *deletion_span(path, ids["a3"]))
    # SQLite hands the highest free id to the next message: the deleted reply's.
    other = store.create_conversation("Other").id
    taken = store.add_message(other, None, "user", "hi").id
    assert taken == ids["a3"]
    moved = restore(store, deleted)
    assert set(moved) == {ids["a3"]}
    assert _contents(store, cid)[-1] == "you are welcome"
    assert store.conversation(cid).current_leaf_id == moved[ids["a3"]]
    assert store.message(taken).content == "hi"
