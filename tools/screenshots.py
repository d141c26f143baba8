"""Screenshots of every pane of the app, filled and empty, for one theme and one window size.

    python tools/screenshots.py OUT_DIR [--theme light|dark] [--size 1280x800] [--root REPO]

Runs the app offscreen (no display needed) with the scripted engine of the GUI tests
(``tests/gui/fake_engine.py``) and the local Hub look-alike (``tests/support/fake_hub.py``): no
network, no real model. Two temporary data directories are used: one with a few conversations,
model folders, a Hub search and a download (the ``filled`` shots), one fresh (the ``empty`` shots:
no conversations, no models, no downloads, a search that finds nothing).

Files are named ``PANE-STATE-THEME-WxH.png``, PANE one of chats, models, discover, downloads,
settings (the chats shot with the pointer over the last message), plus ``shortcuts-filled-...``
for the keyboard shortcut overlay where the window has one.

``--root`` runs another checkout of the repository (e.g. an export of an older commit) with this
same script, so before/after pairs are comparable; a window without the navigation rail is driven
through its tabs, and its settings are the settings dialog.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

PANES = ("chats", "models", "discover", "downloads", "settings")

REPLY = """Here is a small function that computes the **mean** and the *variance*:

```python
def stats(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return mean, var
```

| input | mean | variance |
|---|---|---|
| `[1, 2, 3]` | 2 | 0.667 |
| `[5, 5]` | 5 | 0 |

