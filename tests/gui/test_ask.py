"""``--ask`` on a data folder that already has a model: one load, one complete reply."""

from __future__ import annotations

from pathlib import Path

from fake_engine import make_model_dir


def _ask(window, qtbot, question: str):
    from app.ask import AskRun

    run = AskRun(window, question, timeout_s=60)
    run.start()
    qtbot.waitUntil(lambda: run.finished, timeout=20000)
    return run


def _reuse_data_folder(make_window, qtbot) -> Path:
    """A first run: install the starter and load it, so the next window restores it at startup."""
    first = make_window()
    with qtbot.waitSignal(first.engine.loaded, timeout=10000) as loaded:
        first.install_starter()
    assert first.settings.get("library.last_model") == loaded.args[0].path
    assert first.settings.get("library.autoload")
    first.close()
    return Path(loaded.args[0].path)


def test_ask_on_a_reused_data_folder_loads_once_and_answers_whole(make_window, fake_engine, qtbot, capsys):
    starter = _reuse_data_folder(make_window, qtbot)
    fake_engine.loads.clear()
    # A slow load leaves the restored load in flight when --ask asks for the same model.
    fake_engine.load_delay = 0.5
    window = make_window()
    assert window.engine.loading, "the window restores the last model at startup"
    run = _ask(window, qtbot, "What is two plus two?")
    assert run.exit_code == 0
    question = "What is two plus two?"
    assert (
        run.reply
        == f"You said: {question}. Here is some code:\n\n```python\nprint({question!r})\n```\n\nDone."
    )
    assert fake_engine.loads == [str(starter)]
    captured = capsys.readouterr()
    assert run.reply in captured.out
    # Time to first token, once, on stderr (the bundle's measurement reads it).
    assert captured.err.count("first token at ") == 1 and "s after the question" in captured.err


def test_ask_ignores_a_restored_model_that_is_not_the_starter(make_window, fake_engine, qtbot, data_dir):
    starter = _reuse_data_folder(make_window, qtbot)
    other = make_model_dir(starter.parent / "Other-Model")
    setup = make_window()
    setup.library.refresh()
    setup.settings.set("library.last_model", str(other))
    setup.close()
    fake_engine.loads.clear()
    fake_engine.load_delay = 0.3
    window = make_window()
    run = _ask(window, qtbot, "Hello there")
    assert run.exit_code == 0
    assert run.reply.startswith("You said: Hello there.")
    assert fake_engine.loads == [str(other), str(starter)]
    assert window.engine.model_info.path == str(starter)


def test_ask_waits_for_a_locked_database_and_never_asks_in_an_old_conversation(
    make_window, fake_engine, qtbot
):
    import sqlite3

    from PySide6.QtCore import QTimer

    from app import paths

    _reuse_data_folder(make_window, qtbot)
    window = make_window()
    old = window.chat.new_conversation()
    assert window.chat.submit("an old question")
    qtbot.waitUntil(lambda: not window.chat.busy, timeout=10000)
    before = {c.id for c in window.store.conversations()}

    holder = sqlite3.connect(paths.database_path(), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    QTimer.singleShot(1500, holder.rollback)
    run = _ask(window, qtbot, "Asked while locked")
    holder.close()
    assert run.exit_code == 0 and run.reply.startswith("You said: Asked while locked.")
    asked = window.chat.conversation_id
    assert asked != old
    assert [m.content for m in window.store.current_path(old)] == [
        "an old question",
        fake_engine.reply([{"role": "user", "content": "an old question"}]),
    ]
    assert asked not in before
    assert [m.content for m in window.store.current_path(asked)][0] == "Asked while locked"
