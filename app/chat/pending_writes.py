"""Writes the store could not take yet, kept in order until it can.

A reply must not be lost, nor the window freeze, because the disk is full, another program holds
the database's write lock, or the data folder went read-only. When a chat write fails, the chat
controller queues it here instead: the message stays on screen (a message the store has not
accepted yet has a negative, provisional id), the conversation can go on (the engine is sent the
queued text too, see :meth:`PendingWrites.overlay`), and a timer retries :meth:`PendingWrites.flush`
with backoff. Writes run in the order they were queued, so a reply is never written before the
question it answers, and a message's provisional id becomes its real one as it is written.

If the app closes with writes still queued, :meth:`PendingWrites.rescue` writes each affected
conversation as a conversation export (``app.store.export``'s JSON), which File > Import reads.
"""

from __future__ import annotations

import base64
import json
import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from app.store import ImageBlob, Message, Store
from app.store.export import JSON_FORMAT, JSON_VERSION, from_json

log = logging.getLogger(__name__)


@dataclass
class _Add:
    message: Message  # id < 0 until written
    images: list[ImageBlob | str] = field(default_factory=list)


@dataclass
class _Update:
    message_id: int
    conversation_id: int
    content: str
    complete: bool | None = None
    stats: dict[str, Any] | None = None


@dataclass
class _Delete:
    """Drop an empty failed reply and move the branch back to its parent."""

    message_id: int
    conversation_id: int
    parent_id: int | None


class PendingWrites:
    """The queue of chat writes waiting for the store (GUI thread only, like the store)."""

    def __init__(self) -> None:
        self._ops: list[_Add | _Update | _Delete] = []
        self._next_id = -1
        self.saved_ids: dict[int, int] = {}  # provisional id -> the store's id, once written

    def __len__(self) -> int:
        return len(self._ops)

    def __bool__(self) -> bool:
        return bool(self._ops)

    def has(self, conversation_id: int | None) -> bool:
        return any(self._conversation_of(op) == conversation_id for op in self._ops)

    def conversations(self) -> list[int]:
        seen: list[int] = []
        for op in self._ops:
            cid = self._conversation_of(op)
            if cid not in seen:
                seen.append(cid)
        return seen

    @staticmethod
    def _conversation_of(op: _Add | _Update | _Delete) -> int:
        return op.message.conversation_id if isinstance(op, _Add) else op.conversation_id

    def resolve(self, message_id: int | None) -> int | None:
        """The store's id for ``message_id`` (a provisional id that has been written maps to it)."""
        return self.saved_ids.get(message_id, message_id) if message_id is not None else None

    # -- queueing --------------------------------------------------------------------------------------

    def add(
        self,
        conversation_id: int,
        parent_id: int | None,
        role: str,
        content: str,
        *,
        complete: bool = True,
        stats: dict[str, Any] | None = None,
        model: str = "",
        images: list[ImageBlob | str] | tuple[ImageBlob | str, ...] = (),
    ) -> Message:
        """Queue a new message; returns it with a provisional (negative) id."""
        message = Message(
            id=self._next_id,
            conversation_id=conversation_id,
            parent_id=parent_id,
            role=role,
            content=content,
            created_at=time.time(),
            complete=complete,
            stats=dict(stats or {}),
            model=model,
            images=[i.sha256 if isinstance(i, ImageBlob) else i for i in images],
        )
        self._next_id -= 1
        self._ops.append(_Add(message, list(images)))
        return message

    def update(
        self,
        message_id: int,
        conversation_id: int,
        content: str,
        complete: bool | None = None,
        stats: dict[str, Any] | None = None,
    ) -> None:
        """Queue a new text (and state) for a message; only the latest one matters."""
        for op in self._ops:
            if isinstance(op, _Add) and op.message.id == message_id:
                # Not written yet: it will be written with this text in the first place.
                op.message.content = content
                if complete is not None:
                    op.message.complete = complete
                if stats is not None:
                    op.message.stats = dict(stats)
                return
            if isinstance(op, _Update) and op.message_id == message_id:
                op.content = content
                op.complete = op.complete if complete is None else complete
                op.stats = op.stats if stats is None else dict(stats)
                return
        self._ops.append(_Update(message_id, conversation_id, content, complete, stats))

    def delete_reply(self, message_id: int, conversation_id: int, parent_id: int | None) -> None:
        """Queue dropping an empty reply (one never written is just forgotten)."""
        if message_id < 0:
            self._ops = [op for op in self._ops if not (isinstance(op, _Add) and op.message.id == message_id)]
            return
        self._ops = [op for op in self._ops if not (isinstance(op, _Update) and op.message_id == message_id)]
        self._ops.append(_Delete(message_id, conversation_id, parent_id))

    def forget_conversation(self, conversation_id: int) -> None:
        """The conversation was deleted: its queued writes have nothing left to write to."""
        self._ops = [op for op in self._ops if self._conversation_of(op) != conversation_id]

    # -- writing -------------------------------------------------------------------------------------

    def flush(self, store: Store, saved: Callable[[int, int], None] | None = None) -> None:
        """Write the queue in order, removing each write once it is committed. Raises the store's
        ``sqlite3.Error`` at the first write that fails (the rest stay queued); ``saved(old, new)``
        is called as each new message gets its real id."""
        while self._ops:
            op = self._ops[0]
            if isinstance(op, _Add):
                m = op.message
                stored = store.add_message(
                    m.conversation_id,
                    self.resolve(m.parent_id),
                    m.role,
                    m.content,
                    complete=m.complete,
                    stats=m.stats,
                    model=m.model,
                    created_at=m.created_at,
                    images=op.images,
                )
                self._ops.pop(0)
                self.saved_ids[m.id] = stored.id
                for later in self._ops:
                    if isinstance(later, _Add) and later.message.parent_id == m.id:
                        later.message.parent_id = stored.id
                if saved is not None:
                    saved(m.id, stored.id)
            elif isinstance(op, _Update):
                store.update_message(
                    self.resolve(op.message_id), op.content, complete=op.complete, stats=op.stats
                )
                self._ops.pop(0)
            else:
                with store.transaction() as db:
                    db.execute("DELETE FROM messages WHERE id = ?", (op.message_id,))
                    db.execute(
                        "UPDATE conversations SET current_leaf_id = ? WHERE id = ?",
                        (self.resolve(op.parent_id), op.conversation_id),
                    )
                self._ops.pop(0)

    # -- reading -------------------------------------------------------------------------------------

    def overlay(self, conversation_id: int, messages: list[Message], unsaved: bool = True) -> list[Message]:
        """``messages`` (a branch read from the store) as it will be once the queue is written:
        newer texts applied, dropped replies removed, and (``unsaved``) the conversation's
        unwritten messages appended: they always continue the branch that was shown when they
        were sent, since branch actions wait until a conversation is saved."""
        updates = {op.message_id: op for op in self._ops if isinstance(op, _Update)}
        deleted = {op.message_id for op in self._ops if isinstance(op, _Delete)}
        out = []
        for m in messages:
            if m.id in deleted:
                continue
            op = updates.get(m.id)
            if op is not None:
                m = replace(
                    m,
                    content=op.content,
                    complete=m.complete if op.complete is None else op.complete,
                    stats=m.stats if op.stats is None else dict(op.stats),
                )
            out.append(m)
        if unsaved:
            out.extend(self.unsaved(conversation_id))
        return out

    def unsaved(self, conversation_id: int) -> list[Message]:
        return [
            replace(op.message, images=list(op.message.images))
            for op in self._ops
            if isinstance(op, _Add) and op.message.conversation_id == conversation_id
        ]

    def image_blob(self, sha256: str) -> ImageBlob | None:
        """An image attached to a message not written yet (None: not one of those)."""
        for op in self._ops:
            if isinstance(op, _Add):
                for image in op.images:
                    if isinstance(image, ImageBlob) and image.sha256 == sha256:
                        return image
        return None

    # -- last resort -----------------------------------------------------------------------------------

    def rescue(self, store: Store, directory: Path) -> list[Path]:
        """Write each conversation with queued writes to ``directory`` as an importable export (its
        visible branch as it would have been saved). Returns the files written."""
        written = []
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for cid in self.conversations():
            try:
                conv = store.conversation(cid)
                title, branch = conv.title, store.path(conv.current_leaf_id)
            except Exception:  # the store may be the very thing that fails: keep what is queued
                title, branch = "Unsaved chat", []
            messages = self.overlay(cid, branch)
            data = _export(f"{title} (unsaved)", messages, store, self)
            path = Path(directory) / f"unsaved-{stamp}-{cid}.json"
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
            except OSError as exc:
                log.error("could not write unsaved messages to %s: %s", path, exc)
                continue
            written.append(path)
        return written


