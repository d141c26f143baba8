"""ChatController: the one place that connects the chat view, the store and the engine.

Flow of a reply (all on the GUI thread except the engine itself):

1. ``submit`` commits the user message to the store *before* anything else, appends it to the
   model, and creates the assistant message in the store marked incomplete.
2. The worker's ``chunk`` signals only append to a pending buffer. A 30 ms ``QTimer`` moves the
   buffer into the model (one ``dataChanged`` for the streaming row), so a 200 tokens/s stream
   causes ~30 re-renders a second, not 200.
3. Every second the partial text is written to the store (still incomplete), so a crash loses at
   most a second of a reply and nothing that was complete.
4. ``generationFinished`` writes the final text, marks it complete, and records stats.

What the pane shows about the engine follows the model and the conversation in view: a new load
(or an unload) clears the speed and recounts the context for the new model, and opening another
conversation clears the previous reply's speed. A long prompt's reading ("prefill") reports its
progress (``prefillProgress``) until the first words arrive. A base model (no chat template) is
sent plain-text completion requests (``completion_mode``).

Images: a user message may carry images (``ImageBlob``s from the composer). They are stored with
the message (content-addressed, see ``app.store``) and their bytes go to the engine with the
conversation. When the loaded model cannot see images, a message with images is *refused*
(``errorOccurred`` says why, and the text and images stay in the composer), rather than sent with
the images silently dropped: the user asked about the picture, and an answer given without it
would look like an answer about it. Images already in the history are left out for such a model,
and the reply's stats say so (the conversation can go on as text).

Branches: regenerate adds a sibling of the last reply; editing a user message adds a sibling of
that message. The store's ``current_leaf_id`` says which branch is shown; switching a branch
moves it to the newest leaf under the chosen sibling.

Deleting: a user message goes with its reply, a reply with all its versions (``app.store.deletion``);
the rest of the branch closes up. The last deletion can be undone (Edit > Undo) while its
conversation stays open and no reply has started since.

When the store refuses a write (full disk, another program holding the write lock, a read-only
folder, a damaged file), nothing is lost and nothing freezes: the message or reply text goes to a
queue (``app.chat.pending_writes``) and stays on screen, ``errorOccurred`` says once what is wrong
(``savingChanged`` carries it, then "" once all is saved), and a timer retries with backoff. The
store's busy timeout is short (``app.store.database.GUI_BUSY_TIMEOUT_MS``), so each attempt holds
the GUI thread for at most that long. Reads that fail (a damaged file) end the action with a
message instead of an exception.
"""

from __future__ import annotations

import functools
import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from PySide6.QtCore import QObject, QTimer, Signal

from app import paths
from app.chat.message_model import ChatMessageModel, MessageItem
from app.chat.pending_writes import PendingWrites
from app.chat.presets import effective_sampling, split_generation_limits
from app.chat.tool_loop import ToolLoop, openai_calls, result_messages
from app.store import ImageBlob, Message, Store
from app.store.database import GUI_BUSY_TIMEOUT_MS
from app.store.deletion import DeletedMessages, delete_span, deletion_span, restore
from app.store.errors import StorageProblem, classify, describe
from app.worker import EngineClient
from engine.api import GenerationRequest, ReplyStats

log = logging.getLogger(__name__)

FLUSH_INTERVAL_MS = 30
SAVE_INTERVAL_MS = 1000
TITLE_LENGTH = 48
# Retrying refused writes: the first retry soon (a lock is usually brief), then less and less
# often, so a full disk costs one short attempt every few seconds and not a stall per second.
RETRY_FIRST_MS = 250
RETRY_MAX_MS = 15_000
# At shutdown a last attempt may wait this long for a lock: the window is closing anyway.
SHUTDOWN_BUSY_TIMEOUT_MS = 1000

_R = TypeVar("_R")


