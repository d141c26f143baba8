"""The crash reporter: every unexpected error ends up in a file the user can find and send us.

What it catches, and where it goes (all in :func:`log_dir`):

- ``trellis-chat.log``: the app's ordinary log (rotated), so a report can be read with the
  minutes that led up to it. Qt's own warnings go there too, through a Qt message handler.
- ``crash-<time>.txt``: one file per uncaught Python exception (main thread, other threads, and
  exceptions raised inside Qt slots, which PySide6 routes through ``sys.excepthook``), with the
  traceback and the versions that matter for a bug report.
- ``native-fault.txt``: ``faulthandler``'s output when the process dies in native code (a segfault
  in Qt, torch or a CUDA kernel). Python cannot run anything after such a crash, so the next start
  renames a non-empty file to ``crash-<time>-native.txt`` and tells the user about it then.

A dialog names the file and offers to open the folder. It is shown with ``open()`` (not
``exec()``), on the next event-loop turn and never twice at once, so an error raised inside a
slot does not start a nested event loop inside the exception hook, and a burst of errors does not
pile up a stack of dialogs.

The folder is the platform's log directory (``platformdirs.user_log_dir``: on Linux
``~/.local/state/trellis-chat/log``). ``TRELLIS_LOG_DIR`` overrides it, and a data-directory override
(``TRELLIS_DATA_DIR`` / ``--data-dir``, used by portable installs and the tests) moves the logs
into ``<data dir>/logs`` so one folder holds everything of that install. When that folder cannot be
written (read-only or full disk), everything goes to ``paths.fallback_dir()`` in the temporary
folder instead: the reporter is needed most exactly when the disk misbehaves.
"""

from __future__ import annotations

import faulthandler
import logging
import logging.handlers
import os
import platform
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import PySide6
from platformdirs import user_log_dir
from PySide6.QtCore import QObject, Qt, QtMsgType, QUrl, Signal, qInstallMessageHandler, qVersion
from PySide6.QtGui import QDesktopServices, QGuiApplication
from PySide6.QtWidgets import QApplication, QMessageBox

from app import paths

log = logging.getLogger(__name__)

APP_NAME = "trellis-chat"
LOG_FILE = "trellis-chat.log"
NATIVE_FAULT_FILE = "native-fault.txt"
KEEP_REPORTS = 20  # older crash reports are deleted so a crash loop cannot fill the disk

ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]


def log_dir() -> Path:
    """Where logs and crash reports are written (see the module docstring for the overrides)."""
    override = os.environ.get("TRELLIS_LOG_DIR")
    if override:
        return Path(override).expanduser()
    data_override = os.environ.get("TRELLIS_DATA_DIR")
    if data_override:
        return Path(data_override).expanduser() / "logs"
    return Path(user_log_dir(APP_NAME, appauthor=False))


def _versions() -> list[tuple[str, str]]:
    """Versions for the report header. Never imports torch: a crash handler must not start loading
    a gigabyte library, and if torch was never imported it played no part in the crash."""
    from app.about import app_version

    rows = [
        ("Trellis Chat", app_version()),
        ("Python", sys.version.split()[0]),
        ("Platform", platform.platform()),
        ("Frozen bundle", "yes" if getattr(sys, "frozen", False) else "no"),
    ]
    rows.append(("PySide6 / Qt", f"{PySide6.__version__} / {qVersion()}"))
    torch = sys.modules.get("torch")
    if torch is not None:
        cuda = getattr(getattr(torch, "version", None), "cuda", None)
        rows.append(("torch", f"{getattr(torch, '__version__', '?')} (CUDA {cuda or 'none'})"))
    return rows


class _Notifier(QObject):
    reportWritten = Signal(str, str)  # path, one-line summary


