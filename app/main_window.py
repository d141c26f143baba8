"""The main window: composes the panes and connects them; owns no feature logic itself.

Left: the navigation rail (Chats, Models, Discover, Downloads, Settings; Ctrl+1..5). Chats is the
conversation list beside the chat, whose top row is the model picker; Discover (the Hub browser)
and Downloads are there when their packages are present. F1 or Ctrl+/ lists the shortcuts. The
empty states' buttons lead to the pane that fills them (no models: Discover).

Loads ask for the library's load options (context length, context memory), the same numbers its
memory estimates use. Exports and imports start in the folder used last (the documents folder at
first), not wherever the app was started from.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from PySide6.QtCore import QStandardPaths, Qt, QTimer
from PySide6.QtGui import (
    QAction,
    QCloseEvent,
    QFont,
    QGuiApplication,
    QKeySequence,
    QShortcut,
    QTextDocument,
)
from PySide6.QtWidgets import (
    QApplication,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QSplitter,
    QStackedWidget,
    QWidget,
)

from app import paths
from app.chat.controller import ChatController
from app.chat.markdown import MarkdownRenderer
from app.chat.pane import ChatPane
from app.chat.pending_writes import restore_rescued
from app.conversations.highlight import HIGHLIGHT_BACKGROUND
from app.conversations.model import ConversationListModel
from app.conversations.pane import ConversationPane
from app.edit_actions import EDIT_COMMANDS, focused_widget, run_on_focus, text_undo_available
from app.library.controller import LibraryController
from app.library.model import LibraryModel
from app.library.model_bar import ModelBar
from app.library.pane import LibraryPane
from app.navigation.page import TitledPage
from app.navigation.rail import Destination, NavigationRail
from app.remote.catalog import RemoteCatalog
from app.remote.dialog import EnginesDialog
from app.remote.refs import is_remote_ref, split_ref
from app.serve.status import ServeControl
from app.settings.dialog import SettingsDialog
from app.settings.page import SettingsPage
from app.settings.settings import Settings
from app.shortcut_overlay import ShortcutOverlay
from app.store import Store
from app.store.export import from_json, to_json, to_markdown
from app.theme import apply_theme, color_roles, error_color, render_theme
from app.tools.dialog import ToolsDialog
from app.tools.manager import ToolManager
from app.tools.servers import servers_from_setting
from app.worker import EngineClient
from engine.api import ModelInfo

log = logging.getLogger(__name__)


class MainWindow(QMainWindow):
    def __init__(
        self,
        store: Store,
        engine: EngineClient,
        models_dir: Path | None = None,
        *,
        hub: bool = True,
        download_manager: Any = None,
        autoload: bool = True,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Trellis Chat")
        self.setAccessibleName("Trellis Chat")
        self.resize(1200, 800)
        self.store = store
        self.engine = engine
        self.settings = Settings(store, self)
        self.models_dir = Path(models_dir) if models_dir is not None else paths.models_dir()
        self.download_manager = download_manager
        self.optional_panes: dict[str, QWidget] = {}

        app = QApplication.instance()
        self.dark = apply_theme(app, self.settings.get("appearance.theme")) if app else False
        self.renderer = MarkdownRenderer(render_theme(self.dark))

        # Models and controllers.
        self.chat = ChatController(
            store,
            engine,
            parent=self,
            default_preset=self.settings.get("chat.default_preset"),
            default_system_prompt=self.settings.get("chat.default_system_prompt"),
        )
        self.conversation_model = ConversationListModel(store, self)
        self.library_model = LibraryModel(self)
        self.library = LibraryController(self.settings, self.models_dir, self.library_model, self)

        # Views.
        self.conversations = ConversationPane(self.conversation_model)
        self.chat_pane = ChatPane(self.chat, self.renderer)
        self.library_pane = LibraryPane(self.library_model)
        self.model_bar = ModelBar(self.library_model)
        self.remote = RemoteCatalog(self.library_model.columnCount(), self)  # remote engines' models
        self.model_bar.add_source(self.remote.model)
        self.remote.refresh(self.settings.get("remote.endpoints"))
        # Tool use: the MCP servers' tools, each call asked about (app.chat.tool_loop).
        self.tool_manager = ToolManager(parent=self)
        self.chat.tool_loop.set_manager(self.tool_manager)
        self.chat.tool_loop.always_allowed = lambda: self.settings.get("tools.always_allowed")
        self.chat.tool_loop.allow_always = self._always_allow_tool
        self.chat.max_tool_rounds = self.settings.get("tools.max_rounds")
        self.tool_manager.set_servers(servers_from_setting(self.settings.get("tools.mcp_servers")))
        self.serve = ServeControl(
            engine, lambda: self.settings.get("serve.port"), lambda m: self.statusBar().showMessage(m, 15000)
        )
        self.statusBar().addPermanentWidget(self.serve.status)
        self.library_pane.load_options.set_cache_bits(*self.library.cache_bits())
        self.library_pane.load_options.set_context_length(self.library.context_limit())
        self.settings_page = SettingsPage(self.settings)
        self.chat_pane.set_model_bar(self.model_bar)

        chats = QSplitter(Qt.Orientation.Horizontal)
        chats.setAccessibleName("Chats")
        chats.addWidget(self.conversations)
        chats.addWidget(self.chat_pane)
        chats.setStretchFactor(0, 0)
        chats.setStretchFactor(1, 1)
        chats.setSizes([260, 940])
        self.chats_page = chats
        self.page_for: dict[str, QWidget] = {
            "chats": chats,
            "models": TitledPage(
                "Models",
                "The models on this computer, what each needs and how to load it.",
                self.library_pane,
            ),
        }
        self._add_optional_panes(hub)
        self.page_for["settings"] = self.settings_page
        labels = {"chats": "Chats", "models": "Models", "discover": "Discover", "downloads": "Downloads"}
        labels["settings"] = "Settings"
        self.pages = QStackedWidget()
        self.pages.setAccessibleName("Panes")
        for page in self.page_for.values():
            self.pages.addWidget(page)
        self.nav = NavigationRail([Destination(key, labels[key]) for key in self.page_for])
        self.nav.currentChanged.connect(lambda key: self.pages.setCurrentWidget(self.page_for[key]))
        central = QWidget()
        row = QHBoxLayout(central)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(0)
        row.addWidget(self.nav)
        row.addWidget(self.pages, 1)
        self.setCentralWidget(central)
        self.shortcut_overlay = ShortcutOverlay(self)

        self._build_menus()
        self._connect()
        self._apply_font_size()
        self._apply_theme_colors()  # every pane is in the window now

        # Restore state: first what could not be saved at the last exit (a full disk, a lock).
        restored = restore_rescued(store, store.db_path.parent)
        self.library.refresh()
        self.chat_pane.set_has_models(not self.library.is_empty())
        self.library_pane.set_folders([str(p) for p in self.library.folders()])
        self.conversations.refresh()
        ids = self.conversation_model.ids()
        self.chat.open_conversation(ids[0] if ids else None)
        self._update_starter_banner()
        if autoload:
            self._autoload()
        if restored:
            self.statusBar().showMessage(
                f"Restored {len(restored)} conversation(s) that could not be saved last time", 20000
            )
        self.warmed_up = False
        self._warm_up(self.renderer.warm_up_steps())

    def _warm_up(self, steps: list) -> None:
        """Pay first-use costs (lexer imports, font and layout caches) one step per event-loop
        turn, so the first streamed code block renders as fast as the later ones."""
        if steps:
            steps[0]()
            QTimer.singleShot(0, lambda: self._warm_up(steps[1:]))
        else:
            doc = QTextDocument()
            doc.setHtml(self.renderer.render("```python\nx = 1\n```\n").html)
            doc.size()
            self.warmed_up = True

    # -- construction --------------------------------------------------------------------------------

    def _add_optional_panes(self, enabled: bool) -> None:
        """The Hub browser and downloads queue live in their own packages; the app works without."""
        if not enabled:
            return
        try:
            from app.downloads import create_downloads_pane
            from app.hub import create_hub_pane
        except ImportError as exc:
            log.info("hub panes not available: %s", exc)
            return
        try:
            if self.download_manager is None:
                from engine.hub import DownloadManager

                self.download_manager = DownloadManager(
                    self.models_dir, state_path=paths.data_dir() / "downloads.json", autostart=False
                )
            # One GUI-thread wrapper is shared by both panes; its modelInstalled signal (queued from
            # the download threads) tells the library a verified model just landed.
            from app.downloads.qt_manager import QtDownloadManager

            wrapper = QtDownloadManager.wrap(self.download_manager, self)
            wrapper.modelInstalled.connect(self._on_model_installed)
            hub_pane = create_hub_pane(self.download_manager, self)
            downloads_pane = create_downloads_pane(self.download_manager, self)
            self.page_for["discover"] = TitledPage(
                "Discover", "Models on the Hugging Face Hub, and whether they fit this machine.", hub_pane
            )
            self.page_for["downloads"] = TitledPage(
                "Downloads", "Models being downloaded; they resume after a restart.", downloads_pane
            )
            self.optional_panes = {"hub": hub_pane, "downloads": downloads_pane}
            start = getattr(self.download_manager, "start", None)
            if start is not None:
                start()
        except Exception:  # a broken optional pane must not stop the app from starting
            log.exception("could not create the hub/downloads panes")

    def _on_model_installed(self, path: str) -> None:
        self.library.refresh()
        self.statusBar().showMessage(f"Downloaded {Path(path).name}: it is in the library", 10000)

    def _build_menus(self) -> None:
        bar = self.menuBar()
        file_menu = bar.addMenu("&File")
        self.new_action = self._action(
            file_menu, "&New chat", QKeySequence.StandardKey.New, self.chat.new_conversation
        )
        file_menu.addSeparator()
        self._action(file_menu, "&Import conversation (JSON)…", None, self._import_dialog)
        self._action(file_menu, "Export as &Markdown…", None, lambda: self._export_dialog("md"))
        self._action(file_menu, "Export as &JSON…", None, lambda: self._export_dialog("json"))
        file_menu.addSeparator()
        self._action(file_menu, "Open model &folder…", None, self.library_pane._choose_folder)
        self._action(file_menu, "&Settings…", QKeySequence.StandardKey.Preferences, self.open_settings)
        self._action(file_menu, "Settings › &Engines (remote)…", None, self.open_engines)
        self._action(file_menu, "Settings › &Tools (MCP)…", None, self.open_tools)
        file_menu.addSeparator()
        file_menu.addAction(self.serve.action)
        file_menu.addSeparator()
        self._action(file_menu, "&Quit", QKeySequence.StandardKey.Quit, self.close)

        edit_menu = bar.addMenu("&Edit")
        self.edit_actions: dict[str, QAction] = {}
        for text, key, method in EDIT_COMMANDS:
            slot = self.undo if method == "undo" else (lambda _checked=False, m=method: run_on_focus(m))
            self.edit_actions[method] = self._action(edit_menu, text, key, slot)
            if method in ("redo", "paste"):
                edit_menu.addSeparator()
        edit_menu.addSeparator()
        self.find_action = self._action(
            edit_menu, "&Find in conversations…", QKeySequence.StandardKey.Find, self.focus_search
        )

        view_menu = bar.addMenu("&View")
        for action in self.nav.actions_by_key.values():
            view_menu.addAction(action)

        chat_menu = bar.addMenu("&Chat")
        self._action(chat_menu, "&Regenerate reply", QKeySequence("Ctrl+R"), self.chat.regenerate)
        self._action(chat_menu, "Conversation &settings…", None, self.chat_pane.open_conversation_settings)
        help_menu = bar.addMenu("&Help")
        self.shortcuts_action = self._action(
            help_menu, "&Keyboard shortcuts", QKeySequence("F1"), self.shortcut_overlay.toggle
        )
        self.shortcuts_action.setShortcuts([QKeySequence("F1"), QKeySequence("Ctrl+/")])
        self._action(help_menu, "&About Trellis Chat", None, self.open_about)
        self._action(help_menu, "Open &logs folder", None, self.open_logs_folder)
        # Esc stops a reply; a window-wide shortcut so it works wherever the focus is.
        self.stop_shortcut = QShortcut(QKeySequence(Qt.Key.Key_Escape), self)
        self.stop_shortcut.activated.connect(self.chat.stop)

    def undo(self) -> None:
        """Edit > Undo: the focused text's last edit, else the last deletion of messages."""
        if not text_undo_available(focused_widget()) and self.chat.can_undo_delete():
            self.chat.undo_delete()
        else:
            run_on_focus("undo")

    def _action(self, menu, text: str, shortcut, slot) -> QAction:
        action = QAction(text, self)
        if shortcut is not None:
            action.setShortcut(shortcut)
        action.triggered.connect(slot)
        menu.addAction(action)
        return action

    def _connect(self) -> None:
        conv = self.conversations
        conv.conversationSelected.connect(self._open_conversation)
        conv.newRequested.connect(self.chat.new_conversation)
        conv.renameRequested.connect(self.chat.rename_conversation)
        conv.deleteRequested.connect(self.chat.delete_conversation)
        conv.search.textChanged.connect(lambda _text: self._update_highlight())
        self.chat.conversationsChanged.connect(conv.refresh)
        self.chat.conversationChanged.connect(conv.select)

        self.library_pane.loadRequested.connect(self.request_load)
        self.library_pane.addFolderRequested.connect(self.add_model_folder)
        self.library_pane.removeFolderRequested.connect(self.library.remove_folder)
        self.library_pane.refreshRequested.connect(self.library.refresh)
        self.library_pane.deleteRequested.connect(self.delete_model)
        self.library_pane.showInFolderRequested.connect(self.show_model_folder)
        options = self.library_pane.load_options
        options.contextMemoryChosen.connect(self.library.set_cache_bits)
        options.contextLengthChosen.connect(self.library.set_context_limit)
        self.library.foldersChanged.connect(self.library_pane.set_folders)
        self.library.notModelsChanged.connect(self.library_pane.set_not_models)
        self.library.refreshed.connect(self._update_starter_banner)
        self.library.refreshed.connect(lambda *_: self.chat_pane.set_has_models(not self.library.is_empty()))
        # The empty states' buttons: to the pane that fills them.
        self.library_pane.discoverRequested.connect(lambda: self.go_to("discover"))
        self.chat_pane.navigateRequested.connect(self.go_to)
        downloads = self.optional_panes.get("downloads")
        if downloads is not None:
            downloads.discoverRequested.connect(lambda: self.go_to("discover"))
        self.settings_page.enginesRequested.connect(self.open_engines)
        self.settings_page.toolsRequested.connect(self.open_tools)
        self.model_bar.loadRequested.connect(self.request_load)
        self.model_bar.unloadRequested.connect(self.unload_model)

        self.engine.loadProgress.connect(self.model_bar.set_progress)
        self.engine.loaded.connect(self._on_loaded)
        self.engine.loadFailed.connect(self._on_load_failed)
        self.engine.unloaded.connect(lambda: self.model_bar.set_unloaded())
        self.engine.error.connect(lambda message: self.statusBar().showMessage(message, 20000))
        self.engine.starterProgress.connect(self.model_bar.set_progress)
        self.engine.starterReady.connect(self._on_starter_ready)
        self.engine.starterFailed.connect(self._on_starter_failed)
        banner = self.chat_pane.starter_banner
        banner.installRequested.connect(self.install_starter)
        banner.dismissed.connect(self._dismiss_starter)
        self.settings.changed.connect(self._on_setting_changed)
        hints = QGuiApplication.styleHints()
        if hasattr(hints, "colorSchemeChanged"):  # Qt 6.5+: follow the system's light/dark switch
            hints.colorSchemeChanged.connect(self._on_system_scheme_changed)

    # -- conversations -------------------------------------------------------------------------------

    def go_to(self, key: str) -> None:
        """Show pane ``key`` ("chats", "models", "discover", ...); a pane this window does not
        have (the Hub packages missing) says so in the status bar instead."""
        if key in self.page_for:
            self.nav.select(key)
        else:
            self.statusBar().showMessage(f"The {key} pane is not available in this installation", 10000)

    def _open_conversation(self, conversation_id: int) -> None:
        self.chat.open_conversation(conversation_id)
        self.go_to("chats")

    def focus_search(self) -> None:
        self.conversations.focus_search()

    def _update_highlight(self) -> None:
        """While the conversation list is filtered by a search, its matches are marked in the
        messages shown too."""
        self.chat_pane.view.set_highlight(self.conversation_model.terms(), HIGHLIGHT_BACKGROUND[self.dark])

    # -- export and import -----------------------------------------------------------------------------

    def file_dialog_folder(self) -> Path:
        """Where export and import dialogs open: the folder used last, else the documents folder
        (never the working directory, which for a desktop app is wherever it was started from)."""
        last = self.settings.get("export.last_folder")
        if last and Path(last).is_dir():
            return Path(last)
        documents = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
        return Path(documents) if documents else Path.home()

    def export_default_path(self, fmt: str, conversation_id: int | None = None) -> Path:
        """The file name the export dialog proposes: the conversation's title in that folder."""
        cid = conversation_id or self.chat.conversation_id
        title = self.store.conversation(cid).title if cid else "conversation"
        safe = "".join(c if c.isalnum() or c in " -_" else "_" for c in title).strip() or "conversation"
        return self.file_dialog_folder() / (safe + (".md" if fmt == "md" else ".json"))

    def _remember_folder(self, path: str | Path) -> None:
        self.settings.set("export.last_folder", str(Path(path).parent))

    def export_conversation(self, path: str | Path, fmt: str, conversation_id: int | None = None) -> Path:
        cid = conversation_id or self.chat.conversation_id
        if cid is None:
            raise ValueError("no conversation to export")
        path = Path(path)
        if fmt == "md":
            path.write_text(to_markdown(self.store, cid), encoding="utf-8")
        else:
            path.write_text(
                json.dumps(to_json(self.store, cid), indent=2, ensure_ascii=False), encoding="utf-8"
            )
        self._remember_folder(path)
        self.statusBar().showMessage(f"Exported to {path}", 8000)
        return path

    def import_conversation(self, path: str | Path) -> int:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        cid = from_json(self.store, data)
        self._remember_folder(path)
        self.conversations.refresh()
        self._open_conversation(cid)
        return cid

    def _export_dialog(self, fmt: str) -> None:
        if self.chat.conversation_id is None:
            return
        filt = "Markdown (*.md)" if fmt == "md" else "JSON (*.json)"
        proposed = str(self.export_default_path(fmt))
        path, _ = QFileDialog.getSaveFileName(self, "Export conversation", proposed, filt)
        if path:
            self.export_conversation(path, fmt)

    def _import_dialog(self) -> None:
        folder = str(self.file_dialog_folder())
        path, _ = QFileDialog.getOpenFileName(self, "Import conversation", folder, "JSON (*.json)")
        if path:
            try:
                self.import_conversation(path)
            except (ValueError, OSError) as exc:
                self.chat_pane.show_error(f"Could not import {Path(path).name}: {exc}")

    # -- models ----------------------------------------------------------------------------------------

    def add_model_folder(self, folder: str) -> None:
        info = self.library.add_folder(folder)
        self.go_to("models")
        if info is not None:
            self.library_pane.select_path(str(info.path))
            if not info.ok:
                self.statusBar().showMessage(
                    f"{info.name} cannot be loaded: {'; '.join(info.problems)}", 20000
                )

    def request_load(self, path: str) -> None:
        """Load the model at ``path`` with the load options. Asking for the load that is in flight
        or done (same folder, device, cache and context) changes nothing: a reload would cancel
        whatever was sent to it."""
        if is_remote_ref(path):
            self._load_remote(path)
            return
        device, cache_bits = self.settings.get("engine.device"), self.library.cache_bits()
        info = self.library.info_for(path)
        context = self.library.load_context(info)
        parallel = self.library_pane.load_options.parallel_choice()  # several GPUs: how to split
        if self.engine.has_load(path, device, cache_bits, context, parallel):
            return
        self.chat_pane.clear_error()  # the previous model's trouble is not this one's
        if not info.ok:
            message = f"{info.name} cannot be loaded: {'; '.join(info.problems)}"
            self.chat_pane.show_error(message)
            self.statusBar().showMessage(message, 20000)
            return
        if self.chat.busy:
            self.chat.stop()
        self.model_bar.set_loading(info.name)
        self.model_bar.select_path(path)
        self.engine.load(path, device, cache_bits, context, parallel)

    def open_tools(self) -> ToolsDialog:
        dialog = ToolsDialog(self.settings, self.tool_manager, self)
        dialog.open()
        return dialog

    def _always_allow_tool(self, name: str) -> None:
        allowed = self.settings.get("tools.always_allowed")
        if name not in allowed:
            self.settings.set("tools.always_allowed", [*allowed, name])

    def open_engines(self) -> EnginesDialog:
        dialog = EnginesDialog(self.settings, self.remote, self)
        dialog.open()
        return dialog

    def _load_remote(self, ref: str) -> None:
        """A remote engine's model: nothing to estimate or check here; the load asks the endpoint."""
        if self.engine.has_load(ref, "remote", (16, 16)):
            return
        self.chat_pane.clear_error()
        if self.chat.busy:
            self.chat.stop()
        self.model_bar.set_loading(split_ref(ref)[1])
        self.model_bar.select_path(ref)
        self.engine.load(ref, "remote")

    def unload_model(self) -> None:
        self.chat.stop()
        self.engine.unload()

    def delete_model(self, path: str) -> None:
        """Delete a model folder (the library pane has asked the user). The loaded model (or the
        one loading) is not deleted from under the engine: unload it first."""
        if self.engine.load_target() == str(Path(path).resolve()):
            QMessageBox.information(
                self, "Delete model", f"{Path(path).name} is loaded (or loading): unload it first."
            )
            return
        try:
            self.library.delete_model(path)
        except (OSError, ValueError) as exc:
            QMessageBox.warning(self, "Delete model", f"Could not delete {Path(path).name}: {exc}")
            return
        self.statusBar().showMessage(f"Deleted {Path(path).name}", 8000)

    def show_model_folder(self, path: str) -> None:
        from app.crash import open_folder

        open_folder(Path(path))

    def _on_loaded(self, info: ModelInfo) -> None:
        self.model_bar.set_loaded(info)
        self.settings.set("library.last_model", info.path)
        self.statusBar().showMessage(f"Loaded {info.name}", 5000)

    def _on_load_failed(self, message: str) -> None:
        self.model_bar.set_unloaded("Load failed")
        self.chat_pane.show_error(message)

    def _autoload(self) -> None:
        last = self.settings.get("library.last_model")
        if last and self.settings.get("library.autoload") and self.library_model.row_of(last) >= 0:
            if self.library.info_for(last).ok:
                self.request_load(last)

    def install_starter(self) -> None:
        self.chat_pane.starter_banner.hide()
        self.model_bar.set_progress(0.0, "Installing starter model")
        self.engine.install_starter(self.models_dir)

    def _on_starter_ready(self, path: str) -> None:
        self.library.refresh()
        self.request_load(path)

    def _on_starter_failed(self, message: str) -> None:
        self.model_bar.set_unloaded("No model loaded")
        self.chat_pane.show_error(message)
        self._update_starter_banner()

    def _dismiss_starter(self) -> None:
        self.settings.set("library.starter_dismissed", True)
        self._update_starter_banner()

    def _update_starter_banner(self) -> None:
        show = self.library.is_empty() and not self.settings.get("library.starter_dismissed")
        self.chat_pane.starter_banner.setVisible(show)

    # -- settings ----------------------------------------------------------------------------------------

    def open_settings(self) -> None:
        SettingsDialog(self.settings, self).exec()

    def _on_setting_changed(self, key: str, _value: Any) -> None:
        if key == "appearance.theme":
            self._apply_theme()
        elif key == "appearance.font_size":
            self._apply_font_size()
        elif key == "chat.default_preset":
            self.chat.default_preset = self.settings.get(key)
        elif key == "serve.port":
            self.serve.update_label()
        elif key == "tools.max_rounds":
            self.chat.max_tool_rounds = self.settings.get(key)
        elif key == "chat.default_system_prompt":
            self.chat.default_system_prompt = self.settings.get(key)
        elif key == "engine.device":
            self.library.refresh()
        elif key in ("engine.cache_bits_k", "engine.cache_bits_v"):
            self.library.refresh_estimates()
            self.library_pane.load_options.set_cache_bits(*self.library.cache_bits())
        elif key == "engine.context_length":
            self.library.refresh_estimates()
            self.library_pane.load_options.set_context_length(self.library.context_limit())

    def _apply_theme(self) -> None:
        app = QApplication.instance()
        self.dark = apply_theme(app, self.settings.get("appearance.theme"))
        self.renderer = MarkdownRenderer(render_theme(self.dark))
        self.chat_pane.view.set_renderer(self.renderer)
        self._apply_theme_colors()

    def _apply_theme_colors(self) -> None:
        """Status labels' colours, and those of HTML the panes render and of the list's delegate."""
        color_roles(self, self.dark)
        self.library_pane.set_error_color(error_color(self.dark))
        self.conversations.set_dark(self.dark)
        self._update_highlight()

    def _on_system_scheme_changed(self, *_args) -> None:
        if self.settings.get("appearance.theme") == "system":
            self._apply_theme()

    def _apply_font_size(self) -> None:
        font = QFont(self.chat_pane.view.font())
        font.setPointSize(int(self.settings.get("appearance.font_size")))
        self.chat_pane.view.setFont(font)
        self.chat_pane.composer.setFont(font)

    # -- help: about, GPU report, logs ----------------------------------------------------------------

    def open_about(self) -> None:
        from app.about import AboutDialog

        self.about_dialog = AboutDialog(self)
        self.about_dialog.open()

    def open_logs_folder(self) -> None:
        from app.crash import log_dir, open_folder

        log_dir().mkdir(parents=True, exist_ok=True)
        open_folder(log_dir())

    def show_gpu_report(self, report: Any) -> None:
        """The startup GPU check (app.gpu_check): where models run, in the status bar; why, in its
        tooltip and, for a while, as the status message."""
        label = getattr(self, "gpu_label", None)
        if label is None:
            label = self.gpu_label = QLabel()
            label.setAccessibleName("Where models run")
            self.statusBar().addPermanentWidget(label)
        label.setText(report.short)
        label.setToolTip(report.text())
        devices = report.facts.devices if report.uses_gpu else ()
        # each GPU's free memory where the check read it (before a model is loaded: what the next
        # load can use), else its size
        memory = [device.usable_bytes for device in devices]
        free = bool(devices) and all(device.free_bytes for device in devices)
        # one or more: where the model runs (chosen by its size); several: splitting it across them
        self.library_pane.load_options.set_gpu_count(len(devices), memory[0] if memory else 0, memory, free)
        self.library_pane.model.set_gpus(memory, free)
        self.library_pane.refresh_placement()
        self.statusBar().showMessage(report.headline, 20000)
        self.settings_page.gpu_runtime.set_report(report)

    # -- shutdown ------------------------------------------------------------------------------------------

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 (Qt naming)
        self.chat.shutdown()
        self.engine.shutdown()
        self.tool_manager.close()
        shutdown = getattr(self.download_manager, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:
                log.exception("download manager shutdown failed")
        super().closeEvent(event)
