"""Conversations and their message trees, persisted in SQLite.

A conversation is a tree of messages: each message has a ``parent_id`` (None for the first one).
Regenerating a reply or editing a user message adds a *sibling* instead of overwriting, so every
branch stays reachable. ``current_leaf_id`` remembers which branch the user was looking at; the
visible conversation is the path from the root to that leaf.

Every write is committed before the method returns (the connection is in autocommit mode), which
is what makes "a kill loses nothing that was complete" true. The store is used from the GUI thread
only: each write is a few hundred microseconds, and a write that finds the database locked by
another program fails after ``GUI_BUSY_TIMEOUT_MS`` rather than freezing the window (the chat
controller keeps the text and retries).
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.store.database import GUI_BUSY_TIMEOUT_MS, connect


@dataclass
class Conversation:
    id: int
    title: str
    created_at: float
    updated_at: float
    system_prompt: str = ""
    preset: str = "balanced"
    sampling: dict[str, Any] = field(default_factory=dict)
    current_leaf_id: int | None = None
    json_schema: str = ""  # structured output: replies must be JSON valid under it ('' = off)
    tools_enabled: bool = False  # replies may call the MCP servers' tools (app.tools)


@dataclass
class Message:
    id: int
    conversation_id: int
    parent_id: int | None
    role: str
    content: str
    created_at: float
    complete: bool = True
    stats: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    images: list[str] = field(default_factory=list)  # sha256 of each attached image, in order
    # An assistant's tool calls and what became of each: {"id", "name", "arguments", "status", "result"}.
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class ImageBlob:
    """An image's encoded bytes (as the user gave them: PNG, JPEG...) and what we know of it."""

    data: bytes
    mime: str
    width: int
    height: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclass(frozen=True)
class StoredImage:
    """An image in the store, without its bytes (``Store.image_data`` reads those)."""

    sha256: str
    mime: str
    width: int
    height: int
    size: int