class CrashReporter:
    """Installs the hooks; one per process (``install()`` returns the active one)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else log_dir()
        self.reports: list[Path] = []  # written by this process, oldest first
        self.previous_native_crash: Path | None = None
        self._lock = threading.Lock()
        self._previous_hooks: tuple[Any, Any] | None = None
        self._file_handler: logging.Handler | None = None
        self._fault_file: IO[str] | None = None
        self._notifier: Any = None  # a QObject once attach_gui() ran
        self._dialog: Any = None
        self._handling = threading.local()  # guards against an error inside our own hook
        self.unwritable_directory: Path | None = None  # the folder asked for, when it was not usable

    # -- installation -------------------------------------------------------------------------------

    def install(self) -> CrashReporter:
        """Start logging to the folder and take over the hooks. Never raises for the folder: one
        that cannot be written (read-only or full disk, a path through a file) is swapped for
        ``paths.fallback_dir()``, and with neither writable the hooks still report to stderr."""
        if not paths.is_writable_dir(self.directory):
            self.unwritable_directory = self.directory
            self.directory = paths.fallback_dir()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._file_handler = logging.handlers.RotatingFileHandler(
                self.directory / LOG_FILE, maxBytes=2_000_000, backupCount=3, encoding="utf-8"
            )
        except OSError as exc:
            print(f"Trellis Chat: cannot write logs to {self.directory}: {exc}", file=sys.stderr)
            self._file_handler = None
        root = logging.getLogger()
        if self._file_handler is not None:
            self._file_handler.setFormatter(
                logging.Formatter("%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s")
            )
            root.addHandler(self._file_handler)
        if root.level > logging.INFO or root.level == logging.NOTSET:
            root.setLevel(logging.INFO)
        if self.unwritable_directory is not None:
            log.warning(
                "the log folder %s cannot be written; logs and crash reports go to %s",
                self.unwritable_directory,
                self.directory,
            )
        self._adopt_native_fault()
        try:
            self._fault_file = open(self.directory / NATIVE_FAULT_FILE, "w", encoding="utf-8")  # noqa: SIM115
            faulthandler.enable(self._fault_file, all_threads=True)
        except OSError as exc:
            log.warning("native crashes will not be recorded: %s", exc)
            self._fault_file = None
        self._previous_hooks = (sys.excepthook, threading.excepthook)
        sys.excepthook = self._sys_hook
        threading.excepthook = self._thread_hook
        self._install_qt_handler()
        log.info("Trellis Chat %s starting; logs in %s", _versions()[0][1], self.directory)
        return self

    def uninstall(self) -> None:
        """Undo ``install`` (tests; the app keeps the hooks until it exits)."""
        if self._previous_hooks is not None:
            sys.excepthook, threading.excepthook = self._previous_hooks
            self._previous_hooks = None
        if self._file_handler is not None:
            logging.getLogger().removeHandler(self._file_handler)
            self._file_handler.close()
            self._file_handler = None
        if self._fault_file is not None:
            faulthandler.disable()
            self._fault_file.close()
            self._fault_file = None
        qInstallMessageHandler(None)

    def attach_gui(self) -> None:
        """Show a dialog for each report from now on. Call on the GUI thread once a QApplication
        exists; reports from other threads reach the dialog through a queued signal."""
        self._notifier = _Notifier()
        self._notifier.reportWritten.connect(self._show_dialog, Qt.ConnectionType.QueuedConnection)
        if self.previous_native_crash is not None:
            self._notifier.reportWritten.emit(
                str(self.previous_native_crash), "The last session of Trellis Chat ended with a crash."
            )

    # -- hooks ---------------------------------------------------------------------------------------------

    def _sys_hook(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            sys.__excepthook__(exc_type, exc, tb)
            return
        self.report((exc_type, exc, tb), where=f"thread {threading.current_thread().name}")

    def _thread_hook(self, args: threading.ExceptHookArgs) -> None:
        if args.exc_value is None or issubclass(args.exc_type, SystemExit):
            return
        name = args.thread.name if args.thread is not None else "unknown"
        self.report((args.exc_type, args.exc_value, args.exc_traceback), where=f"thread {name}")

    def _install_qt_handler(self) -> None:
        qt_log = logging.getLogger("qt")
        levels = {
            QtMsgType.QtDebugMsg: logging.DEBUG,
            QtMsgType.QtInfoMsg: logging.INFO,
            QtMsgType.QtWarningMsg: logging.WARNING,
            QtMsgType.QtCriticalMsg: logging.ERROR,
            QtMsgType.QtFatalMsg: logging.CRITICAL,
        }

        def handler(mode: QtMsgType, context: Any, message: str) -> None:
            where = f" ({context.file}:{context.line})" if getattr(context, "file", None) else ""
            qt_log.log(levels.get(mode, logging.WARNING), "%s%s", message, where)
            if mode == QtMsgType.QtFatalMsg:
                # Qt aborts right after this returns; leave a report while we still can.
                self._write(f"Qt fatal error: {message}{where}\n", suffix="qt-fatal")

        qInstallMessageHandler(handler)

    # -- reports -------------------------------------------------------------------------------------------

    def report(self, exc_info: ExcInfo, where: str = "") -> Path | None:
        """Write a crash report for ``exc_info``, log it, and queue the dialog. Returns its path."""
        if getattr(self._handling, "active", False):
            return None  # an error inside the reporter itself: do not recurse
        self._handling.active = True
        try:
            exc_type, exc, tb = exc_info
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            path = self._write(f"Uncaught exception in {where or 'the app'}:\n\n{text}")
            log.error("uncaught exception in %s (report: %s)\n%s", where, path, text.rstrip())
            summary = f"{exc_type.__name__}: {exc}".strip()
            if self._notifier is not None and path is not None:
                self._notifier.reportWritten.emit(str(path), summary[:500])
            elif path is not None:
                print(f"Trellis Chat: unexpected error; report written to {path}", file=sys.stderr)
            return path
        finally:
            self._handling.active = False

    def _recent_log(self, lines: int = 30) -> str:
        """The end of the app log: what happened just before (Qt logs the real cause of a fatal
        error, e.g. which platform plugin failed, as warnings before the fatal message)."""
        if self._file_handler is None:
            return ""
        self._file_handler.flush()
        try:
            text = (self.directory / LOG_FILE).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _write(self, body: str, suffix: str = "") -> Path | None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        header = "\n".join(f"{k}: {v}" for k, v in _versions())
        recent = self._recent_log()
        if recent:
            body = f"{body.rstrip()}\n\nRecent log ({LOG_FILE}):\n{recent}\n"
        with self._lock:
            # The folder can stop being writable after startup (a full disk): then the fallback.
            for folder in dict.fromkeys([self.directory, paths.fallback_dir()]):
                try:
                    folder.mkdir(parents=True, exist_ok=True)
                    path = self._unique(f"crash-{stamp}{'-' + suffix if suffix else ''}", folder)
                    path.write_text(
                        f"Trellis Chat crash report, {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n{header}\n"
                        f"Log file: {self.directory / LOG_FILE}\n\n{body}",
                        encoding="utf-8",
                    )
                    break
                except OSError as exc:  # a full or read-only disk must not turn one error into two
                    print(f"Trellis Chat: could not write a crash report in {folder}: {exc}", file=sys.stderr)
            else:
                return None
            self.reports.append(path)
            self._prune(folder)
        return path

    def _unique(self, stem: str, folder: Path | None = None) -> Path:
        folder = self.directory if folder is None else folder
        path = folder / f"{stem}.txt"
        n = 1
        while path.exists():
            n += 1
            path = folder / f"{stem}-{n}.txt"
        return path

    def _prune(self, folder: Path | None = None) -> None:
        try:
            reports = sorted((folder or self.directory).glob("crash-*.txt"), key=lambda p: p.stat().st_mtime)
            for old in reports[:-KEEP_REPORTS]:
                old.unlink(missing_ok=True)
        except OSError:
            pass  # pruning is housekeeping; the report itself was written

    def _adopt_native_fault(self) -> None:
        """A non-empty fault file means the previous process died in native code."""
        fault = self.directory / NATIVE_FAULT_FILE
        try:
            if fault.is_file() and fault.stat().st_size > 0:
                stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(fault.stat().st_mtime))
                target = self._unique(f"crash-{stamp}-native")
                fault.replace(target)
                self.previous_native_crash = target
                log.warning("the previous session crashed in native code; report: %s", target)
        except OSError:
            pass

    # -- the dialog ----------------------------------------------------------------------------------------

    def _show_dialog(self, path: str, summary: str) -> None:
        if QApplication.instance() is None:
            return
        if self._dialog is not None and self._dialog.isVisible():
            self._dialog.add_report(path)  # one dialog at a time; it counts the rest
            return
        self._dialog = CrashDialog(Path(path), summary)
        self._dialog.open()


def open_folder(path: Path) -> bool:
    """Open ``path`` in the platform's file manager."""
    return QDesktopServices.openUrl(QUrl.fromLocalFile(str(path)))


