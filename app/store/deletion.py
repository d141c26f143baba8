"""Deleting messages from the middle of a conversation, and putting them back (one-level undo).

What a Delete removes is a *span* of the visible branch (``deletion_span``): a user message with
the reply that answered it, or a reply alone. A reply is the run of assistant messages between two
user messages: a reply that called tools is stored as several assistant messages (the one with the
calls and their results, then the one that went on), and they go together.

The branch below the span is kept: its first message (the *continuation*) is moved up to the
span's parent, so deleting one exchange from the middle leaves the rest of the conversation as it
was. Everything else under the deleted messages goes with them: the other versions of the reply
(regenerations), and the branches hanging from those. A deleted user message's own versions
(edits, its siblings) stay.

``delete_span`` returns a ``DeletedMessages`` holding every row it removed (with the images only
they referenced), which ``restore`` writes back, with the same ids where they are still free, and
the continuation moved back under the span.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from typing import Any

from app.store.store import Message, Store


@dataclass(frozen=True)
class DeletedMessages:
    """What ``delete_span`` removed, enough to put it back as it was."""

    conversation_id: int
    messages: list[dict[str, Any]]  # message rows (every column), oldest first
    image_refs: list[dict[str, Any]]  # their message_images rows
    images: list[dict[str, Any]]  # the image rows those refer to (bytes included)
    continuation_id: int | None  # the message moved up to the span's parent (None: nothing below)
    continuation_parent_id: int | None  # its parent before the move (the span's last message)
    current_leaf_id: int | None  # the conversation's leaf before the deletion
    ids: list[int] = field(default_factory=list)  # ids of the removed messages

    @property
    def count(self) -> int:
        return len(self.messages)


def deletion_span(path: list[Message], message_id: int) -> tuple[int, int]:
    """The (first, last) indices in ``path`` that deleting ``message_id`` removes: a user message
    and the assistant messages after it, or the whole run of assistant messages (one reply, tool
    rounds included) that ``message_id`` belongs to. Raises ``KeyError`` if it is not in ``path``."""
    ids = [m.id for m in path]
    if message_id not in ids:
        raise KeyError(f"message {message_id} is not in the visible branch")
    first = ids.index(message_id)
    if path[first].role == "assistant":
        while first > 0 and path[first - 1].role == "assistant":
            first -= 1
    last = first
    while last + 1 < len(path) and path[last + 1].role == "assistant":
        last += 1
    return first, last


def delete_span(store: Store, path: list[Message], first: int, last: int) -> DeletedMessages:
    """Remove ``path[first:last + 1]`` as described in the module docstring, in one transaction."""
    head = path[first]
    conversation_id = head.conversation_id
    continuation = path[last + 1] if last + 1 < len(path) else None
    # A reply goes with all its versions; a user message goes alone (its edits stay).
    if head.role == "assistant":
        roots = [m.id for m in store.children(conversation_id, head.parent_id)]
    else:
        roots = [head.id]
    conv = store.conversation(conversation_id)
    with store.transaction() as db:
        if continuation is not None:
            db.execute("UPDATE messages SET parent_id = ? WHERE id = ?", (head.parent_id, continuation.id))
        rows = _subtree_rows(db, roots)
        ids = [row["id"] for row in rows]
        image_refs = _rows(
            db,
            "SELECT * FROM message_images WHERE message_id IN (SELECT value FROM json_each(?))"
            " ORDER BY message_id, position",
            ids,
        )
        images = _rows(
            db,
            "SELECT * FROM images WHERE sha256 IN (SELECT value FROM json_each(?))",
            sorted({ref["sha256"] for ref in image_refs}),
        )
        # Children cascade (parent_id ON DELETE CASCADE); the FTS and image triggers fire for each.
        db.execute("DELETE FROM messages WHERE id IN (SELECT value FROM json_each(?))", (json.dumps(roots),))
        leaf = conv.current_leaf_id
        if leaf in ids:
            leaf = head.parent_id if head.parent_id is not None else _newest_root_leaf(store, conversation_id)
            db.execute("UPDATE conversations SET current_leaf_id = ? WHERE id = ?", (leaf, conversation_id))
    return DeletedMessages(
        conversation_id=conversation_id,
        messages=rows,
        image_refs=image_refs,
        images=images,
        continuation_id=continuation.id if continuation is not None else None,
        continuation_parent_id=path[last].id if continuation is not None else None,
        current_leaf_id=conv.current_leaf_id,
        ids=ids,
    )


def restore(store: Store, deleted: DeletedMessages) -> dict[int, int]:
    """Write back what ``delete_span`` removed, in one transaction. Each message keeps its id unless
    another message has taken it since; returns {old id: new id} for those that changed."""
    moved: dict[int, int] = {}
    with store.transaction() as db:
        for image in deleted.images:
            columns = ", ".join(image)
            marks = ", ".join("?" for _ in image)
            db.execute(f"INSERT OR IGNORE INTO images ({columns}) VALUES ({marks})", tuple(image.values()))
        for row in deleted.messages:  # oldest first, so a parent is back before its children
            values = dict(row)
            if values["parent_id"] in moved:
                values["parent_id"] = moved[values["parent_id"]]
            taken = db.execute("SELECT 1 FROM messages WHERE id = ?", (values["id"],)).fetchone()
            if taken is not None:
                del values["id"]
            columns = ", ".join(values)
            marks = ", ".join("?" for _ in values)
            cur = db.execute(f"INSERT INTO messages ({columns}) VALUES ({marks})", tuple(values.values()))
            if taken is not None:
                moved[row["id"]] = cur.lastrowid
        for ref in deleted.image_refs:
            db.execute(
                "INSERT INTO message_images (message_id, position, sha256) VALUES (?, ?, ?)",
                (moved.get(ref["message_id"], ref["message_id"]), ref["position"], ref["sha256"]),
            )
        if deleted.continuation_id is not None:
            parent = deleted.continuation_parent_id
            db.execute(
                "UPDATE messages SET parent_id = ? WHERE id = ?",
                (moved.get(parent, parent), deleted.continuation_id),
            )
        leaf = deleted.current_leaf_id
        db.execute(
            "UPDATE conversations SET current_leaf_id = ? WHERE id = ?",
            (moved.get(leaf, leaf) if leaf is not None else None, deleted.conversation_id),
        )
    return moved


def _rows(db: sqlite3.Connection, sql: str, values: list[Any]) -> list[dict[str, Any]]:
    return [dict(row) for row in db.execute(sql, (json.dumps(values),))]


def _subtree_rows(db: sqlite3.Connection, roots: list[int]) -> list[dict[str, Any]]:
    """Every message row under (and including) ``roots``, oldest first."""
    return [
        dict(row)
        for row in db.execute(
            """
            WITH RECURSIVE below(id) AS (
                SELECT value FROM json_each(?)
                UNION ALL
                SELECT m.id FROM messages m JOIN below ON m.parent_id = below.id
            )
            SELECT messages.* FROM messages JOIN below ON messages.id = below.id ORDER BY messages.id
            """,
            (json.dumps(roots),),
        )
    ]


def _newest_root_leaf(store: Store, conversation_id: int) -> int | None:
    """Where the conversation's view lands when its whole visible branch is gone: the newest leaf
    under its newest remaining first message (another version of it), or nowhere."""
    roots = store.children(conversation_id, None)
    return store.latest_leaf(roots[-1].id) if roots else None
