"""The crash reporter: uncaught errors (in slots, threads, at top level), Qt's own messages and
native faults all end in a file in the logs folder, and a dialog tells the user where it is."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from PySide6.QtCore import QTimer, qWarning
from PySide6.QtGui import QGuiApplication

from app.crash import LOG_FILE, NATIVE_FAULT_FILE, CrashDialog, CrashReporter, log_dir

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.qt_no_exception_capture  # the reporter, not pytest-qt, takes these


@pytest.fixture
def reporter(tmp_path: Path):
    rep = CrashReporter(tmp_path / "logs").install()
    yield rep
    rep.uninstall()
    if rep._dialog is not None:
        rep._dialog.close()


def _fail_in_a_slot() -> None:
    raise ValueError("broken slot")


def test_an_exception_in_a_slot_is_reported_in_a_file_and_a_dialog(qtbot, reporter) -> None:
    reporter.attach_gui()
    QTimer.singleShot(0, _fail_in_a_slot)
    qtbot.waitUntil(lambda: bool(reporter.reports) and reporter._dialog is not None, timeout=10_000)
    report = reporter.reports[0]
    assert report.parent == reporter.directory and report.name.startswith("crash-")
    text = report.read_text(encoding="utf-8")
    assert "ValueError: broken slot" in text and "in _fail_in_a_slot" in text  # the traceback
    assert "Trellis Chat: " in text and "PySide6 / Qt: " in text  # the versions
    assert "uncaught exception" in (reporter.directory / LOG_FILE).read_text(encoding="utf-8")

    dialog = reporter._dialog
    assert dialog.isVisible()
    assert "ValueError: broken slot" in dialog.text()
    assert str(report) in dialog.informativeText()
    opened: list[Path] = []
    dialog._opener = lambda path: opened.append(path) or True
    dialog.open_button.click()
    dialog.copy_button.click()
    assert opened == [reporter.directory]
    assert QGuiApplication.clipboard().text() == str(report)
    assert dialog.isVisible()  # those two buttons leave it open

    # A second error while the dialog is up: its own report, the same dialog, counted.
    QTimer.singleShot(0, _fail_in_a_slot)
    qtbot.waitUntil(lambda: len(reporter.reports) == 2, timeout=10_000)
    qtbot.waitUntil(lambda: bool(dialog.extra_reports), timeout=10_000)
    assert reporter._dialog is dialog
    assert "1 more error(s)" in dialog.informativeText()


def test_an_exception_in_another_thread_is_reported(qtbot, reporter) -> None:
    def work() -> None:
        raise RuntimeError("worker failed")

    thread = threading.Thread(target=work, name="model-loader")
    thread.start()
    thread.join()
    assert len(reporter.reports) == 1
    text = reporter.reports[0].read_text(encoding="utf-8")
    assert "Uncaught exception in thread model-loader" in text and "RuntimeError: worker failed" in text


def test_qt_warnings_go_to_the_log(reporter) -> None:
    qWarning("a Qt warning for the log file")
    for handler in __import__("logging").getLogger().handlers:
        handler.flush()
    assert "a Qt warning for the log file" in (reporter.directory / LOG_FILE).read_text(encoding="utf-8")


def test_dialog_escapes_markup(qtbot, tmp_path: Path) -> None:
    report = tmp_path / "crash-x.txt"
    report.write_text("details", encoding="utf-8")
    dialog = CrashDialog(report, "KeyError: '<b>name</b>'")
    qtbot.addWidget(dialog)
    assert "&lt;b&gt;name&lt;/b&gt;" in dialog.text()
    assert dialog.detailedText() == "details"


def _run(script: str, logs: Path) -> subprocess.CompletedProcess:
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + textwrap.dedent(script)
    env = {**os.environ, "TRELLIS_LOG_DIR": str(logs), "QT_QPA_PLATFORM": "offscreen"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_an_uncaught_exception_at_startup_leaves_a_report(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = _run(
        """
        from app import crash
        crash.install()
        raise OSError("settings file unreadable")
        """,
        logs,
    )
    assert result.returncode == 1
    reports = list(logs.glob("crash-*.txt"))
    assert len(reports) == 1 and "OSError: settings file unreadable" in reports[0].read_text()
    assert str(reports[0]) in result.stderr  # said on the terminal too, where there is one


def test_a_native_crash_is_found_and_reported_on_the_next_start(qtbot, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = _run(
        """
        import faulthandler
        from app import crash
        crash.install()
        faulthandler._sigsegv()
        """,
        logs,
    )
    assert result.returncode != 0
    assert "Segmentation fault" in (logs / NATIVE_FAULT_FILE).read_text()
    nxt = CrashReporter(logs).install()  # the next start of the app
    try:
        assert nxt.previous_native_crash is not None
        assert "Segmentation fault" in nxt.previous_native_crash.read_text()
        assert (logs / NATIVE_FAULT_FILE).stat().st_size == 0  # a fresh file for this session
        nxt.attach_gui()
        qtbot.waitUntil(lambda: nxt._dialog is not None, timeout=10_000)
        assert "last session" in nxt._dialog.text()
    finally:
        nxt.uninstall()
        if nxt._dialog is not None:
            nxt._dialog.close()


def test_a_qt_fatal_error_leaves_a_report(tmp_path: Path) -> None:
    # The real-world case: no usable display plugin (e.g. missing xcb libraries); Qt aborts.
    logs = tmp_path / "logs"
    result = _run(
        """
        import os
        os.environ["QT_QPA_PLATFORM"] = "no-such-platform"
        from app import crash
        crash.install()
        from PySide6.QtWidgets import QApplication
        QApplication([])
        """,
        logs,
    )
    assert result.returncode != 0
    reports = list(logs.glob("crash-*-qt-fatal.txt"))
    assert len(reports) == 1
    text = reports[0].read_text()
    assert "Qt fatal error: " in text and "no Qt platform plugin could be initialized" in text
    assert 'platform plugin "no-such-platform"' in text  # the cause, from the recent log


def test_log_dir_follows_the_overrides(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TRELLIS_LOG_DIR", raising=False)
    monkeypatch.setenv("TRELLIS_DATA_DIR", str(tmp_path / "portable"))
    assert log_dir() == tmp_path / "portable" / "logs"
    monkeypatch.setenv("TRELLIS_LOG_DIR", str(tmp_path / "elsewhere"))
    assert log_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("TRELLIS_LOG_DIR")
    monkeypatch.delenv("TRELLIS_DATA_DIR")
    assert log_dir().name == "log" and "trellis-chat" in str(log_dir())  # platformdirs' choice


def test_old_reports_are_pruned(tmp_path: Path) -> None:
    rep = CrashReporter(tmp_path / "logs")
    rep.directory.mkdir(parents=True)
    for i in range(25):
        rep._write(f"report {i}")
    assert len(list(rep.directory.glob("crash-*.txt"))) == 20
