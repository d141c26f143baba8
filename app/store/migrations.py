"""Schema migrations: the list index + 1 is the schema version stored in ``PRAGMA user_version``.

A migration is never edited once released; a change to the schema is a new entry at the end. Each
runs in its own transaction together with the version bump, so a crash mid-migration leaves the
database at the previous version, ready to try again.
"""

from __future__ import annotations

import contextlib
import sqlite3

# v1: conversations, a message tree (parent ids make branches), key/value settings.
_V1_BASE = """
        CREATE TABLE conversations (
            id INTEGER PRIMARY KEY,
            title TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            system_prompt TEXT NOT NULL DEFAULT ''
        );
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content TEXT NOT NULL,
            created_at REAL NOT NULL
        );
        CREATE INDEX messages_by_parent ON messages(conversation_id, parent_id);
        CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


# v2: full-text search over message content (FTS5, external content kept in sync by triggers).
_V2_FTS = """
        CREATE VIRTUAL TABLE messages_fts USING fts5(
            content, content='messages', content_rowid='id', tokenize='unicode61 remove_diacritics 2'
        );
        CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
            INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
        END;
        CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
            INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
        END;
        CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN
            INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
            INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
        END;
        INSERT INTO messages_fts(messages_fts) VALUES ('rebuild');
"""


# v3: streaming replies saved while incomplete, per-message stats, per-conversation sampling,
# and which branch the user was looking at.
_V3_GENERATION_STATE = """
        ALTER TABLE messages ADD COLUMN complete INTEGER NOT NULL DEFAULT 1;
        ALTER TABLE messages ADD COLUMN stats TEXT NOT NULL DEFAULT '{}';
        ALTER TABLE messages ADD COLUMN model TEXT NOT NULL DEFAULT '';
        ALTER TABLE conversations ADD COLUMN preset TEXT NOT NULL DEFAULT 'balanced';
        ALTER TABLE conversations ADD COLUMN sampling TEXT NOT NULL DEFAULT '{}';
        ALTER TABLE conversations ADD COLUMN current_leaf_id INTEGER;
"""


# v4: images attached to messages. Content-addressed: an image is stored once under the sha256 of
# its bytes however many messages (or conversations) show it, and a trigger drops it when the
# last message that shows it is deleted (cascades from a deleted conversation fire it too). Kept
# in the database rather than as files so a conversation and its images are written, backed up
# and deleted together, in one transaction.
_V4_IMAGES = """
        CREATE TABLE images (
            sha256 TEXT PRIMARY KEY,
            data BLOB NOT NULL,
            mime TEXT NOT NULL,
            width INTEGER NOT NULL,
            height INTEGER NOT NULL,
            created_at REAL NOT NULL
        );
        CREATE TABLE message_images (
            message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            sha256 TEXT NOT NULL REFERENCES images(sha256),
            PRIMARY KEY (message_id, position)
        );
        CREATE INDEX message_images_by_image ON message_images(sha256);
        CREATE TRIGGER message_images_release AFTER DELETE ON message_images BEGIN
            DELETE FROM images WHERE sha256 = old.sha256
                AND NOT EXISTS (SELECT 1 FROM message_images WHERE sha256 = old.sha256);
        END;
"""


# v5: a per-conversation JSON schema for structured output ('' = free text). Stored as the text
# the user pasted (not re-serialized), so the editor shows it back exactly as written.
_V5_JSON_SCHEMA = """
        ALTER TABLE conversations ADD COLUMN json_schema TEXT NOT NULL DEFAULT '';
"""


# v6: tool use. An assistant message keeps the tool calls it made, each with what became of it
# (JSON: [{"id", "name", "arguments", "status", "result"}]; status: pending, done, error, denied),
# and a conversation says whether its replies may call tools.
_V6_TOOL_CALLS = """
        ALTER TABLE messages ADD COLUMN tool_calls TEXT NOT NULL DEFAULT '[]';
        ALTER TABLE conversations ADD COLUMN tools_enabled INTEGER NOT NULL DEFAULT 0;
"""


MIGRATIONS: list[str] = [
    _V1_BASE,
    _V2_FTS,
    _V3_GENERATION_STATE,
    _V4_IMAGES,
    _V5_JSON_SCHEMA,
    _V6_TOOL_CALLS,
]
LATEST_VERSION = len(MIGRATIONS)


class SchemaTooNewError(RuntimeError):
    """The database was written by a newer Trellis Chat; opening it could destroy data."""


def schema_version(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def statements(script: str) -> list[str]:
    """Split a script into statements (``sqlite3.complete_statement`` understands trigger bodies)."""
    out: list[str] = []
    buffer = ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            out.append(buffer.strip())
            buffer = ""
    if buffer.strip():
        out.append(buffer.strip())
    return out


def migrate(db: sqlite3.Connection, target: int = LATEST_VERSION) -> int:
    """Bring ``db`` (opened in autocommit mode) up to ``target``; returns the version it was at."""
    start = schema_version(db)
    if start > LATEST_VERSION:
        raise SchemaTooNewError(
            f"the conversation database has schema version {start}, this app knows up to "
            f"{LATEST_VERSION}; update Trellis Chat"
        )
    for version in range(start + 1, target + 1):
        # executescript() would commit on its own, so statements run one by one inside an explicit
        # transaction that also carries the version bump.
        db.execute("BEGIN IMMEDIATE")
        try:
            for statement in statements(MIGRATIONS[version - 1]):
                db.execute(statement)
            db.execute(f"PRAGMA user_version = {version}")
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:  # SQLite may have rolled back already (full disk, I/O error)
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise
    return start
