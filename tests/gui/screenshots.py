"""Screenshots of every pane and dialog, light and dark, at 1280x800.

Not a test: ``QT_QPA_PLATFORM=offscreen python tests/gui/screenshots.py OUT_DIR`` writes PNGs for
a human to look at (nothing cut off, nothing overlapping, no window wider than the screen). Uses
the scripted engine of the tests and the Hub look-alike of ``tools/screenshots.py`` (the
per-pane shots at any size and theme): no network, no real model.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "support"), str(HERE.parents[1])]
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

WIDTH, HEIGHT = 1280, 800

REPLY = """Sure! Here is a small function that computes the **mean** and the *variance*:

```python
def stats(values: list[float]) -> tuple[float, float]:
    \"\"\"Mean and (population) variance.\"\"\"
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return mean, var
```

The variance is $\\sigma^2 = \\frac{1}{n} \\sum_{i=1}^{n} (x_i - \\mu)^2$, and

$$
\\sigma = \\sqrt{\\sigma^2}
$$

| input | mean | variance |
|---|---|---|
| `[1, 2, 3]` | 2 | 0.667 |
| `[5, 5]` | 5 | 0 |

1. Call `stats([1, 2, 3])`.
2. Read the tuple back.
"""

# A reply whose model did not fence its code nor blank-line its list (issue 40, defect 3).
UNFENCED = """Steps:
1) open the file
2) read it
Code:
for line in open("x"):
    print(line)
