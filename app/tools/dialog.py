"""Settings › Tools: the MCP servers (a command run over stdio, or a streamable-HTTP URL), the
tools each offers, and the tools that run without asking."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QListWidget, QPushButton, QWidget

from app.entry_list_dialog import EntryField, EntryListDialog
from app.settings.settings import Settings
from app.tools.manager import ToolManager
from app.tools.servers import make_server, servers_from_setting

SERVERS, ALWAYS = "tools.mcp_servers", "tools.always_allowed"

FIELDS = (
    EntryField("Name", "Server name"),
    EntryField(
        "Command or URL",
        "Command or URL",
        "a command (npx -y @modelcontextprotocol/server-filesystem ~/notes) or http://…/mcp",
    ),
)


class ToolsDialog(EntryListDialog):
    def __init__(self, settings: Settings, manager: ToolManager, parent: QWidget | None = None) -> None:
        super().__init__(
            "Tools (MCP servers)",
            "MCP servers whose tools the model may call (turn tools on per conversation).",
            "MCP servers",
            FIELDS,
            parent,
        )
        self.settings, self.manager = settings, manager
        self.setAccessibleName("Tools")
        self.status.setAccessibleName("Tools status")
        self.servers = self.entries
        self.name, self.target = self.fields
        self.add_section(QLabel("Tools (✓: runs without asking; select and press Forget to ask again):"))
        self.tools = QListWidget()
        self.tools.setAccessibleName("Tools")
        self.add_section(self.tools)
        self.forget_button = QPushButton("Forget “always allow”")
        self.add_section(self.forget_button)
        self.forget_button.clicked.connect(self.forget_selected)
        manager.toolsChanged.connect(self._fill_tools)
        manager.serverFailed.connect(lambda name, why: self.status.setText(why))
        self._fill()

    def _fill(self) -> None:
        self.servers.clear()
        for server in servers_from_setting(self.settings.get(SERVERS)):
            self.servers.addItem(f"{server.name}: {server.describe}")
        self._fill_tools()

    def _fill_tools(self) -> None:
        self.tools.clear()
        always = set(self.settings.get(ALWAYS))
        for name, (server, schema) in sorted(self.manager.tools.items()):
            mark = "✓ " if name in always else ""
            about = schema["function"].get("description", "")
            self.tools.addItem(f"{mark}{name} ({server.name}){': ' + about if about else ''}")
        if self.manager.pending_listings:
            self.status.setText("Listing the servers' tools…")

    def add(self, name: str, target: str) -> bool:
        try:
            server = make_server(name, target)
        except ValueError as exc:
            self.status.setText(str(exc))
            return False
        current = servers_from_setting(self.settings.get(SERVERS))
        if any(s.name == server.name for s in current):
            self.status.setText(f"There already is a server named {server.name!r}.")
            return False
        self.settings.set(SERVERS, [*self.settings.get(SERVERS), server.to_setting()])
        self.clear_fields()
        self._apply()
        return True

    def remove_selected(self) -> None:
        row = self.servers.currentRow()
        if row < 0:
            return
        values = list(self.settings.get(SERVERS))
        del values[row]
        self.settings.set(SERVERS, values)
        self._apply()

    def forget_selected(self) -> None:
        item = self.tools.currentItem()
        if item is None:
            return
        name = item.text().removeprefix("✓ ").split(" (", 1)[0]
        self.settings.set(ALWAYS, [n for n in self.settings.get(ALWAYS) if n != name])
        self._fill_tools()

    def _apply(self) -> None:
        self.manager.set_servers(servers_from_setting(self.settings.get(SERVERS)))
        self._fill()