def _store_action(doing: str, default: Any = None) -> Callable[[Callable[..., _R]], Callable[..., _R]]:
    """For a user action: a store error ends it with a message (``doing`` says what failed) and
    ``default`` as its result, instead of an uncaught exception."""

    def wrap(method: Callable[..., _R]) -> Callable[..., _R]:
        @functools.wraps(method)
        def run(self: ChatController, *args: Any, **kwargs: Any) -> _R:
            try:
                return method(self, *args, **kwargs)
            except sqlite3.Error as exc:
                self._storage_failed(exc, doing, will_retry=False)
                return default

        return run

    return wrap


@dataclass
class _UndoDelete:
    """The last deletion, while its conversation stays open: what went, and the titles before and
    after (a title made from a deleted first message is remade from the new first one)."""

    deleted: DeletedMessages
    title_before: str
    title_after: str


@dataclass
class _Active:
    """The reply being streamed."""

    request_id: int
    conversation_id: int
    message_id: int  # provisional (negative) while the store has not taken it
    parent_id: int | None
    parts: list[str] = field(default_factory=list)  # everything received
    pending: list[str] = field(default_factory=list)  # received but not yet in the model
    chunks: int = 0
    first_chunk_at: float = 0.0
    saved_length: int = 0

    @property
    def text(self) -> str:
        return "".join(self.parts)


def title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1].rstrip() + "…"