"""

LONG_TITLE = "A very long conversation title about Rust lifetimes, borrowing and the async runtime"


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    os.environ["TRELLIS_DATA_DIR"] = tempfile.mkdtemp(prefix="trellis-shots-")
    from tools.screenshots import isolated_from_user

    hub = isolated_from_user()
    from fake_engine import FakeEngine, fake_starter, make_model_dir
    from PySide6.QtWidgets import QApplication, QDialog, QInputDialog

    from app import paths
    from app.main_window import MainWindow
    from app.store import Store
    from app.worker import EngineClient

    app = QApplication([])
    script = FakeEngine(token_delay=0.0005)
    engine = EngineClient(script.factory, fake_starter)
    store = Store(paths.database_path())
    window = MainWindow(store, engine, paths.models_dir(), hub=True)
    window.resize(WIDTH, HEIGHT)
    window.show()

    def spin(until, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline:
            app.processEvents()
            time.sleep(0.002)

    def shot(widget, name: str) -> None:
        spin(lambda: False, 0.25)
        image = widget.grab()
        image.save(str(out / f"{name}.png"))
        print(f"{name}.png {image.width()}x{image.height()}")

    for name in ("Help with Rust lifetimes", "Plan a trip to Lisbon", LONG_TITLE):
        window.chat.new_conversation()
        window.chat.rename_conversation(window.chat.conversation_id, name)
    model = make_model_dir(window.models_dir / "SmolLM2-135M-Instruct")
    broken = make_model_dir(window.models_dir / "broken-download", architecture="MambaForCausalLM")
    (broken / "tokenizer.json").unlink()
    # A folder that holds no model (an adapter: weights, no config.json).
    adapter = window.models_dir / "my-lora-adapter"
    adapter.mkdir(parents=True, exist_ok=True)
    (adapter / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    from fixture_paths import exl3_fixture_dir

    fixtures = exl3_fixture_dir()
    if fixtures is not None:  # real EXL3 and dense models, where the shared fixtures are found
        window.library.add_folder(fixtures)
    window.library.refresh()
    window.request_load(str(model))
    spin(lambda: engine.is_loaded)
    window.chat.new_conversation()
    questions = [
        "How do I compute the mean and variance of a list in Python?",
        "Can you explain the formula too?",
        "And a plain-text answer, please.",
    ]
    for q in questions:
        script.reply = (lambda m: UNFENCED) if "plain" in q else (lambda m: REPLY)
        window.chat.submit(q)
        spin(lambda: not window.chat.busy)
    window.chat.regenerate()  # gives the last reply a "2/2" branch switcher
    spin(lambda: not window.chat.busy)
    window.chat_pane.show_error(
        "Could not finish the reply: unexpected RuntimeError: a long error message that goes on "
        "and on to see whether the error line wraps or widens the window " * 2
    )

    # The Hub: a search and a model page, then downloads of one model.
    hub_pane = window.optional_panes.get("hub")
    downloads_pane = window.optional_panes.get("downloads")
    if hub_pane is not None:
        hub_pane.search_edit.setText("llama")
        hub_pane.supported_check.setChecked(False)
        hub_pane.run_search()
        spin(lambda: hub_pane.results.rowCount() > 0, 20)
        hub_pane.results_view.selectRow(0)
        spin(lambda: hub_pane.page is not None, 20)
        hub_pane.start_download()
        spin(lambda: False, 2.0)

    for theme in ("light", "dark"):
        window.settings.set("appearance.theme", theme)
        window.go_to("chats")
        spin(lambda: False, 0.3)
        window.chat_pane.view.scroll_to_bottom()
        shot(window, f"chat-{theme}-bottom")
        window.chat_pane.view.verticalScrollBar().setValue(0)
        shot(window, f"chat-{theme}-top")
        # A search: the list shows where it matched, the conversation marks the matches.
        window.conversations.search.setText("variance")
        spin(lambda: False, 0.2)
        if window.conversation_model.rowCount():
            window.conversations.conversationSelected.emit(window.conversation_model.ids()[0])
        window.chat_pane.view.verticalScrollBar().setValue(0)
        shot(window, f"chat-search-{theme}")
        window.conversations.search.clear()
        window.go_to("models")
        window.library_pane.select_path(str(broken))
        shot(window, f"library-{theme}")
        if hub_pane is not None:
            window.go_to("discover")
            shot(window, f"hub-{theme}")
            # What the pane shows when the Hub cannot be reached (a long error message).
            hub_pane.controller.failed.emit(
                "cannot reach https://huggingface.co: ConnectError: [Errno -3] Temporary failure in "
                "name resolution while fetching /api/models?search=llama&sort=downloads&limit=200 " * 2
            )
            shot(window, f"hub-error-{theme}")
            if hasattr(hub_pane, "notice"):  # and a real search without a network
                import socket

                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    closed = sock.getsockname()[1]
                hub_pane.controller.client._endpoint = f"http://127.0.0.1:{closed}"
                hub_pane.run_search()
                spin(lambda: not hub_pane.controller.busy, 15)
                shot(window, f"hub-offline-{theme}")
                hub_pane.controller.client._endpoint = None
        if downloads_pane is not None:
            window.go_to("downloads")
            shot(window, f"downloads-{theme}")
        window.go_to("chats")
        if hasattr(window.chat, "prefillProgress"):  # a long prompt being read
            script.prefill_chunk, script.prefill_delay = 200, 0.15
            window.chat.submit("Summarise this: " + "lorem ipsum dolor sit amet " * 300)
            spin(lambda: window.chat_pane.speed_label.text().startswith("Reading"), 10)
            spin(lambda: False, 0.4)
            shot(window, f"chat-reading-{theme}")
            spin(lambda: not window.chat.busy)
            script.prefill_delay = 0.0
        from app.settings.dialog import SettingsDialog

        dialog = SettingsDialog(window.settings, window)
        dialog.show()
        shot(dialog, f"settings-dialog-{theme}")
        dialog.close()
        from app.chat.conversation_settings import ConversationSettingsDialog

        conv = store.conversation(window.chat.conversation_id)
        dialog = ConversationSettingsDialog(conv.system_prompt, conv.preset, conv.sampling, window)
        dialog.show()
        shot(dialog, f"conversation-settings-{theme}")
        dialog.close()
        rename = getattr(window.conversations, "make_rename_dialog", None)
        dialog = rename(LONG_TITLE) if rename else QInputDialog(window)
        if not rename:
            dialog.setWindowTitle("Rename conversation")
            dialog.setLabelText("Title:")
            dialog.setTextValue(LONG_TITLE)
        dialog.show()
        shot(dialog, f"rename-dialog-{theme}")
        dialog.close()
        assert isinstance(dialog, QDialog)
        print(f"window size after {theme}: {window.width()}x{window.height()}")
    window.close()
    store.close()
    hub.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "screenshots"))