class CrashDialog(QMessageBox):
    """Says what happened in plain words, where the report is, and offers the folder."""

    def __init__(self, report: Path, summary: str, opener: Callable[[Path], bool] = open_folder) -> None:
        super().__init__()
        self.report = report
        self.extra_reports: list[Path] = []
        self._opener = opener
        self.setIcon(QMessageBox.Icon.Critical)
        self.setWindowTitle("Trellis Chat: unexpected error")
        self.setAccessibleName("Crash report")
        self.setText(
            f"Something went wrong inside Trellis Chat.<br><br><b>{_escape(summary)}</b><br><br>"
            "The app may keep working; if it misbehaves, restart it."
        )
        self._update_informative()
        self.setDetailedText(report.read_text(encoding="utf-8", errors="replace") if report.exists() else "")
        self.open_button = self.addButton("Open log folder", QMessageBox.ButtonRole.ActionRole)
        self.copy_button = self.addButton("Copy path", QMessageBox.ButtonRole.ActionRole)
        self.close_button = self.addButton(QMessageBox.StandardButton.Close)
        # QMessageBox closes on any button; these two should leave it open.
        self.open_button.clicked.disconnect()
        self.copy_button.clicked.disconnect()
        self.open_button.clicked.connect(lambda: self._opener(self.report.parent))
        self.copy_button.clicked.connect(lambda: QGuiApplication.clipboard().setText(str(self.report)))

    def add_report(self, path: str) -> None:
        self.extra_reports.append(Path(path))
        self._update_informative()

    def _update_informative(self) -> None:
        more = (
            f"<br>{len(self.extra_reports)} more error(s) since, each with its own report there."
            if self.extra_reports
            else ""
        )
        self.setInformativeText(
            f"A report was saved to:<br><tt>{_escape(str(self.report))}</tt><br>"
            f"Please attach it when you report the problem.{more}"
        )


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


_active: CrashReporter | None = None


def install(directory: Path | None = None) -> CrashReporter:
    """Install the crash reporter for this process (idempotent)."""
    global _active
    if _active is None:
        _active = CrashReporter(directory).install()
    return _active


def active() -> CrashReporter | None:
    return _active