class ChatController(QObject):
    conversationChanged = Signal(int)  # id of the conversation now shown (0 = none)
    conversationsChanged = Signal()  # titles / order / set changed: refresh lists
    busyChanged = Signal(bool)  # a reply is streaming
    speedChanged = Signal(float)  # tokens per second (live estimate, then the engine's figure)
    contextChanged = Signal(int, int)  # tokens used, context length (0 = unknown)
    prefillProgress = Signal(int, int)  # the streaming reply's prompt: tokens read, to read
    errorOccurred = Signal(str)
    savingChanged = Signal(str)  # why writes are waiting (shown once), "" once all is saved
    toolsEnabledChanged = Signal(bool)  # the conversation shown may call tools (or not)

    def __init__(
        self,
        store: Store,
        engine: EngineClient,
        model: ChatMessageModel | None = None,
        parent: QObject | None = None,
        default_preset: str = "balanced",
        default_system_prompt: str = "",
    ) -> None:
        super().__init__(parent)
        self.store = store
        self.engine = engine
        self.model = model or ChatMessageModel(self)
        self.conversation_id: int | None = None
        self.default_preset = default_preset
        self.default_system_prompt = default_system_prompt
        self._active: _Active | None = None
        # Tool use (app.chat.tool_loop): the calls of the last reply, asked about and run; the
        # window sets the MCP tool manager and the settings it reads.
        self.tool_loop = ToolLoop(store, parent=self)
        self.tool_loop.callsChanged.connect(self._on_tool_calls_changed)
        self.tool_loop.roundFinished.connect(self._continue_after_tools)
        self.max_tool_rounds = 8
        self._count_request = 0
        self._context_used = 0
        self._undo_delete: _UndoDelete | None = None

        self._flush_timer = QTimer(self)
        self._flush_timer.setInterval(FLUSH_INTERVAL_MS)
        self._flush_timer.timeout.connect(self._flush)
        self._save_timer = QTimer(self)
        self._save_timer.setInterval(SAVE_INTERVAL_MS)
        self._save_timer.timeout.connect(self._save_partial)
        self.pending = PendingWrites()
        self._retry_delay = RETRY_FIRST_MS
        self._retry_timer = QTimer(self)
        self._retry_timer.setSingleShot(True)
        self._retry_timer.timeout.connect(self.retry_saves)
        self._storage_problem: StorageProblem | None = None

        engine.chunk.connect(self._on_chunk)
        engine.generationFinished.connect(self._on_finished)
        engine.tokensCounted.connect(self._on_tokens_counted)
        engine.prefillProgress.connect(self._on_prefill)
        engine.loaded.connect(lambda _info: self.refresh_context())
        # The figures shown were the previous model's: clear them as soon as it goes.
        engine.loadStarted.connect(lambda _path: self._on_model_changed())
        engine.unloaded.connect(self._on_model_changed)
        engine.loadFailed.connect(lambda _message: self._on_model_changed())

    # -- state -----------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._active is not None or self.tool_loop.running

    def context_length(self) -> int:
        info = self.engine.model_info
        return info.context_length if info else 0

    def completion_mode(self) -> bool:
        """The loaded model is a base model (no chat template): replies are plain-text
        completions of the conversation's text."""
        info = self.engine.model_info
        return info is not None and not info.chat_template

    def cannot_see_images_reason(self) -> str:
        """Why images cannot be sent to the loaded model now ("" when they can, or when no model is
        loaded: that has its own message when sending)."""
        info = self.engine.model_info
        if not info or info.sees_images:
            return ""
        return (
            f"{info.name or 'The loaded model'} cannot see images: it is a text-only model. "
            "Load a vision model (Gemma 3, Gemma 4, Qwen2.5-VL, Qwen3-VL or Mistral 3) or remove the images."
        )

    # -- conversations ---------------------------------------------------------------------------

    @_store_action("open the conversation")
    def open_conversation(self, conversation_id: int | None) -> None:
        """Show ``conversation_id`` (None: nothing). A reply still streaming elsewhere is stopped."""
        if self._active is not None and self._active.conversation_id != conversation_id:
            self.stop()
        if conversation_id != self.conversation_id and self._active is None:
            self.speedChanged.emit(0.0)  # that figure was another conversation's reply
        if conversation_id != self.conversation_id:
            self._forget_undo()  # undo is for the conversation in view
        self.conversation_id = conversation_id
        self._reload()
        self.conversationChanged.emit(conversation_id or 0)
        self.toolsEnabledChanged.emit(self.tools_enabled())
        self.refresh_context()

    @_store_action("start a new chat", default=0)
    def new_conversation(self) -> int:
        """Create and show a new conversation; returns its id (0 when the store refused)."""
        conv = self.store.create_conversation(
            "New chat", system_prompt=self.default_system_prompt, preset=self.default_preset
        )
        self.conversationsChanged.emit()
        self.open_conversation(conv.id)
        return conv.id

    @_store_action("delete the conversation")
    def delete_conversation(self, conversation_id: int) -> None:
        if self._active is not None and self._active.conversation_id == conversation_id:
            self.stop()
            self._finish_locally(ReplyStats("cancelled"))
        self.store.delete_conversation(conversation_id)
        self.pending.forget_conversation(conversation_id)
        if conversation_id == self.conversation_id:
            self.open_conversation(None)
        self.conversationsChanged.emit()

    @_store_action("rename the conversation")
    def rename_conversation(self, conversation_id: int, title: str) -> None:
        title = title.strip()
        if title:
            self.store.rename_conversation(conversation_id, title)
            self.conversationsChanged.emit()

    @_store_action("save the system prompt")
    def set_system_prompt(self, text: str) -> None:
        if self.conversation_id is not None:
            self.store.update_conversation(self.conversation_id, system_prompt=text)
            self.refresh_context()

    @_store_action("save the sampling settings")
    def set_sampling(self, preset: str, overrides: dict[str, Any] | None = None) -> None:
        if self.conversation_id is not None:
            self.store.update_conversation(self.conversation_id, preset=preset, sampling=overrides or {})

    @_store_action("turn tools on or off")
    def set_tools_enabled(self, enabled: bool) -> None:
        """Whether this conversation's replies may call the MCP servers' tools."""
        if self.conversation_id is not None:
            self.store.update_conversation(self.conversation_id, tools_enabled=enabled)
            self.toolsEnabledChanged.emit(enabled)

    def tools_enabled(self) -> bool:
        if self.conversation_id is None:
            return False
        try:
            return self.store.conversation(self.conversation_id).tools_enabled
        except (sqlite3.Error, KeyError):
            return False

    @_store_action("save the JSON schema")
    def set_json_schema(self, text: str) -> None:
        """Structured output for this conversation's next replies: JSON valid under the schema
        ``text`` ("" = free text). The settings dialog has already checked it (app.chat.structured)."""
        if self.conversation_id is not None:
            self.store.update_conversation(self.conversation_id, json_schema=text.strip())

    # -- messages ----------------------------------------------------------------------------------

    @_store_action("send the message", default=False)
    def submit(self, text: str, images: list[ImageBlob] | tuple[ImageBlob, ...] = ()) -> bool:
        """Send a user message (with ``images`` attached) and start the reply. Returns False when it
        cannot be sent now (nothing to send, a reply is streaming, the model cannot see images, or
        the store cannot be read: then ``errorOccurred`` explains)."""
        text = text.strip()
        if (not text and not images) or self.busy:
            return False
        if images:
            reason = self.cannot_see_images_reason()
            if reason:
                self.errorOccurred.emit(reason)
                return False
        if self.conversation_id is None and not self.new_conversation():
            return False
        conv = self.store.conversation(self.conversation_id)
        path = self._visible_branch(conv.id)
        user = self._add_message(conv.id, path[-1].id if path else None, "user", text, images=list(images))
        if not path and conv.title == "New chat":
            self._rename_quietly(conv.id, title_from(text) if text else "Image")
        self.conversationsChanged.emit()
        self.model.append(self._item(user))
        self._start_reply(user.id)
        return True

    @_store_action("regenerate the reply", default=False)
    def regenerate(self) -> bool:
        """A new reply to the last user message, kept as a sibling of the current one."""
        if self.busy or self.conversation_id is None or self._waiting_to_save():
            return False
        path = self.store.current_path(self.conversation_id)
        if not path:
            return False
        last = path[-1]
        parent_id = last.parent_id if last.role == "assistant" else last.id
        if parent_id is None:
            return False
        self.store.set_current_leaf(self.conversation_id, parent_id)
        self._reload()
        self._start_reply(parent_id)
        return True

    @_store_action("save the edited message", default=False)
    def edit_message(self, message_id: int, text: str) -> bool:
        """Replace a past user message by starting a new branch from its parent."""
        text = text.strip()
        if self.busy or self.conversation_id is None or not text or self._waiting_to_save():
            return False
        original = self.store.message(message_id)
        if original.role != "user" or original.conversation_id != self.conversation_id:
            return False
        edited = self._add_message(
            self.conversation_id, original.parent_id, "user", text, images=list(original.images)
        )
        if edited.id < 0:
            # Not stored yet, so the store's branch cannot show it: show the new branch as it will be.
            self._show_branch(self.pending.overlay(self.conversation_id, self.store.path(original.parent_id)))
        else:
            self._reload()
        self._start_reply(edited.id)
        return True

    @_store_action("switch the branch", default=False)
    def switch_branch(self, message_id: int, delta: int) -> bool:
        """Show the previous (-1) or next (+1) alternative of ``message_id`` and its newest leaf."""
        if self.busy or self.conversation_id is None or self._waiting_to_save():
            return False
        siblings = self.store.siblings(message_id)
        ids = [m.id for m in siblings]
        target = ids.index(message_id) + delta
        if not 0 <= target < len(ids):
            return False
        self.store.set_current_leaf(self.conversation_id, self.store.latest_leaf(ids[target]))
        self._reload()
        self.refresh_context()
        return True

    @_store_action("delete the message", default=False)
    def delete_message(self, message_id: int) -> bool:
        """Delete a message of the branch shown: a user message with its reply, or a reply (all its
        versions, tool rounds included); see ``app.store.deletion``. Not while a reply streams."""
        if self.busy or self.conversation_id is None or self._waiting_to_save():
            return False
        conv = self.store.conversation(self.conversation_id)
        path = self.store.path(conv.current_leaf_id)
        try:
            first, last = deletion_span(path, message_id)
        except KeyError:
            return False
        deleted = delete_span(self.store, path, first, last)
        title = conv.title
        first_user = next((m for m in path if m.role == "user"), None)
        if (
            first_user is not None
            and first_user.id in deleted.ids
            and title == title_from(first_user.content)
        ):
            # The automatic title named the message that is gone: name the conversation after
            # what now comes first.
            remaining = self.store.path(self.store.conversation(conv.id).current_leaf_id)
            new_first = next((m for m in remaining if m.role == "user"), None)
            title = (
                title_from(new_first.content) if new_first is not None and new_first.content else "New chat"
            )
            self._rename_quietly(conv.id, title)
        self._undo_delete = _UndoDelete(deleted, conv.title, title)
        self._after_deletion()
        return True

    def can_undo_delete(self) -> bool:
        return self._undo_delete is not None and not self.busy

    @_store_action("bring the deleted messages back", default=False)
    def undo_delete(self) -> bool:
        """Put back what the last ``delete_message`` removed, where it was."""
        undo = self._undo_delete
        if undo is None or self.busy or undo.deleted.conversation_id != self.conversation_id:
            return False
        restore(self.store, undo.deleted)
        if self.store.conversation(self.conversation_id).title == undo.title_after:
            self._rename_quietly(self.conversation_id, undo.title_before)
        self._undo_delete = None
        self._after_deletion()
        return True

    def _after_deletion(self) -> None:
        self._reload()
        self.refresh_context()
        self.conversationsChanged.emit()

    def _forget_undo(self) -> None:
        self._undo_delete = None

    def stop(self) -> None:
        if self._active is not None:
            self.engine.cancel(self._active.request_id)
        if self.tool_loop.running:
            self.tool_loop.cancel()
            self.busyChanged.emit(False)

    def shutdown(self) -> None:
        """The app is closing: stop the reply and commit what it has as a finished (stopped)
        message now, since the engine's final signal would arrive after the event loop ends.
        Writes the store still refuses are written to files that File > Import reads back."""
        if self._active is not None:
            self.stop()
            self._flush()
            self._finish_locally(ReplyStats("cancelled"))
        self._retry_timer.stop()
        if self.pending:
            self._last_chance_save()

    # -- context meter ---------------------------------------------------------------------------

    def engine_messages(self, path: list[Message] | None = None) -> list[dict[str, Any]]:
        """What the engine sees: the system prompt, then the visible branch (complete text only).
        A message with images also has ``"images"``: their bytes, in order (see engine.api)."""
        if self.conversation_id is None:
            return []
        conv = self.store.conversation(self.conversation_id)
        if path is None:
            path = self._visible_branch(conv.id)
        messages: list[dict[str, Any]] = []
        if conv.system_prompt.strip():
            messages.append({"role": "system", "content": conv.system_prompt})
        for m in path:
            if m.content or m.role == "user" or m.tool_calls:
                message: dict[str, Any] = {"role": m.role, "content": m.content}
                if m.images:
                    message["images"] = [self._image_data(sha) for sha in m.images]
                if m.tool_calls:  # the calls, then what each came to, as OpenAI's messages
                    message["tool_calls"] = openai_calls(m.tool_calls)
                messages.append(message)
                messages.extend(result_messages(m.tool_calls))
        return messages

    @_store_action("count the conversation's tokens")
    def refresh_context(self) -> None:
        """Ask the engine to count the visible conversation (answer arrives as tokensCounted)."""
        total = self.context_length()
        if not self.engine.is_loaded or self.conversation_id is None:
            self._context_used = 0
            self.contextChanged.emit(0, total)
            return
        self._count_request = self.engine.count_tokens(self.engine_messages(), self.completion_mode())

    def _on_model_changed(self) -> None:
        self.speedChanged.emit(0.0)
        self.refresh_context()

    def _on_tokens_counted(self, request_id: int, count: int) -> None:
        if request_id == self._count_request:
            self._context_used = count
            self.contextChanged.emit(count, self.context_length())

    # -- streaming ---------------------------------------------------------------------------------

    def _start_reply(self, parent_id: int) -> None:
        self._forget_undo()  # the conversation has moved on from the deletion
        conv = self.store.conversation(self.conversation_id)
        history = self._branch_to(conv.id, parent_id)
        model_name = self.engine.model_info.name if self.engine.model_info else ""
        reply = self._add_message(conv.id, parent_id, "assistant", "", complete=False, model=model_name)
        item = self._item(reply)
        item.streaming = True
        self.model.append(item)
        self._refresh_sibling_counts()
        sampler, max_new_tokens = split_generation_limits(effective_sampling(conv.preset, conv.sampling))
        manager = self.tool_loop.manager
        tools = tuple(manager.openai_tools()) if conv.tools_enabled and manager is not None else ()
        request = GenerationRequest(
            sampler,
            max_new_tokens,
            json_schema=conv.json_schema,
            completion=self.completion_mode(),
            tools=tools,
        )
        request_id = self.engine.generate(self.engine_messages(history), request)
        self._active = _Active(request_id, conv.id, reply.id, parent_id)
        self._flush_timer.start()
        self._save_timer.start()
        self.busyChanged.emit(True)
        self.speedChanged.emit(0.0)

    def _on_prefill(self, request_id: int, done: int, total: int) -> None:
        active = self._active
        if active is not None and request_id == active.request_id and active.chunks == 0:
            self.prefillProgress.emit(done, total)

    def _on_chunk(self, request_id: int, text: str) -> None:
        active = self._active
        if active is None or request_id != active.request_id:
            return
        if active.chunks == 0:
            active.first_chunk_at = time.perf_counter()
            self.prefillProgress.emit(0, 0)  # the prompt is read: the reply is coming
        active.chunks += 1
        active.parts.append(text)
        active.pending.append(text)

    def _flush(self) -> None:
        """Timer tick: move what arrived since the last tick into the model (one re-render)."""
        active = self._active
        if active is None or not active.pending:
            return
        text = "".join(active.pending)
        active.pending.clear()
        if active.conversation_id == self.conversation_id:
            row = self.model.row_of(active.message_id)
            if row >= 0:
                self.model.append_text(row, text)
        elapsed = time.perf_counter() - active.first_chunk_at
        if active.chunks > 1 and elapsed > 0:
            self.speedChanged.emit((active.chunks - 1) / elapsed)

    def _save_partial(self) -> None:
        active = self._active
        if active is None:
            return
        text = active.text
        if len(text) != active.saved_length:
            self._update_message(active.message_id, active.conversation_id, text, complete=False)
            active.saved_length = len(text)

    def _on_finished(self, request_id: int, stats: ReplyStats) -> None:
        active = self._active
        if active is None or request_id != active.request_id:
            return
        self._flush()
        self._finish_locally(stats)
        if stats.tool_calls and stats.stop_reason not in ("cancelled", "error"):
            self._begin_tools(active, stats)

    # -- tool use ----------------------------------------------------------------------------------

    def _begin_tools(self, active: _Active, stats: ReplyStats) -> None:
        message_id = self.pending.resolve(active.message_id)
        if message_id < 0:
            self.errorOccurred.emit("The reply's tool calls wait until the conversation can be saved.")
            return
        self.busyChanged.emit(True)
        self.tool_loop.begin(active.conversation_id, message_id, stats.tool_calls)

    def _on_tool_calls_changed(self, message_id: int, calls: list[dict[str, Any]]) -> None:
        row = self.model.row_of(message_id)
        if row >= 0:
            self.model.update(row, tool_calls=calls)

    @_store_action("send the tool results")
    def _continue_after_tools(self, conversation_id: int, message_id: int) -> None:
        """Every call of the reply is resolved: the model gets the results and goes on, unless
        the reply has called tools ``max_tool_rounds`` times in a row."""
        try:
            if conversation_id != self.conversation_id:
                return  # the user went elsewhere: the results are stored, the loop ends here
            path = self.store.path(message_id)
            rounds = 0
            for m in reversed(path):
                if m.role != "assistant" or not m.tool_calls:
                    break
                rounds += 1
            if rounds >= self.max_tool_rounds:
                self.errorOccurred.emit(
                    f"The model called tools {rounds} times in a row; its reply ends here "
                    "(the limit is in Settings)."
                )
                return
            self._start_reply(message_id)
        finally:
            if self._active is None:
                self.busyChanged.emit(False)

    def _finish_locally(self, stats: ReplyStats) -> None:
        active = self._active
        if active is None:
            return
        self._active = None
        self._flush_timer.stop()
        self._save_timer.stop()
        try:
            self._commit_reply(active, stats)
        except sqlite3.Error as exc:  # a read for the view failed; the reply is saved or queued
            self._storage_failed(exc, "show the conversation", will_retry=False)
        finally:
            # Whatever the store did, the reply has ended: the chat must not stay busy.
            self.conversationsChanged.emit()
            self.busyChanged.emit(False)

    def _commit_reply(self, active: _Active, stats: ReplyStats) -> None:
        text = active.text
        error = stats.error
        current = active.conversation_id == self.conversation_id
        saved = stats.to_dict()  # the store's and the item model's form
        if stats.stop_reason == "error" and not text:
            # Nothing was generated: drop the empty reply so the branch ends at the user message,
            # from where Regenerate can try again.
            first = not self.pending
            self.pending.delete_reply(active.message_id, active.conversation_id, active.parent_id)
            self._write_queue(first)
            if current:
                self._reload()
        else:
            self._update_message(active.message_id, active.conversation_id, text, complete=True, stats=saved)
            if current:
                row = self.model.row_of(self.pending.resolve(active.message_id))
                if row >= 0:
                    self.model.update(
                        row, streaming=False, complete=True, stats=saved, error=error, content=text
                    )
        if error:
            self.errorOccurred.emit(error)
        if stats.tokens_per_second:
            self.speedChanged.emit(stats.tokens_per_second)
        if current and stats.prompt_tokens:
            self._context_used = stats.prompt_tokens + stats.new_tokens
            self.contextChanged.emit(self._context_used, self.context_length())

    # -- saving ------------------------------------------------------------------------------------

    @property
    def unsaved(self) -> int:
        """How many writes wait for the store (0: everything shown is saved)."""
        return len(self.pending)

    def _add_message(
        self, conversation_id: int, parent_id: int | None, role: str, content: str, **fields: Any
    ) -> Message:
        """Store a new message, or queue it if the store refuses (or earlier writes still wait:
        order matters); either way the returned message can be shown and replied to."""
        first = not self.pending
        message = self.pending.add(conversation_id, parent_id, role, content, **fields)
        self._write_queue(first)
        saved_id = self.pending.resolve(message.id)
        return message if saved_id == message.id else replace(message, id=saved_id)

    def _update_message(
        self,
        message_id: int,
        conversation_id: int,
        content: str,
        complete: bool | None = None,
        stats: dict[str, Any] | None = None,
    ) -> None:
        first = not self.pending
        self.pending.update(self.pending.resolve(message_id), conversation_id, content, complete, stats)
        self._write_queue(first)

    def _write_queue(self, now: bool) -> None:
        """Write what was just queued: ``now`` when nothing waited before it (the usual case: a
        few hundred microseconds), else it goes after the rest, on the retry timer."""
        if now:
            self.retry_saves()
        elif not self._retry_timer.isActive():
            self._retry_timer.start(self._retry_delay)

    def retry_saves(self) -> bool:
        """Write the queued writes now; True when nothing is left waiting."""
        self._retry_timer.stop()
        try:
            self.pending.flush(self.store, self._on_saved)
        except sqlite3.Error as exc:
            self._storage_failed(exc, "save the conversation")
            self._retry_timer.start(self._retry_delay)
            self._retry_delay = min(self._retry_delay * 2, RETRY_MAX_MS)
            return False
        self._retry_delay = RETRY_FIRST_MS
        if self._storage_problem is not None:
            self._storage_problem = None
            log.info("the delayed writes are saved")
            self.savingChanged.emit("")
            try:
                self._refresh_sibling_counts()
            except sqlite3.Error as exc:  # a timer slot: an exception here would go nowhere useful
                log.warning("could not refresh the branch counts: %s", exc)
            self.conversationsChanged.emit()
        return True

    def _on_saved(self, provisional_id: int, message_id: int) -> None:
        """A queued message was written: from now on it is known by the store's id."""
        row = self.model.row_of(provisional_id)
        if row >= 0:
            self.model.update(row, id=message_id)
        if self._active is not None and self._active.message_id == provisional_id:
            self._active.message_id = message_id
        if self._active is not None and self._active.parent_id == provisional_id:
            self._active.parent_id = message_id

    def _storage_failed(self, exc: sqlite3.Error, doing: str, will_retry: bool = True) -> None:
        """Tell the user the store refused. A queued write that keeps failing says so once per
        kind of problem (not once a second); an action that failed outright always says so."""
        if will_retry:
            problem = classify(exc)
            if problem is self._storage_problem:
                log.debug("still cannot %s: %s", doing, exc)
                return
            self._storage_problem = problem
        log.warning("could not %s: %s", doing, exc)
        message = describe(exc, doing, will_retry)
        if will_retry:
            self.savingChanged.emit(message)
        self.errorOccurred.emit(message)

    def _waiting_to_save(self) -> bool:
        """Branch actions need this conversation's messages in the store (they work on its ids)."""
        if not self.pending.has(self.conversation_id) or self.retry_saves():
            return False
        self.errorOccurred.emit(
            "Wait until the last messages are saved: this works on the saved conversation "
            "(they are retried in the background)."
        )
        return True

    def _rename_quietly(self, conversation_id: int, title: str) -> None:
        """The automatic title: nice to have, so a refused write only logs."""
        try:
            self.store.rename_conversation(conversation_id, title)
        except sqlite3.Error as exc:
            log.warning("could not title conversation %s: %s", conversation_id, exc)

    def _last_chance_save(self) -> None:
        """At shutdown: one attempt that may wait a little for a lock, then files for the rest."""
        try:
            self.store.db.execute(f"PRAGMA busy_timeout = {SHUTDOWN_BUSY_TIMEOUT_MS}")
            saved = self.retry_saves()
            self.store.db.execute(f"PRAGMA busy_timeout = {GUI_BUSY_TIMEOUT_MS}")
            if saved:
                return
        except sqlite3.Error as exc:
            log.warning("last save attempt failed: %s", exc)
        written = self.pending.rescue(self.store, paths.writable_dir(self.store.db_path.parent))
        for path in written:
            log.error("unsaved messages written to %s (File > Import reads it back)", path)

    # -- helpers -------------------------------------------------------------------------------------

    def _visible_branch(self, conversation_id: int) -> list[Message]:
        """The branch shown: the store's path to the current leaf, with the queued writes applied."""
        conv = self.store.conversation(conversation_id)
        return self.pending.overlay(conversation_id, self.store.path(conv.current_leaf_id))

    def _branch_to(self, conversation_id: int, leaf_id: int | None) -> list[Message]:
        """The messages from the root down to ``leaf_id`` (stored or not yet)."""
        if leaf_id is None:
            return []
        branch = self._visible_branch(conversation_id)
        ids = [m.id for m in branch]
        if leaf_id in ids:
            return branch[: ids.index(leaf_id) + 1]
        return self.pending.overlay(conversation_id, self.store.path(leaf_id), unsaved=False)

    def _image_data(self, sha256: str) -> bytes:
        blob = self.pending.image_blob(sha256)
        return blob.data if blob is not None else self.store.image_data(sha256)

    def _item(self, message: Message) -> MessageItem:
        return MessageItem(
            id=message.id,
            role=message.role,
            content=message.content,
            complete=message.complete,
            stats=message.stats,
            error=message.stats.get("error", ""),
            images=list(message.images),
            tool_calls=[dict(c) for c in message.tool_calls],
            created_at=message.created_at,
        )

    def _reload(self) -> None:
        """Rebuild the model from the store: the path to the current leaf, with sibling counts."""
        if self.conversation_id is None:
            self.model.set_items([])
            return
        self._show_branch(self._visible_branch(self.conversation_id))

    def _show_branch(self, messages: list[Message]) -> None:
        items = []
        for message in messages:
            item = self._item(message)
            if self._active is not None and message.id == self._active.message_id:
                item.streaming = True
                item.content = self._active.text
                self._active.pending.clear()
            items.append(item)
        self.model.set_items(items)
        self._refresh_sibling_counts()

    def _refresh_sibling_counts(self) -> None:
        for row, item in enumerate(self.model.items()):
            if item.id < 0:
                continue  # not stored yet: the store knows no siblings of it
            siblings = [m.id for m in self.store.siblings(item.id)]
            index, count = siblings.index(item.id), len(siblings)
            if (index, count) != (item.sibling_index, item.sibling_count):
                self.model.update(row, sibling_index=index, sibling_count=count)
