"""``python -m engine serve`` as a user starts it: a subprocess on a free port, its startup line,
the API key, and a clean stop on Ctrl-C (SIGINT: exit status 130, as every command)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx2
import pytest

from engine.cli import build_parser


def test_serve_options_and_bad_tool_parser():
    args = build_parser().parse_args(["serve", "-m", "x"])
    assert (args.host, args.port, args.api_key, args.allowed_media_dir) == ("127.0.0.1", 8000, None, [])
    done = subprocess.run(
        [sys.executable, "-m", "engine", "serve", "-m", "x", "--tool-parser", "xml"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--tool-parser must be one of" in done.stderr


def test_trellis_chat_serve_is_the_engines_serve(capsys):
    from app.__main__ import main

    assert main(["serve", "-m", "x", "--tool-parser", "xml"]) == 2
    assert "--tool-parser must be one of" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_subprocess_binds_localhost_and_wants_the_key(smollm2_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "engine",
        "serve",
        "-m",
        str(smollm2_dir),
        "--port",
        "0",
        "--api-key",
        "k3y",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()  # printed once the socket listens
        found = re.search(r"at http://127\.0\.0\.1:(\d+)/v1 .*bound to 127\.0\.0\.1: this machine only", line)
        assert found, line + process.stderr.read() if process.poll() is not None else line
        base = f"http://127.0.0.1:{found.group(1)}/v1"
        assert httpx2.get(base + "/models", timeout=30).status_code == 401
        auth = {"Authorization": "Bearer k3y"}
        models = httpx2.get(base + "/models", headers=auth, timeout=30).json()
        assert [m["id"] for m in models["data"]] == [smollm2_dir.name]
        body = {"model": smollm2_dir.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        reply = httpx2.post(base + "/chat/completions", json=body, headers=auth, timeout=120).json()
        assert (
            reply["usage"]["completion_tokens"] <= 3 and reply["choices"][0]["message"]["role"] == "assistant"
        )
    finally:
        process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if process.poll() is None:
            process.kill()
    errors = process.stderr.read()
    assert process.returncode == 130 and "Traceback" not in errors, errors  # Ctrl-C, as every command