RESCUED_PATTERN = "unsaved-*.json"
RESTORED_SUFFIX = ".restored"


def restore_rescued(store: Store, directory: Path) -> list[int]:
    """Import the files :meth:`PendingWrites.rescue` wrote in ``directory`` at an earlier exit, as
    conversations of their own (titled "... (unsaved)"). Each file is renamed with
    ``RESTORED_SUFFIX`` once imported, never deleted; one that cannot be imported now (the store
    still refuses, the file is damaged) stays for the next start or File > Import. Returns the new
    conversation ids."""
    restored = []
    for path in sorted(Path(directory).glob(RESCUED_PATTERN)):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            restored.append(from_json(store, data))
            path.rename(path.with_name(path.name + RESTORED_SUFFIX))
        except (OSError, ValueError, KeyError, TypeError, sqlite3.Error) as exc:
            log.error("could not restore unsaved messages from %s: %s", path, exc)
    return restored


def _export(title: str, messages: list[Message], store: Store, pending: PendingWrites) -> dict[str, Any]:
    """``app.store.export.to_json``'s format for a branch that is partly not in the store."""
    ids = {m.id for m in messages}
    images: dict[str, dict[str, Any]] = {}
    entries = []
    for m in messages:
        kept = []
        for sha in m.images:
            if sha not in images:
                blob = pending.image_blob(sha)
                try:
                    if blob is None:
                        meta = store.image(sha)
                        blob = ImageBlob(store.image_data(sha), meta.mime, meta.width, meta.height)
                except Exception:
                    continue  # unreadable: the text is what matters most
                images[sha] = {
                    "mime": blob.mime,
                    "width": blob.width,
                    "height": blob.height,
                    "data": base64.b64encode(blob.data).decode("ascii"),
                }
            kept.append(sha)
        entries.append(
            {
                "id": m.id,
                "parent_id": m.parent_id if m.parent_id in ids else None,
                "role": m.role,
                "content": m.content,
                "created_at": m.created_at,
                "complete": m.complete,
                "stats": m.stats,
                "model": m.model,
                "images": kept,
            }
        )
    return {
        "format": JSON_FORMAT,
        "version": JSON_VERSION,
        "title": title,
        "created_at": messages[0].created_at if messages else time.time(),
        "messages": entries,
        "images": images,
        "current_leaf_id": messages[-1].id if messages else None,
    }