1. Call `stats([1, 2, 3])`.
2. Read the tuple back. 🎉
"""


def _parse_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must be WIDTHxHEIGHT, e.g. 1280x800, not {text!r}") from None
    if width < 320 or height < 240:
        raise argparse.ArgumentTypeError(f"size {text} is too small (at least 320x240)")
    return width, height


def demo_hub():
    """The local Hub look-alike, started, with two llama repositories to search, page and download
    (``fake_hub`` must be importable: tests/support on ``sys.path``)."""
    from fake_hub import FakeHub, PatternBlob, tiny_llama_config

    hub = FakeHub()
    hub.start()
    cfg = json.dumps(tiny_llama_config())
    hub.add_repo(
        "turbo/llama-8B-exl3",
        {"config.json": cfg, "README.md": "---\nlicense: llama3.1\n---\n# Llama EXL3\n\nPick a **branch**."},
        branches={"4.0bpw": {"config.json": cfg, "model.safetensors": PatternBlob(400_000, seed=2)}},
        tags=["exl3"],
        downloads=100,
        card_data={"license": "llama3.1"},
        params=8_000_000_000,
    )
    hub.add_repo(
        "meta/llama-8B",
        {"config.json": cfg, "tokenizer.json": "{}", "model.safetensors": PatternBlob(100_000, 3)},
        downloads=999,
    )
    return hub


def isolated_from_user():
    """Keep the app away from the user's Hub cache, token and keyring; point it at a started
    :func:`demo_hub`, which is returned (stop it when done)."""
    os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="trellis-shots-hf-")
    os.environ["PYTHON_KEYRING_BACKEND"] = "keyring.backends.null.Keyring"
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        os.environ.pop(var, None)
    hub = demo_hub()
    os.environ["HF_ENDPOINT"] = hub.endpoint
    return hub


class Session:
    """One app window on its own data directory, driven to a state and photographed."""

    def __init__(self, app, out: Path, theme: str, size: tuple[int, int], state: str) -> None:
        from fake_engine import FakeEngine, fake_starter

        from app import paths
        from app.main_window import MainWindow
        from app.store import Store
        from app.worker import EngineClient

        os.environ["TRELLIS_DATA_DIR"] = tempfile.mkdtemp(prefix=f"trellis-shots-{state}-")
        self.app, self.out, self.theme, self.size, self.state = app, out, theme, size, state
        self.script = FakeEngine(token_delay=0.0005)
        self.engine = EngineClient(self.script.factory, fake_starter)
        self.store = Store(paths.database_path())
        self.window = MainWindow(self.store, self.engine, paths.models_dir(), hub=True, autoload=False)
        self.window.settings.set("appearance.theme", theme)
        self.window.resize(*size)
        self.window.show()
        self.spin(lambda: False, 0.3)

    def spin(self, until, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline:
            self.app.processEvents()
            time.sleep(0.002)

    def pane_widget(self, pane: str):
        window = self.window
        return {
            "chats": window.chat_pane,
            "models": window.library_pane,
            "discover": window.optional_panes.get("hub"),
            "downloads": window.optional_panes.get("downloads"),
        }.get(pane)

    def show(self, pane: str) -> None:
        nav = getattr(self.window, "nav", None)
        if nav is not None:
            nav.select(pane)
        elif self.pane_widget(pane) is not None:
            self.window.tabs.setCurrentWidget(self.pane_widget(pane))

    def shot(self, pane: str) -> None:
        self.show(pane)
        self.window.resize(*self.size)
        self.spin(lambda: False, 0.3)
        if pane == "chats":
            self._hover_last_message()
        target = self.window
        dialog = None
        if pane == "settings" and getattr(self.window, "nav", None) is None:
            from app.settings.dialog import SettingsDialog

            dialog = SettingsDialog(self.window.settings, self.window)
            dialog.show()
            self.spin(lambda: False, 0.3)
            target = dialog
        width, height = self.size
        name = f"{pane}-{self.state}-{self.theme}-{width}x{height}.png"
        image = target.grab()
        image.save(str(self.out / name))
        print(f"{name} {image.width()}x{image.height()}")
        if dialog is not None:
            dialog.close()

    def _hover_last_message(self) -> None:
        """Show the last message as the pointer over it shows it (its actions and time)."""
        view = self.window.chat_pane.view
        rows = view.model.rowCount()
        if rows and hasattr(view.message_widget(rows - 1), "set_hovered"):
            view.scroll_to_bottom()
            view.message_widget(rows - 1).set_hovered(True)
            self.spin(lambda: False, 0.1)

    def shortcuts(self) -> None:
        """The keyboard shortcut overlay, where the window has one."""
        overlay = getattr(self.window, "shortcut_overlay", None)
        if overlay is None:
            return
        self.show("chats")
        overlay.open()
        self.spin(lambda: False, 0.3)
        width, height = self.size
        name = f"shortcuts-{self.state}-{self.theme}-{width}x{height}.png"
        self.window.grab().save(str(self.out / name))
        print(name)
        overlay.hide()

    def close(self) -> None:
        self.window.close()
        self.store.close()


def fill(session: Session) -> None:
    """Conversations, models (one broken), a reply with code and a table, a Hub search, a download."""
    from fake_engine import make_model_dir

    window = session.window
    for title in ("Help with Rust lifetimes", "Plan a trip to Lisbon", "Ideas for a birthday party"):
        window.chat.new_conversation()
        window.chat.rename_conversation(window.chat.conversation_id, title)
    model = make_model_dir(window.models_dir / "SmolLM2-135M-Instruct")
    broken = make_model_dir(window.models_dir / "broken-download", architecture="MambaForCausalLM")
    (broken / "tokenizer.json").unlink()
    window.library.refresh()
    window.request_load(str(model))
    session.spin(lambda: session.engine.is_loaded)
    window.chat.new_conversation()
    session.script.reply = lambda _messages: REPLY
    for question in ("How do I compute the mean and variance of a list in Python?", "Thanks! 👍"):
        window.chat.submit(question)
        session.spin(lambda: not window.chat.busy)
    window.chat.rename_conversation(window.chat.conversation_id, "Mean and variance in Python")
    window.library_pane.select_path(str(model))
    hub_pane = window.optional_panes.get("hub")
    if hub_pane is not None:
        hub_pane.search_edit.setText("llama")
        hub_pane.supported_check.setChecked(False)
        hub_pane.run_search()
        session.spin(lambda: hub_pane.results.rowCount() > 0, 20)
        hub_pane.results_view.selectRow(0)
        session.spin(lambda: hub_pane.page is not None, 20)
        hub_pane.start_download()
        session.spin(lambda: False, 2.0)


def search_nothing(session: Session) -> None:
    """The empty session's Hub: a search that finds no model."""
    hub_pane = session.window.optional_panes.get("hub")
    if hub_pane is not None:
        hub_pane.search_edit.setText("no-such-model-anywhere")
        hub_pane.run_search()
        session.spin(lambda: not hub_pane.controller.busy, 20)
        session.spin(lambda: False, 0.5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the PNGs (created)")
    parser.add_argument("--theme", choices=("light", "dark"), default="light")
    parser.add_argument("--size", type=_parse_size, default=(1280, 800), help="window size, WxH")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="repository")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if not (root / "app" / "main_window.py").is_file():
        parser.error(f"{root} is not a Trellis Chat checkout (no app/main_window.py)")
    sys.path[:0] = [str(root / "tests" / "gui"), str(root / "tests" / "support"), str(root)]
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    args.out.mkdir(parents=True, exist_ok=True)
    hub = isolated_from_user()
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([])
    try:
        for state, prepare in (("filled", fill), ("empty", search_nothing)):
            session = Session(app, args.out, args.theme, args.size, state)
            prepare(session)
            for pane in PANES:
                session.shot(pane)
            if state == "filled":
                session.shortcuts()
            session.close()
    finally:
        hub.stop()


if __name__ == "__main__":
    main()
