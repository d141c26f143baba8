"""Enforcing the one threading rule of the app: Qt item models change on the GUI thread only.

Qt does not check this, and a model mutated from a worker thread corrupts views at random
(the classic bug of chat clients that append tokens from the generation thread). Every write
method of our models calls ``require_gui_thread`` so such a bug fails loudly and at once.
"""

from __future__ import annotations

from PySide6.QtCore import QCoreApplication, QThread


class WrongThreadError(RuntimeError):
    """A Qt model was about to be changed from a thread other than the GUI thread."""


def require_gui_thread(what: str) -> None:
    app = QCoreApplication.instance()
    if app is not None and QThread.currentThread() is not app.thread():
        raise WrongThreadError(f"{what} must be changed on the GUI thread (marshal with a queued signal)")
