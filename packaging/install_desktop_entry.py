"""Put Trellis Chat into this user's desktop menu (Linux, freedesktop.org desktop entries).

    trellis-chat --install-desktop-entry            # the usual way (a checkout or a bundle)
    python packaging/install_desktop_entry.py [--exec PATH] [--uninstall]

Writes ``$XDG_DATA_HOME/applications/trellis-chat.desktop`` (``~/.local/share`` by default) from
``resources/trellis-chat.desktop.in`` and the icons into ``$XDG_DATA_HOME/icons/hicolor``, so menus,
launchers and docks show the app with its icon. Per user, no root, and undone by ``--uninstall``.

The entry's ``Exec`` is an absolute path, found in this order: ``--exec``; the running bundle's
executable; the ``trellis-chat`` script beside the Python that runs this (the virtual
environment's ``bin/``); ``trellis-chat`` on PATH; else ``<python> -m app``. An absolute path is
what makes a double-click work: menus do not start programs with the user's shell PATH, so a
virtual environment's ``bin/`` is not on it.

Standard library only: it runs inside the bundle, where nothing else is guaranteed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

APP_ID = "trellis-chat"
HERE = Path(__file__).resolve().parent
RESOURCES = HERE.parent / "resources"
# Qt's X11 window class for this app (QGuiApplication's applicationName "Trellis Chat", as the
# main window's WM_CLASS shows under xprop); lets docks match the window to this entry.
WM_CLASS = "Trellis Chat"


def data_home() -> Path:
    value = os.environ.get("XDG_DATA_HOME", "")
    # The spec says a relative or empty value is invalid and must be ignored.
    return Path(value) if value and os.path.isabs(value) else Path.home() / ".local" / "share"


def find_executable() -> list[str]:
    """The command that starts this installation, as argv (absolute paths)."""
    if getattr(sys, "frozen", False):
        return [str(Path(sys.executable).resolve())]
    beside = Path(sys.executable).parent / APP_ID
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside.absolute())]  # not resolve(): keep the venv's path, not its python's
    on_path = shutil.which(APP_ID)
    if on_path:
        return [str(Path(on_path).absolute())]
    return [str(Path(sys.executable).absolute()), "-m", "app"]


def quote_exec_arg(arg: str) -> str:
    """Quote one argument for an Exec key (Desktop Entry Specification, "The Exec key").

    Inside double quotes, ``"``, backquote, ``$`` and backslash are escaped with a backslash;
    then, because Exec is a string value, every backslash is escaped once more."""
    reserved = set(" \t\n\"'\\><~|&;$*?#()`")
    if arg and not (set(arg) & reserved) and "=" not in arg and "%" not in arg:
        return arg
    inner = "".join("\\" + c if c in '"`$\\' else c for c in arg).replace("%", "%%")
    return ('"' + inner + '"').replace("\\", "\\\\")


def render_entry(argv: list[str], template: Path = RESOURCES / f"{APP_ID}.desktop.in") -> str:
    exec_line = " ".join(quote_exec_arg(a) for a in argv)
    return (
        template.read_text(encoding="utf-8")
        .replace("@EXEC@", exec_line)
        .replace("@TRYEXEC@", argv[0].replace("\\", "\\\\"))
        .replace("@WMCLASS@", WM_CLASS)
    )


def icon_files() -> list[tuple[Path, str]]:
    """(source, path below the hicolor theme folder) for every icon we ship."""
    pairs = [
        (png, str(png.relative_to(RESOURCES / "icons" / "hicolor")))
        for png in sorted((RESOURCES / "icons" / "hicolor").glob(f"*/apps/{APP_ID}.png"))
    ]
    svg = RESOURCES / f"{APP_ID}.svg"
    if svg.is_file():
        pairs.append((svg, f"scalable/apps/{APP_ID}.svg"))
    return pairs


def _refresh_caches(root: Path) -> None:
    """Tell menus about the change; both tools are optional and their failure is harmless."""
    for cmd in (
        ["update-desktop-database", "-q", str(root / "applications")],
        ["gtk-update-icon-cache", "-q", "-t", "-f", str(root / "icons" / "hicolor")],
    ):
        if shutil.which(cmd[0]):
            subprocess.run(cmd, check=False, capture_output=True)


def install(argv: list[str], root: Path) -> Path:
    entry = root / "applications" / f"{APP_ID}.desktop"
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_suffix(".tmp")
    tmp.write_text(render_entry(argv), encoding="utf-8")
    tmp.chmod(0o755)  # some desktops (GNOME, XFCE) only trust executable entries
    tmp.replace(entry)  # atomic: a menu scanning the folder never sees half a file
    for source, relative in icon_files():
        target = root / "icons" / "hicolor" / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    _refresh_caches(root)
    return entry


def uninstall(root: Path) -> list[Path]:
    removed = []
    for path in [root / "applications" / f"{APP_ID}.desktop"] + [
        root / "icons" / "hicolor" / relative for _, relative in icon_files()
    ]:
        if path.exists():
            path.unlink()
            removed.append(path)
    _refresh_caches(root)
    return removed


def validate(entry: Path) -> str | None:
    """desktop-file-validate's complaints, or None when it is happy or not installed."""
    tool = shutil.which("desktop-file-validate")
    if tool is None:
        return None
    result = subprocess.run([tool, str(entry)], capture_output=True, text=True)
    output = (result.stdout + result.stderr).strip()
    if result.returncode == 0:
        if output:
            print(f"desktop-file-validate hints: {output}")
        return None
    return output or "invalid"


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exec", dest="executable", help="program the menu entry starts (absolute path)")
    parser.add_argument("--uninstall", action="store_true", help="remove the entry and icons")
    parser.add_argument("--data-home", type=Path, help="instead of $XDG_DATA_HOME (~/.local/share)")
    opts = parser.parse_args(args)
    root = opts.data_home or data_home()
    if opts.uninstall:
        for path in uninstall(root):
            print(f"removed {path}")
        return 0
    argv = [str(Path(opts.executable).absolute())] if opts.executable else find_executable()
    if not Path(argv[0]).is_file():
        print(f"error: {argv[0]} does not exist", file=sys.stderr)
        return 1
    entry = install(argv, root)
    print(f"installed {entry}\n  Exec: {' '.join(argv)}\n  icons: {root / 'icons' / 'hicolor'}")
    problems = validate(entry)
    if problems:
        print(f"desktop-file-validate: {problems}", file=sys.stderr)
        return 1
    print("Trellis Chat is in your desktop menu (some desktops show it after logging in again).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
