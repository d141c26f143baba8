"""``python -m engine serve`` as a user starts it: a subprocess on a free port, its startup line,
the API key, and a clean stop on Ctrl-C (SIGINT: exit status 130, as every command)."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx2
import pytest
from engine_serve_process import engine_serve

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
    with engine_serve(smollm2_dir, "k3y") as served:
        base = served.base_url
        line = served.startup_line
        assert re.search(r"bound to 127\.0\.0\.1: this machine only", line), line
        assert httpx2.get(base + "/models", timeout=30).status_code == 401
        auth = {"Authorization": "Bearer k3y"}
        models = httpx2.get(base + "/models", headers=auth, timeout=30).json()
        assert [m["id"] for m in models["data"]] == [smollm2_dir.name]
        body = {"model": smollm2_dir.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        reply = httpx2.post(base + "/chat/completions", json=body, headers=auth, timeout=120).json()
        assert (
            reply["usage"]["completion_tokens"] <= 3 and reply["choices"][0]["message"]["role"] == "assistant"
        )
    process = served.process
    errors = process.stderr.read()
    assert process.returncode == 130 and "Traceback" not in errors, errors  # Ctrl-C, as every command