@dataclass
class SearchHit:
    conversation_id: int
    title: str
    message_id: int | None  # None when only the title matched
    snippet: str


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(
        id=row["id"],
        title=row["title"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        system_prompt=row["system_prompt"],
        preset=row["preset"],
        sampling=json.loads(row["sampling"] or "{}"),
        current_leaf_id=row["current_leaf_id"],
        json_schema=row["json_schema"],
        tools_enabled=bool(row["tools_enabled"]),
    )


def _message(row: sqlite3.Row) -> Message:
    return Message(
        id=row["id"],
        conversation_id=row["conversation_id"],
        parent_id=row["parent_id"],
        role=row["role"],
        content=row["content"],
        created_at=row["created_at"],
        complete=bool(row["complete"]),
        stats=json.loads(row["stats"] or "{}"),
        model=row["model"],
        tool_calls=json.loads(row["tool_calls"] or "[]"),
    )


def insert_images(db: sqlite3.Connection, message_id: int, images: Sequence[ImageBlob | str]) -> None:
    """Attach ``images`` to a message, inside the caller's transaction. An ``ImageBlob`` is stored
    unless an image with its hash already is (so a duplicate costs one row of references); a
    ``str`` is the hash of an image already stored (an edited message keeps its images)."""
    for position, image in enumerate(images):
        if isinstance(image, ImageBlob):
            sha = image.sha256
            db.execute(
                "INSERT OR IGNORE INTO images (sha256, data, mime, width, height, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (sha, image.data, image.mime, image.width, image.height, time.time()),
            )
        else:
            sha = image
        db.execute(
            "INSERT INTO message_images (message_id, position, sha256) VALUES (?, ?, ?)",
            (message_id, position, sha),
        )


def fts_query(text: str) -> str:
    """Turn what a user typed into a safe FTS5 query: every word must occur, the last as a prefix
    (so results appear while typing). Quoting each word keeps FTS syntax characters inert."""
    words = re.findall(r"\w+", text, flags=re.UNICODE)
    if not words:
        return ""
    quoted = [f'"{w}"' for w in words]
    quoted[-1] += "*"
    return " ".join(quoted)


class Store:
    """All persistence of the app: conversations, messages, settings."""

    def __init__(self, path: str | Path, busy_timeout_ms: int = GUI_BUSY_TIMEOUT_MS) -> None:
        self.db_path = Path(path)
        self.db = connect(self.db_path, busy_timeout_ms=busy_timeout_ms)

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """Group several writes so they land together or not at all."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
            self.db.execute("COMMIT")
        except BaseException:
            # SQLite may already have rolled back (a full disk, an I/O error): a second ROLLBACK
            # would raise "no transaction is active" and hide the error that matters.
            if self.db.in_transaction:
                with suppress(sqlite3.Error):
                    self.db.execute("ROLLBACK")
            raise

    # -- conversations ---------------------------------------------------------------------------

    def create_conversation(
        self,
        title: str = "New chat",
        system_prompt: str = "",
        preset: str = "balanced",
        sampling: dict[str, Any] | None = None,
        created_at: float | None = None,
        json_schema: str = "",
    ) -> Conversation:
        now = created_at if created_at is not None else time.time()
        cur = self.db.execute(
            "INSERT INTO conversations"
            " (title, created_at, updated_at, system_prompt, preset, sampling, json_schema)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (title, now, now, system_prompt, preset, json.dumps(sampling or {}), json_schema),
        )
        return self.conversation(cur.lastrowid)

    def conversation(self, conversation_id: int) -> Conversation:
        row = self.db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conversation_id}")
        return _conversation(row)

    def conversations(self) -> list[Conversation]:
        """All conversations, most recently active first."""
        rows = self.db.execute("SELECT * FROM conversations ORDER BY updated_at DESC, id DESC")
        return [_conversation(r) for r in rows]

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        self.db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def delete_conversation(self, conversation_id: int) -> None:
        # Messages go with it (ON DELETE CASCADE) and the FTS triggers fire for each.
        self.db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def update_conversation(
        self,
        conversation_id: int,
        *,
        system_prompt: str | None = None,
        preset: str | None = None,
        sampling: dict[str, Any] | None = None,
        json_schema: str | None = None,
        tools_enabled: bool | None = None,
    ) -> None:
        sets, args = [], []
        if tools_enabled is not None:
            sets.append("tools_enabled = ?")
            args.append(int(tools_enabled))
        if system_prompt is not None:
            sets.append("system_prompt = ?")
            args.append(system_prompt)
        if preset is not None:
            sets.append("preset = ?")
            args.append(preset)
        if sampling is not None:
            sets.append("sampling = ?")
            args.append(json.dumps(sampling))
        if json_schema is not None:
            sets.append("json_schema = ?")
            args.append(json_schema)
        if sets:
            self.db.execute(
                f"UPDATE conversations SET {', '.join(sets)} WHERE id = ?", (*args, conversation_id)
            )

    def set_current_leaf(self, conversation_id: int, leaf_id: int | None) -> None:
        self.db.execute(
            "UPDATE conversations SET current_leaf_id = ? WHERE id = ?", (leaf_id, conversation_id)
        )

    # -- messages --------------------------------------------------------------------------------

    def add_message(
        self,
        conversation_id: int,
        parent_id: int | None,
        role: str,
        content: str,
        *,
        complete: bool = True,
        stats: dict[str, Any] | None = None,
        model: str = "",
        created_at: float | None = None,
        images: Sequence[ImageBlob | str] = (),
    ) -> Message:
        """Append a message under ``parent_id`` and make it the conversation's current leaf.
        ``images`` are stored with it in the same transaction (see :func:`insert_images`)."""
        now = created_at if created_at is not None else time.time()
        with self.transaction() as db:
            cur = db.execute(
                "INSERT INTO messages (conversation_id, parent_id, role, content, created_at, complete,"
                " stats, model) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    conversation_id,
                    parent_id,
                    role,
                    content,
                    now,
                    int(complete),
                    json.dumps(stats or {}),
                    model,
                ),
            )
            insert_images(db, cur.lastrowid, images)
            db.execute(
                "UPDATE conversations SET updated_at = ?, current_leaf_id = ? WHERE id = ?",
                (now, cur.lastrowid, conversation_id),
            )
        return self.message(cur.lastrowid)

    def update_message(
        self,
        message_id: int,
        content: str,
        *,
        complete: bool | None = None,
        stats: dict[str, Any] | None = None,
    ) -> None:
        """Replace a message's text: used for the periodic save of a streaming reply and its end."""
        sets, args = ["content = ?"], [content]
        if complete is not None:
            sets.append("complete = ?")
            args.append(int(complete))
        if stats is not None:
            sets.append("stats = ?")
            args.append(json.dumps(stats))
        self.db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*args, message_id))

    def set_tool_calls(self, message_id: int, calls: Sequence[dict[str, Any]]) -> None:
        """Record a message's tool calls and what became of them (see ``Message.tool_calls``)."""
        self.db.execute(
            "UPDATE messages SET tool_calls = ? WHERE id = ?", (json.dumps(list(calls)), message_id)
        )

    def delete_message(self, message_id: int) -> None:
        """Remove a message and everything below it (a failed, empty reply)."""
        self.db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    def message(self, message_id: int) -> Message:
        row = self.db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise KeyError(f"no message {message_id}")
        return self._with_images([_message(row)])[0]

    def messages(self, conversation_id: int) -> list[Message]:
        """Every message of the conversation, all branches, in creation order."""
        rows = self.db.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        )
        return self._with_images([_message(r) for r in rows])

    def children(self, conversation_id: int, parent_id: int | None) -> list[Message]:
        rows = self.db.execute(
            "SELECT * FROM messages WHERE conversation_id = ? AND parent_id IS ? ORDER BY id",
            (conversation_id, parent_id),
        )
        return [_message(r) for r in rows]

    def siblings(self, message_id: int) -> list[Message]:
        """The message and its alternatives (same parent), oldest first."""
        msg = self.message(message_id)
        return self.children(msg.conversation_id, msg.parent_id)

    def path(self, leaf_id: int | None) -> list[Message]:
        """Messages from the root down to ``leaf_id`` (one recursive query, not one per level)."""
        if leaf_id is None:
            return []
        rows = self.db.execute(
            """
            WITH RECURSIVE chain(id, depth) AS (
                SELECT ?, 0
                UNION ALL
                SELECT m.parent_id, chain.depth + 1 FROM messages m JOIN chain ON m.id = chain.id
                WHERE m.parent_id IS NOT NULL
            )
            SELECT messages.* FROM chain JOIN messages ON messages.id = chain.id ORDER BY chain.depth DESC
            """,
            (leaf_id,),
        )
        return self._with_images([_message(r) for r in rows])

    def current_path(self, conversation_id: int) -> list[Message]:
        return self.path(self.conversation(conversation_id).current_leaf_id)

    def latest_leaf(self, message_id: int) -> int:
        """Follow the newest child from ``message_id`` down to a leaf: where a branch switch lands."""
        conversation_id = self.message(message_id).conversation_id
        current = message_id
        while True:
            row = self.db.execute(
                "SELECT id FROM messages WHERE conversation_id = ? AND parent_id = ?"
                " ORDER BY id DESC LIMIT 1",
                (conversation_id, current),
            ).fetchone()
            if row is None:
                return current
            current = row["id"]

    def incomplete_messages(self, conversation_id: int | None = None) -> list[Message]:
        """Replies a crash or kill interrupted while streaming."""
        if conversation_id is None:
            rows = self.db.execute("SELECT * FROM messages WHERE complete = 0 ORDER BY id")
        else:
            rows = self.db.execute(
                "SELECT * FROM messages WHERE complete = 0 AND conversation_id = ? ORDER BY id",
                (conversation_id,),
            )
        return [_message(r) for r in rows]

    # -- images --------------------------------------------------------------------------------------

    def _with_images(self, messages: list[Message]) -> list[Message]:
        """Fill in each message's image hashes (one query for the lot, ids passed as one JSON
        array so a long conversation never hits SQLite's limit on bound parameters)."""
        if not messages:
            return messages
        by_id = {m.id: m for m in messages}
        rows = self.db.execute(
            "SELECT message_id, sha256 FROM message_images"
            " WHERE message_id IN (SELECT value FROM json_each(?)) ORDER BY message_id, position",
            (json.dumps(list(by_id)),),
        )
        for r in rows:
            by_id[r["message_id"]].images.append(r["sha256"])
        return messages

    def image(self, sha256: str) -> StoredImage:
        row = self.db.execute(
            "SELECT sha256, mime, width, height, length(data) AS size FROM images WHERE sha256 = ?",
            (sha256,),
        ).fetchone()
        if row is None:
            raise KeyError(f"no image {sha256}")
        return StoredImage(row["sha256"], row["mime"], row["width"], row["height"], row["size"])

    def image_data(self, sha256: str) -> bytes:
        row = self.db.execute("SELECT data FROM images WHERE sha256 = ?", (sha256,)).fetchone()
        if row is None:
            raise KeyError(f"no image {sha256}")
        return bytes(row["data"])

    def image_count(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM images").fetchone()[0])

    # -- search ----------------------------------------------------------------------------------

    def search(self, text: str, limit: int = 200) -> list[SearchHit]:
        """Conversations whose title or any message matches ``text``; best message match first."""
        query = fts_query(text)
        if not query:
            return []
        hits: dict[int, SearchHit] = {}
        rows = self.db.execute(
            """
            SELECT m.conversation_id, c.title, m.id AS message_id,
                   snippet(messages_fts, 0, '[', ']', '…', 12) AS snip
            FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid
            JOIN conversations c ON c.id = m.conversation_id
            WHERE messages_fts MATCH ? ORDER BY bm25(messages_fts) LIMIT ?
            """,
            (query, limit),
        )
        for r in rows:
            hits.setdefault(
                r["conversation_id"], SearchHit(r["conversation_id"], r["title"], r["message_id"], r["snip"])
            )
        like = "%" + text.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        for r in self.db.execute(
            "SELECT id, title FROM conversations WHERE title LIKE ? ESCAPE '\\' ORDER BY updated_at DESC",
            (like,),
        ):
            hits.setdefault(r["id"], SearchHit(r["id"], r["title"], None, r["title"]))
        return list(hits.values())

    # -- settings --------------------------------------------------------------------------------

    def get_setting(self, key: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return json.loads(row["value"]) if row is not None else default

    def set_setting(self, key: str, value: Any) -> None:
        self.db.execute(
            "INSERT INTO settings (key, value) VALUES (?, ?)"
            " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, json.dumps(value)),
        )
