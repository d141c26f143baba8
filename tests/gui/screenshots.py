"""Screenshots of the main window (light and dark, a long conversation with code and math).

Not a test: ``QT_QPA_PLATFORM=offscreen python tests/gui/screenshots.py OUT_DIR`` writes PNGs for
a human to look at (nothing cut off, nothing overlapping). Uses the scripted engine.
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


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    os.environ["TRELLIS_DATA_DIR"] = tempfile.mkdtemp(prefix="trellis-shots-")
    from fake_engine import FakeEngine, fake_starter, make_model_dir
    from PySide6.QtWidgets import QApplication

    from app import paths
    from app.main_window import MainWindow
    from app.store import Store
    from app.worker import EngineClient

    app = QApplication([])
    script = FakeEngine(token_delay=0.0005)
    engine = EngineClient(script.factory, fake_starter)
    store = Store(paths.database_path())
    window = MainWindow(store, engine, paths.models_dir(), hub=True)
    window.resize(1280, 860)
    window.show()

    def spin(until, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline:
            app.processEvents()
            time.sleep(0.002)

    for name in ("Help with Rust lifetimes", "Plan a trip to Lisbon", "Explain attention"):
        window.chat.new_conversation()
        window.chat.rename_conversation(window.chat.conversation_id, name)
    model = make_model_dir(window.models_dir / "SmolLM2-135M-Instruct")
    broken = make_model_dir(window.models_dir / "broken-download", architecture="MambaForCausalLM")
    (broken / "tokenizer.json").unlink()
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
        "And show it as a table.",
        "Thanks! One more time, all together please.",
    ]
    for q in questions:
        script.reply = lambda m: REPLY
        window.chat.submit(q)
        spin(lambda: not window.chat.busy)
    window.chat.regenerate()  # gives the last reply a "2/2" branch switcher
    spin(lambda: not window.chat.busy)
    spin(lambda: False, 0.3)
    if os.environ.get("SHOTS_DEBUG"):
        for w in window.chat_pane.view.message_widgets()[-2:]:
            for piece in w.pieces:
                print(
                    piece.geometry(),
                    piece.viewport().geometry(),
                    piece.document().size(),
                    piece.verticalScrollBar().value(),
                    piece.verticalScrollBar().maximum(),
                    repr(piece.toPlainText()[-50:]),
                )

    for theme in ("light", "dark"):
        window.settings.set("appearance.theme", theme)
        spin(lambda: False, 0.3)
        window.chat_pane.view.scroll_to_bottom()
        spin(lambda: False, 0.2)
        window.grab().save(str(out / f"main-{theme}-bottom.png"))
        window.chat_pane.view.verticalScrollBar().setValue(0)
        spin(lambda: False, 0.2)
        window.grab().save(str(out / f"main-{theme}-top.png"))
        window.tabs.setCurrentWidget(window.library_pane)
        window.library_pane.select_path(str(broken))
        spin(lambda: False, 0.2)
        window.grab().save(str(out / f"library-{theme}.png"))
        window.tabs.setCurrentWidget(window.chat_pane)
    window.close()
    store.close()
    print("\n".join(str(p) for p in sorted(out.glob("*.png"))))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "screenshots"))
