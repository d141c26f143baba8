"""``python -m app`` / ``trellis-chat``: start the desktop app."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    # The bundle's GPU runtime (app.runtime), if installed, must be on sys.path before torch loads.
    from app.runtime.activate import activate, managed_runtime_enabled

    if managed_runtime_enabled():
        activate(given)
    if given[:1] == ["serve"]:  # the engine's OpenAI-compatible server, no window: python -m engine serve
        from engine.cli import main as engine_main

        return engine_main(given)
    parser = argparse.ArgumentParser(prog="trellis-chat", description="Chat with local LLMs")
    parser.add_argument(
        "--data-dir", help="where conversations and settings live (default: platform data dir)"
    )
    parser.add_argument("--models-dir", help="the app's models folder (default: <data dir>/models)")
    parser.add_argument("--no-hub", action="store_true", help="hide the Hub and Downloads tabs")
    parser.add_argument(
        "--ask",
        metavar="QUESTION",
        help="smoke check: start the app, load the built-in starter model (offline), ask QUESTION, "
        "print the reply on stdout and exit (0 = answered)",
    )
    parser.add_argument(
        "--about", action="store_true", help="print versions, folders and the GPU check, then exit"
    )
    parser.add_argument(
        "--install-desktop-entry",
        action="store_true",
        help="add Trellis Chat to this user's desktop menu (Linux; --uninstall-desktop-entry removes it)",
    )
    parser.add_argument("--uninstall-desktop-entry", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--install-gpu-runtime",
        action="store_true",
        help="download and install the GPU runtime for this machine's NVIDIA driver, then exit "
        "(what the first-run offer does; --gpu-runtime-wheels DIR takes wheels downloaded elsewhere)",
    )
    parser.add_argument("--gpu-runtime-wheels", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.data_dir:
        os.environ["TRELLIS_DATA_DIR"] = args.data_dir
    if args.models_dir:
        os.environ["TRELLIS_MODELS_DIR"] = args.models_dir
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.install_gpu_runtime:
        from app import paths
        from app.runtime.cli import install_gpu_runtime

        wheels = Path(args.gpu_runtime_wheels) if args.gpu_runtime_wheels else None
        return install_gpu_runtime(paths.data_dir(), wheels)
    # Before Qt loads a platform plugin: where it would abort, say why (and what to install).
    from app.display_check import check

    display = check(headless=bool(args.ask or args.about))
    if display.problem:
        print(display.problem, file=sys.stderr)
        return 1
    if display.platform:
        os.environ["QT_QPA_PLATFORM"] = display.platform
    if args.install_desktop_entry or args.uninstall_desktop_entry:
        return _desktop_entry(uninstall=args.uninstall_desktop_entry)
    if args.about:
        from app.about import print_about

        return print_about()

    # Before anything else can fail: uncaught errors, Qt warnings and native faults get a log file.
    from app import crash

    reporter = crash.install()

    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication, QMessageBox

    from app import paths
    from app.main_window import MainWindow
    from app.store.migrations import SchemaTooNewError
    from app.store.recovery import StoreOpenError, open_store
    from app.worker import EngineClient

    app = QApplication(sys.argv[:1])
    app.setApplicationName("Trellis Chat")
    app.setDesktopFileName("trellis-chat")
    from app.about import app_icon

    app.setWindowIcon(app_icon())
    reporter.attach_gui()
    try:
        # Checks the file, backs it up, and repairs a damaged one (keeping it aside) before use.
        store, startup = open_store(paths.database_path())
    except (SchemaTooNewError, StoreOpenError) as exc:
        if args.ask:  # headless: a modal dialog would wait forever
            print(f"Trellis Chat: {exc}", file=sys.stderr)
        else:
            QMessageBox.critical(None, "Trellis Chat", str(exc))
        return 1
    if startup.recovered:
        if args.ask:
            print(f"Trellis Chat: {startup.message()}", file=sys.stderr)
        else:
            QMessageBox.warning(None, "Trellis Chat: conversations repaired", startup.message())
    engine = EngineClient()
    # --ask drives the one load itself; restoring the last model too would race with it.
    window = MainWindow(store, engine, paths.models_dir(), hub=not args.no_hub, autoload=not args.ask)
    window.show()
    # The GPU report imports torch (seconds), so it runs on a thread, once the window is up.
    from app.gpu_check import GpuCheck

    gpu = GpuCheck(window)
    gpu.finished.connect(window.show_gpu_report)
    if not args.ask:
        from app.runtime.offer import maybe_offer

        # An NVIDIA GPU the bundled CPU torch cannot use: offer the GPU runtime download.
        gpu.finished.connect(lambda report: maybe_offer(window, report, window.settings, paths.data_dir()))
    QTimer.singleShot(500, lambda: gpu.start(window.settings.get("engine.device")))
    ask = None
    if args.ask:
        from app.ask import AskRun

        ask = AskRun(window, args.ask)
        ask.done.connect(app.exit)
        QTimer.singleShot(0, ask.start)
    code = app.exec()
    store.close()
    return ask.exit_code if ask is not None else code


def _desktop_entry(uninstall: bool) -> int:
    """Run packaging/install_desktop_entry.py for this installation (a checkout or a bundle)."""
    import runpy

    from app.about import resources_dir

    script = resources_dir().parent / "packaging" / "install_desktop_entry.py"
    if not script.is_file():
        print(f"{script} is missing: install from a source checkout or a bundle", file=sys.stderr)
        return 1
    sys.argv = [str(script), *(["--uninstall"] if uninstall else [])]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        return int(done.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
