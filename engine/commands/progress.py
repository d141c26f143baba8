"""A progress line for long command-line work (scoring windows, measuring runs), on stderr.

``Progress(label)(done, total)`` prints ``label: done/total (p%)`` at most every ``interval``
seconds and always at the end, so a run of minutes shows it is moving and a run of hundreds of
windows does not print hundreds of lines. On a terminal the line is rewritten in place. stderr,
so that ``--json`` on stdout stays clean.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, stream: TextIO | None = None, interval: float = 1.0) -> None:
        self.label = label
        self.stream = stream
        self.interval = interval
        self._last = float("-inf")

    def __call__(self, done: int, total: int) -> None:
        stream = self.stream or sys.stderr
        now = time.monotonic()
        if done < total and now - self._last < self.interval:
            return
        self._last = now
        percent = 100 * done / total if total else 100.0
        line = f"{self.label}: {done}/{total} ({percent:.0f}%)"
        if stream.isatty():
            stream.write("\r" + line + ("\n" if done >= total else ""))
        else:
            stream.write(line + "\n")
        stream.flush()
