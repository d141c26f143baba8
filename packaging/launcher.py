"""Entry script of the PyInstaller bundle: the same ``main`` as ``python -m app``/``trellis-chat``.

PyInstaller needs a script file, not an entry point; keeping it to one call means the bundle and
the pip install cannot drift apart in what they do at startup.
"""

from __future__ import annotations

import multiprocessing
import sys

if __name__ == "__main__":
    # A frozen app that (through torch or a library) starts a multiprocessing child must let the
    # child run its task instead of starting a second copy of the GUI.
    multiprocessing.freeze_support()
    from app.__main__ import main

    sys.exit(main())
