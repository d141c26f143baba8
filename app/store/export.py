"""Conversations out of and into files.

Markdown export is for reading: the branch on screen, as a document. JSON export is for moving a
conversation between machines: the whole tree, every branch, so an import loses nothing. Its
images are embedded (base64, once each however many messages show them) so the file is complete
on its own; version 1 files (before images) still import.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from typing import Any

from app.store.store import ImageBlob, Store, insert_images

JSON_FORMAT = "trellis-chat-conversation"
JSON_VERSION = 2

_ROLE_TITLES = {"system": "System", "user": "User", "assistant": "Assistant"}


class ImportFormatError(ValueError):
    """The file is not a conversation this app exported (or is damaged)."""


def to_markdown(store: Store, conversation_id: int) -> str:
    """The current branch as a Markdown document."""
    conv = store.conversation(conversation_id)
    parts = [f"# {conv.title}\n"]
    if conv.system_prompt.strip():
        parts.append(f"## System\n\n{conv.system_prompt.strip()}\n")
    for msg in store.path(conv.current_leaf_id):
        heading = _ROLE_TITLES.get(msg.role, msg.role.title())
        if not msg.complete:
            heading += " (interrupted)"
        body = msg.content.strip()
        if msg.images:
            count = len(msg.images)
            note = f"*[{count} image{'s' if count > 1 else ''} attached]*"
            body = f"{note}\n\n{body}" if body else note
        parts.append(f"## {heading}\n\n{body}\n")
    return "\n".join(parts)


def to_json(store: Store, conversation_id: int) -> dict[str, Any]:
    """The whole conversation tree as a JSON-serialisable dict."""
    conv = store.conversation(conversation_id)
    messages = store.messages(conversation_id)
    images: dict[str, dict[str, Any]] = {}
    for sha in (sha for m in messages for sha in m.images):
        if sha not in images:
            meta = store.image(sha)
            images[sha] = {
                "mime": meta.mime,
                "width": meta.width,
                "height": meta.height,
                "data": base64.b64encode(store.image_data(sha)).decode("ascii"),
            }
    return {
        "format": JSON_FORMAT,
        "version": JSON_VERSION,
        "title": conv.title,
        "created_at": conv.created_at,
        "system_prompt": conv.system_prompt,
        "preset": conv.preset,
        "sampling": conv.sampling,
        "json_schema": conv.json_schema,
        "current_leaf_id": conv.current_leaf_id,
        "messages": [
            {
                "id": m.id,
                "parent_id": m.parent_id,
                "role": m.role,
                "content": m.content,
                "created_at": m.created_at,
                "complete": m.complete,
                "stats": m.stats,
                "model": m.model,
                "images": m.images,
                "tool_calls": m.tool_calls,
            }
            for m in messages
        ],
        "images": images,
    }


def _read_images(data: dict[str, Any]) -> dict[str, ImageBlob]:
    """The export's embedded images, each checked against the hash it is filed under."""
    raw = data.get("images") or {}
    if not isinstance(raw, dict):
        raise ImportFormatError("the export's image table is malformed")
    images: dict[str, ImageBlob] = {}
    for sha, entry in raw.items():
        try:
            blob = ImageBlob(
                base64.b64decode(entry["data"], validate=True),
                str(entry.get("mime") or "application/octet-stream"),
                int(entry.get("width") or 0),
                int(entry.get("height") or 0),
            )
        except (TypeError, KeyError, ValueError, binascii.Error) as exc:
            raise ImportFormatError(f"image {sha} is malformed ({exc})") from None
        if blob.sha256 != sha:
            raise ImportFormatError(f"image {sha} is damaged (its bytes do not match its hash)")
        images[sha] = blob
    return images


def from_json(store: Store, data: Any) -> int:
    """Create a new conversation from :func:`to_json` output; returns its id.

    Message ids are remapped (the importing database has its own), parents must come before their
    children (they do in an export, which lists messages in id order), and the whole import is one
    transaction: a damaged file adds nothing.
    """
    if not isinstance(data, dict) or data.get("format") != JSON_FORMAT:
        raise ImportFormatError("not a Trellis Chat conversation export")
    if int(data.get("version", 0)) > JSON_VERSION:
        raise ImportFormatError(f"export version {data.get('version')} is newer than this app understands")
    messages = data.get("messages")
    if not isinstance(messages, list):
        raise ImportFormatError("the export has no message list")
    images = _read_images(data)
    db = store.db
    with store.transaction():
        created = float(data.get("created_at") or 0) or None
        cur = db.execute(
            "INSERT INTO conversations"
            " (title, created_at, updated_at, system_prompt, preset, sampling, json_schema)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                str(data.get("title") or "Imported chat"),
                created or time.time(),
                time.time(),
                str(data.get("system_prompt") or ""),
                str(data.get("preset") or "balanced"),
                _json_text(data.get("sampling") or {}),
                str(data.get("json_schema") or ""),  # absent from exports made before v5
            ),
        )
        conversation_id = cur.lastrowid
        id_map: dict[Any, int] = {}
        for m in messages:
            try:
                role = m["role"]
                content = m["content"]
                parent = m.get("parent_id")
            except (TypeError, KeyError) as exc:
                raise ImportFormatError(f"malformed message entry ({exc})") from None
            if role not in _ROLE_TITLES or not isinstance(content, str):
                raise ImportFormatError(f"message {m.get('id')} has an invalid role or content")
            if parent is not None and parent not in id_map:
                raise ImportFormatError(f"message {m.get('id')} refers to unknown parent {parent}")
            refs = m.get("images") or []
            if not isinstance(refs, list) or any(ref not in images for ref in refs):
                raise ImportFormatError(f"message {m.get('id')} refers to an image the export lacks")
            cur = db.execute(
                "INSERT INTO messages (conversation_id, parent_id, role, content, created_at, complete,"
                " stats, model, tool_calls) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    conversation_id,
                    id_map.get(parent) if parent is not None else None,
                    role,
                    content,
                    float(m.get("created_at") or 0.0),
                    int(bool(m.get("complete", True))),
                    _json_text(m.get("stats") or {}),
                    str(m.get("model") or ""),
                    _json_text(_tool_calls(m)),
                ),
            )
            id_map[m.get("id")] = cur.lastrowid
            insert_images(db, cur.lastrowid, [images[ref] for ref in refs])
        leaf = id_map.get(data.get("current_leaf_id"))
        if leaf is None and id_map:
            leaf = max(id_map.values())
        db.execute("UPDATE conversations SET current_leaf_id = ? WHERE id = ?", (leaf, conversation_id))
    return conversation_id


def _tool_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list) or not all(
        isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls
    ):
        raise ImportFormatError(f"message {message.get('id')} has malformed tool calls")
    return calls


def _json_text(value: Any) -> str:
    return json.dumps(value)
