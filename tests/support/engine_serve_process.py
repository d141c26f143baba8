"""``python -m engine serve`` in a subprocess, as a user starts it: on a free port of 127.0.0.1
with an API key and one compute thread (OMP_NUM_THREADS=1), stopped with Ctrl-C (SIGINT) when
the test is done."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

STOP_TIMEOUT_S = 30.0


@dataclass
class ServedEngine:
    process: subprocess.Popen
    startup_line: str  # the first line on stdout, printed once the socket listens

    @property
    def base_url(self) -> str:
        """The ``http://127.0.0.1:PORT/v1`` the startup line names (with the server's stderr in
        the failure when it names none: the server died)."""
        found = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", self.startup_line)
        if found is None:
            errors = self.process.stderr.read() if self.process.poll() is not None else ""
            raise AssertionError(f"no base URL in the startup line {self.startup_line!r}\n{errors}")
        return found.group(1)


@contextmanager
def engine_serve(model_dir: Path, api_key: str) -> Iterator[ServedEngine]:
    """Serve ``model_dir`` for the block; afterwards the process has exited (SIGINT, killed after
    :data:`STOP_TIMEOUT_S`) and its ``returncode`` and unread stderr are there to check."""
    command = [
        sys.executable,
        "-m",
        "engine",
        "serve",
        "-m",
        str(model_dir),
        "--port",
        "0",
        "--api-key",
        api_key,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        yield ServedEngine(process, process.stdout.readline())
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
