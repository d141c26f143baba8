"""The desktop-entry installer puts a valid, launchable menu entry and its icons into the user's
XDG data folder (a temporary one here), and removes them again."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "packaging" / "install_desktop_entry.py"

sys.path.insert(0, str(ROOT / "packaging"))
import install_desktop_entry as ide  # noqa: E402  (a script, not a package: loaded by path)


def unquote_exec(value: str) -> list[str]:
    """Split an Exec value back into argv, following the Desktop Entry Specification: first the
    string-value escapes (\\\\ -> \\), then double-quoted arguments with \\-escaped characters."""
    value = value.replace("\\\\", "\\")
    args: list[str] = []
    current, quoted, i, started = "", False, 0, False
    while i < len(value):
        c = value[i]
        if quoted:
            if c == "\\" and i + 1 < len(value) and value[i + 1] in '"`$\\':
                current += value[i + 1]
                i += 1
            elif c == '"':
                quoted = False
            else:
                current += c
        elif c == '"':
            quoted, started = True, True
        elif c == " ":
            if started or current:
                args.append(current)
            current, started = "", False
        else:
            current += c
            started = True
        i += 1
    if started or current:
        args.append(current)
    return [a.replace("%%", "%") for a in args]


def read_entry(path: Path) -> dict[str, str]:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # keys are case-sensitive in desktop entries
    parser.read(path, encoding="utf-8")
    return dict(parser["Desktop Entry"])


def run_installer(data_home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_DATA_HOME": str(data_home)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_install_puts_a_valid_entry_and_icons_into_xdg_data_home(tmp_path: Path) -> None:
    data_home = tmp_path / "share"
    result = run_installer(data_home)
    assert result.returncode == 0, result.stderr
    entry_path = data_home / "applications" / "trellis-chat.desktop"
    entry = read_entry(entry_path)
    assert entry["Type"] == "Application"
    assert entry["Name"] == "Trellis Chat"
    assert entry["Terminal"] == "false"
    assert entry["StartupWMClass"] == "Trellis Chat"  # Qt's WM_CLASS class for applicationName

    argv = unquote_exec(entry["Exec"])
    program = Path(argv[0])
    assert program.is_absolute() and program.is_file() and os.access(program, os.X_OK)
    assert entry["TryExec"] == argv[0]
    # The entry starts this installation of the app (the venv's trellis-chat, or python -m app).
    started = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120)
    assert started.returncode == 0 and "--install-desktop-entry" in started.stdout

    assert entry["Icon"] == "trellis-chat"  # a theme name, found in hicolor below
    icon = data_home / "icons" / "hicolor" / "256x256" / "apps" / "trellis-chat.png"
    with Image.open(icon) as image:
        assert image.size == (256, 256) and image.mode == "RGBA"
    assert (data_home / "icons" / "hicolor" / "scalable" / "apps" / "trellis-chat.svg").is_file()

    if shutil.which("desktop-file-validate"):
        check = subprocess.run(["desktop-file-validate", str(entry_path)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_uninstall_removes_what_install_added(tmp_path: Path) -> None:
    data_home = tmp_path / "share"
    assert run_installer(data_home).returncode == 0
    result = run_installer(data_home, "--uninstall")
    assert result.returncode == 0
    assert not (data_home / "applications" / "trellis-chat.desktop").exists()
    assert not list((data_home / "icons").rglob("trellis-chat.*"))


def test_paths_with_spaces_and_shell_characters_survive_exec_quoting(tmp_path: Path) -> None:
    tricky = ["/opt/Trellis Chat/trellis-chat", '/home/a "b"/$HOME/x`y`\\z', "/tmp/100%/run", "/usr/bin/x"]
    for path in tricky:
        line = ide.quote_exec_arg(path)
        assert unquote_exec(line) == [path], line
    weird = tmp_path / "my apps" / "trellis $chat"
    weird.parent.mkdir()
    weird.write_text("#!/bin/sh\n")
    weird.chmod(0o755)
    result = run_installer(tmp_path / "share", "--exec", str(weird))
    assert result.returncode == 0, result.stderr
    entry = read_entry(tmp_path / "share" / "applications" / "trellis-chat.desktop")
    assert unquote_exec(entry["Exec"]) == [str(weird)]


def test_a_missing_executable_is_refused(tmp_path: Path) -> None:
    result = run_installer(tmp_path / "share", "--exec", str(tmp_path / "nope"))
    assert result.returncode == 1 and "does not exist" in result.stderr
    assert not (tmp_path / "share" / "applications").exists()


def test_relative_xdg_data_home_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", "relative/share")
    assert ide.data_home() == Path.home() / ".local" / "share"
    monkeypatch.setenv("XDG_DATA_HOME", "/srv/share")
    assert ide.data_home() == Path("/srv/share")
