"""``python -m app`` / ``trellis-chat``: start the desktop app."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trellis-chat", description="Chat with local LLMs")
    parser.add_argument(
        "--data-dir", help="where conversations and settings live (default: platform data dir)"
    )
    parser.add_argument("--models-dir", help="the app's models folder (default: <data dir>/models)")
    parser.add_argument("--no-hub", action="store_true", help="hide the Hub and Downloads tabs")
    args = parser.parse_args(argv)
    if args.data_dir:
        os.environ["TRELLIS_DATA_DIR"] = args.data_dir
    if args.models_dir:
        os.environ["TRELLIS_MODELS_DIR"] = args.models_dir
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from PySide6.QtWidgets import QApplication, QMessageBox

    from app import paths
    from app.main_window import MainWindow
    from app.store import Store
    from app.store.migrations import SchemaTooNewError
    from app.worker import EngineClient

    app = QApplication(sys.argv[:1])
    app.setApplicationName("Trellis Chat")
    app.setDesktopFileName("trellis-chat")
    try:
        store = Store(paths.database_path())
    except SchemaTooNewError as exc:
        QMessageBox.critical(None, "Trellis Chat", str(exc))
        return 1
    engine = EngineClient()
    window = MainWindow(store, engine, paths.models_dir(), hub=not args.no_hub)
    window.show()
    code = app.exec()
    store.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
