"""The chat pane: the model picker on top (the window puts its model bar there), the conversation
view, composer, Send/Stop/Regenerate, speed and context meter, and the images attached to the
message being written. An empty conversation shows what to do next instead: get a model, load
one, or type.

Composes the chat widgets and connects them to a ``ChatController``; holds no conversation state
of its own. The pending attachments (an ``AttachmentListModel``) are the pane's: like the text in
the composer, they belong to the message being written, not to a conversation. Messages (errors,
the plain-text completion note, "reading your message") are shown in labels that wrap or elide
within the pane: none can widen the window.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QImage
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QLabel,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.chat.attachment_strip import AttachmentStrip
from app.chat.attachments import FILE_FILTER, AttachmentError, AttachmentListModel, ImageSource, read_image
from app.chat.composer import Composer
from app.chat.controller import ChatController
from app.chat.conversation_settings import ConversationSettingsDialog
from app.chat.images import ImageLibrary, ImageViewer, decode_image
from app.chat.markdown import MarkdownRenderer
from app.chat.presets import PRESET_LABELS
from app.chat.view import ChatView
from app.elided_label import ElidedLabel, never_widen
from app.empty_state import EmptyStack, EmptyState
from app.theme import SPACE_M, SPACE_S, SPACE_XS, font_for
from app.tools.approval import ToolApprovalBar

# A prompt at least this long gets "Reading your message (N tokens)" while the model reads it:
# shorter ones are read in well under a second.
PREFILL_NOTICE_TOKENS = 256


class StarterBanner(QFrame):
    """First run, empty library: offer the bundled starter model (no network needed)."""

    installRequested = Signal()
    dismissed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Starter model offer")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        layout = QHBoxLayout(self)
        self.label = QLabel(
            "<b>No models yet.</b> Install the built-in starter model, SmolLM2-135M-Instruct: "
            "small, runs on any CPU, needs no network."
        )
        self.label.setWordWrap(True)
        self.install_button = QPushButton("Install starter model")
        self.install_button.setAccessibleName("Install starter model")
        self.dismiss_button = QPushButton("Not now")
        self.dismiss_button.setAccessibleName("Dismiss starter model offer")
        layout.addWidget(self.label, 1)
        layout.addWidget(self.install_button)
        layout.addWidget(self.dismiss_button)
        self.install_button.clicked.connect(self.installRequested)
        self.dismiss_button.clicked.connect(self.dismissed)


class ChatPane(QWidget):
    navigateRequested = Signal(str)  # a pane the empty state's button leads to ("discover", "models")

    def __init__(
        self,
        controller: ChatController,
        renderer: MarkdownRenderer,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.controller = controller
        self.setAccessibleName("Chat")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(SPACE_XS)

        # The model picker's row (filled by set_model_bar), then the conversation's row.
        self.model_row = QHBoxLayout()
        self.model_row.setContentsMargins(SPACE_M, SPACE_S, SPACE_M, 0)
        layout.addLayout(self.model_row)
        top = QHBoxLayout()
        top.setContentsMargins(SPACE_M, SPACE_XS, SPACE_M, 0)
        top.setSpacing(SPACE_S)
        self.title_label = ElidedLabel()
        self.title_label.setAccessibleName("Conversation title")
        self.title_label.setFont(font_for("title", self.title_label.font()))
        self.preset_combo = QComboBox()
        self.preset_combo.setAccessibleName("Sampling preset")
        for key, label in PRESET_LABELS.items():
            self.preset_combo.addItem(label, key)
        self.settings_button = QPushButton("System prompt && sampling…")
        self.settings_button.setAccessibleName("Conversation settings")
        self.tools_check = QCheckBox("Tools")
        self.tools_check.setAccessibleName("Use tools in this conversation")
        self.tools_check.setToolTip(
            "Let the model call the MCP servers' tools (Settings › Tools); each call asks first."
        )
        top.addWidget(self.title_label, 1)
        top.addWidget(self.tools_check)
        top.addWidget(QLabel("Preset:"))
        top.addWidget(self.preset_combo)
        top.addWidget(self.settings_button)
        layout.addLayout(top)

        # Base models are answered by plain-text completion: say so, since it changes what the
        # model does with the messages (and that the system prompt is not used).
        self.mode_notice = never_widen(QLabel())
        self.mode_notice.setAccessibleName("Reply mode")
        self.mode_notice.setProperty("role", "muted")
        self.mode_notice.setContentsMargins(8, 0, 8, 0)
        self.mode_notice.hide()
        layout.addWidget(self.mode_notice)

        self.starter_banner = StarterBanner(self)
        self.starter_banner.hide()
        layout.addWidget(self.starter_banner)

        self.images = ImageLibrary(controller.store.image_data)
        self.view = ChatView(controller.model, renderer, self, images=self.images)
        self.empty = EmptyState("", "", "")
        self.empty.actionRequested.connect(lambda: self.navigateRequested.emit(self._empty_target))
        self._empty_target = ""
        self.has_models = False
        self.view_stack = EmptyStack(self.view, self.empty)
        layout.addWidget(self.view_stack, 1)
        self.tool_approval = ToolApprovalBar(self)  # asks before each tool call runs
        layout.addWidget(self.tool_approval)

        self.error_label = never_widen(QLabel())
        self.error_label.setAccessibleName("Error message")
        self.error_label.setProperty("role", "error")  # coloured by the theme (app.theme)
        self.error_label.setContentsMargins(8, 4, 8, 4)
        self.error_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.error_label.hide()
        layout.addWidget(self.error_label)

        # Speed and context meter.
        status = QHBoxLayout()
        status.setContentsMargins(8, 0, 8, 0)
        self.speed_label = ElidedLabel("")
        self.speed_label.setAccessibleName("Generation speed")
        self.prefill_bar = QProgressBar()
        self.prefill_bar.setAccessibleName("Reading your message")
        self.prefill_bar.setTextVisible(False)
        self.prefill_bar.setMaximumWidth(160)
        self.prefill_bar.setMaximumHeight(10)
        self.prefill_bar.hide()
        self.context_meter = QProgressBar()
        self.context_meter.setAccessibleName("Context used")
        self.context_meter.setTextVisible(True)
        self.context_meter.setMinimumWidth(230)
        self.context_meter.setMaximumWidth(320)
        self.context_meter.setRange(0, 1)
        self.context_meter.setValue(0)
        self.context_meter.setFormat("context: no model")
        status.addWidget(self.speed_label, 1)
        status.addWidget(self.prefill_bar)
        status.addWidget(self.context_meter)
        layout.addLayout(status)

        # Attached images, then the composer and buttons.
        self.attachments = AttachmentListModel(self)
        self.attachment_strip = AttachmentStrip(self.attachments, self)
        layout.addWidget(self.attachment_strip)
        bottom = QHBoxLayout()
        bottom.setContentsMargins(8, 0, 8, 8)
        self.composer = Composer(self)
        buttons = QVBoxLayout()
        self.attach_button = QPushButton("Attach image…")
        self.attach_button.setAccessibleName("Attach image")
        self.attach_button.setToolTip("Attach images (or drop them on the message box, or paste)")
        self.send_button = QPushButton("Send")
        self.send_button.setAccessibleName("Send message")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setAccessibleName("Stop reply")
        self.stop_button.setToolTip("Stop the reply (Esc)")
        self.regenerate_button = QPushButton("Regenerate")
        self.regenerate_button.setAccessibleName("Regenerate last reply")
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addWidget(self.regenerate_button)
        buttons.addWidget(self.attach_button)
        bottom.addWidget(self.composer, 1)
        bottom.addLayout(buttons)
        layout.addLayout(bottom)

        # Wiring: view/composer intents -> controller; controller state -> widgets.
        self.composer.submitted.connect(self._submit)
        self.composer.attachmentsOffered.connect(self.attach)
        self.attach_button.clicked.connect(self.choose_images)
        self.attachment_strip.removeRequested.connect(self.attachments.remove)
        self.attachment_strip.opened.connect(self._open_pending_image)
        self.attachments.rowsInserted.connect(self._on_attachments_changed)
        self.attachments.rowsRemoved.connect(self._on_attachments_changed)
        self.attachments.modelReset.connect(self._on_attachments_changed)
        self.view.imageOpened.connect(self.open_stored_image)
        controller.engine.loaded.connect(self._on_attachments_changed)
        controller.engine.unloaded.connect(self._on_attachments_changed)
        self.send_button.clicked.connect(self.composer.submit)
        self.stop_button.clicked.connect(controller.stop)
        self.regenerate_button.clicked.connect(controller.regenerate)
        self.view.regenerateRequested.connect(controller.regenerate)
        self.view.editSubmitted.connect(controller.edit_message)
        self.view.branchRequested.connect(controller.switch_branch)
        self.view.deleteRequested.connect(self.confirm_delete)
        self.preset_combo.activated.connect(self._preset_chosen)
        self.settings_button.clicked.connect(self.open_conversation_settings)
        controller.busyChanged.connect(self._on_busy)
        controller.tool_loop.approvalRequested.connect(self.tool_approval.ask)
        controller.tool_loop.runningChanged.connect(lambda running: running or self.tool_approval.hide())
        self.tool_approval.decided.connect(controller.tool_loop.decide)
        self.tools_check.clicked.connect(lambda checked: controller.set_tools_enabled(checked))
        controller.toolsEnabledChanged.connect(self.tools_check.setChecked)
        controller.speedChanged.connect(self._on_speed)
        controller.contextChanged.connect(self._on_context)
        controller.prefillProgress.connect(self._on_prefill)
        controller.engine.loaded.connect(self._update_mode_notice)
        controller.engine.unloaded.connect(self._update_mode_notice)
        controller.engine.loadStarted.connect(self._update_mode_notice)
        controller.conversationChanged.connect(self._on_conversation)
        for signal in (
            controller.model.modelReset,
            controller.model.rowsInserted,
            controller.model.rowsRemoved,
        ):
            signal.connect(self.update_empty)
        for signal in (controller.engine.loaded, controller.engine.unloaded, controller.engine.loadStarted):
            signal.connect(self.update_empty)
        controller.conversationsChanged.connect(self._update_title)
        controller.errorOccurred.connect(self.show_error)
        controller.savingChanged.connect(self._on_saving)
        self._on_busy(False)
        self._on_conversation(0)
        self.update_empty()

    def set_model_bar(self, bar: QWidget) -> None:
        """Put the window's model bar (the picker) at the top of the chat."""
        self.model_row.addWidget(bar)

    def set_has_models(self, has_models: bool) -> None:
        """Whether the library has any model (the empty conversation's guidance depends on it)."""
        self.has_models = has_models
        self.update_empty()

    def update_empty(self, *_args) -> None:
        """An empty conversation shows the next step: get a model, load one, or write."""
        if self.controller.model.rowCount() > 0:
            self.view_stack.set_empty(False)
            return
        if self.controller.engine.is_loaded:
            self._empty_target = ""
            self.empty.set_message(
                "How can I help?",
                "Type a message below and press Enter (Shift+Enter for a new line). Attach or paste "
                "images for models that see them. F1 lists the keyboard shortcuts.",
                "",
            )
        elif self.has_models:
            self._empty_target = "models"
            self.empty.set_message(
                "No model loaded",
                "Pick a model at the top and press Load, or choose one in Models, which says how "
                "much memory each needs.",
                "Open Models",
            )
        else:
            self._empty_target = "discover"
            self.empty.set_message(
                "Get a model to start",
                "Download one from Discover, which searches the Hugging Face Hub and says which "
                "models fit this machine, or install the small starter model offered above.",
                "Download a model",
            )
        self.view_stack.set_empty(True)

    # -- intents -------------------------------------------------------------------------------

    def _submit(self, text: str) -> None:
        self.error_label.hide()
        images = self.attachments.blobs()
        if images and self.controller.cannot_see_images_reason():
            # The notice beside the images already says why; mark it as the reason nothing was
            # sent rather than repeating it in the error line.
            self.attachment_strip.set_notice(self.controller.cannot_see_images_reason(), refused=True)
            return
        if self.controller.submit(text, images):
            self.composer.clear()
            self.attachments.clear()
            self.view.scroll_to_bottom()

    # -- images ----------------------------------------------------------------------------------

    def choose_images(self) -> None:
        """The Attach button: pick image files."""
        paths, _ = QFileDialog.getOpenFileNames(self, "Attach images", "", FILE_FILTER)
        if paths:
            self.attach(paths)

    def attach(self, sources: list[ImageSource]) -> int:
        """Attach files or images (the button, drops and pastes all end here); returns how many
        were attached. Those that cannot be are named in the error line, the rest still attach."""
        problems = []
        added = 0
        for source in sources:
            try:
                blob = read_image(source)
            except AttachmentError as exc:
                problems.append(str(exc))
                continue
            self.attachments.add(blob)
            added += 1
        if problems:
            self.show_error("Not attached: " + "; ".join(problems))
        elif added:
            self.error_label.hide()
        return added

    def _on_attachments_changed(self, *_args) -> None:
        self.composer.set_has_attachments(self.attachments.rowCount() > 0)
        self.attachment_strip.set_notice(self.controller.cannot_see_images_reason())

    def _open_pending_image(self, row: int) -> None:
        blob = self.attachments.blobs()[row]
        self._show_image(decode_image(blob.data), f"Attached image — {blob.width}×{blob.height}")

    def open_stored_image(self, sha256: str) -> None:
        try:
            meta = self.controller.store.image(sha256)
        except KeyError:
            return
        title = f"Image — {meta.width}×{meta.height}"
        self._show_image(self.images.image(sha256), title)

    def _show_image(self, image: QImage, title: str) -> None:
        # Non-modal and kept on the pane, so several can be open and tests can find the last one.
        self.image_viewer = ImageViewer(image, title, self)
        self.image_viewer.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.image_viewer.show()

    def _preset_chosen(self) -> None:
        self.controller.set_sampling(self.preset_combo.currentData(), {})

    def open_conversation_settings(self) -> None:
        if self.controller.conversation_id is None:
            self.controller.new_conversation()
        conv = self.controller.store.conversation(self.controller.conversation_id)
        dialog = ConversationSettingsDialog(
            conv.system_prompt, conv.preset, conv.sampling, self, json_schema=conv.json_schema
        )
        if dialog.exec():
            prompt, preset, overrides = dialog.result_values()
            self.controller.set_system_prompt(prompt)
            self.controller.set_sampling(preset, overrides)
            self.controller.set_json_schema(dialog.json_schema_text())
            self._on_conversation(conv.id)

    def show_error(self, message: str) -> None:
        self.error_label.setText(message)
        self.error_label.show()

    def clear_error(self) -> None:
        """What went wrong before is no longer the news (another model was picked, say)."""
        self.error_label.clear()
        self.error_label.hide()

    def _on_saving(self, problem: str) -> None:
        """The "saving delayed" line goes away once the delayed writes are saved (unless a newer
        error has replaced it on the line)."""
        if problem:
            self._saving_notice = problem
        elif self.error_label.text() == getattr(self, "_saving_notice", None):
            self.error_label.hide()

    def confirm_delete(self, message_id: int) -> None:
        """Ask, then delete a message (a user message takes its reply with it). Edit > Undo brings
        it back, so the focus goes to the conversation, where Ctrl+Z reaches that command."""
        row = self.controller.model.row_of(message_id)
        if row < 0 or self.controller.busy:
            return
        item = self.controller.model.item(row)
        if item.role == "user":
            question = "Delete this message and its reply?"
        elif item.sibling_count > 1:
            question = f"Delete this reply and its other versions ({item.sibling_count} in all)?"
        else:
            question = "Delete this reply?"
        answer = QMessageBox.question(self, "Delete message", question)
        if answer == QMessageBox.StandardButton.Yes and self.controller.delete_message(message_id):
            self.view.setFocus()

    # -- state -----------------------------------------------------------------------------------

    def _on_busy(self, busy: bool) -> None:
        if not busy and not self.prefill_bar.isHidden():  # stopped (or failed) while still reading
            self._on_prefill(0, 0)
        self.view.set_busy(busy)
        self.send_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy)
        self.regenerate_button.setEnabled(not busy and self.controller.model.rowCount() > 0)

    def _on_speed(self, tps: float) -> None:
        self.prefill_bar.hide()
        self.speed_label.setText(f"{tps:.1f} tokens/s" if tps > 0 else "")

    def _on_prefill(self, done: int, total: int) -> None:
        """The model is reading a long prompt before its first word: say so, with progress."""
        if total < PREFILL_NOTICE_TOKENS or done >= total:
            if not self.prefill_bar.isHidden():
                self.prefill_bar.hide()
                self.speed_label.setText("")
            return
        self.speed_label.setText(f"Reading your message ({total:,} tokens)…")
        self.prefill_bar.setRange(0, total)
        self.prefill_bar.setValue(done)
        self.prefill_bar.show()

    def _update_mode_notice(self, *_args) -> None:
        info = self.controller.engine.model_info
        if info is not None and not info.chat_template:
            self.mode_notice.setText(
                f"Plain-text completion: {info.name} is a base model (it has no chat template), so "
                "it continues the conversation's text instead of answering it. The system prompt "
                "is not used."
            )
            self.mode_notice.show()
        else:
            self.mode_notice.hide()

    def _on_context(self, used: int, total: int) -> None:
        if total <= 0:
            self.context_meter.setRange(0, 1)
            self.context_meter.setValue(0)
            self.context_meter.setFormat("context: no model")
            return
        self.context_meter.setRange(0, total)
        self.context_meter.setValue(min(used, total))
        self.context_meter.setFormat(f"context: {used} / {total} tokens")

    def _on_conversation(self, conversation_id: int) -> None:
        store = self.controller.store
        enabled = bool(conversation_id)
        self.preset_combo.setEnabled(enabled)
        if enabled:
            conv = store.conversation(conversation_id)
            self.preset_combo.setCurrentIndex(max(0, self.preset_combo.findData(conv.preset)))
        self._update_title()
        self._on_busy(self.controller.busy)

    def _update_title(self) -> None:
        cid = self.controller.conversation_id
        title = self.controller.store.conversation(cid).title if cid else "No conversation"
        self.title_label.setText(title)
        self._on_busy(self.controller.busy)
